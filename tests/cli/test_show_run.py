"""`lastgood show RUN`: the run's health and its checkpoint interval, with the run's own
numbers (C, M, τ, work lost per failure), through the real console script."""

from __future__ import annotations

import math

import httpx

from .conftest import lastgood


def test_show_run_prints_health_and_the_interval(service, run_name):
    u = service.url
    gen = httpx.post(f"{u}/api/v1/runs/{run_name}/launches", json={"attempt": "a", "world_size": 2}).json()["generation"]
    for rank in (0, 1):
        r = httpx.post(f"{u}/api/v1/runs/{run_name}/heartbeats", json={
            "rank": rank, "world_size": 2, "step": 40, "step_seconds": 0.5, "phase": "train", "attempt": "a",
            "generation": gen, "save_stall_s": 3.0})
        assert r.status_code == 204, r.text
    doc = lastgood("--json", "show", run_name, url=u).json()
    assert doc["run"]["name"] == run_name and [x["rank"] for x in doc["health"]["ranks"]] == [0, 1]
    iv = doc["health"]["interval"]
    assert iv["cost_s"] == 3.0 and iv["mtbf_source"] == "prior"

    out = lastgood("show", run_name, url=u).out
    assert f"run {run_name}" in out and "every rank ok" in out
    assert "checkpoint cost C" in out and "3.0 s" in out
    assert "the prior: no failure yet" in out and "24 h" in out  # the service's default prior
    tau_min = iv["seconds"] / 60
    assert "auto interval τ (Daly)" in out and f"{tau_min:.0f} min" in out
    assert f"Young √(2·C·M) = {math.sqrt(2 * 3.0 * 86400) / 60:.0f} min" in out
    assert "work lost per failure" in out
    assert out.count(" train ") == 2  # one line per rank


def test_show_run_without_beats_and_unknown_runs(service, run_name):
    httpx.post(f"{service.url}/api/v1/runs/{run_name}/launches", json={"attempt": "a"})
    out = lastgood("show", run_name, url=service.url).out
    assert "no heartbeats yet" in out and "not measured yet" in out
    res = lastgood("show", f"{run_name}-nope", url=service.url, code=3)
    assert "does not exist" in res.err


def test_a_finished_run_is_not_live_and_the_cli_counts_the_failures_the_page_does(service, run_name):
    """Every rank's last beat says idle (closed its Checkpointer): `/health` says finished,
    with no hang timeout and an exposure (so an MTBF) that no longer grows; `lastgood show`
    says so too, and counts the run's failures as the runs overview (the page's badge) does.
    Control: the same run while a rank still trains is live, with a timeout."""
    import time

    u = service.url
    gen = httpx.post(f"{u}/api/v1/runs/{run_name}/launches", json={"attempt": "a", "world_size": 2}).json()["generation"]

    def beat(rank, phase):
        r = httpx.post(f"{u}/api/v1/runs/{run_name}/heartbeats", json={
            "rank": rank, "world_size": 2, "step": 40, "step_seconds": 0.5, "phase": phase, "attempt": "a",
            "generation": gen})
        assert r.status_code == 204, r.text

    r = httpx.post(f"{u}/api/v1/runs/{run_name}/events",
                   json={"kind": "save_given_up", "data": {"rank": 1, "count": 2, "steps": [5, 6], "reason": "x"}})
    assert r.status_code == 200, r.text
    beat(0, "idle")
    beat(1, "train")
    live = httpx.get(f"{u}/api/v1/runs/{run_name}/health").json()
    assert live["finished"] is False and live["timeout_s"] is not None  # the control: rank 1 still trains
    beat(1, "idle")
    first = httpx.get(f"{u}/api/v1/runs/{run_name}/health").json()
    time.sleep(1.1)
    h = httpx.get(f"{u}/api/v1/runs/{run_name}/health").json()
    assert h["finished"] is True and h["finished_at"] and h["timeout_s"] is None
    assert all(x["timeout_s"] is None and x["state"] == "ok" for x in h["ranks"])
    assert h["interval"]["exposure_s"] == first["interval"]["exposure_s"]  # the MTBF does not drift
    assert h["failures"]["count"] == 1 and h["failures"]["kinds"] == {"save_given_up": 1}
    over = httpx.get(f"{u}/api/v1/overview", params={"limit": 1000}).json()["items"]
    assert [x["recent_failures"] for x in over if x["name"] == run_name] == [1]  # the page's badge: the same

    out = lastgood("show", run_name, url=u).out
    assert "finished" in out and "hang timeout" not in out and "every rank ok" not in out
    assert "1 in 24 h" in out and "save_given_up 1" in out
