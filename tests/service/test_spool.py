"""The same-host hand-over: a shard written into the service's spool is taken, re-hashed and
adopted as the blob (by rename: the very file), and every trick with that directory - links,
wrong sizes, foreign ids, names that climb out - is refused, changing nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
import torch

import lastgood
from lastgood.wire import names
from lastgood.wire.hashing import hash_bytes
from lastgood.datapath.transport import Transport
from lastgood.wire.v1 import lastgood_pb2 as pb
from tests.conftest import through_its_data_path

from .helpers import (Client, assert_unchanged, make_shard, rpc_error, shard_blob, shard_name, snapshot)

SC = grpc.StatusCode


def spool_of(svc) -> tuple[Path, str]:
    info = svc.get("/api/v1/info").json()["spool"]
    return Path(info["dir"]), info["id"]


def spooled_put(cl, cid: int, data: bytes, name: str, spool_id: str, *, size: int | None = None,
                xxh3: str | None = None, chunks: tuple = ()):
    header = pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                            size=len(data) if size is None else size, xxh3_128=xxh3 or hash_bytes(data),
                            spool_file=name, spool_id=spool_id)
    msgs = [pb.PutShardRequest(header=header)] + [pb.PutShardRequest(chunk=c) for c in chunks]
    return cl.stub.PutShard(iter(msgs), timeout=30)


def spool_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def hand_over(svc, spool: Path, run_name: str, data: bytes) -> tuple[Path, int]:
    """One rank's shard written into the spool and handed over through the client's own
    Transport, committed; the blob, and the inode the client wrote."""
    t = Transport(svc.url)
    try:
        assert t.spool is not None and Path(t.spool["dir"]) == spool
        name = t.spool_write(data)
        inode = (spool / name).stat().st_ino
        cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
        res = t.put_shard(cid, 0, shard_name(0), memoryview(data), hash_bytes(data), spooled=name)
        assert (res.already_present, res.size, res.xxh3_128) == (False, len(data), hash_bytes(data))
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    finally:
        t.close()
    blob = shard_blob(svc, cid, 0)
    assert blob.read_bytes() == data
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []
    return blob, inode


@pytest.mark.parametrize("follow", [True, False], ids=["followed", "written-whole"])
def test_the_checkpointer_hands_its_shard_over_and_the_blob_is_that_file(svc, run_name, spool_inodes, follow):
    spool, _ = spool_of(svc)
    blob, inode = hand_over(svc, spool, run_name, make_shard(0, seed=4))
    assert blob.stat().st_ino == inode  # adopted, not copied
    spool_inodes.clear()

    # the whole Checkpointer path: saved through the spool (followed by the service as it
    # is written, or handed over once written), restored bit-exactly
    model = torch.nn.Linear(64, 64)
    with lastgood.Checkpointer(svc.url, run=run_name + "-ck") as ckpt:
        assert ckpt.transport.spool is not None and ckpt.transport.spool["follow"]
        ckpt.transport.spool["follow"] = follow
        through_its_data_path(ckpt.transport)
        ckpt.save(3, lastgood.TrainState(model=model))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    assert spool_files(spool) == []
    assert spool_inodes == {shard_blob(svc, cid, 0).stat().st_ino}  # handed over, not streamed
    other = torch.nn.Linear(64, 64)
    with lastgood.Checkpointer(svc.url, run=run_name + "-ck") as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=other)) == 3
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert svc.post(f"/api/v1/checkpoints/{cid}/verify").json()["status"] == "COMMITTED"


def test_links_and_foreign_files_are_refused(svc, cl, run_name, tmp_path):
    """A symlink or a hard link in the spool could make the service adopt (move) a file that
    is not the client's - another checkpoint's blob, say. Control: the same bytes as a plain
    file of the client are accepted."""
    spool, sid = spool_of(svc)
    cid_done, _ = cl.save(run_name, 1)
    victim = shard_blob(svc, cid_done, 0)
    victim_bytes = victim.read_bytes()
    cid = cl.begin(run_name, step=2).checkpoint_id
    before = snapshot(svc, run_name)

    (spool / ("a" * 32 + ".part")).symlink_to(victim)
    os.link(victim, spool / ("b" * 32 + ".part"))
    outside = tmp_path / "outside.part"
    outside.write_bytes(victim_bytes)
    (spool / ("c" * 32 + ".part")).symlink_to(outside)
    (spool / ("d" * 32 + ".part")).mkdir()
    for name in ("a" * 32 + ".part", "b" * 32 + ".part", "c" * 32 + ".part", "d" * 32 + ".part"):
        err = rpc_error(SC.INVALID_ARGUMENT, spooled_put, cl, cid, victim_bytes, name, sid)
        assert "regular file" in err.details(), err.details()
    # names that are not the spool's own: refused before anything is touched
    for name in ("../blobs/x.part", "/etc/passwd", "x" * 32 + ".part", "", ".lastgood-spool"):
        rpc_error(SC.INVALID_ARGUMENT, spooled_put, cl, cid, victim_bytes, name or "?", sid)
    assert victim.read_bytes() == victim_bytes and victim.stat().st_nlink == 1
    assert outside.read_bytes() == victim_bytes
    assert_unchanged(before, snapshot(svc, run_name))
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []

    # control: the same bytes in a plain file of the client's
    name = "e" * 32 + ".part"
    (spool / name).write_bytes(victim_bytes)
    res = spooled_put(cl, cid, victim_bytes, name, sid)
    assert res.size == len(victim_bytes) and not res.already_present


def test_wrong_size_hash_id_or_extra_chunks_change_nothing(svc, cl, run_name):
    spool, sid = spool_of(svc)
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, seed=9)
    before = snapshot(svc, run_name)

    def put(name: str, **kw):
        (spool / name).write_bytes(data)
        return spooled_put(cl, cid, data, name, kw.pop("spool_id", sid), **kw)

    rpc_error(SC.INVALID_ARGUMENT, put, "1" * 32 + ".part", size=len(data) + 1)
    rpc_error(SC.INVALID_ARGUMENT, put, "2" * 32 + ".part", size=len(data) - 1)
    rpc_error(SC.DATA_LOSS, put, "3" * 32 + ".part", xxh3=hash_bytes(b"other bytes"))
    rpc_error(SC.INVALID_ARGUMENT, put, "4" * 32 + ".part", chunks=(data[:10],))
    assert spool_files(spool) == ["4" * 32 + ".part"]  # refused before it was taken: still the client's
    (spool / ("4" * 32 + ".part")).unlink()
    # another spool's id: the file is not touched at all, and the client is told to stream
    err = rpc_error(SC.FAILED_PRECONDITION, put, "5" * 32 + ".part", spool_id="f" * 32)
    assert err.details().startswith("spool:")
    assert spool_files(spool) == ["5" * 32 + ".part"]
    (spool / ("5" * 32 + ".part")).unlink()
    assert_unchanged(before, snapshot(svc, run_name))
    assert list((spool / ".taken").iterdir()) == []
    # control: the right size, hash and id are accepted
    assert put("6" * 32 + ".part").size == len(data)


def test_fifos_other_users_files_and_missing_files(svc, cl, run_name):
    """A FIFO must be refused, not waited on (that would hold a server thread for good); a
    file of another user, or one that is not there (taken already: a retried hand-over
    after a lost reply), is a 'spool:' refusal, after which the client streams."""
    spool, sid = spool_of(svc)
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, seed=12)
    before = snapshot(svc, run_name)
    os.mkfifo(spool / ("7" * 32 + ".part"))
    err = rpc_error(SC.INVALID_ARGUMENT, spooled_put, cl, cid, data, "7" * 32 + ".part", sid)  # 30 s call timeout
    assert "regular file" in err.details()
    foreign = spool / ("8" * 32 + ".part")
    foreign.write_bytes(data)
    os.chown(foreign, 65534, 65534)
    err = rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, data, foreign.name, sid)
    assert err.details().startswith("spool:") and "uid 65534" in err.details()
    err = rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, data, "9" * 32 + ".part", sid)
    assert err.details().startswith("spool:") and "not in the spool" in err.details()
    assert_unchanged(before, snapshot(svc, run_name))
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []

    # the client: its hand-over landed but the reply was lost, so it hands over the same
    # (now gone) file again; it streams instead and hears that the shard is stored
    t = Transport(svc.url)
    name = t.spool_write(data)
    assert t.put_shard(cid, 0, shard_name(0), memoryview(data), hash_bytes(data), spooled=name).size == len(data)
    again = t.put_shard(cid, 0, shard_name(0), memoryview(data), hash_bytes(data), spooled=name)
    assert again.already_present and t.spool is not None  # a missing file does not turn the spool off
    assert t.commit_rank(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    t.close()


def test_spool_refusals_carry_their_error_code(svc, cl, run_name):
    """The client tells "this service does not read that spool" (stream from now on) from
    "this file could not be taken" (stream this shard) by the error code, not the words."""
    from lastgood import errors

    spool, sid = spool_of(svc)
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, seed=14)
    refusals = {
        "another spool": rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, data, "a" * 32 + ".part", "f" * 32),
        "no such file": rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, data, "b" * 32 + ".part", sid),
    }
    got = {what: errors.from_grpc("PutShard", e.code().name, e.details(), e.trailing_metadata())
           for what, e in refusals.items()}
    assert type(got["another spool"]) is errors.SpoolNotShared and got["another spool"].reason == "spool_not_shared"
    assert type(got["no such file"]) is errors.SpoolRefused and got["no such file"].reason == "spool_refused"
    assert all(e.details().startswith("spool:") for e in refusals.values())  # older clients read the words


@pytest.mark.slow
def test_a_spool_on_another_file_system_is_copied(make_service, run_name):
    """Adoption needs a rename into the blob store; across file systems (or bind mounts)
    the service copies the taken file instead, through the same hashing path."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == Path("/tmp").stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    spool_dir = shm / f"lastgood-spool-{run_name}"
    try:
        svc = make_service(LASTGOOD_SPOOL_DIR=str(spool_dir))
        blob, inode = hand_over(svc, spool_dir, run_name, make_shard(0, seed=13))
        assert blob.stat().st_ino != inode  # copied
    finally:
        import shutil

        shutil.rmtree(spool_dir, ignore_errors=True)


