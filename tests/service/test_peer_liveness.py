"""Peer verification's liveness (domain/peer/peer_fallback.py, docs/dataplane.md): a checkpoint
whose ranks all voted commits even when no rank checks a file - a checker that died after
its vote, a rank that does not wait for the outcome (DCP's non-coordinators), a checker
that hit EIO part-way: the service hashes what nobody reported, after a grace, in the
background. Control: with the rule off (a grace past the lease) the same checkpoint is
ABANDONED when its lease runs out. The service's hash still refuses a changed file."""

from __future__ import annotations

import errno
import os
import time

import pytest

from lastgood.datapath import directfs, peer
from lastgood.errors import SaveFailed
from lastgood.commit.session import SaveSession
from lastgood.datapath.transport import Transport
from lastgood.wire import peerkey

from .helpers import checkpoint, events, make_shard, shard_name, wait_status
from .test_directfs import handed_over, mount_of

GRACE = "2"
PEER_SETTINGS = {"LASTGOOD_LEASE_SECONDS": "20", "LASTGOOD_PEER_CHECK_GRACE_SECONDS": GRACE}  # conftest's peer_svc


def voted_unchecked(svc, tmp_path, run: str, seed: int) -> int:
    """A one-rank checkpoint whose rank handed its file over and voted, and never checked
    (it crashed after its vote): the checkpoint's id."""
    data = make_shard(0, seed=seed)
    t, direct, handle, digest, cid = handed_over(svc, tmp_path, run, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"  # voted; never checked
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
    finally:
        t.close()
    return cid


def test_a_checker_that_never_reports_does_not_stop_the_commit(peer_svc, run_name, tmp_path):
    """Every rank voted, no rank checks (it crashed after its vote): the service hashes the
    file once the grace is over and the checkpoint commits, well before its lease."""
    cid = voted_unchecked(peer_svc, tmp_path, run_name, seed=21)
    wait_status(peer_svc, cid, "COMMITTED", timeout=60)
    kinds = [e["kind"] for e in events(peer_svc, run_name)]
    assert "commit" in kinds and "peer_verified" not in kinds and "expired" not in kinds


def test_a_commit_that_fails_after_the_services_hash_is_tried_again(make_service, run_name, tmp_path):
    """The service hashed the file nobody checked, then its commit attempt failed (a
    transient catalog error: the commit_fails_once failpoint). Nothing else would commit
    the checkpoint - every rank voted, no file is DECLARED any more, so the hash is not
    started again - and before the fix it sat PENDING until its lease ran out: ABANDONED,
    a save lost to the service's own hiccup. The sweep tries the commit again."""
    svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_FAILPOINT="commit_fails_once", **PEER_SETTINGS)
    cid = voted_unchecked(svc, tmp_path, run_name, seed=26)
    deadline = time.monotonic() + 60
    while (view := checkpoint(svc, cid))["status"] == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert view["status"] == "COMMITTED", view  # before the fix: ABANDONED when the lease ran out
    assert "failpoint commit_fails_once" in svc.log.read_text()  # the first attempt did fail
    kinds = [e["kind"] for e in events(svc, run_name)]
    assert "commit" in kinds and "expired" not in kinds


@pytest.mark.slow  # waits for a lease to run out
def test_the_retried_commit_does_not_commit_a_file_lost_since_it_was_verified(make_service, run_name, tmp_path):
    """The rank's own report verified its file, and the report's commit attempt failed
    (commit_fails_once). Before the sweep tries the commit again, the file is gone from the
    store (a host crash lost what was published but not on disk). The sweep's retry must
    not commit a checkpoint whose file is missing - as recovery at start-up checks every
    file's presence first (lifecycle.shards_present), so does the retry: the lease decides,
    ABANDONED. Before the fix (a review finding) it committed with the file missing."""
    svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_FAILPOINT="commit_fails_once",
                       LASTGOOD_LEASE_SECONDS="20", LASTGOOD_PEER_CHECK_GRACE_SECONDS="6")
    data = make_shard(0, seed=27)
    t, direct, handle, digest, cid = handed_over(svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"  # voted
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
        a = t.peer_assignment(cid, 1)
        assert [f["name"] for f in a["files"]] == [shard_name(0)]
        # the report verifies the file; its commit attempt fails (the failpoint). Sent once,
        # not through the transport, whose retry would commit at once
        svc.post(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check", json={"peer_rank": a["peer_rank"],
                                           "files": [peer.report_entry(shard_name(0), digest)]},
                 headers={peerkey.HEADER: peerkey.rank_secret(cid, 1)})
    finally:
        t.close()
    assert "failpoint commit_fails_once" in svc.log.read_text()
    blobs = [p for p in svc.blob_root.rglob("*") if p.is_file() and p.stat().st_size == len(data)]
    assert len(blobs) == 1, blobs
    os.chmod(blobs[0].parent, 0o755)
    blobs[0].unlink()  # lost before the sweep's retry (grace: 6 s after begin)
    wait_status(svc, cid, "ABANDONED", timeout=60)  # before the fix: COMMITTED, its file missing
    assert "commit" not in [e["kind"] for e in events(svc, run_name)]


