"""Helpers for the service tests: valid shard bytes, a thin gRPC client, error checks, snapshots.

Everything here talks to a real service process (tests/conftest.py starts it) over loopback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from lastgood.wire.format import TensorSpec, plan_layout
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc
from lastgood_service.domain.keys import INDEX_SUFFIX

ATTEMPT = "attempt-1"
RPC_TIMEOUT = 20.0


# ---------------------------------------------------------------- shard bytes
def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def make_shard(rank: int = 0, seed: int = 0, n: int = 6) -> bytes:
    """A small but valid safetensors file, laid out by lastgood.wire.format.plan_layout.

    Three tensors of different element sizes (F32, I64, U8) so the tensor index has
    something to say; `seed` changes the values (and so the hash), not the layout.
    """
    values = {
        f"model.layers.{rank}.weight": np.arange(n, dtype=np.float32) * (seed + 1) + rank,
        "train.step": np.array([seed, rank], dtype=np.int64),
        "rng.state": np.arange(5, dtype=np.uint8) + seed,
    }
    return safetensors_bytes(values, {"lastgood.format": "1", "rank": str(rank), "seed": str(seed)})


DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8"}


def safetensors_bytes(values: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file of `values` (F32, I64 or U8 arrays) and `metadata`, laid out by
    lastgood.wire.format.plan_layout as a rank writes it."""
    specs = [TensorSpec(k, DTYPES[v.dtype], tuple(v.shape)) for k, v in values.items()]
    layout = plan_layout(specs, metadata)
    buf = bytearray(layout.size)
    buf[:layout.data_start] = layout.header
    for name, arr in values.items():
        a, b = layout.offsets[name]
        buf[a:b] = arr.tobytes()
    return bytes(buf)


# ---------------------------------------------------------------- gRPC
class Client:
    """The generated stubs, with defaults that keep the tests short. Errors are left raw
    (grpc.RpcError) so that tests can assert the exact status code."""

    def __init__(self, grpc_target: str) -> None:
        self.channel = grpc.insecure_channel(grpc_target)
        self.stub = pb_grpc.CheckpointsStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def begin(self, run: str, step: int = 1, world_size: int = 1, parent_id: int = 0,
              attempt: str = ATTEMPT, rank: int = 0, generation: int = 0) -> pb.BeginCheckpointResponse:
        return self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
            run=run, step=step, world_size=world_size, parent_id=parent_id, attempt=attempt, rank=rank,
            generation=generation), timeout=RPC_TIMEOUT)

    def put(self, checkpoint_id: int, rank: int, file_name: str, data: bytes, *, xxh3: str | None = None,
            size: int | None = None, chunk: int = 64, extra_messages: list[pb.PutShardRequest] | None = None,
            ) -> pb.PutShardResponse:
        """Stream one shard: header (declared size/hash default to the true ones), then chunks."""
        def messages() -> Iterator[pb.PutShardRequest]:
            yield pb.PutShardRequest(header=pb.ShardHeader(
                checkpoint_id=checkpoint_id, rank=rank, file_name=file_name,
                size=len(data) if size is None else size,
                xxh3_128=hash_bytes(data) if xxh3 is None else xxh3))
            for off in range(0, len(data), chunk):
                yield pb.PutShardRequest(chunk=data[off:off + chunk])
            yield from extra_messages or ()

        return self.stub.PutShard(messages(), timeout=RPC_TIMEOUT)

    def vote(self, checkpoint_id: int, rank: int, files: list[str], wait: float = 0.0) -> pb.CommitRankResponse:
        return self.stub.CommitRank(pb.CommitRankRequest(
            checkpoint_id=checkpoint_id, rank=rank, files=files, wait_seconds=wait), timeout=RPC_TIMEOUT + wait)

    def abort(self, checkpoint_id: int, reason: str = "test", rank: int = 0) -> pb.AbortCheckpointResponse:
        return self.stub.AbortCheckpoint(pb.AbortCheckpointRequest(
            checkpoint_id=checkpoint_id, reason=reason, rank=rank), timeout=RPC_TIMEOUT)

    def manifest(self, checkpoint_id: int = 0, run: str = "") -> pb.GetManifestResponse:
        return self.stub.GetManifest(pb.GetManifestRequest(checkpoint_id=checkpoint_id, run=run),
                                     timeout=RPC_TIMEOUT)

    def read(self, checkpoint_id: int, rank: int, file_name: str, offset: int = 0, length: int = 0) -> bytes:
        return b"".join(m.chunk for m in self.stub.GetShard(pb.GetShardRequest(
            checkpoint_id=checkpoint_id, rank=rank, file_name=file_name, offset=offset, length=length),
            timeout=RPC_TIMEOUT))

    # one call that does a whole single-rank (or all-rank) save
    def save(self, run: str, step: int, world_size: int = 1, parent_id: int = 0, seed: int = 0,
             attempt: str = ATTEMPT, generation: int = 0) -> tuple[int, dict[int, bytes]]:
        cid = self.begin(run, step, world_size, parent_id, attempt, generation=generation).checkpoint_id
        shards = {r: make_shard(r, seed=seed + step) for r in range(world_size)}
        for r, data in shards.items():
            self.put(cid, r, shard_name(r), data)
        for r in range(world_size):
            res = self.vote(cid, r, [shard_name(r)], wait=0.0 if r < world_size - 1 else 2.0)
        assert res.status == "COMMITTED", res
        return cid, shards