def test_a_declined_hand_over_is_streamed_instead(svc, run_name, tmp_path):
    """A client that believes it shares a spool the service does not read (a replica on
    another host, say) is told so, streams the bytes, and removes its file."""
    t = Transport(svc.url)
    fake = tmp_path / "not-the-services"
    fake.mkdir()
    (fake / ".lastgood-spool").write_text("f" * 32)
    t.spool = {"dir": str(fake), "id": "f" * 32}
    data = make_shard(0, seed=11)
    name = t.spool_write(data)
    assert (fake / name).exists()
    cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
    res = t.put_shard(cid, 0, shard_name(0), memoryview(data), hash_bytes(data), spooled=name)
    assert res.size == len(data) and res.xxh3_128 == hash_bytes(data)
    assert not (fake / name).exists() and t.spool is None  # and later saves stream straight away
    assert t.commit_rank(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    assert shard_blob(svc, cid, 0).read_bytes() == data
    t.close()


@pytest.mark.slow
def test_without_a_spool_clients_stream(make_service, run_name):
    svc = make_service(LASTGOOD_SPOOL="false")
    assert svc.get("/api/v1/info").json()["spool"] is None
    model = torch.nn.Linear(8, 8)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.transport.spool is None
        ckpt.save(1, lastgood.TrainState(model=model))
        ckpt.wait()
    cl = Client(svc.grpc_target)
    try:
        gen = svc.get(f"/api/v1/runs/{run_name}/launches/current").json()["generation"]  # as its launch
        cid = cl.begin(run_name, step=2, generation=gen).checkpoint_id
        err = rpc_error(SC.FAILED_PRECONDITION, spooled_put, cl, cid, b"x", "0" * 32 + ".part", "0" * 32)
        assert err.details().startswith("spool:")
    finally:
        cl.close()


def test_sweep_removes_only_abandoned_spool_files(tmp_path):
    from lastgood_service.domain.dataplane.spool import Spool

    spool = Spool(tmp_path / "spool")
    old, fresh, other = (spool.dir / ("a" * 32 + ".part"), spool.dir / ("b" * 32 + ".part"),
                         spool.dir / "notes.txt")
    for p in (old, fresh, other):
        p.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.utime(other, (time.time() - 7200, time.time() - 7200))
    assert spool.sweep(3600) == 1
    assert not old.exists() and fresh.exists() and other.exists()
    # a spool directory opened up to others is closed again
    os.chmod(spool.dir, 0o777)
    assert oct(Spool(tmp_path / "spool").dir.stat().st_mode & 0o777) == "0o700"
    # a file taken by a process that died, or a link its reader left, is removed when the
    # next service opens the spool; links are swept by age
    (spool.taken_dir / ("c" * 32 + ".part")).write_bytes(b"x")
    (spool.out_dir / ("d" * 32 + ".part")).write_bytes(b"x")
    again = Spool(tmp_path / "spool")
    assert again.id == spool.id and list(again.taken_dir.iterdir()) == [] and list(again.out_dir.iterdir()) == []
    (again.out_dir / ("e" * 32 + ".part")).write_bytes(b"x")
    assert again.sweep_lent(3600) == 0 and again.sweep_lent(0) == 1
    assert oct((tmp_path / "spool").stat().st_mode & 0o777) == "0o700"


def test_a_lent_link_ages_by_its_name_not_by_its_blobs_inode(tmp_path):
    """A link lent two hours ago whose blob was lent again just now (a new link: the shared
    inode's ctime is now) is swept as two hours old; the new link stays. By ctime, the
    stale one would live as long as the blob keeps being read."""
    from lastgood_service.domain.dataplane.spool import Spool

    spool = Spool(tmp_path / "spool")
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 10)
    old = spool.out_dir / names.new_lent_name(time.time() - 7200)
    os.link(blob, old)
    fresh = spool.dir / spool.lend(blob)
    assert spool.sweep_lent(3600) == 1
    assert not old.exists() and fresh.exists() and blob.exists()


