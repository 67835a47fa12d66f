"""The followed hand-over (ShardHeader.follow): the service takes a spool file while its
writer is still writing it and hashes each range the writer reports written. The file is
adopted as the blob only when the service's hash of every byte equals the writer's hash
in the last message. Every lie about progress, size or hash is refused and changes
nothing. A store that cannot adopt the spool's files offers no following; the client
then hands its files over once they are written. A file the spool declines is streamed; a
refusal of the file or of its checkpoint is raised at once."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import time
from pathlib import Path

import grpc
import pytest

from lastgood import errors
from lastgood.wire.hashing import hash_bytes
from lastgood.datapath.transport import Transport
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import Client, assert_unchanged, make_shard, metric, rpc_error, shard_blob, shard_name, snapshot
from tests.conftest import through_its_data_path

SC = grpc.StatusCode


def spool_of(svc) -> tuple[Path, str, bool]:
    info = svc.get("/api/v1/info").json()["spool"]
    return Path(info["dir"]), info["id"], info["follow"]


def spool_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def progress(written: int, digest: str = "") -> pb.PutShardRequest:
    return pb.PutShardRequest(progress=pb.SpoolProgress(written=written, xxh3_128=digest))


def followed_put(cl, cid: int, name: str, spool_id: str, size: int, messages, *, file_name: str | None = None,
                 spool_file: str | None = None):
    """A followed PutShard by hand: the header, then `messages` as given (the file's bytes
    are in the spool already, or written by the caller's messages generator)."""
    header = pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=file_name or shard_name(0), size=size,
                            spool_file=name if spool_file is None else spool_file, spool_id=spool_id, follow=True)
    return cl.stub.PutShard(iter([pb.PutShardRequest(header=header), *messages]), timeout=30)


def followed_commit(svc, run_name: str, data: bytes) -> int:
    """Begin a checkpoint of one rank, hand `data` over as part.bin while writing it (the
    client's followed path), vote; the committed checkpoint's id."""
    t = Transport(svc.url)
    try:
        cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
        assert t.put_followed(cid, 0, "part.bin", data) == hash_bytes(data)
        assert t.commit_rank(cid, 0, ["part.bin"], wait=2).status == "COMMITTED"
    finally:
        t.close()
    return cid


def test_a_followed_file_is_hashed_as_it_grows_and_becomes_the_blob(svc, run_name, spool_inodes):
    spool, _sid, follow = spool_of(svc)
    assert follow, "a local store on the spool's file system adopts followed files"
    data = os.urandom(3 * (8 << 20) + 12345)  # several 8 MiB pieces and a short one: several reports
    ingested = metric(svc, "lastgood_bytes_ingested_total")
    cid = followed_commit(svc, run_name, data)
    assert metric(svc, "lastgood_bytes_ingested_total") - ingested == len(data)  # its bytes are counted
    blob = shard_blob(svc, cid, 0)
    assert blob.read_bytes() == data
    assert spool_inodes == {blob.stat().st_ino}  # the very file the client wrote: adopted, not copied
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []


def test_followed_hand_overs_that_lie_change_nothing(svc, run_name):
    """Every way a follower's reports can disagree with the file, or with themselves, is
    refused before anything is recorded, and the taken file is removed. Control: the
    same file with honest reports is accepted."""
    spool, sid, _ = spool_of(svc)
    cl = Client(svc.grpc_target)
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, seed=21)
    n, half, good = len(data), len(data) // 2, hash_bytes(data)
    before = snapshot(svc, run_name)
    cases = [  # (what, status, bytes in the file, declared size, messages after the header)
        ("another file's hash", SC.DATA_LOSS, data, n, [progress(half), progress(n, hash_bytes(b"x"))]),
        ("written goes back", SC.INVALID_ARGUMENT, data, n, [progress(half), progress(half - 1), progress(n, good)]),
        ("written beyond the size", SC.INVALID_ARGUMENT, data, n, [progress(n + 1, good)]),
        ("more reported than written", SC.INVALID_ARGUMENT, data[:half], n, [progress(n, good)]),
        ("no last message", SC.INVALID_ARGUMENT, data, n, [progress(half), progress(n)]),
        ("last message short", SC.INVALID_ARGUMENT, data, n, [progress(half, good)]),
        ("a message after the last", SC.INVALID_ARGUMENT, data, n, [progress(n, good), progress(n)]),
        ("a chunk", SC.INVALID_ARGUMENT, data, n, [progress(half), pb.PutShardRequest(chunk=data[half:])]),
        ("longer than declared", SC.INVALID_ARGUMENT, data + b"x", n, [progress(n, good)]),
        ("not a hash", SC.INVALID_ARGUMENT, data, n, [progress(n, "Z" * 32)]),
    ]
    for i, (what, status, content, size, messages) in enumerate(cases):
        name = f"{i:x}" * 32 + ".part"
        (spool / name).write_bytes(content)
        err = rpc_error(status, followed_put, cl, cid, name, sid, size, messages)
        assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == [], what
        assert len(err.details()) < 1100, what
    # a follow that names no spooled file, and one that names another spool: refused, nothing taken
    rpc_error(SC.INVALID_ARGUMENT, followed_put, cl, cid, "", sid, n, [progress(n, good)], spool_file="")
    (spool / ("e" * 32 + ".part")).write_bytes(data)
    err = rpc_error(SC.FAILED_PRECONDITION, followed_put, cl, cid, "e" * 32 + ".part", "f" * 32, n, [])
    assert err.details().startswith("spool:") and spool_files(spool) == ["e" * 32 + ".part"]
    (spool / ("e" * 32 + ".part")).unlink()
    assert_unchanged(before, snapshot(svc, run_name))

    # control: the same bytes, reported honestly
    (spool / ("f" * 32 + ".part")).write_bytes(data)
    res = followed_put(cl, cid, "f" * 32 + ".part", sid, n, [progress(half), progress(n, good)])
    assert (res.size, res.xxh3_128, res.already_present) == (n, good, False)
    # the same file again, followed: recorded already, so the client is told to stream it (and compare)
    (spool / ("a" * 32 + ".part")).write_bytes(data)
    err = rpc_error(SC.FAILED_PRECONDITION, followed_put, cl, cid, "a" * 32 + ".part", sid, n, [progress(n, good)])
    assert errors.from_grpc("PutShard", err.code().name, err.details(), err.trailing_metadata()).reason == \
        "spool_refused"
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []
    cl.close()


