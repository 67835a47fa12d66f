"""A gRPC fuzz of every method of lastgood.proto: malformed, truncated, mutated and
oversized messages, sent as raw bytes (a generic channel method with no serializers), to a
real service with tokens off and on. Every answer must be OK or a defined status other
than INTERNAL/UNKNOWN, and the service must stay healthy. Seeded: a failure repeats.
"""

from __future__ import annotations

import random

import grpc
import httpx
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

from .helpers import make_shard, shard_name

pytestmark = pytest.mark.fuzz

SERVICE = pb.DESCRIPTOR.services_by_name["Checkpoints"]
BOOT = "bootstrap-admin-secret-for-fuzz"
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MUTATIONS_PER_SEED = 12
MAX_MESSAGE = 4 * 1024 * 1024 + 64 * 1024  # the service's receive limit (api/grpc_server.py)


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    """One random damage: truncate, flip bits, insert, delete, or splice in a bad varint or tag."""
    b = bytearray(raw)
    what = rng.randrange(6)
    if what == 0 and b:
        return bytes(b[:rng.randrange(len(b))])
    if what == 1 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if what == 2:
        at = rng.randrange(len(b) + 1)
        return bytes(b[:at] + rng.randbytes(rng.randint(1, 16)) + b[at:])
    if what == 3 and b:
        at = rng.randrange(len(b))
        return bytes(b[:at] + b[at + rng.randint(1, 8):])
    if what == 4:  # a varint that never ends, or a length that runs past the end
        return bytes(b) + rng.choice([b"\x08" + b"\xff" * 11, b"\x1a\xff\xff\xff\xff\x0f", b"\x0a\x7fab"])
    return rng.randbytes(rng.randint(0, 64))  # noise


TYPES = {getattr(FD, n): n for n in dir(FD) if n.startswith("TYPE_")}


def _extremes(message_cls) -> list[bytes]:
    """The message with each scalar field at a boundary value, one field at a time."""
    out = []
    values = {  # by FieldDescriptor type name
        "TYPE_INT64": [-2**63, 2**63 - 1, -1, 0], "TYPE_INT32": [-2**31, 2**31 - 1, -1],
        "TYPE_DOUBLE": [float("nan"), float("inf"), -float("inf"), -1.0, 1e308],
        "TYPE_STRING": ["", "\n", "x\n", "../../etc/passwd", "é" * 300, "a" * 100_000, "\x00"],
        "TYPE_BYTES": [b"", b"\x00" * 100_000], "TYPE_BOOL": [True],
    }
    for field in message_cls.DESCRIPTOR.fields:
        if field.message_type is not None:
            continue
        for v in values.get(TYPES.get(field.type), []):
            msg = message_cls()
            if field.is_repeated:
                getattr(msg, field.name).extend([v] * 3 if not isinstance(v, str) or len(v) < 1000 else [v])
            else:
                setattr(msg, field.name, v)
            out.append(msg.SerializeToString())
    return out


class World:
    """A service, a committed and a pending checkpoint, and the metadata to call with."""

    def __init__(self, svc, token: str | None, run: str) -> None:
        self.svc = svc
        self.md = (("authorization", f"Bearer {token}"),) if token else None
        self.channel = grpc.insecure_channel(svc.grpc_target, options=[("grpc.max_send_message_length", -1)])
        self.stub = pb_grpc.CheckpointsStub(self.channel)
        data = make_shard(0)
        self.data = data
        cid = self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run, step=1, world_size=1, attempt="a"),
                                        metadata=self.md, timeout=30).checkpoint_id
        self.stub.PutShard(iter([self.header(cid), pb.PutShardRequest(chunk=data)]), metadata=self.md, timeout=30)
        self.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, files=[shard_name(0)], wait_seconds=2),
                             metadata=self.md, timeout=30)
        self.committed = cid
        self.pending = self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
            run=run, step=2, world_size=2, attempt="a"), metadata=self.md, timeout=30).checkpoint_id
        self.run = run

    def header(self, cid: int, **kw) -> pb.PutShardRequest:
        fields = dict(checkpoint_id=cid, rank=0, file_name=shard_name(0), size=len(self.data),
                      xxh3_128=hash_bytes(self.data)) | kw
        return pb.PutShardRequest(header=pb.ShardHeader(**fields))

    def seeds(self, method: str) -> list[bytes]:
        """Valid requests of the method, for the mutations to start from."""
        r, c, p = self.run, self.committed, self.pending
        return [m.SerializeToString() for m in {
            "BeginCheckpoint": [pb.BeginCheckpointRequest(run=r, step=3, world_size=1, attempt="a"),
                                pb.BeginCheckpointRequest(run=r, step=4, world_size=2, parent_id=c, attempt="b", rank=1)],
            "PutShard": [self.header(p), self.header(p, spool_file="0" * 32 + ".part", spool_id="x")],
            "CommitRank": [pb.CommitRankRequest(checkpoint_id=p, rank=1, files=["a.bin", "b.bin"], wait_seconds=0.1)],
            "AbortCheckpoint": [pb.AbortCheckpointRequest(checkpoint_id=p, reason="fuzz", rank=1)],
            "GetManifest": [pb.GetManifestRequest(checkpoint_id=c), pb.GetManifestRequest(run=r)],
            "GetShard": [pb.GetShardRequest(checkpoint_id=c, rank=0, file_name=shard_name(0), offset=8, length=16)],
        }[method]]

    def call(self, method, requests: list[bytes]) -> grpc.StatusCode:
        """One call of `method` with these raw request messages; its status code."""
        path = f"/{SERVICE.full_name}/{method.name}"
        try:
            if method.client_streaming:
                self.channel.stream_unary(path)(iter(requests), metadata=self.md, timeout=20)
            elif method.server_streaming:
                for _ in self.channel.unary_stream(path)(requests[0], metadata=self.md, timeout=20):
                    pass
            else:
                self.channel.unary_unary(path)(requests[0], metadata=self.md, timeout=20)
        except grpc.RpcError as e:
            assert e.code() not in BAD, f"{method.name}: {e.code().name}: {e.details()}"
            return e.code()
        return grpc.StatusCode.OK


