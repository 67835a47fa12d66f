"""Zombies are fenced: the torchrun agent of a two-rank job is SIGKILLed while its workers
go on (orphaned, still training), and the job is relaunched. The relaunch registers a new
generation; the zombies' next save is refused, they exit with lastgood.Fenced, nothing of
theirs commits after the relaunch registered, last-good never points to one of theirs,
and the relaunched job ends bit-identical to an uninterrupted run (docs/fencing.md).

The zombies are held at a gate (examples/gpt/train.py, LASTGOOD_EXAMPLE_PAUSE) before
their save of step 11 until the relaunch has registered, so that the race goes the way
this test is about; the other way (a commit landing before the registration) is in
tests/catalog/test_fencing.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port
from tests.multiproc.launch import TRAIN, inherited_env, train, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare  # noqa: E402

PAUSE_STEP = 11   # saves after steps 2, 5, 8, 11, 14, 17: the zombies hold before their save of 11
RESUME_FROM = 8   # the last save the first launch committed
WAIT = 240.0


def _alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie process left unreaped by whoever adopted it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _is_rank(pid: int) -> bool:
    try:
        return str(TRAIN) in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


def _wait_for(what: str, cond, timeout: float = WAIT, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"waiting for {what}: a launch ended early ({p.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _launch(service, run: str, out: Path, log: Path, env: dict) -> subprocess.Popen:
    """torchrun in a session of its own; each rank's output goes to a file under log/ that
    the rank itself writes, so a rank that outlives its agent still reports."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           f"--log-dir={log}", "--redirects=3", str(TRAIN), "--url", service.url, "--run-name", run,
           "--out", str(out)]
    full_env = {**inherited_env(), "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", "PYTHONFAULTHANDLER": "1", **env}
    with open(log.with_suffix(".agent.log"), "w") as agent_log:
        return subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=agent_log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _rank_output(log: Path, rank: int) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(log.glob(f"**/attempt_*/{rank}/std*.log")))


@pytest.fixture
def cleanup():
    """Every process this test starts dies with it: the agents' sessions, and the orphaned
    ranks (torchrun starts each rank in a session of its own, with its loader workers)."""
    agents: list[subprocess.Popen] = []
    ranks: list[int] = []
    yield agents, ranks
    for p in agents:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
    for pid in ranks:
        if _is_rank(pid) and os.getpgid(pid) == pid != os.getpgrp():
            os.killpg(pid, signal.SIGKILL)


def test_zombies_of_a_killed_agent_are_fenced(service, run_name, tmp_path, cleanup):
    agents, ranks = cleanup
    ref = tmp_path / "ref"
    res = train(service.url, f"{run_name}-ref", ref)
    assert res.returncode == 0, why(res)

    first_out, gate, first_log = tmp_path / "first", tmp_path / "gate", tmp_path / "first-log"
    gate.mkdir()
    first_log.mkdir()
    first = _launch(service, run_name, first_out, first_log, {"LASTGOOD_EXAMPLE_PAUSE": f"{PAUSE_STEP}:{gate}"})
    agents.append(first)
    markers = [gate / f"paused-rank{r}" for r in range(2)]
    _wait_for("both ranks at the gate", lambda: all(m.exists() and m.read_text() for m in markers), procs=[first])
    ranks += [int(m.read_text()) for m in markers]
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == RESUME_FROM

    os.kill(first.pid, signal.SIGKILL)  # the agent only: its ranks are orphaned and go on
    first.wait(timeout=30)
    assert all(_alive(pid) for pid in ranks), "the ranks died with their agent: no zombies to fence"

    second_out, second_log = tmp_path / "second", tmp_path / "second-log"
    shutil.copytree(first_out, second_out)  # the steps before the resume point, as a user's log dir would hold
    second_log.mkdir()
    second = _launch(service, run_name, second_out, second_log, {})
    agents.append(second)
    _wait_for("the relaunch to register",
              lambda: service.get(f"/api/v1/runs/{run_name}").json()["generation"] == 2, procs=[second])
    registered = service.get(f"/api/v1/runs/{run_name}/launches/current").json()

    (gate / "go").write_text("")  # the zombies go on: train step 11 done, save it, wait for it
    _wait_for("the zombies to exit", lambda: not any(_alive(pid) for pid in ranks))
    assert second.wait(timeout=WAIT) == 0, "\n".join(_rank_output(second_log, r)[-3000:] for r in range(2))

    for r in range(2):
        out = _rank_output(first_log, r)
        assert "lastgood.errors.Fenced" in out and "stop training" in out, out[-3000:]
        assert f"starting at step {RESUME_FROM + 1} (restored: {RESUME_FROM})" in _rank_output(second_log, r)

    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    old = [c for c in listing if c["generation"] == 1]
    assert old and all(c["committed_at"] is None or c["committed_at"] < registered["registered_at"] for c in old)
    assert sorted(c["step"] for c in old if c["status"] == "COMMITTED") == [2, 5, 8]
    new = {c["id"] for c in listing if c["generation"] == 2}
    assert sorted(c["step"] for c in listing if c["id"] in new and c["status"] == "COMMITTED") == [11, 14, 17]
    events = service.get(f"/api/v1/runs/{run_name}/events", params={"limit": 1000}).json()["items"]
    launched = next(i for i, e in enumerate(events) if e["kind"] == "launch" and e["data"]["generation"] == 2)
    after = events[launched:]
    # every commit after the relaunch registered is the relaunch's: last-good never went to a zombie's
    assert all(e["checkpoint_id"] in new for e in after if e["kind"] == "commit")
    assert [e["data"]["generation"] for e in after if e["kind"] == "fenced"] == [1]
    refused = [e["data"] for e in after if e["kind"] == "fenced_write"]
    assert sorted(d["rank"] for d in refused) == [0, 1] and {d["step"] for d in refused} == {PAUSE_STEP}
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 17 and lg["generation"] == 2

    diffs = compare(ref, second_out, world=2)
    assert diffs == [], "\n".join(diffs[:20])
