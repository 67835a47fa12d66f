"""Group commit of votes (domain/commit/votebatch.py): a batch is written whole or not at all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout

import grpc
import pytest

from tests.service.helpers import Client, http, make_shard, rpc_error, shard_name

pytestmark = pytest.mark.slow  # a service of its own per test, armed with failpoints

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


def test_voters_of_a_completing_batch_are_answered_while_its_commit_is_held(make_service, run_name):
    """The failpoint holds every commit before its manifest write until the test releases
    it (a slow S3 PUT). The four votes arrive in one batch, which completes the checkpoint:
    one voter commits and is held; the other three asked to wait 0 s and are answered
    PENDING while the commit is still held, and so is a vote sent again meanwhile (it does
    not become a second committer). Released, the committer answers COMMITTED."""
    ranks = 4
    svc = make_service(LASTGOOD_FAILPOINT="hold_manifest", LASTGOOD_VOTE_BATCH_WINDOW="1.0",
                       LASTGOOD_LEASE_SECONDS="60")
    release = svc.data_dir / "hold_manifest.release"
    pool = ThreadPoolExecutor(ranks)
    try:
        with Client(svc.grpc_target) as c:
            cid = c.begin(run_name, world_size=ranks).checkpoint_id
            for r in range(ranks):
                c.put(cid, r, shard_name(r), make_shard(r))
            votes = [pool.submit(c.vote, cid, r, [shard_name(r)]) for r in range(ranks)]
            answered = []
            try:
                for f in as_completed(votes, timeout=60):  # a hang guard, not a timing assert
                    answered.append(f.exception() or f.result())
                    if len(answered) == ranks - 1:
                        break
            except FuturesTimeout:
                pass
            assert not release.exists()  # the commit is still held
            replies = [(a.code().name, a.details()) if isinstance(a, grpc.RpcError) else (a.status, list(a.missing_ranks))
                       for a in answered]
            assert replies == [("PENDING", [])] * (ranks - 1), "voters waited for a commit they did not wait for"
            held = [f for f in votes if not f.done()]
            assert len(held) == 1  # the committer
            again = c.vote(cid, 0, [shard_name(0)])  # sent again while the manifest is written
            assert (again.status, list(again.missing_ranks)) == ("PENDING", [])
            assert http(svc).get(f"/api/v1/checkpoints/{cid}").json()["status"] == "PENDING"
            release.touch()
            assert held[0].result(timeout=60).status == "COMMITTED"
            assert c.vote(cid, 1, [shard_name(1)]).status == "COMMITTED"
    finally:
        release.touch()
        pool.shutdown(wait=True)