def _reaper_transactions(svc) -> tuple[int, int]:
    """The lease reaper's catalog transactions so far: its expiry passes, its peer-check passes."""
    counts = {line.split('"')[1]: int(float(line.split()[-1])) for line in svc.get("/metrics").text.splitlines()
              if line.startswith("lastgood_catalog_transactions_total{")}
    return counts.get("expire", 0), counts.get("peer_sweep", 0)


@pytest.mark.slow  # watches the reaper through several idle periods
def test_the_reaper_reads_the_catalog_only_when_something_can_be_due(make_service, run_name):
    """Expiry and the peer-check pass ran on every reaper pass (0.2 s here), two catalog
    transactions each time, pending checkpoint or not: most of an idle service's CPU, and a
    pending save paid for them the longer it took. Each pass now sleeps until it can have
    work: expiry until the earliest lease (or a lease from now), the peer pass until the
    grace has passed since the earliest begin. Bounded from above only (a loaded machine
    makes fewer passes). Then a checkpoint begun while both slept: once it is older than
    the grace the peer pass runs again and again (its ranks may vote any time), and its
    lease still expires it."""
    svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_LEASE_SECONDS="10",
                       LASTGOOD_PEER_CHECK_GRACE_SECONDS="4")  # FAST: a reaper pass every 0.2 s
    time.sleep(1)  # the first passes, at start
    expire0, sweep0 = _reaper_transactions(svc)
    time.sleep(3)  # 15 reaper passes: 30 transactions before
    expire1, sweep1 = _reaper_transactions(svc)
    assert expire1 - expire0 <= 1 and sweep1 - sweep0 <= 1, (expire1 - expire0, sweep1 - sweep0)

    t = Transport(svc.url, spool=False)
    try:
        cid = t.begin(run_name, 1, 2, None, "a1", 0).checkpoint_id  # world 2: nobody votes
    finally:
        t.close()
    deadline = time.monotonic() + 60
    while (now := _reaper_transactions(svc))[1] - sweep1 < 4:  # 0.4 s apart once it is 4 s old
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    wait_status(svc, cid, "ABANDONED", timeout=60)
    assert "expired" in [e["kind"] for e in events(svc, run_name)]


@pytest.mark.slow  # waits for a lease to run out
def test_control_with_the_rule_off_the_unchecked_checkpoint_is_abandoned(make_service, run_name, tmp_path):
    svc = make_service(LASTGOOD_LEASE_SECONDS="6", LASTGOOD_VERIFICATION="peer",
                       LASTGOOD_PEER_CHECK_GRACE_SECONDS="6")  # at the lease: the service never takes over
    cid = voted_unchecked(svc, tmp_path, run_name, seed=21)
    wait_status(svc, cid, "ABANDONED", timeout=60)
    assert "expired" in [e["kind"] for e in events(svc, run_name)]


def test_the_services_own_hash_refuses_a_changed_file_nobody_checked(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=22)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
    finally:
        t.close()
    wait_status(peer_svc, cid, "ABANDONED", timeout=60)
    kinds = [e["kind"] for e in events(peer_svc, run_name)]
    assert "hash_mismatch" in kinds and "commit" not in kinds and "expired" not in kinds


