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
