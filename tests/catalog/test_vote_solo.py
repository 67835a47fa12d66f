"""A single-rank checkpoint's vote skips the vote batch's gathering window (domain/commit/votebatch.py).

No other vote of a checkpoint of one rank can join its batch, so waiting `vote_batch_window`
for them is a fixed cost of every tiny single-rank save. The hint comes from the begin
through the same service; a checkpoint begun elsewhere (another replica), or of two ranks,
still waits the window. Counted by the batcher, never timed.
"""

from __future__ import annotations

from lastgood_service.catalog import txtimer
from lastgood_service.domain.commit import CommitService
from lastgood_service.settings import Settings
from tests.service.helpers import make_shard, shard_name

from .test_commit_backends import ATTEMPT, put, status


def test_a_single_rank_vote_skips_the_window_and_others_wait_it(sessions, blobs, clock):
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0, vote_batch_window=0.05),
                            sessions, blobs, clock=clock)
    other = CommitService(Settings(lease_seconds=60), sessions, blobs, clock=clock)
    solo = commits.begin("run-solo", 1, 1, None, ATTEMPT).id
    pair = commits.begin("run-pair", 1, 2, None, ATTEMPT).id
    elsewhere = other.begin("run-elsewhere", 1, 1, None, ATTEMPT).id  # begun through another replica
    for cid, rank in [(solo, 0), (pair, 0), (pair, 1), (elsewhere, 0)]:
        put(commits, cid, rank, make_shard(rank))

    assert commits.vote(solo, 0, [shard_name(0)]).status == "COMMITTED"
    assert (commits.vote_batches.unwaited, commits.vote_batches.batches) == (1, 1)
    # controls: two ranks, and one rank begun elsewhere, wait the window (and still commit)
    assert commits.vote(pair, 0, [shard_name(0)]).status == "PENDING"
    assert commits.vote(pair, 1, [shard_name(1)]).status == "COMMITTED"
    assert commits.vote(elsewhere, 0, [shard_name(0)]).status == "COMMITTED"
    assert (commits.vote_batches.unwaited, commits.vote_batches.batches) == (1, 4)
    assert {status(sessions, c) for c in (solo, pair, elsewhere)} == {"COMMITTED"}


def test_the_completing_vote_commits_with_the_plan_its_batch_read(sessions, blobs, clock):
    """The vote that completes a checkpoint reads the manifest's plan in its batch's
    transaction, under the row lock, and try_commit does not read it again: a single-rank
    vote is two catalog transactions (the batch, the commit), not three."""
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0), sessions, blobs, clock=clock)
    timer = txtimer.of(sessions)
    for step in (1, 2):
        cid = commits.begin("run-plan", step, 1, None, ATTEMPT).id
        put(commits, cid, 0, make_shard(0))
        mark = timer.total
        assert commits.vote(cid, 0, [shard_name(0)]).status == "COMMITTED"
        assert len(timer.since(mark, label="vote")) == 2, timer.since(mark)
        assert status(sessions, cid) == "COMMITTED"