def test_a_same_host_reader_gets_a_link_instead_of_a_stream(svc, cl, run_name, monkeypatch):
    """The read direction: GetShard with the spool's id answers with a hard link to the
    blob in the spool; the client reads and hashes it into its buffer (or preads the range
    it asked for) and removes the link. Readers without the spool get chunks."""
    from lastgood.datapath import handover

    spool, sid = spool_of(svc)
    cid, shards = cl.save(run_name, 1)
    data = shards[0]
    lent = []
    real = handover.read_lent
    monkeypatch.setattr(handover, "read_lent", lambda *a: lent.append(a[1]) or real(*a))
    t = Transport(svc.url)
    try:
        buf = bytearray(len(data) + 100)
        view, digest = t.read_file(cid, 0, shard_name(0), len(data), into=buf)
        assert bytes(view) == data and digest == hash_bytes(data) and len(lent) == 1
        assert list((spool / ".out").iterdir()) == []  # the reader removed its link
        assert shard_blob(svc, cid, 0).read_bytes() == data and shard_blob(svc, cid, 0).stat().st_nlink == 1
        # a range (a resharding restore, docs/resharding.md): a link too, of which it preads the range
        part = bytearray(16)
        t.read_range(cid, 0, shard_name(0), 8, part)
        assert bytes(part) == data[8:24] and t.lent_ranges == 1 and list((spool / ".out").iterdir()) == []
        t.spool = None  # a reader elsewhere streams
        view, digest = t.read_file(cid, 0, shard_name(0), len(data))
        assert bytes(view) == data and digest == hash_bytes(data) and len(lent) == 1
        t.read_range(cid, 0, shard_name(0), 8, part)
        assert bytes(part) == data[8:24] and t.lent_ranges == 1
    finally:
        t.close()
    # a range outside the file is refused before anything is lent
    with pytest.raises(grpc.RpcError) as e:
        list(cl.stub.GetShard(pb.GetShardRequest(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                 offset=len(data) - 4, length=16, spool_id=sid), timeout=30))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and list((spool / ".out").iterdir()) == []
    # the whole file with the spool id: a link, which this test removes itself
    (only,) = list(cl.stub.GetShard(pb.GetShardRequest(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                        spool_id=sid), timeout=30))
    assert only.spool_file.startswith(".out/") and not only.chunk
    assert (spool / only.spool_file).read_bytes() == data
    (spool / only.spool_file).unlink()