def metric(svc, name: str) -> float:
    """An unlabelled counter or gauge from the service's /metrics."""
    for line in svc.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def rpc_error(code: grpc.StatusCode, fn: Callable, *args, **kwargs) -> grpc.RpcError:
    """Call fn; it must fail with exactly `code` and a non-empty message. Returns the error."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if isinstance(result, Iterator):  # server-streaming: errors surface while reading
            list(result)
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    details = err.details() or ""
    assert len(details.strip()) >= 10, f"{code.name} with an empty or vague message: {details!r}"
    return err


# ---------------------------------------------------------------- REST
_HTTP: dict[str, httpx.Client] = {}


def http(svc) -> httpx.Client:
    """A keep-alive client per service URL (httpx.get builds a new client, TLS context
    included, on every call: ~20 ms, which the many snapshot reads would pay each time)."""
    c = _HTTP.get(svc.url)
    if c is None:
        c = _HTTP[svc.url] = httpx.Client(base_url=svc.url, timeout=30)
    return c


def json_error(resp, status: int | tuple[int, ...]) -> dict:
    """A REST error: the given status (never 500) and the body {"error": {"code", "message"}}."""
    wanted = (status,) if isinstance(status, int) else status
    assert resp.status_code in wanted, f"HTTP {resp.status_code} (wanted {wanted}): {resp.text[:500]}"
    assert resp.status_code < 500
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err.get("code"), str) and err["code"], body
    assert isinstance(err.get("message"), str) and len(err["message"].strip()) >= 5, body
    return err


def events(svc, run: str) -> list[dict]:
    r = http(svc).get(f"/api/v1/runs/{run}/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return r.json()["items"]


def checkpoint(svc, checkpoint_id: int) -> dict:
    r = http(svc).get(f"/api/v1/checkpoints/{checkpoint_id}")
    assert r.status_code == 200, r.text
    return r.json()


def last_good_id(svc, run: str) -> int | None:
    """The run's last-good checkpoint id, or None when REST says 404 (no last-good / no run)."""
    r = http(svc).get(f"/api/v1/runs/{run}/last-good")
    if r.status_code == 404:
        json_error(r, 404)
        return None
    assert r.status_code == 200, r.text
    return r.json()["id"]


