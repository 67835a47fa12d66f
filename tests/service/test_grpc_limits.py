"""What a gRPC caller that opens streams and then says nothing can hold: never every worker,
never another caller's budget, and nothing past the idle timeout (api/streams.py)."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from lastgood.wire.codes import ERROR_METADATA, STREAMS_BUSY
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc
from tests.service.helpers import make_shard, shard_name

BOOT = "bootstrap-admin-secret-for-limits"


def _token(svc, name: str) -> str:
    r = httpx.post(svc.url + "/api/v1/tokens", json={"name": name, "role": "writer"},
                   headers={"Authorization": f"Bearer {BOOT}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["token"]


def _md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _silent(release: threading.Event, first: bytes | None = None):
    """A PutShard stream that sends `first` (or nothing) and then nothing until released."""
    if first is not None:
        yield first
    release.wait(120)


@pytest.mark.parametrize("auth", [False, True], ids=["tokens-off", "tokens-on"])
@pytest.mark.slow
def test_silent_streams_cannot_starve_an_authenticated_unary_rpc(make_service, run_name, auth):
    env = {"LASTGOOD_GRPC_WORKERS": "8", "LASTGOOD_GRPC_IDLE_TIMEOUT": "2"}
    if auth:
        env |= {"LASTGOOD_AUTH_REQUIRED": "true", "LASTGOOD_ADMIN_TOKEN": BOOT}
    svc = make_service(**env)
    token = _token(svc, "trainer") if auth else None
    trainer = grpc.insecure_channel(svc.grpc_target)
    stub = pb_grpc.CheckpointsStub(trainer)
    begin = pb.BeginCheckpointRequest(run=run_name, step=1, world_size=1, attempt="a")
    stub.BeginCheckpoint(begin, metadata=_md(token), timeout=30)  # connected, warm
    release = threading.Event()
    attackers = [grpc.insecure_channel(svc.grpc_target) for _ in range(5)]
    calls = []
    try:
        # 25 silent streams with no token, from 5 connections: more than the 8 workers
        for ch in attackers:
            put = ch.stream_unary("/lastgood.v1.Checkpoints/PutShard")
            calls += [put.future(_silent(release), timeout=120) for _ in range(5)]
        time.sleep(1.0)  # let the service take them all up
        for step in (2, 3, 4):
            # the same trainer's RPCs go through, each within a 1 s deadline
            stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run_name, step=step, world_size=1, attempt="a"),
                                 metadata=_md(token), timeout=1.0)
        # and every silent stream is closed by the service, though its client still holds it
        codes = [c.exception(timeout=60).code() for c in calls]
        if auth:  # refused before a message was read
            assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        else:  # beyond the budgets: refused at once; the rest: cancelled after the idle timeout
            assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, codes
            busy = [dict(c.exception().trailing_metadata() or ()).get(ERROR_METADATA)
                    for c in calls if c.exception().code() != grpc.StatusCode.CANCELLED]
            assert busy and set(busy) == {STREAMS_BUSY}, busy
            log = svc.log.read_text()
            assert "no message for 2.0 s (LASTGOOD_GRPC_IDLE_TIMEOUT); cancelling the stream" in log
    finally:
        release.set()
        for ch in attackers:
            ch.close()
    # the service still does its job
    data = make_shard(0)
    cid = stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run_name, step=9, world_size=1, attempt="a"),
                               metadata=_md(token), timeout=30).checkpoint_id
    stub.PutShard(iter([pb.PutShardRequest(header=pb.ShardHeader(
        checkpoint_id=cid, rank=0, file_name=shard_name(0), size=len(data), xxh3_128=hash_bytes(data))),
        pb.PutShardRequest(chunk=data)]), metadata=_md(token), timeout=30)
    res = stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, files=[shard_name(0)], wait_seconds=2),
                          metadata=_md(token), timeout=30)
    assert res.status == "COMMITTED"
    trainer.close()


@pytest.mark.slow
def test_one_callers_stalled_streams_do_not_refuse_another_tokens_upload(make_service, run_name):
    """Budgets are per token: the old per-address budget let one local client with its
    streams stalled refuse every other trainer on the host."""
    svc = make_service(LASTGOOD_AUTH_REQUIRED="true", LASTGOOD_ADMIN_TOKEN=BOOT, LASTGOOD_MAX_STREAMS_PER_CLIENT="2",
                       LASTGOOD_LEASE_SECONDS="120")
    a, b = _token(svc, "stalled"), _token(svc, "other")
    channel = grpc.insecure_channel(svc.grpc_target)
    stub = pb_grpc.CheckpointsStub(channel)
    data = make_shard(0)

    def header(cid: int) -> pb.PutShardRequest:
        return pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                        size=len(data), xxh3_128=hash_bytes(data)))

    def begin(step: int, token: str) -> int:
        return stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run_name, step=step, world_size=1, attempt="a"),
                                    metadata=_md(token), timeout=30).checkpoint_id

    release = threading.Event()
    try:
        held = [stub.PutShard.future(_silent(release, header(begin(step, a))), metadata=_md(a), timeout=120)
                for step in (1, 2)]
        # A's budget is spent (its third stream is refused at once, without a message read) ...
        for _ in range(100):
            try:
                stub.PutShard(iter([header(begin(3, a))]), metadata=_md(a), timeout=30)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "streams" in e.details(), e.details()
                    break
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT  # got a slot: the held ones are not up yet
            time.sleep(0.1)
        else:
            pytest.fail("the stalled caller's budget never filled up")
        # ... and B uploads all the same
        cid = begin(4, b)
        res = stub.PutShard(iter([header(cid), pb.PutShardRequest(chunk=data)]), metadata=_md(b), timeout=30)
        assert res.size == len(data)
        assert not any(h.done() for h in held)
    finally:
        release.set()
    channel.close()


def test_streams_can_never_be_set_to_take_every_worker():
    from pydantic import ValidationError

    from lastgood_service.settings import Settings

    assert Settings(grpc_workers=64).grpc_max_streams == 32  # half, by default
    assert Settings(grpc_workers=64, grpc_max_streams=47).grpc_max_streams == 47
    with pytest.raises(ValidationError, match="no worker for unary RPCs"):
        Settings(grpc_workers=64, grpc_max_streams=48)  # 48 + 16 waiting votes: none left


@pytest.mark.slow
def test_a_download_nobody_reads_is_cancelled_after_the_idle_timeout(make_service, run_name):
    """GetShard holds its worker while the reader does not take the chunks; after the idle
    timeout the service cancels it. A reader that keeps reading is not affected."""
    svc = make_service(LASTGOOD_GRPC_IDLE_TIMEOUT="3", LASTGOOD_SPOOL="false")  # 3 s: a loaded reader still reads
    data = bytes(range(256)) * (32 * 4096)  # 32 MiB: more than gRPC buffers between the two ends
    channel = grpc.insecure_channel(svc.grpc_target, options=[("grpc.max_receive_message_length", -1)])
    stub = pb_grpc.CheckpointsStub(channel)
    try:
        cid = stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run_name, step=1, world_size=1, attempt="a"),
                                   timeout=30).checkpoint_id
        chunks = [pb.PutShardRequest(chunk=data[i:i + 4 * 2**20]) for i in range(0, len(data), 4 * 2**20)]
        stub.PutShard(iter([pb.PutShardRequest(header=pb.ShardHeader(
            checkpoint_id=cid, rank=0, file_name="big.bin", size=len(data), xxh3_128=hash_bytes(data)))] + chunks),
            timeout=60)
        assert stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, files=["big.bin"], wait_seconds=2),
                               timeout=30).status == "COMMITTED"
        request = pb.GetShardRequest(checkpoint_id=cid, rank=0, file_name="big.bin")
        assert b"".join(m.chunk for m in stub.GetShard(request, timeout=60)) == data  # a reader that reads
        stalled = stub.GetShard(request, timeout=60)
        next(stalled)
        time.sleep(7)  # reads nothing for longer than the idle timeout
        with pytest.raises(grpc.RpcError) as info:
            for _ in stalled:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert "GetShard: no message for 3.0 s" in svc.log.read_text()
    finally:
        channel.close()


@pytest.mark.slow
def test_the_client_waits_its_turn_when_the_service_has_too_many_streams(make_service, run_name):
    """A refusal for too many open streams read nothing: the client library tries again
    (with backoff, up to the call's timeout) instead of failing the save."""
    from lastgood.datapath.transport import Transport

    # 2 streams at most; a lease longer than the wait, so a slow machine's backoff cannot expire
    # the checkpoint before the upload gets its turn (that is not what this test is about)
    svc = make_service(LASTGOOD_GRPC_WORKERS="4", LASTGOOD_GRPC_IDLE_TIMEOUT="2", LASTGOOD_LEASE_SECONDS="60")
    release = threading.Event()
    holder = grpc.insecure_channel(svc.grpc_target)
    put = holder.stream_unary("/lastgood.v1.Checkpoints/PutShard")
    held = [put.future(_silent(release), timeout=60) for _ in range(2)]
    t = Transport(svc.url)
    try:
        time.sleep(0.5)  # both hold their slots now (until the idle timeout)
        data = make_shard(0)
        cid = t.begin(run_name, 1, 1, None, "a", 0).checkpoint_id
        res = t.put_shard(cid, 0, shard_name(0), memoryview(data), hash_bytes(data))
        assert res.size == len(data)
        assert {h.exception(timeout=30).code() for h in held} == {grpc.StatusCode.CANCELLED}  # they were held
    finally:
        release.set()
        t.close()
        holder.close()


@pytest.mark.slow
def test_a_refusal_for_too_many_streams_carries_its_error_code(make_service, run_name):
    """streams_busy, so the client retries it by its code (errors.Busy), not by its words."""
    from lastgood import errors

    svc = make_service(LASTGOOD_GRPC_WORKERS="4", LASTGOOD_GRPC_IDLE_TIMEOUT="5")  # 2 streams at most
    release = threading.Event()
    holder = grpc.insecure_channel(svc.grpc_target)
    put = holder.stream_unary("/lastgood.v1.Checkpoints/PutShard")
    try:
        held = [put.future(_silent(release), timeout=60) for _ in range(2)]  # kept: a dropped future cancels
        time.sleep(0.5)  # both hold their slots now
        with pytest.raises(grpc.RpcError) as refused:
            put(_silent(release), timeout=30)
        e = refused.value
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = errors.from_grpc("PutShard", e.code().name, e.details(), e.trailing_metadata())
        assert type(err) is errors.Busy and err.reason == "streams_busy" and err.retryable
        assert not any(h.done() for h in held)  # they still hold the slots the refusal was about
    finally:
        release.set()
        holder.close()
