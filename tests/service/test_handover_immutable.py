"""A file handed over is immutable from then on (domain/dataplane/spool.py, Taken.require_no_writer):
the service takes a spooled or direct-FS file only when no process holds it open for writing.
A writer that keeps its descriptor and writes through it after the hand-over, before the vote,
never gets those bytes committed: its hand-over is refused (the spool's raw hand-over: nothing
recorded, the vote refused; the client's own path: it streams the declared bytes instead).
Before, the service hashed the file, the writer changed it and the changed bytes became
last-good. The control: the same hand-over with the descriptor closed is taken."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from lastgood.wire.hashing import hash_bytes

from ..conftest import FAST, ServiceProc
from .helpers import checkpoint, last_good_id, make_shard, rpc_error, shard_blob, shard_name
from .test_directfs import mount_of, written
from .test_spool import spool_of, spooled_put

SC = grpc.StatusCode


def test_a_spooled_file_its_writer_keeps_open_is_refused_and_never_committed(svc, cl, run_name):
    spool, sid = spool_of(svc)
    data = make_shard(0, seed=51)
    cid = cl.begin(run_name).checkpoint_id
    name = "a" * 32 + ".part"
    fd = os.open(spool / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        err = rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, data, name, sid)
        assert "still open for writing" in err.details()
        os.pwrite(fd, b"\xff" * 64, 4096)  # the writer goes on through its descriptor
    finally:
        os.close(fd)
    rpc_error(SC.FAILED_PRECONDITION, cl.vote, cid, 0, [shard_name(0)])  # nothing recorded to vote for
    assert checkpoint(svc, cid)["status"] == "PENDING" and last_good_id(svc, run_name) is None
    # control: written and closed, the same hand-over is taken and commits the declared bytes
    cid = cl.begin(run_name, step=2).checkpoint_id
    (spool / name).write_bytes(data)
    assert spooled_put(cl, cid, data, name, sid).size == len(data)
    assert cl.vote(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    assert shard_blob(svc, cid, 0).read_bytes() == data


@pytest.fixture(scope="module")
def hashing_svc(tmp_path_factory):
    s = ServiceProc(tmp_path_factory.mktemp("service"), {**FAST, "LASTGOOD_LEASE_SECONDS": "60"}).start()
    yield s
    s.stop()


def test_a_direct_fs_file_changed_through_a_kept_descriptor_after_the_hand_over_is_not_committed(
        hashing_svc, run_name, tmp_path):
    """`service` mode: the service hashed the file at the hand-over, so a change after it was
    never read (before: committed, last-good, and `verify` later found it CORRUPT)."""
    data = make_shard(0, seed=52)
    t, direct, handle, digest = written(hashing_svc, tmp_path, data)
    cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
    fd = os.open(Path(direct.staging["dir"]) / handle.name, os.O_WRONLY)  # the writer keeps a descriptor
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)  # refused: streamed instead
        os.pwrite(fd, b"\xff" * 64, 4096)  # after the hand-over, before the vote
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        os.close(fd)
        t.close()
    blob = shard_blob(hashing_svc, cid, 0)
    assert hash_bytes(blob.read_bytes()) == digest  # the declared bytes, not the changed file
    assert hashing_svc.post(f"/api/v1/checkpoints/{cid}/verify").json()["ok"]


def test_control_a_direct_fs_file_closed_before_the_hand_over_is_adopted(hashing_svc, run_name, tmp_path):
    data = make_shard(0, seed=53)
    t, direct, handle, digest = written(hashing_svc, tmp_path, data)
    inode = (Path(direct.staging["dir"]) / handle.name).stat().st_ino
    cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()
    assert shard_blob(hashing_svc, cid, 0).stat().st_ino == inode  # taken by name: the very file
    assert mount_of(hashing_svc, tmp_path).exists()
