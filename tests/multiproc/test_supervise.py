"""`lastgood supervise`: a hung rank is found through the service and the whole job relaunched,
bit-identically; a rank that keeps crashing is drained and the job finishes on fewer ranks
with its data position kept; exit codes; no process of a killed launch survives."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from lastgood.supervise import proctree
from tests.conftest import ROOT
from tests.multiproc.launch import TRAIN, Background, _command, _train_args, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare  # noqa: E402

JOB = Path(__file__).with_name("supervised_job.py")
LASTGOOD = [sys.executable, "-m", "lastgood.cli"]


def torchrun_cmd(script: Path, args: list[str], nproc: int, env: dict | None = None) -> tuple[list[str], dict]:
    return _command(script, args, nproc, env, None)


def supervise(url: str, run: str, options: list[str], script: Path, args: list[str], nproc: int,
              env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """`lastgood supervise OPTIONS -- torchrun ... script ARGS` in the background, its output in `log`."""
    cmd, full_env = torchrun_cmd(script, args, nproc, env)
    argv = [*LASTGOOD, "--url", url, "supervise", "--run", run, *options, "--", *cmd]
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")


def events(service, run: str, prefix: str = "supervisor_") -> list[dict]:
    items = service.get(f"/api/v1/runs/{run}/events", params={"limit": 1000}).json()["items"]
    return [e for e in items if e["kind"].startswith(prefix)]


def marked(mark: str) -> list[proctree.Proc]:
    """Every live process that inherited the test's marker, read from /proc by the test."""
    return [p for p in proctree.table().values()
            if not p.dead and proctree.environ(p.pid).get("SUPERVISE_TEST") == mark]


