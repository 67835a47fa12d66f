"""Run health against a real service: heartbeats are one row per rank, bad beats are refused
and store nothing, and the auto checkpoint interval is Young/Daly of the run's own C and M.
(Hang and straggler verdicts with ranks beating through the real client: tests/client/test_health.py.)"""

from __future__ import annotations

import math
import sqlite3

import httpx
import pytest

from ..conftest import ServiceProc

PRIOR_H = 2.0


@pytest.fixture(scope="module")
def hsvc(tmp_path_factory):
    s = ServiceProc(tmp_path_factory.mktemp("health"), {
        "LASTGOOD_HEALTH_INTERVAL": "0", "LASTGOOD_MTBF_PRIOR_HOURS": str(PRIOR_H),
        "LASTGOOD_FAILURE_MERGE_SECONDS": "0"}).start()
    yield s
    s.stop()


def launch(svc, run: str, attempt: str, world_size: int = 2) -> int:
    r = httpx.post(f"{svc.url}/api/v1/runs/{run}/launches", json={"attempt": attempt, "world_size": world_size})
    assert r.status_code == 200, r.text
    return r.json()["generation"]


def beat(svc, run: str, **body) -> httpx.Response:
    return httpx.post(f"{svc.url}/api/v1/runs/{run}/heartbeats", json=body, timeout=30)


def health(svc, run: str, **query) -> dict:
    r = httpx.get(f"{svc.url}/api/v1/runs/{run}/health", params=query, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def rows(svc, run: str) -> list[tuple]:
    with sqlite3.connect(svc.data_dir / "catalog.db") as db:
        return db.execute("SELECT h.rank, h.step, h.beats FROM heartbeats h JOIN runs r ON r.id = h.run_id "
                          "WHERE r.name = ? ORDER BY h.rank", (run,)).fetchall()


def daly(c: float, m: float) -> float:
    """Daly (2006), written out here independently of lastgood.common.interval."""
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + (c / (2 * m)) ** 0.5 / 3 + (c / (2 * m)) / 9) - c


def test_heartbeats_keep_one_row_per_rank(hsvc, run_name):
    gen = launch(hsvc, run_name, "a")
    for step in range(25):
        for rank in (0, 1):
            r = beat(hsvc, run_name, rank=rank, world_size=2, step=step, step_seconds=0.1 if step else None,
                     phase="train", attempt="a", generation=gen)
            assert r.status_code == 204, r.text
    assert rows(hsvc, run_name) == [(0, 24, 25), (1, 24, 25)]  # 50 beats, 2 rows: an upsert
    h = health(hsvc, run_name)
    assert h["world_size"] == 2 and [r["rank"] for r in h["ranks"]] == [0, 1]
    assert [r["step"] for r in h["ranks"]] == [24, 24] and h["hung"] == [] and h["stragglers"] == []


def test_health_of_a_run_without_beats_and_of_no_run(hsvc, run_name):
    launch(hsvc, run_name, "a")
    h = health(hsvc, run_name)
    assert h["ranks"] == [] and h["hung"] == [] and h["world_size"] is None
    assert h["interval"]["mtbf_source"] == "prior" and h["interval"]["seconds"] is None  # no cost measured yet
    r = httpx.get(f"{hsvc.url}/api/v1/runs/{run_name}-absent/health")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


GOOD = {"rank": 0, "world_size": 2, "step": 1, "step_seconds": 0.5, "phase": "train", "attempt": "a"}
BAD = [
    ({"rank": -1}, 422), ({"rank": 2}, 400), ({"rank": 2**31}, 422), ({"rank": "0"}, 422), ({"rank": True}, 422),
    ({"rank": 1.5}, 422), ({"world_size": 0}, 422), ({"step": -1}, 422), ({"step": 2**63}, 422),
    ({"step_seconds": -0.1}, 422), ({"step_seconds": "1"}, 422), ({"step_seconds": 1e12}, 422),
    ({"phase": "running"}, 422), ({"phase": None}, 422), ({"attempt": "a/b"}, 400), ({"attempt": "x" * 65}, 422),
    ({"generation": -1}, 422), ({"generation": 99}, 400), ({"save_stall_s": -1}, 422),
]


@pytest.mark.parametrize("change,status", BAD, ids=[str(c) for c, _ in BAD])
def test_bad_heartbeats_are_refused_and_store_nothing(hsvc, run_name, change, status):
    launch(hsvc, run_name, "a")
    r = beat(hsvc, run_name, **{**GOOD, **change})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert rows(hsvc, run_name) == [] and health(hsvc, run_name)["ranks"] == []
    assert beat(hsvc, run_name, **GOOD).status_code == 204  # the control: the same body, made good, is stored
    assert rows(hsvc, run_name) == [(0, 1, 1)]


