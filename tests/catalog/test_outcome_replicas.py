"""Two replicas on one PostgreSQL catalog: a rank waiting for the outcome on replica B hears
a commit decided on replica A. B was never told (the commit ran in A's process); its one
outcome notifier sees it in its shared poll of the watched checkpoints (domain/commit/outcomes.py)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.catalog.test_two_services import replicas  # noqa: F401 - the two-replica fixture
from tests.service.helpers import Client, make_shard, shard_name


def test_a_waiter_on_one_replica_hears_the_commit_decided_on_the_other(replicas, run_name):  # noqa: F811
    a, b = replicas
    got: list[dict] = []
    with Client(a.grpc_target) as ca:
        cid = ca.begin(run_name, world_size=3).checkpoint_id
        for r in range(3):
            ca.put(cid, r, shard_name(r), make_shard(r))
        assert ca.vote(cid, 0, [shard_name(0)]).status == "PENDING"
        with Client(b.grpc_target) as cb:
            assert cb.vote(cid, 1, [shard_name(1)]).status == "PENDING"  # rank 1's vote lands on B
        with httpx.Client(base_url=b.url, timeout=180) as h:
            waiter = threading.Thread(target=lambda: got.append(
                h.get(f"/api/v1/checkpoints/{cid}/outcome", params={"wait": 120}).json()))
            waiter.start()
            time.sleep(1.0)  # best effort: B's waiter is waiting before the last vote (it passes either way)
            assert ca.vote(cid, 2, [shard_name(2)]).status == "COMMITTED"  # decided on A
            waiter.join(180)
    assert got == [{"checkpoint_id": cid, "status": "COMMITTED", "missing_ranks": []}]
    # and B answers anyone who asks after the fact at once
    assert httpx.get(f"{b.url}/api/v1/checkpoints/{cid}/outcome", timeout=30).json()["status"] == "COMMITTED"