def wait_until(predicate, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---------------------------------------------------------------- hang
def test_a_hung_rank_is_found_and_the_relaunched_job_ends_bit_identical_to_one_that_never_hung(
        service, run_name, tmp_path):
    """Rank 1 stops making progress inside step 10 (rank 0 then waits in the all-reduce) on
    the first launch only; last-good is step 8. The script never calls ckpt.step(): its saves
    alone show its pace (docs/health.md), so the hang is judged by the steady timeout (the
    60 s floor), not the 600 s first-step allowance a rank without a step time gets (the
    verdict says each rank's timeout). Default settings everywhere (beats every 10 s, the
    supervisor's poll 5 s): found and relaunched within 2 minutes, and the job ends
    bit-identical to one that never hung. Control: the same job without the supervisor,
    started at the same time, is still hanging when the supervised one has finished."""
    steps, hang_step = ("--steps", "12", "--every", "3"), 10
    only = {"LASTGOOD_EXAMPLE_SAVE_ONLY": "1"}
    ref = Background(service.url, f"{run_name}-ref", tmp_path / "reference", *steps, env=only)
    mark, control_trigger = uuid.uuid4().hex, tmp_path / "hang-control"
    control_trigger.touch()
    control = Background(service.url, f"{run_name}-ctl", tmp_path / "control", *steps,
                         env={**only, "SUPERVISE_TEST": mark,
                              "LASTGOOD_EXAMPLE_HANG": f"1:{hang_step}:{control_trigger}"})
    try:
        trigger, out, log = tmp_path / "hang", tmp_path / "supervised", tmp_path / "supervise.log"
        trigger.touch()
        sup_mark = uuid.uuid4().hex
        sup = supervise(service.url, run_name, [], TRAIN, _train_args(service.url, None, out, steps), 2, log=log,
                        env={**only, "SUPERVISE_TEST": sup_mark, "LASTGOOD_EXAMPLE_HANG": f"1:{hang_step}:{trigger}"})
        res = finish(sup, log)
        assert res.returncode == 0, why(res)
        assert marked(sup_mark) == []  # nothing left of the hung launch (ranks, data-loader workers)
        assert "fault injection: hanging in step 10" in res.stdout and not trigger.exists()

        restarts = events(service, run_name)
        assert [e["kind"] for e in restarts] == ["supervisor_restart"], restarts
        found = dt.datetime.fromisoformat(restarts[0]["at"]) - dt.datetime.fromisoformat(
            events(service, run_name, "launch")[0]["at"])
        assert found.total_seconds() < 120, (found, res.stdout[-2000:])
        # each rank's own timeout: the steady one, not the 600 s first-step allowance; and the
        # step each rank last saved, where the verdict says it was
        detail = restarts[0]["data"]["detail"]
        assert restarts[0]["data"]["reason"] == "hung" and "timeout 600" not in detail, detail
        assert "after step 8 (no progress for" in detail and "timeout 60.0s" in detail, detail
        assert res.stdout.count("starting at step 9 (restored: 8)") == 2  # both ranks of the relaunch
        # logs at scale: the job's incident (no checkpoint yet, a new run) is one line, rank 0's,
        # with the job's rank count; the other rank's is at debug level (common/joblog.py)
        assert res.stdout.count("has no checkpoint at") == 1, res.stdout[-3000:]
        assert "starting from the beginning [rank 0 of 2 ranks; the others log theirs at debug level]" in res.stdout
        assert ref.finish().returncode == 0
        assert ref.output().count("has no checkpoint at") == 1
        diffs = compare(tmp_path / "reference", out, world=2)
        assert diffs == [], "\n".join(diffs[:20])

        # the control: hung in step 10 all this time; nothing beyond step 8 was saved
        assert not control_trigger.exists() and control.proc.poll() is None, control.output()[-3000:]
        assert service.get(f"/api/v1/runs/{run_name}-ctl/last-good").json()["step"] == 8
    finally:
        proctree.terminate(("SUPERVISE_TEST", mark), grace=1, root=None)  # the control, by its marker
        control.finish(timeout=30)
    assert marked(mark) == []


# ---------------------------------------------------------------- drain
def _history(out: Path, world: int, final_world: int, last_before: int) -> list[dict]:
    """The records of the training that counts: every rank's steps up to `last_before` (the
    last-good the smaller launch restored), then the last launch's steps on its ranks."""
    recs = []
    for r in range(world):
        rows = [json.loads(line) for line in (out / f"losses-rank{r}.jsonl").read_text().splitlines()]
        recs += [x for x in rows if x["step"] <= last_before]
        if r < final_world:
            later = {x["step"]: x for x in rows if x["step"] > last_before}  # the last launch wrote last
            recs += later.values()
    return recs


def test_a_rank_that_keeps_crashing_is_drained_and_the_job_finishes_on_fewer_ranks(service, run_name, tmp_path):
    # rank 3 SIGKILLs itself after step 8 on every 4-rank launch (a bad GPU, say); last-good is 7
    out, log = tmp_path / "out", tmp_path / "supervise.log"
    args = _train_args(service.url, None, out, ("--loader", "plain", "--every", "2", "--steps", "12"))
    mark = uuid.uuid4().hex
    sup = supervise(service.url, run_name, ["--max-restarts", "4", "--drain-after", "2", "--poll", "1", "--grace", "5"],
                    TRAIN, args, nproc=4, env={"LASTGOOD_EXAMPLE_KILL": "3:8:after_step", "SUPERVISE_TEST": mark},
                    log=log)
    res = finish(sup, log)
    assert res.returncode == 0, why(res)
    assert marked(mark) == []

    # two failures blamed on rank 3 drain it (a failure whose first death cannot be told on
    # a starved machine is blamed on no one and costs one more 4-rank launch)
    restarts = [e["data"] for e in events(service, run_name)]
    assert restarts and all(e["reason"] == "exited" and e["ranks"] in ([3], []) for e in restarts), restarts
    assert [e["ranks"] for e in restarts].count([3]) == 2 and restarts[-1]["ranks"] == [3], restarts
    assert restarts[-1]["drained"] == [3] and restarts[-1]["next_world_size"] == 3, restarts
    assert all(e["drained"] == [] for e in restarts[:-1]), restarts
    final = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert final["step"] == 11 and final["world_size"] == 3
    relaunched_on_4 = len(restarts) - 1
    assert res.stdout.count("starting at step 8 (restored: 7)") == 4 * relaunched_on_4 + 3

    # epoch 2 spans the change: steps 6 and 7 on four ranks, the rest on three
    recs = _history(out, 4, 3, last_before=7)
    before = [i for x in recs if x["epoch"] == 2 and x["step"] <= 7 for i in x["ids"]]
    after = [i for x in recs if x["epoch"] == 2 and x["step"] > 7 for i in x["ids"]]
    assert len(before) == 32 and sorted(set(before + after)) == list(range(48))  # nothing skipped
    assert len(before + after) - 48 == 2  # repeats only from padding 16 left-over samples to 18 for 3 ranks
    assert set(before).isdisjoint(after[:16 - 2])  # what was trained before is not trained again


# ---------------------------------------------------------------- exit codes, orphans
def test_gave_up_after_the_restarts_and_stopped_by_sigterm_leaves_no_process(service, run_name, tmp_path):
    # gave up: every launch fails; one restart allowed
    service.post(f"/api/v1/runs/{run_name}/launches", json={"attempt": "setup", "world_size": 2})
    log = tmp_path / "fail.log"
    res = finish(supervise(service.url, run_name, ["--max-restarts", "1", "--poll", "0.5"], JOB, ["fail"], 2,
                           log=log), log)
    assert res.returncode == 7, res.stdout
    assert [e["kind"] for e in events(service, run_name)] == ["supervisor_restart", "supervisor_gave_up"]
    assert "giving up: 1 restart(s) used of 1" in res.stdout

    # stopped: SIGTERM to the supervisor while every rank has a child in a session of its own
    # that ignores SIGTERM; the supervisor ends them all (SIGKILL after the grace) and exits 130
    mark, pids = uuid.uuid4().hex, tmp_path / "pids"
    pids.mkdir()
    log = tmp_path / "linger.log"
    sup = supervise(service.url, run_name, ["--poll", "0.5", "--grace", "2"], JOB, ["linger", str(pids)], 2,
                    env={"SUPERVISE_TEST": mark}, log=log)
    wait_until(lambda: len(list(pids.glob("rank?"))) == 2 or sup.poll() is not None, "both ranks to start")
    job = [int(p) for f in sorted(pids.glob("rank?")) for p in f.read_text().split()]
    assert len(marked(mark)) > len(job)  # supervisor, torchrun, 2 ranks, 2 stubborn children
    sup.send_signal(signal.SIGTERM)
    res = finish(sup, log, timeout=60)
    assert res.returncode == 130, res.stdout
    assert marked(mark) == [], f"processes left: {marked(mark)}"
    assert all(proctree.read(pid) is None for pid in job)
    assert events(service, run_name)[-1]["kind"] == "supervisor_stopped"


def test_killing_torchruns_process_group_alone_leaves_its_ranks_running(tmp_path):
    """The control of the test above: torchrun starts each rank in a session of its own, so
    the obvious kill (the launcher's process group) leaves every rank running."""
    mark, pids = uuid.uuid4().hex, tmp_path / "pids"
    pids.mkdir()
    cmd, env = torchrun_cmd(JOB, ["linger", str(pids)], 2, {"SUPERVISE_TEST": mark})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(list(pids.glob("rank?"))) == 2, "both ranks to start")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(1)
        left = marked(mark)
        assert len(left) == 4, left  # two ranks and their two children
    finally:
        proctree.terminate(("SUPERVISE_TEST", mark), grace=1, root=None)  # by the marker only
    assert marked(mark) == []


def test_an_unreachable_service_does_not_stop_the_job(run_name, tmp_path):
    from tests.conftest import free_port

    log = tmp_path / "away.log"
    res = finish(supervise(f"http://127.0.0.1:{free_port()}", run_name, ["--poll", "0.2"], JOB, ["finish", "4"], 2,
                           log=log), log, timeout=120)
    assert res.returncode == 0, res.stdout
    assert "the service is unreachable; the job keeps running" in res.stdout
    assert "launch 0 finished" in res.stdout