def test_non_finite_and_unknown_runs_are_refused(hsvc, run_name):
    launch(hsvc, run_name, "a")
    for raw in (b'{"rank":0,"world_size":2,"phase":"train","step_seconds":NaN}',
                b'{"rank":0,"world_size":2,"phase":"train","step_seconds":Infinity}', b'{"rank":0', b'[]'):
        r = httpx.post(f"{hsvc.url}/api/v1/runs/{run_name}/heartbeats", content=raw,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (raw, r.text)
    assert beat(hsvc, f"{run_name}-absent", **GOOD).status_code == 404
    assert rows(hsvc, run_name) == []


def test_a_fenced_launch_beats_no_more(hsvc, run_name):
    old = launch(hsvc, run_name, "first")
    new = launch(hsvc, run_name, "second")
    r = beat(hsvc, run_name, **{**GOOD, "attempt": "first", "generation": old})
    assert r.status_code == 409 and r.json()["error"]["code"] == "fenced"
    assert beat(hsvc, run_name, **{**GOOD, "attempt": "second", "generation": new}).status_code == 204
    assert rows(hsvc, run_name) == [(0, 1, 1)]


def test_auto_interval_is_young_daly_of_cost_and_failures(hsvc, run_name):
    gen = launch(hsvc, run_name, "a")
    for rank, stall in ((0, 4.0), (1, 6.0)):  # C is the slowest rank's stall: the job waits for it
        assert beat(hsvc, run_name, rank=rank, world_size=2, step=10, step_seconds=2.0, phase="train",
                    attempt="a", generation=gen, save_stall_s=stall).status_code == 204
    iv = health(hsvc, run_name)["interval"]
    prior = PRIOR_H * 3600
    # without failures: the prior
    assert iv["failures"] == 0 and iv["mtbf_source"] == "prior" and iv["mtbf_s"] == prior and iv["cost_s"] == 6.0
    assert iv["seconds"] == pytest.approx(daly(6.0, prior), rel=1e-9)
    assert iv["seconds"] == pytest.approx(math.sqrt(2 * 6.0 * prior), rel=0.05)  # C << M: Young's within 5%
    assert iv["young_s"] == pytest.approx(math.sqrt(2 * 6.0 * prior), rel=1e-9)
    assert iv["expected_loss_s"] == pytest.approx((iv["seconds"] + 6.0) / 2)
    assert iv["steps"] == round(iv["seconds"] / 2.0)
    without = iv["seconds"]

    # injected failures: two relaunches and a torchrun restart, each one failure (merge window 0)
    gen = launch(hsvc, run_name, "b")
    gen = launch(hsvc, run_name, "c")
    r = httpx.post(f"{hsvc.url}/api/v1/runs/{run_name}/events", json={"kind": "restart", "data": {"restart_count": 1}})
    assert r.status_code == 200, r.text
    for rank, stall in ((0, 4.0), (1, 6.0)):  # the new launch measures the same cost
        beat(hsvc, run_name, rank=rank, world_size=2, step=10, phase="train", attempt="c", generation=gen,
             save_stall_s=stall)
    iv = health(hsvc, run_name)["interval"]
    assert iv["failures"] == 3 and iv["mtbf_source"] == "observed"
    assert iv["mtbf_s"] == pytest.approx(iv["exposure_s"] / 3, rel=0.05)
    assert iv["seconds"] == pytest.approx(daly(6.0, iv["mtbf_s"]), rel=1e-9)
    assert iv["seconds"] < without  # failing more often: checkpoint more often
    # failures far more often than a checkpoint costs: Daly's bound, one interval per M
    if 6.0 >= 2 * iv["mtbf_s"]:
        assert iv["seconds"] == pytest.approx(iv["mtbf_s"])


@pytest.mark.slow
def test_failures_close_together_are_one(make_service, run_name):
    svc = make_service(LASTGOOD_HEALTH_INTERVAL="0", LASTGOOD_FAILURE_MERGE_SECONDS="600")
    launch(svc, run_name, "a")
    launch(svc, run_name, "b")  # a relaunch ...
    httpx.post(f"{svc.url}/api/v1/runs/{run_name}/events", json={"kind": "restart", "data": {}})  # ... and its restart
    assert health(svc, run_name)["interval"]["failures"] == 1


@pytest.mark.slow
def test_an_outage_of_the_service_does_not_make_every_rank_hung(make_service, run_name):
    """Beats cannot arrive while the service is down; training goes on. When it comes back, the
    time it was away is not the ranks' silence: no rank is hung or lost until it has had a full
    timeout to beat again (else a supervisor would kill a healthy job after every outage).
    Control: a rank that still does not beat after that is judged as before."""
    import time

    svc = make_service(LASTGOOD_HEALTH_INTERVAL="0", LASTGOOD_HANG_FLOOR_SECONDS="1")
    gen = launch(svc, run_name, "a")
    body = dict(world_size=2, phase="train", step_seconds=0.05, period_s=0.1, attempt="a", generation=gen)
    for step in (1, 2):
        for rank in (0, 1):
            assert beat(svc, run_name, rank=rank, step=step, **body).status_code == 204
    assert health(svc, run_name)["timeout_s"] == 1.0
    svc.stop()
    time.sleep(3)  # longer than the timeout (1 s) and than "lost" (twice that)
    svc.start(keep_ports=True)
    h = health(svc, run_name)
    assert (h["hung"], h["lost"]) == ([], []), h["ranks"]
    assert beat(svc, run_name, rank=0, step=3, **body).status_code == 204  # rank 0 beats again, rank 1 never
    deadline = time.monotonic() + 30
    while not (h := health(svc, run_name))["hung"] and not h["lost"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 1 in h["hung"] + h["lost"] and 0 not in h["lost"], h["ranks"]
