"""Peer verification's liveness (domain/peer_fallback.py, docs/dataplane.md): a checkpoint
whose ranks all voted commits even when no rank checks a file - a checker that died after
its vote, a rank that does not wait for the outcome (DCP's non-coordinators), a checker
that hit EIO part-way: the service hashes what nobody reported, after a grace, in the
background. Control: with the rule off (a grace past the lease) the same checkpoint is
ABANDONED when its lease runs out. The service's hash still refuses a changed file."""

from __future__ import annotations

import pytest

from ..conftest import FAST, ServiceProc
from .helpers import events, make_shard, shard_name, wait_status
from .test_directfs import handed_over

GRACE = "2"


@pytest.fixture(scope="module")
def fb_svc(tmp_path_factory):
    s = ServiceProc(tmp_path_factory.mktemp("peerfb"), {**FAST, "LASTGOOD_LEASE_SECONDS": "20",
                                                        "LASTGOOD_VERIFICATION": "peer",
                                                        "LASTGOOD_PEER_CHECK_GRACE_SECONDS": GRACE}).start()
    yield s
    s.stop()


def test_a_checker_that_never_reports_does_not_stop_the_commit(fb_svc, run_name, tmp_path):
    """Every rank voted, no rank checks (it crashed after its vote): the service hashes the
    file once the grace is over and the checkpoint commits, well before its lease."""
    data = make_shard(0, seed=21)
    t, direct, handle, digest, cid = handed_over(fb_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"  # voted; never checked
    finally:
        t.close()
    wait_status(fb_svc, cid, "COMMITTED", timeout=60)
    kinds = [e["kind"] for e in events(fb_svc, run_name)]
    assert "commit" in kinds and "peer_verified" not in kinds and "expired" not in kinds


@pytest.mark.slow  # waits for a lease to run out
def test_control_with_the_rule_off_the_unchecked_checkpoint_is_abandoned(make_service, run_name, tmp_path):
    svc = make_service(LASTGOOD_LEASE_SECONDS="6", LASTGOOD_VERIFICATION="peer",
                       LASTGOOD_PEER_CHECK_GRACE_SECONDS="6")  # at the lease: the service never takes over
    data = make_shard(0, seed=21)
    t, direct, handle, digest, cid = handed_over(svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"
    finally:
        t.close()
    wait_status(svc, cid, "ABANDONED", timeout=60)
    assert "expired" in [e["kind"] for e in events(svc, run_name)]


def test_the_services_own_hash_refuses_a_changed_file_nobody_checked(fb_svc, run_name, tmp_path):
    data = make_shard(0, seed=22)
    t, direct, handle, digest, cid = handed_over(fb_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
    finally:
        t.close()
    wait_status(fb_svc, cid, "ABANDONED", timeout=60)
    kinds = [e["kind"] for e in events(fb_svc, run_name)]
    assert "hash_mismatch" in kinds and "commit" not in kinds and "expired" not in kinds