def test_a_rank_that_does_not_wait_for_the_outcome_does_not_wait_for_its_peers_vote(peer_svc, run_name, tmp_path,
                                                                                     monkeypatch):
    """DCP's non-coordinators vote with commit(wait=False) in write_data, before the
    coordinator (rank 0) votes in finish(): rank 1 checks rank 0's files, so waiting for
    rank 0's vote there would deadlock. Rank 1 returns at once; rank 0's file, which nobody
    checked, is hashed by the service, and the checkpoint commits."""
    monkeypatch.setenv("LASTGOOD_DIRECT_FS_MOUNT", str(mount_of(peer_svc, tmp_path)))
    t = Transport(peer_svc.url, spool=False)
    try:
        direct = directfs.of(t)
        assert direct is not None
        ups = [SaveSession(t, run_name, r, commit_timeout=t_out, path=directfs.DirectFSPath(t, direct)).checkpoint(7)
               for r, t_out in ((0, 120.0), (1, 5.0))]  # rank 1 gives up on rank 0 after 5 s if it waits
        for r, up in enumerate(ups):
            up.add(shard_name(r), make_shard(r, seed=30 + r))
        cid = ups[0].begin(2, "a1")
        assert ups[1].begin(2, "a1") == cid
        ups[1].commit(wait=False)  # before the fix: SaveFailed, "rank 0 did not vote in time"
        assert checkpoint(peer_svc, cid)["status"] == "PENDING"
        ups[0].commit()  # votes, checks rank 1's file, waits: rank 0's own file is the service's to hash
    finally:
        t.close()
    assert checkpoint(peer_svc, cid)["status"] == "COMMITTED"
    checked = [e.get("data", e) for e in events(peer_svc, run_name) if e["kind"] == "peer_verified"]
    assert [(c["rank"], c["checked_by"]) for c in checked] == [(1, 0)], checked


def test_an_error_part_way_through_the_read_back_is_reported_unread(peer_svc, run_name, tmp_path, monkeypatch):
    """EIO after the first piece: the checker reports the file unread (the service hashes
    it) instead of failing the save with the error."""
    data = make_shard(0, seed=23, n=2_000_000)  # several of the checker's 8 MiB pieces
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    reads = []
    real = os.readv

    def failing(fd, bufs):
        reads.append(fd)
        if len(reads) > 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs)

    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
        monkeypatch.setattr(peer.os, "readv", failing)
        try:
            peer.check(t, direct, cid, 1, deadline=float("inf"))
        except OSError as e:  # before the fix
            raise AssertionError(f"the read error escaped the peer check: {e!r}") from e
        except SaveFailed:
            raise
        monkeypatch.undo()
        assert len(reads) == 2  # it did fail part-way
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status in ("PENDING", "COMMITTED")
    finally:
        t.close()
    wait_status(peer_svc, cid, "COMMITTED", timeout=60)


def test_a_file_reported_unread_is_hashed_after_the_report_not_inside_it(peer_svc, run_name, tmp_path):
    """The report answers before the service hashes the file (a multi-GB hash inside the
    POST outlasted the client's timeout, and each retry started another): the answer does
    not list it as verified; the service's own hash then does, and the checkpoint commits."""
    data = make_shard(0, seed=24)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
        r = peer_svc.post(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check",
                        json={"peer_rank": 0, "files": [{"name": shard_name(0), "xxh3_128": None}]},
                        headers={peerkey.HEADER: peerkey.rank_secret(cid, 1)})
        assert r.status_code == 200, r.text
        assert r.json()["verified"] == [], r.json()  # before the fix: hashed in the request, and listed
    finally:
        t.close()
    wait_status(peer_svc, cid, "COMMITTED", timeout=60)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_the_checker_drops_the_files_cached_pages_before_reading_it(peer_svc, run_name, tmp_path, monkeypatch):
    """A checker on the writer's host (torchrun's rank r + 1, mostly) would otherwise read
    the writer's pages from memory, not what the file system stored."""
    data = make_shard(0, seed=25)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    calls = []
    real_fadvise, real_readv = os.posix_fadvise, os.readv
    monkeypatch.setattr(peer.os, "posix_fadvise", lambda fd, off, n, advice: (calls.append(("fadvise", advice)),
                                                                              real_fadvise(fd, off, n, advice))[1])
    monkeypatch.setattr(peer.os, "readv", lambda fd, bufs: (calls.append(("readv", None)), real_readv(fd, bufs))[1])
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        t.commit_rank(cid, 1, [], wait=0)  # rank 1: no files, rank 0's checker
        assert peer.check(t, direct, cid, 1, deadline=float("inf")) in ("PENDING", "COMMITTED")
    finally:
        monkeypatch.undo()
        t.close()
    assert calls and calls[0] == ("fadvise", os.POSIX_FADV_DONTNEED), calls[:3]
    assert ("readv", None) in calls
    wait_status(peer_svc, cid, "COMMITTED", timeout=60)
