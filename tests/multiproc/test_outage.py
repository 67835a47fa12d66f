"""The checkpoint service never costs the job: a two-rank training run (examples/gpt/train.py
under real torchrun) goes on through a service outage, at any point of its life, and
resumes from its last-good afterwards. The service is SIGKILLed and restarted on the same
data directory and the same ports (ServiceProcess.restart), as a supervisor would.

The job's steps are lined up with the outage through train.py's gates (LASTGOOD_EXAMPLE_GATE):
a rank waits after a given step until the test has created a file.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.multiproc.launch import Background, train, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare_final, load_steps  # noqa: E402

OUTAGE = 10.0  # seconds the service is down
STEPS = ["--steps", "30", "--every", "3"]  # saves after steps 2, 5, ..., 29
LEASE = {"LASTGOOD_LEASE_SECONDS": "30"}  # a checkpoint in flight may commit after the restart
NO_RETRIES = {"LASTGOOD_RETRY_DEADLINE": "0"}


def trained(out: Path, step: int):
    """Has every rank logged `step`?"""
    def check() -> bool:
        for rank in (0, 1):
            path = out / f"losses-rank{rank}.jsonl"
            if not path.exists() or step not in load_steps(path)[0]:
                return False
        return True
    return check


def committed_steps(svc, run: str) -> list[int]:
    items = svc.get(f"/api/v1/runs/{run}/checkpoints", params={"limit": 100}).json()["items"]
    return sorted(c["step"] for c in items if c["status"] == "COMMITTED")


def test_an_outage_mid_run_costs_the_job_nothing(make_service, run_name, tmp_path):
    svc = make_service(**LEASE)
    out, down, up = tmp_path / "run", tmp_path / "down", tmp_path / "up"
    back = tmp_path / "back"
    gates = f"6:{down},20:{up},22:{back}"
    job = Background(svc.url, run_name, out, *STEPS, env={"LASTGOOD_EXAMPLE_GATE": gates})
    job.wait_for(trained(out, 6), "step 6")
    svc.kill()
    killed = time.monotonic()
    down.touch()  # steps 7..20 train while the service is away (saves of 8..20 cannot commit yet)
    job.wait_for(trained(out, 20), "step 20 during the outage")
    time.sleep(max(0.0, killed + OUTAGE - time.monotonic()))
    svc.restart()
    up.touch()
    # the newest snapshot of the outage commits once the service is back; the job then trains
    # on with saves of a healthy service (a tiny model trains faster than it could save)
    job.wait_for(lambda: 20 in committed_steps(svc, run_name), "step 20 to commit after the restart")
    back.touch()
    res = job.finish()
    assert res.returncode == 0, why(res)

    assert json.loads((out / "final-rank0.json").read_text())["step"] == 30  # every step trained
    steps = committed_steps(svc, run_name)
    assert {23, 26, 29} <= set(steps), steps  # saves after the outage commit
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 29 and lg["status"] == "COMMITTED"
    # snapshots the outage made stale were given up, counted, and recorded once the service was back
    stats = [json.loads(line.split("saves: ", 1)[1]) for line in res.stdout.splitlines() if "] saves: " in line]
    assert len(stats) == 2 and all(s["saves_given_up"] >= 1 for s in stats), stats
    events = svc.get(f"/api/v1/runs/{run_name}/events", params={"limit": 1000}).json()["items"]
    given_up = [e for e in events if e["kind"] == "save_given_up"]
    assert {e["data"]["rank"] for e in given_up} == {0, 1}
    # logs at scale: each given-up save is one line for the job (rank 0's, with the rank
    # count), not one per rank; rank 1's are at debug level (common/joblog.py)
    lines = [line for line in res.stdout.splitlines() if "given up, training goes on" in line]
    rank0 = next(json.loads(x.split("saves: ", 1)[1]) for x in res.stdout.splitlines() if "[rank 0] saves: " in x)
    assert len(lines) == rank0["saves_given_up"] and all("[rank 0 of 2 ranks;" in x for x in lines), lines

    # a relaunch resumes from the final checkpoint bit for bit
    again = tmp_path / "again"
    res = train(svc.url, run_name, again, *STEPS)
    assert res.returncode == 0, why(res)
    assert "starting at step 30 (restored: 29)" in res.stdout
    diffs = compare_final(out, again, world=2)
    assert diffs == [], "\n".join(diffs[:20])


@pytest.mark.parametrize("retries", [True, False], ids=["retries", "control-no-retries"])
def test_an_outage_over_the_final_wait(make_service, run_name, tmp_path, retries):
    """The job trains to its end while the service is away: wait() waits it out and the
    final state commits. Control: without retries the job fails, saying what was lost."""
    svc = make_service(**LEASE)
    out, down = tmp_path / "run", tmp_path / "down"
    env = {"LASTGOOD_EXAMPLE_GATE": f"6:{down}", **({} if retries else NO_RETRIES)}
    job = Background(svc.url, run_name, out, *STEPS, env=env)
    job.wait_for(trained(out, 6), "step 6")
    svc.kill()
    killed = time.monotonic()
    down.touch()
    try:
        job.wait_for(lambda: job.output().count("waiting for the saves") == 2, "the final wait()", timeout=120)
    except AssertionError:
        if retries:
            raise
    time.sleep(max(0.0, killed + OUTAGE - time.monotonic()))
    svc.restart()
    res = job.finish()
    if not retries:
        assert res.returncode != 0
        assert "the newest state was NOT committed" in res.stdout
        assert 29 not in committed_steps(svc, run_name)
        return
    assert res.returncode == 0, why(res)
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 29 and lg["status"] == "COMMITTED"


def test_a_job_launched_while_the_service_starts_resumes(make_service, run_name, tmp_path):
    svc = make_service()
    first = train(svc.url, run_name, tmp_path / "first", "--steps", "6", "--every", "3")
    assert first.returncode == 0, why(first)
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 5
    svc.stop()

    # control: without retries the launch fails, and never starts from step 0
    res = train(svc.url, run_name, tmp_path / "control", "--steps", "9", "--every", "3", env=NO_RETRIES)
    assert res.returncode != 0
    assert "starting at step" not in res.stdout
    assert "cannot reach the lastgood service" in res.stdout + res.stderr

    job = Background(svc.url, run_name, tmp_path / "second", "--steps", "9", "--every", "3")
    job.wait_for(lambda: "retrying for up to" in job.output(), "the job to find the service down")
    time.sleep(5)
    svc.restart()
    res = job.finish()
    assert res.returncode == 0, why(res)
    assert "starting at step 6 (restored: 5)" in res.stdout
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 8


def test_torchrun_standalone_without_a_run_name_is_refused(service, tmp_path):
    """`torchrun --standalone` draws a new rendezvous id on every launch: as a run name it
    would make every relaunch a new run that starts at step 0."""
    runs_before = service.get("/api/v1/runs", params={"limit": 1000}).json()
    for launch in ("first", "second"):
        res = train(service.url, None, tmp_path / launch, "--steps", "3", launcher=["--standalone"],
                    env={"LASTGOOD_RUN": ""})
        assert res.returncode != 0
        text = res.stdout + res.stderr
        assert "draws at random on every launch" in text, why(res)
        assert all(hint in text for hint in ("run=", "LASTGOOD_RUN", "--rdzv-id", "LASTGOOD_NEW_RUN=1"))
    assert service.get("/api/v1/runs", params={"limit": 1000}).json() == runs_before

    # opting into a new run: it starts, and says in which run it found nothing
    res = train(service.url, None, tmp_path / "new", "--steps", "3", launcher=["--standalone"],
                env={"LASTGOOD_RUN": "", "LASTGOOD_NEW_RUN": "1"})
    assert res.returncode == 0, why(res)
    assert "starting at step 0 (restored: None)" in res.stdout
    assert "has no checkpoint at" in res.stdout + res.stderr
