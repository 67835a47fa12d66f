"""The service's memory under hostile shard headers: the worst the header limits allow.

    python -m bench.headers [REPEATS]   # default 3 uploads of each header

A fresh service per kind of header (tokens off, streamed uploads), warmed by one small
valid upload; the header is then uploaded as a whole shard file REPEATS times, one after
the other, and the service's VmHWM (peak RSS) is compared with its VmRSS before. The figure that matters is the peak over idle: it must stay within 64 MiB
(docs/security.md). tests/service/test_hostile_headers.py sends the same headers and checks
the answers.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

from lastgood.wire.format import MAX_DIM, MAX_DIMS, MAX_HEADER_BYTES, MAX_HEADER_VALUES

MiB = 1024 * 1024


def _file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _members(fmt: str, size: int, values: int, open_: str = "{", close: str = "}",
             max_values: int = MAX_HEADER_VALUES) -> bytes:
    """A container of as many members `fmt % i` as fit in `size` bytes and in MAX_HEADER_VALUES,
    a member counting as `values` values (format._count_values), the container as one."""
    member = (lambda i: fmt % i) if "%" in fmt else (lambda i: fmt)
    n = min((size - len(open_) - len(close)) // (len(member(0).encode()) + 1), (max_values - 8) // values)
    return (open_ + ",".join(member(i) for i in range(n)) + close).encode()


def zero_tensors(size: int = MAX_HEADER_BYTES, max_values: int = MAX_HEADER_VALUES) -> bytes:
    """A valid shard: as many zero-size tensors as fit in a header of `size` bytes and
    `max_values` values (7 each)."""
    body = _members('"t%07d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}', size - 8, 7,
                    max_values=max_values)
    return _file(body + b" " * (-(8 + len(body)) % 8))


def hostile(limit: int = MAX_HEADER_BYTES) -> dict[str, tuple[bytes, str]]:
    """name -> (shard file, a word the refusal names, or None: accepted). Each is as large as the limits allow
    (or just over them), in the shapes that cost the most memory or CPU to parse."""
    depth = limit // 2
    over = MAX_HEADER_VALUES + 1
    return {
        "20 MiB of nested lists": (_file(b"[" * (10 * MiB) + b"]" * (10 * MiB)), "exceeds"),
        "a header 1 byte over the limit": (_file(b" " * (limit + 1)), "exceeds"),
        "nested lists at the byte limit": (_file(b"[" * depth + b"]" * depth), "values"),
        "one value over the value limit": (_file(b"[" + b"0," * (over - 1) + b"0]"), "values"),
        "lists of empty lists": (_file(b'{"t":' + _members("[]", limit - 6, 2, "[", "]") + b"}"), "object"),
        "empty objects": (_file(_members('"%07d":{}', limit, 2)), "dtype"),
        "objects holding a list": (_file(_members('"%07d":{"":[]}', limit, 3)), "dtype"),
        "metadata of short strings": (_file(b'{"__metadata__":' + _members('"%010d":"ab"', limit - 20, 1)
                                            + b"}"), None),  # valid: no tensors
        "a shape of 100,000 numbers": (_file(json.dumps({"t": {"dtype": "U8", "shape": [1000] * 100_000,
                                                               "data_offsets": [0, 1]}}).encode(), b"\0"), "shape"),
        f"a shape of {MAX_DIMS} dimensions of {MAX_DIM}": (_file(json.dumps({"t": {
            "dtype": "U8", "shape": [MAX_DIM] * MAX_DIMS, "data_offsets": [0, 1]}}).encode(), b"\0"), "fit"),
        "a dimension over the limit, with a zero": (_file(json.dumps({"t": {
            "dtype": "U8", "shape": [MAX_DIM + 1, 0], "data_offsets": [0, 0]}}).encode()), "shape"),
        "a dimension of 4,000 digits": (_file(b'{"t":{"dtype":"U8","shape":[' + b"9" * 4000
                                              + b'],"data_offsets":[0,0]}}'), "shape"),
        "a 3 MiB header of zero-size tensors": (zero_tensors(3 * MiB, 10 * MAX_HEADER_VALUES), "exceeds"),
    }


def _upload(stub, pb, step: int, data: bytes) -> str:
    import grpc

    from lastgood.wire.hashing import hash_bytes

    cid = stub.BeginCheckpoint(pb.BeginCheckpointRequest(run="headers", step=step, world_size=1, attempt="a"),
                               timeout=60).checkpoint_id
    msgs = [pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=0, file_name="r.safetensors",
                                                     size=len(data), xxh3_128=hash_bytes(data)))]
    msgs += [pb.PutShardRequest(chunk=data[i:i + 4 * MiB]) for i in range(0, len(data), 4 * MiB)]
    try:
        stub.PutShard(iter(msgs), timeout=120)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def main() -> None:
    import grpc

    from bench.common import Service, proc_status
    from lastgood.wire.v1 import lastgood_pb2 as pb
    from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    cases = {**hostile(), "the largest valid header (zero-size tensors)": (zero_tensors(), None)}
    print(f"header limits {MAX_HEADER_BYTES / MiB:g} MiB, {MAX_HEADER_VALUES} values; a fresh service per kind, "
          f"{repeats} uploads each")
    for name, (data, _word) in cases.items():
        work = Path(tempfile.mkdtemp(prefix="lastgood-headers-", dir="/tmp"))
        svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0"}).start()
        channel = grpc.insecure_channel(svc.grpc_target)
        stub = pb_grpc.CheckpointsStub(channel)
        try:
            _upload(stub, pb, 0, zero_tensors(4096))  # warm: one small valid shard
            idle = proc_status(svc.pid, "VmRSS")
            codes = {_upload(stub, pb, step, data) for step in range(1, repeats + 1)}
            peak = proc_status(svc.pid, "VmHWM")
            print(f"{name:48s} {len(data) / MiB:6.2f} MiB  {'/'.join(sorted(codes)):18s} idle {idle / MiB:4.0f} MiB, "
                  f"peak {peak / MiB:4.0f} MiB: +{(peak - idle) / MiB:.0f} MiB")
        finally:
            channel.close()
            svc.stop()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
