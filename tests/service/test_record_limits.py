"""Limits on what one caller may record in a run (#36, findings 8 and 9): launch
registrations per run and time, heartbeats only from ranks of the launch's world, tags per
checkpoint. Each refusal is a clear 4xx that changes nothing; each has a control just
inside the bound. One service with small bounds for the whole module."""

from __future__ import annotations

import time

import httpx
import pytest

from lastgood import errors
from lastgood.remote.rest import RestClient
from lastgood.remote.retry import RetryPolicy

from .helpers import Client

WINDOW_S = 8.0  # long enough that a loaded machine makes its calls inside one window


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.conftest import FAST, ServiceProc

    svc = ServiceProc(tmp_path_factory.mktemp("limits"), {
        **FAST, "LASTGOOD_LAUNCH_RATE_MAX": "3", "LASTGOOD_LAUNCH_RATE_WINDOW": str(WINDOW_S),
        "LASTGOOD_MAX_TAGS_PER_CHECKPOINT": "3", "LASTGOOD_MAX_WORLD_SIZE": "1024",
        "LASTGOOD_HEALTH_INTERVAL": "0"}).start()
    yield svc
    svc.stop()


def register(svc, run: str, attempt: str, world_size: int = 2) -> httpx.Response:
    return httpx.post(f"{svc.url}/api/v1/runs/{run}/launches", json={"attempt": attempt, "world_size": world_size},
                      timeout=30)


def test_launch_registrations_are_rate_limited_per_run(svc, run_name):
    for i in range(3):  # control: up to the bound, each registers
        assert register(svc, run_name, f"a{i}").status_code == 200
    assert register(svc, run_name, "a1").json()["generation"] == 2  # a rank of a registered launch: not counted
    r = register(svc, run_name, "a3")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
    assert "LASTGOOD_LAUNCH_RATE_MAX" in r.json()["error"]["message"]
    current = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/launches/current", timeout=30).json()
    assert current["generation"] == 3 and current["attempt"] == "a2"  # the refusal fenced nothing
    assert register(svc, f"{run_name}-other", "b0").status_code == 200  # per run: another run is not held up
    # the client hears RateLimited, retries it, and registers once the window has moved on
    with pytest.raises(errors.RateLimited) as refused:
        RestClient(svc.url).register_launch(run_name, "a3", 2)
    assert refused.value.retryable
    t0 = time.monotonic()
    assert RestClient(svc.url, retry=RetryPolicy(deadline=30)).register_launch(run_name, "a3", 2) == 4
    assert time.monotonic() - t0 < 30


def beat(svc, run: str, rank: int, world_size: int, generation: int | None) -> httpx.Response:
    return httpx.post(f"{svc.url}/api/v1/runs/{run}/heartbeats", timeout=30, json={
        "rank": rank, "world_size": world_size, "phase": "train", "attempt": "a", "generation": generation})


def test_heartbeats_come_only_from_ranks_of_the_launch(svc, run_name):
    gen = register(svc, run_name, "a", world_size=2).json()["generation"]
    for rank in (0, 1):  # control: the launch's ranks beat
        assert beat(svc, run_name, rank, 2, gen).status_code == 204
    for rank, world in ((2, 2), (5000, 2**31 - 1), (1, 4), (0, 1)):
        r = beat(svc, run_name, rank, world, gen)
        assert r.status_code == 400 and "world size 2" in r.json()["error"]["message"], (rank, world, r.text)
    # generation 0 (no launch named): bounded by the run's newest launch
    assert [beat(svc, run_name, rank, world, None).status_code
            for rank, world in ((2, 2), (5000, 2**31 - 1), (1, 4), (1, 2))] == [400, 400, 400, 204]
    h = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/health", timeout=30).json()
    assert sorted(r["rank"] for r in h["ranks"]) == [0, 1]
    # a launch's world size itself is bounded by the service's
    r = register(svc, run_name, "huge", world_size=2**31 - 1)
    assert r.status_code == 400 and "1..1024" in r.json()["error"]["message"], r.text


def test_tags_per_checkpoint_are_capped(svc, run_name):
    with Client(svc.grpc_target) as c:
        cid, _ = c.save(run_name, 1)
        other, _ = c.save(run_name, 2, parent_id=cid, attempt="b")
    tag = lambda ck, name, alias=False: httpx.post(  # noqa: E731
        f"{svc.url}/api/v1/checkpoints/{ck}/tags", json={"name": name, "alias": alias}, timeout=30)
    for name in ("t0", "t1"):
        assert tag(cid, name).status_code == 200
    assert tag(cid, "best", alias=True).status_code == 200  # aliases count: 3 of 3
    assert tag(cid, "t0").status_code == 200  # the same tag again: no new row, not refused
    r = tag(cid, "x" * 128)
    assert r.status_code == 409 and "LASTGOOD_MAX_TAGS_PER_CHECKPOINT" in r.json()["error"]["message"], r.text
    assert tag(other, "t3").status_code == 200  # per checkpoint: another one takes tags
    names = {t["name"] for t in httpx.get(f"{svc.url}/api/v1/checkpoints/{cid}", timeout=30).json()["tags"]}
    assert {"t0", "t1"} <= names and "x" * 128 not in names
    assert httpx.delete(f"{svc.url}/api/v1/checkpoints/{cid}/tags/t1", timeout=30).status_code == 200
    assert tag(cid, "x" * 128).status_code == 200  # room again once one is removed
