"""What the service's put path would gain, measured at one moment on one machine.

    python -m bench.wire [SIZE_GIB]     # default 1; three reps of each variant, medians

A PutShard-shaped client stream (the real header message, then 4 MiB chunks) to a server
process that hashes every chunk with xxh3-128, in six variants:
  pb                  protobuf messages on both sides, as lastgood does today; bytes discarded
  raw                 the same bytes on the wire, pre-framed by the client (tag 0x12, varint
                      length, chunk: one copy from the buffer) and parsed by the server as a
                      memoryview (no copy): a custom (de)serializer, no .proto change
  pb-file / raw-file  ... and the server writes each chunk to a file in the receiving
                      thread, then fsyncs (as _LocalWriter does today)
  *-file-behind       ... the writes go through a write-behind thread (a queue of 4 chunks)
"""
import os, sys, time, subprocess, tempfile, threading, queue
from concurrent import futures
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import grpc, xxhash
from lastgood.wire.v1 import lastgood_pb2 as pb
MiB = 1 << 20
OPT = [("grpc.max_receive_message_length", 4*MiB+65536), ("grpc.max_send_message_length", 4*MiB+65536)]

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F; n >>= 7
        if n: out.append(b | 0x80)
        else: out.append(b); return bytes(out)

def sink(mode, d):
    def handler(it, ctx):
        h = xxhash.xxh3_128(); n = 0
        f = open(os.path.join(d, f"x{threading.get_ident()}.part"), "wb", buffering=0) if "file" in mode else None
        q = None
        if "behind" in mode:
            q = queue.Queue(4)
            def drain():
                while (b := q.get()) is not None:
                    mv = memoryview(b)
                    while mv: mv = mv[f.write(mv):]
            t = threading.Thread(target=drain); t.start()
        for raw in it:
            if mode.startswith("pb"):
                m = pb.PutShardRequest.FromString(raw)
                if m.WhichOneof("body") != "chunk": continue
                c = m.chunk
            else:
                if raw[0] != 0x12: continue
                i = 1
                while raw[i] & 0x80: i += 1
                c = memoryview(raw)[i + 1:]
            h.update(c); n += len(c)
            if q is not None: q.put(c)
            elif f is not None:
                mv = memoryview(c)
                while mv: mv = mv[f.write(mv):]
        if q is not None: q.put(None); t.join()
        if f is not None:
            os.fsync(f.fileno()); f.close(); os.unlink(f.name)
        return str(n).encode()
    return handler

def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        d = sys.argv[2]
        srv = grpc.server(futures.ThreadPoolExecutor(8), options=OPT)
        srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("w.W", {
            m: grpc.stream_unary_rpc_method_handler(sink(m, d)) for m in ("pb", "raw", "pb-file", "raw-file", "pb-file-behind", "raw-file-behind")})])
        port = srv.add_insecure_port("127.0.0.1:0"); srv.start(); print(port, flush=True); srv.wait_for_termination()
    else:
        size = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 1 << 30
        data = memoryview(bytearray(os.urandom(64 * MiB)) * (size // (64 * MiB)))
        d = tempfile.mkdtemp(prefix="lastgood-wire-", dir="/tmp")
        p = subprocess.Popen([sys.executable, "-m", "bench.wire", "serve", d], stdout=subprocess.PIPE, text=True)
        port = int(p.stdout.readline())
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPT)
        hdr = pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=1, rank=0, file_name="x", size=size, xxh3_128="0"*32)).SerializeToString()
        def pb_msgs():
            yield hdr
            for off in range(0, size, 4 * MiB):
                yield pb.PutShardRequest(chunk=bytes(data[off:off + 4 * MiB])).SerializeToString()
        pre = b"\x12" + varint(4 * MiB)
        def raw_msgs():
            yield hdr
            for off in range(0, size, 4 * MiB):
                yield b"".join((pre, data[off:off + 4 * MiB]))
        res = {}
        for rep in range(3):
            for name, msgs in (("pb", pb_msgs), ("raw", raw_msgs), ("pb-file", pb_msgs), ("raw-file", raw_msgs), ("pb-file-behind", pb_msgs), ("raw-file-behind", raw_msgs)):
                call = ch.stream_unary(f"/w.W/{name}")
                t = time.perf_counter(); call(msgs()); dt = time.perf_counter() - t
                res.setdefault(name, []).append(size / dt / (1 << 30))
        for k, v in res.items():
            v.sort(); print(f"{k:16s} median {v[1]:.2f} GiB/s  (reps {', '.join(f'{x:.2f}' for x in v)})")
        p.terminate()
        p.wait()
        os.rmdir(d)


if __name__ == "__main__":
    main()
