"""`peer` verification over direct S3 uploads (docs/direct-s3.md, docs/dataplane.md), on moto.

moto accepts a part whose bytes do not match its CRC32 and keeps no part checksum, so on
moto the store verifies nothing and `store` verification has nothing to stand on (the
service refuses such a hand-over). In `peer` mode the service records a directly uploaded
file DECLARED; rank r reads rank r+1's object back through a presigned GET the service
grants it (the rank holds no store credentials) and reports its xxh3-128; only then may the
checkpoint commit. A part changed after its checksum was computed never commits (control:
the same upload, with the read-back replaced by a check that trusts the digest it is told,
commits the bad bytes). A file nobody checks is hashed by the service from S3 after the
grace (domain/peer/peer_fallback.py), and still refused when it is bad."""

from __future__ import annotations

import pytest

import lastgood
from lastgood.datapath import directs3, peer
from lastgood.errors import SaveFailed

from .helpers import checkpoint, events, last_good_id, lying_checker, wait_status
from .test_direct_s3 import MiB, metric, round_trip, upload_corrupted

NAME = "rank00000.bin"


def PEER_SETTINGS(request) -> dict:  # conftest's peer_svc: direct uploads to a bucket of this module's
    server = request.getfixturevalue("s3_server")
    return {**server.env(server.make_bucket()), "LASTGOOD_DIRECT_S3": "true",
            "LASTGOOD_DIRECT_S3_PART_SIZE": str(5 * MiB)}


def uploaded(svc, run: str, corrupt: bool):
    """Begin a checkpoint of two ranks, checksum rank 0's 12 MiB file (3 parts), change a byte
    of part 2 if `corrupt`, upload, hand over, vote; rank 1 (no files of its own, rank 0's
    checker) votes: the checkpoint then waits for its peer check (`check`)."""
    t, cid, data, prepared = upload_corrupted(svc, run, corrupt, world=2)
    handle = directs3.upload(t, cid, 0, NAME, data, prepared)  # moto takes the bad part: no BadDigest
    directs3.hand_over(t, cid, 0, NAME, handle)  # DECLARED: the store vouches for nothing here
    assert t.commit_rank(cid, 0, [NAME], wait=0).status == "PENDING"  # voted; not checked yet
    assert t.commit_rank(cid, 1, [], wait=0).status == "PENDING"
    return t, cid, data, prepared


def test_a_direct_save_checked_by_a_peer_round_trips_bitwise(peer_svc, run_name):
    assert peer_svc.info["direct_s3"] and peer_svc.info["verification"] == "peer"
    round_trip(peer_svc.url, run_name)
    kinds = [e["kind"] for e in events(peer_svc, run_name)]
    # one rank: it does not check itself, the service reads the object back (it received none of it)
    assert "direct_upload" in kinds and "peer_verified" not in kinds
    assert metric(peer_svc, "lastgood_bytes_ingested_total") == 0


def test_a_part_changed_after_its_checksum_never_commits_in_peer_mode(peer_svc, run_name):
    t, cid, data, prepared = uploaded(peer_svc, run_name, corrupt=True)
    try:
        with pytest.raises(SaveFailed, match="peer check: rank 0's rank00000.bin in the store has xxh3-128"):
            peer.check(t, None, cid, 1, deadline=float("inf"))  # the real read-back, through a presigned GET
    finally:
        t.close()
    assert checkpoint(peer_svc, cid)["status"] == "ABANDONED"
    kinds = [e["kind"] for e in events(peer_svc, run_name)]
    assert "hash_mismatch" in kinds and "commit" not in kinds
    assert last_good_id(peer_svc, run_name) is None


def test_control_without_the_read_back_the_changed_part_commits_on_moto(peer_svc, run_name):
    """The same upload, with the peer's read replaced by a check that reports the declared digest
    unread: nothing else on moto stops it, and the bad bytes commit."""
    t, cid, data, prepared = uploaded(peer_svc, run_name, corrupt=True)
    try:
        peer.check(t, None, cid, 1, deadline=float("inf"), read=lying_checker({NAME: prepared.xxh3_128}))
        assert t.commit_rank(cid, 0, [NAME], wait=5).status == "COMMITTED"
        view, digest = t.read_file(cid, 0, NAME, len(data))  # a presigned GET of the committed object
    finally:
        t.close()
    assert bytes(view) == bytes(data) and digest != prepared.xxh3_128  # the changed bytes, committed


def test_the_check_reads_through_a_presigned_get_the_service_grants(peer_svc, run_name):
    """The assignment names a URL, not a path: the checker needs no store credentials, and
    a reader that is not the assigned checker gets nothing it could not already read."""
    t, cid, data, prepared = uploaded(peer_svc, run_name, corrupt=False)
    try:
        a = t.peer_assignment(cid, 1)
        (f,) = a["files"]
        assert f["path"] is None and f["url"].startswith("http") and "X-Amz-Signature=" in f["url"]
        assert "xxh3_128" not in f and prepared.xxh3_128 not in str(a)  # the checker is never told what to say
        assert directs3.hash_object(f["url"], f["size"])[0] == prepared.xxh3_128
        assert peer.check(t, None, cid, 1, deadline=float("inf")) in ("PENDING", "COMMITTED")
        assert t.commit_rank(cid, 0, [NAME], wait=5).status == "COMMITTED"
    finally:
        t.close()


@pytest.mark.slow  # a service of its own each, and the grace to wait out
@pytest.mark.parametrize("corrupt", [False, True], ids=["good", "corrupted"])
def test_a_file_nobody_checks_is_hashed_by_the_service_from_s3(make_service, tmp_path, s3_server, s3_bucket,
                                                              run_name, corrupt):
    """The liveness rule over S3: every rank voted, none checks; after the grace the service
    reads the object from the store itself: a good file commits, a changed one is refused."""
    svc = make_service(data_dir=tmp_path / "svc", **s3_server.env(s3_bucket), LASTGOOD_DIRECT_S3="true",
                       LASTGOOD_VERIFICATION="peer", LASTGOOD_DIRECT_S3_PART_SIZE=str(5 * MiB),
                       LASTGOOD_LEASE_SECONDS="20", LASTGOOD_PEER_CHECK_GRACE_SECONDS="2")
    t, cid, _data, _prepared = uploaded(svc, run_name, corrupt=corrupt)
    t.close()
    wait_status(svc, cid, "ABANDONED" if corrupt else "COMMITTED", timeout=60)
    kinds = [e["kind"] for e in events(svc, run_name)]
    assert "peer_verified" not in kinds and "expired" not in kinds
    assert ("hash_mismatch" in kinds) == corrupt