def test_a_file_written_while_it_is_followed_arrives_whole(svc, run_name):
    """The reports race the writer as they do in a real save: each range is written just
    before it is reported, with pauses, and the service reads what is there by then."""
    spool, sid, _ = spool_of(svc)
    cl = Client(svc.grpc_target)
    cid = cl.begin(run_name).checkpoint_id
    data = os.urandom((3 << 20) + 1234)  # one GetShard chunk reads it back
    name = "9" * 32 + ".part"
    fd = os.open(spool / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def messages():
        for off in range(0, len(data), 256 << 10):
            os.write(fd, data[off:off + (256 << 10)])
            time.sleep(0.02)
            yield progress(min(off + (256 << 10), len(data)))
        os.close(fd)
        yield progress(len(data), hash_bytes(data))

    header = pb.ShardHeader(checkpoint_id=cid, rank=0, file_name="part.bin", size=len(data), spool_file=name,
                            spool_id=sid, follow=True)
    res = cl.stub.PutShard(_chain(pb.PutShardRequest(header=header), messages()), timeout=30)
    assert (res.size, res.xxh3_128) == (len(data), hash_bytes(data))
    assert cl.vote(cid, 0, ["part.bin"], wait=2).status == "COMMITTED"
    assert cl.read(cid, 0, "part.bin") == data
    cl.close()


def _chain(first, rest):
    yield first
    yield from rest


@pytest.mark.slow
def test_a_followed_file_keeps_its_checkpoint_alive(make_service, run_name):
    """A followed file that takes longer than the lease keeps the checkpoint PENDING: each
    report renews the lease as streamed chunks do. Control: a checkpoint with no activity
    over the same time is ABANDONED."""
    svc = make_service(LASTGOOD_LEASE_SECONDS="2")
    spool, sid, _ = spool_of(svc)
    cl = Client(svc.grpc_target)
    idle = cl.begin(run_name, step=1).checkpoint_id
    cid = cl.begin(run_name, step=2).checkpoint_id
    data = os.urandom(1 << 20)
    (spool / ("5" * 32 + ".part")).write_bytes(data)

    def slow():
        for i in range(1, 9):  # 4 s in all, twice the lease
            time.sleep(0.5)
            yield progress(len(data) * i // 8)
        yield progress(len(data), hash_bytes(data))

    header = pb.ShardHeader(checkpoint_id=cid, rank=0, file_name="part.bin", size=len(data),
                            spool_file="5" * 32 + ".part", spool_id=sid, follow=True)
    assert cl.stub.PutShard(_chain(pb.PutShardRequest(header=header), slow()), timeout=30).size == len(data)
    assert cl.vote(cid, 0, ["part.bin"], wait=2).status == "COMMITTED"
    assert svc.get(f"/api/v1/checkpoints/{idle}").json()["status"] == "ABANDONED"  # control
    cl.close()


@pytest.mark.slow
def test_a_store_that_cannot_adopt_offers_no_following_and_the_client_stops_following(
        make_service, run_name, tmp_path):
    """A spool on another file system than the store (here tmpfs) cannot be renamed into it:
    the service does not offer following, refuses a followed header with its own error
    code, and a client that follows anyway streams that file and hands its files over once
    written from then on."""
    spool_dir = Path("/dev/shm") / f"lastgood-test-{os.getpid()}-{run_name[-6:]}"
    svc = make_service(LASTGOOD_SPOOL_DIR=str(spool_dir))
    try:
        spool, sid, follow = spool_of(svc)
        assert not follow
        cl = Client(svc.grpc_target)
        cid = cl.begin(run_name).checkpoint_id
        data = make_shard(0, seed=3)
        (spool / ("c" * 32 + ".part")).write_bytes(data)
        err = rpc_error(SC.FAILED_PRECONDITION, followed_put, cl, cid, "c" * 32 + ".part", sid, len(data),
                        [progress(len(data), hash_bytes(data))])
        assert errors.from_grpc("PutShard", err.code().name, err.details(), err.trailing_metadata()).reason == \
            "spool_follow_refused"
        (spool / ("c" * 32 + ".part")).unlink()
        cl.close()

        t = Transport(svc.url)
        try:
            t.spool["follow"] = True  # as a client that missed the offer would
            cid = t.begin(run_name, 2, 1, None, "a1", 0).checkpoint_id
            assert t.put_followed(cid, 0, shard_name(0), data) == hash_bytes(data)
            assert t.spool is not None and t.spool["follow"] is False  # not asked to follow again
            assert t.commit_rank(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
        finally:
            t.close()
        assert shard_blob(svc, cid, 0).read_bytes() == data
        assert spool_files(spool) == []
    finally:
        import shutil

        shutil.rmtree(spool_dir, ignore_errors=True)


@pytest.mark.slow
def test_files_refused_a_stream_to_follow_them_are_streamed(make_service, run_name, caplog):
    """With one PutShard stream allowed per caller, four files followed at once find the
    slot taken (RESOURCE_EXHAUSTED): each is streamed, with retries, and the save commits.
    Control: the refusals did happen."""
    import lastgood
    import torch

    svc = make_service(LASTGOOD_MAX_STREAMS_PER_CLIENT="1")
    state = {f"w{i}": torch.nn.Linear(256, 256) for i in range(6)}
    with caplog.at_level(logging.WARNING, logger="lastgood"):
        with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
            ckpt.config = dataclasses.replace(ckpt.config, file_bytes=64 << 10)  # four files
            assert ckpt.transport.spool["follow"]
            through_its_data_path(ckpt.transport)  # files of 64 KiB: followed, not carried by the vote
            ckpt.save(1, lastgood.TrainState(**state))
            ckpt.wait()
            cid = ckpt.last_saved.checkpoint_id
    assert any("while writing it failed" in r.getMessage() for r in caplog.records)  # control
    assert svc.get(f"/api/v1/checkpoints/{cid}").json()["status"] == "COMMITTED"
    other = {f"w{i}": torch.nn.Linear(256, 256) for i in range(6)}
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(**other)) == 1
    assert all(torch.equal(other[k].weight, state[k].weight) for k in state)


def test_a_followed_file_the_store_has_no_room_for_is_refused_before_a_byte_is_read(make_service, run_name):
    """Its bytes are still to be written on the store's disk, so the room check applies as
    for a stream, even when the begin that made the checkpoint declared nothing. Control:
    the same hand-over on a service with the usual reserve is accepted."""
    full = make_service(LASTGOOD_STORE_RESERVE_BYTES=str(1 << 60))  # no disk has that much left
    for svc, refused in ((full, True), (make_service(), False)):
        spool, sid, _ = spool_of(svc)
        cl = Client(svc.grpc_target)
        cid = cl.begin(run_name).checkpoint_id  # expected_bytes 0: begin checked nothing
        data = make_shard(0, seed=5)
        (spool / ("d" * 32 + ".part")).write_bytes(data)
        put = (followed_put, cl, cid, "d" * 32 + ".part", sid, len(data), [progress(len(data), hash_bytes(data))])
        if refused:
            err = rpc_error(SC.RESOURCE_EXHAUSTED, *put)
            assert "store full" in err.details()
            assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []
        else:
            assert put[0](*put[1:]).size == len(data)
        cl.close()


def test_a_file_that_grows_past_its_last_report_is_refused(svc, run_name):
    """The writer reports the whole file, then writes more: the file is not what was
    reported, and nothing is recorded."""
    spool, sid, _ = spool_of(svc)
    cl = Client(svc.grpc_target)
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, seed=6)
    path = spool / ("7" * 32 + ".part")
    path.write_bytes(data)
    before = snapshot(svc, run_name)

    header = pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0), size=len(data),
                            spool_file=path.name, spool_id=sid, follow=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # opened before the take, as a writer's is: it follows the rename
    try:
        def grow():
            yield progress(len(data) // 2)
            os.write(fd, b"more")
            yield progress(len(data), hash_bytes(data))

        err = rpc_error(SC.INVALID_ARGUMENT, lambda: cl.stub.PutShard(
            _chain(pb.PutShardRequest(header=header), grow()), timeout=30))
        assert "holds" in err.details(), err.details()
    finally:
        os.close(fd)
    assert_unchanged(before, snapshot(svc, run_name))
    assert spool_files(spool) == [] and list((spool / ".taken").iterdir()) == []
    cl.close()


def test_a_refusal_of_the_checkpoint_is_raised_not_written_again(svc, run_name, spool_inodes, caplog):
    """A followed file of a checkpoint that is no longer PENDING is refused for good: the
    client raises it at once, without writing the file into the spool a second time or
    streaming it. Control: a spool refusal (the service does not follow) is streamed."""
    t = Transport(svc.url)
    try:
        cid = t.begin(run_name, 1, 1, None, "a1", 0).checkpoint_id
        t.abort(cid, "test", 0)
        data = make_shard(0, seed=8)
        with caplog.at_level(logging.WARNING, logger="lastgood"), pytest.raises(errors.FailedPrecondition):
            t.put_followed(cid, 0, shard_name(0), data)
        assert len(spool_inodes) == 1  # written once
        assert not any("streaming it" in r.getMessage() for r in caplog.records)
        assert t.spool["follow"] is True

        cid = t.begin(run_name, 2, 1, None, "a1", 0).checkpoint_id  # control
        t.spool["follow"] = False  # as after a FollowRefused: followed no more, so the file is streamed
        assert t.put_followed(cid, 0, shard_name(0), data) == hash_bytes(data)
        assert len(spool_inodes) == 1  # streamed, not written into the spool
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    finally:
        t.close()


@pytest.mark.parametrize("limit", ["16M", "-1"], ids=["drop-behind", "control: never drop"])
def test_a_large_followed_file_leaves_only_its_head_in_the_page_cache(make_service, run_name, limit, tmp_path):
    """Beyond LASTGOOD_SPOOL_CACHE_BYTES of a followed file, what the service has hashed is
    dropped from the page cache once on the disk (lastgood.common.durable.DropBehind): the blob's
    head and its last DROP_LAG stay cached, the middle is read from the disk, and every byte
    is the one written. Control: -1 keeps the whole blob cached."""
    from lastgood.common import durable
    from tests.unit.test_durable import on_tmpfs, resident

    if durable._sfr is None:
        pytest.skip("sync_file_range (Linux)")
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs and overlay pages are not dropped")
    svc = make_service(LASTGOOD_SPOOL_CACHE_BYTES=str(16 << 20) if limit == "16M" else limit)
    data = os.urandom(96 << 20)
    cid = followed_commit(svc, run_name, data)
    blob, size = shard_blob(svc, cid, 0), len(data)
    cached = resident(blob, 0, size)
    if limit == "-1":
        assert cached == size
    else:
        head, tail = 16 << 20, size - durable.DROP_LAG
        assert resident(blob, 0, head) == head
        assert resident(blob, head, tail) == 0
        assert cached == size - (tail - head)
    # read back as a restore does on the service's host (a link lent in the spool): the dropped
    # middle comes straight from the disk (lastgood.common.durable.read_into), not into the page cache
    t = Transport(svc.url)
    try:
        view, digest = t.read_file(cid, 0, "part.bin", size, into=memoryview(mmap.mmap(-1, size)))
        assert digest == hash_bytes(data) and bytes(view) == data
    finally:
        t.close()
    assert resident(blob, 0, size) == cached
    assert blob.read_bytes() == data