def wait_status(svc, checkpoint_id: int, status: str, timeout: float = 15.0) -> dict:
    """Poll (bounded) until the checkpoint has `status`; fail with the last view otherwise."""
    deadline = time.monotonic() + timeout
    view = checkpoint(svc, checkpoint_id)
    while view["status"] != status and time.monotonic() < deadline:
        time.sleep(0.1)
        view = checkpoint(svc, checkpoint_id)
    assert view["status"] == status, f"checkpoint {checkpoint_id} is still {view['status']} after {timeout}s"
    return view


# ---------------------------------------------------------------- the blob store on disk
def blob_files(svc) -> tuple[dict[str, int], dict[str, int]]:
    """Files (path -> size) under the local blob store's blobs/ and tmp/ folders."""
    out = []
    for sub in ("blobs", "tmp"):
        root: Path = svc.blob_root / sub
        out.append({p.relative_to(root).as_posix(): p.stat().st_size
                    for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {})
    return out[0], out[1]


def ckpt_dir(svc, checkpoint_id: int) -> Path:
    """The folder of a checkpoint's blobs in the local store (keys: ckpt/<id>-<nonce>/...,
    see lastgood_service.domain.keys); a path that does not exist when it has none."""
    root = svc.blob_root / "blobs" / "ckpt"
    found = [p for p in root.glob(f"{checkpoint_id}-*") if p.is_dir()] if root.exists() else []
    assert len(found) <= 1, found
    return found[0] if found else root / f"{checkpoint_id}-none"


def shard_blob(svc, checkpoint_id: int, rank: int) -> Path:
    """The one blob file holding rank's shard of the checkpoint (keys end in r<rank>/<name>;
    its tensor index beside it ends in .index, see index_blob)."""
    files = [p for p in (ckpt_dir(svc, checkpoint_id) / f"r{rank}").iterdir()
             if p.is_file() and not p.name.endswith(INDEX_SUFFIX)]
    assert len(files) == 1, files
    return files[0]


def root_of(full: dict) -> dict:
    """The committed root of a full manifest view: the view less every file's tensors."""
    full_only = ("data_start", "tensors", "digests")
    return {**full, "ranks": [{**r, "files": [{k: v for k, v in f.items() if k not in full_only}
                                              for f in r["files"]]} for r in full["ranks"]]}


def index_blob(svc, checkpoint_id: int, rank: int) -> Path:
    """The one tensor index object of rank's shard (keys end in r<rank>/<xxh3>.index)."""
    files = [p for p in (ckpt_dir(svc, checkpoint_id) / f"r{rank}").iterdir() if p.name.endswith(INDEX_SUFFIX)]
    assert len(files) == 1, files
    return files[0]


def snapshot(svc, *runs: str) -> dict:
    """Everything a rejected request must leave alone: number of runs, each run's checkpoints
    (id, status, bytes, parent, last-good flag), each run's last-good, the stored blobs and
    the temporary files of the blob store."""
    r = http(svc).get("/api/v1/runs", params={"limit": 1})
    assert r.status_code == 200, r.text
    snap: dict = {"runs_total": r.json()["total"], "runs": {}}
    for run in runs:
        r = http(svc).get(f"/api/v1/runs/{run}/checkpoints", params={"limit": 1000})
        if r.status_code == 404:
            snap["runs"][run] = None
            continue
        assert r.status_code == 200, r.text
        cks = sorted((c["id"], c["status"], c["bytes"], c["parent_id"], c["last_good"]) for c in r.json()["items"])
        snap["runs"][run] = {"checkpoints": cks, "last_good": last_good_id(svc, run)}
    snap["blobs"], snap["tmp"] = blob_files(svc)
    return snap


def assert_unchanged(before: dict, after: dict) -> None:
    assert after == before
    assert after["tmp"] == {}, f"temporary files left behind: {after['tmp']}"


def lying_checker(declared: dict[str, str]):
    """A peer check's `read` that reads nothing and reports the digest each file's writer
    declared (file name -> xxh3-128, which the test knows: neither the assignment nor GET
    .../shards tells a checker): the check a control replaces the real read-back with."""
    return lambda _direct, f: declared[f["name"]]
