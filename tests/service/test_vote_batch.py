"""Group commit of votes (domain/commit/votebatch.py): a batch is written whole or not at all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from tests.service.helpers import Client, http, make_shard, rpc_error, shard_name

RANKS = 3


def test_a_vote_batch_whose_transaction_fails_writes_nothing_and_its_voters_can_vote_again(make_service, run_name):
    """The failpoint fails the first batch's transaction after its votes were written into
    it. Every voter of that batch hears UNAVAILABLE (retryable) saying its vote was not
    recorded; the catalog holds none of their votes; voting again commits."""
    # a 1 s window: the three votes sent together are all in the first batch
    svc = make_service(LASTGOOD_FAILPOINT="vote_batch_fails_once", LASTGOOD_VOTE_BATCH_WINDOW="1.0",
                       LASTGOOD_LEASE_SECONDS="60")
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name, world_size=RANKS).checkpoint_id
        for r in range(RANKS):
            c.put(cid, r, shard_name(r), make_shard(r))
        with ThreadPoolExecutor(RANKS) as pool:
            errors = list(pool.map(lambda r: rpc_error(grpc.StatusCode.UNAVAILABLE, c.vote, cid, r, [shard_name(r)]),
                                   range(RANKS)))
        for e in errors:
            assert "vote not recorded" in e.details() and "vote again" in e.details(), e.details()
        # nothing half-written: no vote of the batch is in the catalog
        out = http(svc).get(f"/api/v1/checkpoints/{cid}/outcome").json()
        assert out == {"checkpoint_id": cid, "status": "PENDING", "missing_ranks": list(range(RANKS))}
        # control: the same votes, again (the failpoint fails one batch only), commit
        results = [c.vote(cid, r, [shard_name(r)]).status for r in range(RANKS)]
    assert results == ["PENDING"] * (RANKS - 1) + ["COMMITTED"]
    assert http(svc).get(f"/api/v1/checkpoints/{cid}").json()["status"] == "COMMITTED"
