"""The bare gRPC transport ceiling in Python on loopback: raw bytes messages (no protobuf,
no catalog) of the same chunk size lastgood uses, from memory or a stored file's chunks as
they are read, hashed with xxh3-128 on receipt and discarded. Download: server-streaming (the restore direction); upload: client-streaming
(the save direction). The server runs in its own process, as the service does.

    python -m bench.pipe serve PORT_FILE      # prints nothing; writes the bound port to PORT_FILE
"""

from __future__ import annotations

import os
import sys
import time
from concurrent import futures

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import xxhash  # noqa: E402

CHUNK = 4 * 1024 * 1024
OPTIONS = [("grpc.max_receive_message_length", CHUNK + 64 * 1024),
           ("grpc.max_send_message_length", CHUNK + 64 * 1024)]
_BLOCK = os.urandom(CHUNK)


def _download(request: bytes, context):
    left = int(request)
    while left > 0:
        n = min(CHUNK, left)
        yield _BLOCK if n == CHUNK else _BLOCK[:n]
        left -= n


def _download_file(request: bytes, context):
    """The chunks of a stored file, read as they go (one copy out of the page cache each):
    the service's read path with nothing of its own (no catalog, no framing, no hashing)."""
    with open(request.decode(), "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _upload(request_iterator, context):
    h = xxhash.xxh3_128()
    n = 0
    for msg in request_iterator:
        h.update(msg)
        n += len(msg)
    return f"{n} {h.hexdigest()}".encode()


def serve(port_file: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Pipe", {
        "Download": grpc.unary_stream_rpc_method_handler(_download),
        "DownloadFile": grpc.unary_stream_rpc_method_handler(_download_file),
        "Upload": grpc.stream_unary_rpc_method_handler(_upload),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, port_file)
    server.wait_for_termination()


class PipeClient:
    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        self._down = self.channel.unary_stream("/bench.Pipe/Download")
        self._up = self.channel.stream_unary("/bench.Pipe/Upload")
        self._down_file = self.channel.unary_stream("/bench.Pipe/DownloadFile")

    def download(self, nbytes: int) -> float:
        """Seconds to receive nbytes, hashing every chunk; the bytes are discarded."""
        t0 = time.perf_counter()
        h = xxhash.xxh3_128()
        got = 0
        for chunk in self._down(str(nbytes).encode(), timeout=3600):
            h.update(chunk)
            got += len(chunk)
        h.hexdigest()
        dt = time.perf_counter() - t0
        assert got == nbytes, (got, nbytes)
        return dt

    def download_files(self, paths) -> float:
        """Seconds to receive the files at `paths`, each its own stream, all at once (as a
        restore reads a rank's files), hashing every chunk as download() does."""
        def one(path) -> None:
            h = xxhash.xxh3_128()
            for chunk in self._down_file(str(path).encode(), timeout=3600):
                h.update(chunk)
            h.hexdigest()

        t0 = time.perf_counter()
        with futures.ThreadPoolExecutor(max_workers=len(paths)) as pool:
            for f in [pool.submit(one, p) for p in paths]:
                f.result()
        return time.perf_counter() - t0

    def upload(self, nbytes: int) -> float:
        """Seconds to send nbytes (4 MiB messages sliced from one buffer) to a server that hashes them."""
        block = memoryview(_BLOCK)

        def messages():
            left = nbytes
            while left > 0:
                n = min(CHUNK, left)
                yield bytes(block[:n])  # one copy per chunk, as lastgood's client makes
                left -= n

        t0 = time.perf_counter()
        reply = self._up(messages(), timeout=3600)
        dt = time.perf_counter() - t0
        assert int(reply.split()[0]) == nbytes
        return dt

    def close(self) -> None:
        self.channel.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
