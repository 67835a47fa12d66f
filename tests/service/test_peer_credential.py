"""Peer checks are bound to the checker (docs/dataplane.md, "Who may check"): every rank of a job
holds the same token, so a report is accepted only with the secret whose commitment the
assigned rank's vote carried (lastgood/wire/peerkey.py). A rank that files its checker's
report, a second claim of a rank's vote, and a job of one rank checking itself are each
refused, and the file with bytes that are not its declared digest never becomes last-good;
the controls are the same requests by the rank that holds the secret."""

from __future__ import annotations

import grpc
import pytest

from lastgood.datapath import peer
from lastgood.datapath.transport import Transport
from lastgood.datapath.directfs import DirectFS
from lastgood.errors import PermissionDenied, SaveFailed
from lastgood.wire import peerkey
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import checkpoint, events, last_good_id, make_shard, shard_name, wait_status
from .test_directfs import handed_over, mount_of, written


def forged_report(t, cid: int, digest: str, key: str | None):
    """Rank 0, the writer, files rank 1's report of its own file: the digest it declared, unread."""
    headers = {peerkey.HEADER: key} if key else None
    return t.post_json(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check",
                       {"peer_rank": 0, "files": [{"name": shard_name(0), "xxh3_128": digest}]}, headers=headers)


@pytest.mark.parametrize("key", ["none", "the writer's own"])
def test_a_writer_cannot_file_its_checker_s_report(peer_svc, run_name, tmp_path, key):
    data = make_shard(0, seed=21)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)  # the checker voted: its report is due
        with pytest.raises(PermissionDenied, match="only that rank may check"):
            forged_report(t, cid, digest, None if key == "none" else peerkey.rank_secret(cid, 0))
        assert checkpoint(peer_svc, cid)["status"] == "PENDING"
        assert "peer_report_refused" in [e["kind"] for e in events(peer_svc, run_name)]
        # the checker's own check, with its secret, reads the changed bytes back: aborted
        with pytest.raises(SaveFailed, match="peer check: rank 0's"):
            peer.check(t, direct, cid, 1, deadline=float("inf"))
    finally:
        t.close()
    assert checkpoint(peer_svc, cid)["status"] == "ABANDONED"
    assert last_good_id(peer_svc, run_name) is None


def test_control_the_checker_s_own_report_of_the_declared_digest_commits(peer_svc, run_name, tmp_path):
    """The same unread report, sent with the checker's secret, is accepted: the secret is
    what the service checks (a checker that does not read is caught by not knowing the digest)."""
    data = make_shard(0, seed=21)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)
        assert forged_report(t, cid, digest, peerkey.rank_secret(cid, 1))["status"] == "COMMITTED"
    finally:
        t.close()


def test_the_checker_learns_where_the_file_is_but_not_its_declared_digest(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=22)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)
        with pytest.raises(PermissionDenied):  # the assignment, too, is the checker's alone
            t.get_json(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check")
        a = t.peer_assignment(cid, 1)
        assert [f["name"] for f in a["files"]] == [shard_name(0)] and a["files"][0]["path"]
        assert digest not in str(a)
        listed = t.get_json(f"/api/v1/checkpoints/{cid}/shards")["ranks"][0]["files"][0]
        assert listed["status"] == "DECLARED" and listed["xxh3_128"] is None
        assert peer.check(t, direct, cid, 1, deadline=float("inf")) == "COMMITTED"
        listed = t.get_json(f"/api/v1/checkpoints/{cid}/shards")["ranks"][0]["files"][0]
        assert listed["xxh3_128"] == digest  # control: shown once verified
    finally:
        t.close()


def test_a_second_claim_of_a_rank_s_vote_is_refused_and_aborts_the_checkpoint(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=23)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 1, [], wait=0)
        assert t.commit_rank(cid, 1, [], wait=0).status == "PENDING"  # control: the same claim again is the same vote
        other = peerkey.commitment("ab" * 32)
        with pytest.raises(grpc.RpcError) as refused:
            t._stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=1, files=[], peer_key=other), timeout=30)
        assert "claimed twice with different peer keys" in refused.value.details()
    finally:
        t.close()
    assert checkpoint(peer_svc, cid)["status"] == "ABANDONED"
    assert "peer_key_contested" in [e["kind"] for e in events(peer_svc, run_name)]


def test_a_one_rank_job_does_not_check_itself_the_service_hashes_its_file(peer_svc, run_name, tmp_path):
    """Alone, the rank would check its own file: its report is refused, its assignment is
    empty and the service hashes the file; a changed file is aborted (before, the rank's
    report of the declared digest committed it)."""
    data = make_shard(0, seed=24)
    t, direct, handle, digest = written(peer_svc, tmp_path, data, change_after_hashing=True)
    cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        with pytest.raises(Exception, match="does not check its own files"):
            t.peer_report(cid, 0, {"peer_rank": 0, "files": [{"name": shard_name(0), "xxh3_128": digest}]})
        assert t.peer_assignment(cid, 0)["files"] == []
        wait_status(peer_svc, cid, "ABANDONED", timeout=30)
    finally:
        t.close()
    assert "hash_mismatch" in [e["kind"] for e in events(peer_svc, run_name)]
    assert last_good_id(peer_svc, run_name) is None


def test_a_malformed_peer_key_is_refused_and_records_no_vote(peer_svc, run_name, tmp_path):
    t, _direct, _handle, _digest = written(peer_svc, tmp_path, make_shard(0, seed=25))
    cid = t.begin(run_name, 1, 2, None, "a1", 0).checkpoint_id
    try:
        for bad in ("x" * 64, "AB" * 32, "ab" * 31, "ab" * 33):
            with pytest.raises(grpc.RpcError) as refused:
                t._stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=1, files=[], peer_key=bad), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert t.get_json(f"/api/v1/checkpoints/{cid}/shards")["ranks"] == []  # no vote recorded
        r = peer_svc.get(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check", headers={peerkey.HEADER: "ab" * 40})
        assert r.status_code == 422, r.text  # a header longer than a secret: refused before any lookup
        assert t.commit_rank(cid, 1, [], wait=0).status == "PENDING"  # control: the client's own key
    finally:
        t.close()


def test_a_checker_that_voted_without_a_key_is_given_nothing_and_the_service_hashes(peer_svc, run_name, tmp_path):
    """A client that sends no peer key (an older one) is not failed: its assignment is empty,
    its report refused, and the service hashes its peer's file - a changed one is aborted."""
    data = make_shard(0, seed=26)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t._stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=1, files=[]), timeout=30)  # no peer_key
        with pytest.raises(PermissionDenied, match="without a peer key"):
            forged_report(t, cid, digest, peerkey.rank_secret(cid, 1))
        assert peer.check(t, direct, cid, 1, deadline=float("inf")) in ("PENDING", "ABANDONED")  # nothing to read
        wait_status(peer_svc, cid, "ABANDONED", timeout=30)
    finally:
        t.close()
    assert last_good_id(peer_svc, run_name) is None