def _cases(world: World, method, rng: random.Random) -> list[list[bytes]]:
    seeds = world.seeds(method.name)
    request_cls = getattr(pb, method.input_type.name)
    singles = [s for s in seeds]
    singles += [_mutate(rng, s) for s in seeds for _ in range(MUTATIONS_PER_SEED)]
    singles += [s[:n] for s in seeds for n in sorted({0, 1, len(s) // 2, len(s) - 1}) if n < len(s)]  # truncated
    singles += _extremes(request_cls)
    singles += [b"\x00" * 64, b"\xff" * 64, b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
    if not method.client_streaming:
        return [[s] for s in singles]
    chunk = pb.PutShardRequest(chunk=b"x" * 16).SerializeToString()
    first = world.header(world.pending).SerializeToString()
    streams = [[s] for s in singles]
    streams += [[s, chunk] for s in singles[:20]]
    streams += [[], [chunk], [first, first], [first, _mutate(rng, chunk)], [first, b"\x12"],
                [first] + [chunk] * 3, [first, b"\x12\x80\x80\x80\x80\x10"]]  # a chunk of 4 GiB declared
    return streams


@pytest.fixture(scope="module", params=["tokens-off", "tokens-on"])
def world(request, tmp_path_factory):
    from tests.conftest import FAST, ServiceProc

    env = {**FAST, "LASTGOOD_LEASE_SECONDS": "120", "LASTGOOD_COMMIT_WAIT_MAX": "0.2"}
    token = None
    if request.param == "tokens-on":
        env |= {"LASTGOOD_AUTH_REQUIRED": "true", "LASTGOOD_ADMIN_TOKEN": BOOT}
    svc = ServiceProc(tmp_path_factory.mktemp(f"fuzz-{request.param}"), env).start()
    if request.param == "tokens-on":
        r = httpx.post(svc.url + "/api/v1/tokens", json={"name": "fuzz", "role": "writer"},
                       headers={"Authorization": f"Bearer {BOOT}"}, timeout=30)
        token = r.json()["token"]
    w = World(svc, token, f"fuzz-{request.param}")
    yield w
    w.channel.close()
    svc.stop()


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_fuzz_every_method(world, method):
    m = SERVICE.methods_by_name[method]
    rng = random.Random(f"{method}-{world.md is not None}")
    codes = {}
    for requests in _cases(world, m, rng):
        code = world.call(m, requests)
        codes[code] = codes.get(code, 0) + 1
    # the cases reach past the parser into the service, not only its refusals of bytes
    assert set(codes) - {grpc.StatusCode.INVALID_ARGUMENT}, {c.name: n for c, n in codes.items()}
    # the oversized: one message past the receive limit is refused, never buffered
    big = b"\x0a" + b"\xff\xff\xff\x02" + b"a" * (MAX_MESSAGE + 1)
    assert world.call(m, [big]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    if world.md is not None:  # and without the token, nothing is read
        anonymous = World.__new__(World)
        anonymous.channel, anonymous.md = world.channel, None
        assert anonymous.call(m, world.seeds(method)) == grpc.StatusCode.UNAUTHENTICATED
    # still healthy: nothing failed inside, a whole save goes through and REST answers
    assert "Traceback" not in world.svc.log.read_text()
    assert httpx.get(world.svc.url + "/healthz", timeout=30).status_code == 200
    cid = world.stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=world.run, step=100 + len(codes), world_size=1,
                                                               attempt=method), metadata=world.md,
                                     timeout=30).checkpoint_id
    world.stub.PutShard(iter([world.header(cid), pb.PutShardRequest(chunk=world.data)]), metadata=world.md, timeout=30)
    assert world.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, files=[shard_name(0)], wait_seconds=2),
                                 metadata=world.md, timeout=30).status == "COMMITTED"