def test_the_client_reads_lent_files_only_from_the_spools_out_folder(tmp_path):
    from lastgood.errors import CorruptCheckpoint, ServiceError
    from lastgood.wire.hashing import StreamHasher
    from lastgood.datapath.handover import read_lent

    (tmp_path / "secret").write_bytes(b"not a shard")
    for name in ("../secret", "secret", ".out/../../secret", "/etc/passwd", ".out/" + "a" * 31 + ".part"):
        with pytest.raises(ServiceError, match="outside the spool"):
            read_lent(str(tmp_path / "spool"), name, memoryview(bytearray(16)), StreamHasher())
    # a lent file longer than the manifest says is refused, as damage (restore falls back)
    (tmp_path / ".out").mkdir()
    (tmp_path / ".out" / ("b" * 32 + ".part")).write_bytes(b"x" * 17)
    with pytest.raises(CorruptCheckpoint, match="longer"):
        read_lent(str(tmp_path), ".out/" + "b" * 32 + ".part", memoryview(bytearray(16)), StreamHasher())


@pytest.mark.slow
def test_a_restarted_service_sweeps_stale_spool_files_at_start(make_service, tmp_path):
    """Files of writers that died are swept once they are older than the lease (and GC grace),
    also by a service that restarts more often than its sweep interval (60 s): the first
    pass runs at start-up. A fresh file (a writer still at work) is kept. Control: the same
    stale file stays while no sweep runs (before the restart)."""
    env = {"LASTGOOD_GC_GRACE_SECONDS": "0", "LASTGOOD_LEASE_SECONDS": "60"}  # fresh: under a minute old
    svc = make_service(tmp_path / "svc", **env)
    spool, _ = spool_of(svc)
    stale, fresh = spool / ("a" * 32 + ".part"), spool / ("b" * 32 + ".part")
    svc.stop()
    stale.write_bytes(b"x" * 10)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert stale.exists()  # control: nothing swept it while no service ran
    fresh.write_bytes(b"y")
    svc = make_service(tmp_path / "svc", **env)
    deadline = time.monotonic() + 15
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stale.exists() and fresh.exists()


def test_lent_links_and_blobs_are_read_only(svc, cl, run_name):
    """The proto promises the reader a read-only link. A hard link is the blob's own inode:
    blobs are published 0444, streamed or adopted from the spool, and a blob from before
    that is made read-only when it is lent."""
    spool, sid = spool_of(svc)

    def lend(cid: int) -> Path:
        (only,) = list(cl.stub.GetShard(pb.GetShardRequest(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                            spool_id=sid), timeout=30))
        return spool / only.spool_file

    streamed, _ = cl.save(run_name, 1)
    adopted = hand_over(svc, spool, f"{run_name}-spooled", make_shard(0, seed=5))[0]
    assert oct(adopted.stat().st_mode & 0o777) == "0o444"
    older, _ = cl.save(run_name, 2)
    shard_blob(svc, older, 0).chmod(0o644)  # as the store published blobs before
    for cid in (streamed, older):
        link = lend(cid)
        try:
            assert oct(link.stat().st_mode & 0o777) == "0o444"
            assert oct(shard_blob(svc, cid, 0).stat().st_mode & 0o777) == "0o444"
        finally:
            link.unlink()
