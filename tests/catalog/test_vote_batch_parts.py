"""One checkpoint's part of a vote batch (domain/commit/votebatch.py) fails alone, on SQLite and PostgreSQL.

A batch writes the votes of several checkpoints, of unrelated runs too, in one
transaction. An SQL error in one checkpoint's part (a deadlock, a lock timeout) must
fail only that checkpoint's voters: the others' votes are written and answered. The
failpoint raises a real SQL error (on PostgreSQL it aborts the transaction) right after
that checkpoint's votes were written into it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import select

from lastgood_service.catalog.models import Vote
from lastgood_service.domain.commit import CommitService
from lastgood_service.domain.errors import Conflict, FailedPrecondition, Unavailable
from lastgood_service.settings import Settings
from tests.service.helpers import make_shard, shard_name

from .test_commit_backends import ATTEMPT, put, status


def test_an_sql_error_in_one_checkpoint_of_a_batch_fails_only_its_voters(sessions, blobs, clock):
    plain = CommitService(Settings(lease_seconds=60), sessions, blobs, clock=clock)
    good = plain.begin("run-good", 1, 2, None, ATTEMPT).id
    bad = plain.begin("run-bad", 1, 1, None, ATTEMPT).id
    for cid, rank in [(good, 0), (good, 1), (bad, 0)]:
        put(plain, cid, rank, make_shard(rank))
    # a 1 s window: the three votes sent together are one batch
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0, vote_batch_window=1.0,
                                     failpoint=f"vote_fails_on_checkpoint_{bad}"), sessions, blobs, clock=clock)
    voters = [(good, 0), (good, 1), (bad, 0)]
    with ThreadPoolExecutor(len(voters)) as pool:
        futures = [pool.submit(commits.vote, cid, rank, [shard_name(rank)]) for cid, rank in voters]
        outcomes = [f.exception() or f.result() for f in futures]
    assert isinstance(outcomes[2], Unavailable) and "vote again" in str(outcomes[2]), outcomes[2]
    assert sorted(getattr(o, "status", repr(o)) for o in outcomes[:2]) == ["COMMITTED", "PENDING"], outcomes
    assert status(sessions, good) == "COMMITTED"
    assert commits.vote_batches.batches == 1  # the three were one batch, and it was written
    with sessions() as s:
        assert list(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == bad))) == []  # nothing of its part
    # control: the failing checkpoint's voter votes again, through a service without the failpoint
    assert plain.vote(bad, 0, [shard_name(0)]).status == "COMMITTED"


def test_one_batch_commits_two_checkpoints_and_its_refusals_stay_with_their_voters(sessions, blobs, clock):
    """One batch: the last vote of checkpoint a, rank 0 of a again with other files
    (Conflict), the only vote of checkpoint b, and a vote on c for a file never uploaded
    (FailedPrecondition). a and b commit; each refusal reaches its own voter alone and
    writes nothing."""
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0, vote_batch_window=1.0),
                            sessions, blobs, clock=clock)
    # b and c begun through another service: a single-rank vote on a checkpoint begun through
    # this one would skip the window (votebatch.py) and could lead a batch of its own
    plain = CommitService(Settings(lease_seconds=60), sessions, blobs, clock=clock)
    a = commits.begin("run-a", 1, 2, None, ATTEMPT).id
    b = plain.begin("run-b", 1, 1, None, ATTEMPT).id
    c = plain.begin("run-c", 1, 1, None, ATTEMPT).id
    for cid, rank in [(a, 0), (a, 1), (b, 0), (c, 0)]:
        put(commits, cid, rank, make_shard(rank))
    assert commits.vote(a, 0, [shard_name(0)]).status == "PENDING"
    before = commits.vote_batches.batches
    voters = [(a, 1, [shard_name(1)]), (a, 0, [shard_name(0), "other.safetensors"]), (b, 0, [shard_name(0)]),
              (c, 0, ["never-uploaded.safetensors"])]
    with ThreadPoolExecutor(len(voters)) as pool:
        futures = [pool.submit(commits.vote, *v) for v in voters]
        outcomes = [f.exception() or f.result() for f in futures]
    assert commits.vote_batches.batches == before + 1  # one batch
    assert outcomes[0].status == "COMMITTED" and outcomes[2].status == "COMMITTED", outcomes
    assert isinstance(outcomes[1], Conflict) and "already voted" in str(outcomes[1]), outcomes[1]
    assert isinstance(outcomes[3], FailedPrecondition) and "not verified" in str(outcomes[3]), outcomes[3]
    assert (status(sessions, a), status(sessions, b), status(sessions, c)) == ("COMMITTED", "COMMITTED", "PENDING")
    with sessions() as s:
        assert list(s.scalars(select(Vote.files_json).where(Vote.checkpoint_id == a, Vote.rank == 0))) == [
            f'["{shard_name(0)}"]']  # the first vote stands
        assert list(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == c))) == []
