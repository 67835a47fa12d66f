"""How a rank's tensors are split into files, written and read back in parallel.

Why: one file per rank is one serial chain (hash and write, the service re-hashes, one
fsync, rename), where DCP writes a rank's data with two threads into several files. So a
rank's state of `file_bytes` or more is split into several files, each a valid
safetensors file of whole tensors (a tensor is never cut), and the files are written,
hashed and handed over concurrently by a small thread pool. Nothing about the commit
changes: every file is hashed and verified on its own, the rank's one vote names all of
them, the checkpoint commits once, and a file missing or damaged makes the checkpoint
unusable like any damage (docs/recovery.md).

The rule (`plan`), deterministic for the same tensors, setting and host:
  n = total bytes // file_bytes files (at least 1, at most max_files; file_bytes 0: 1),
  where max_files (`files_per_rank`) is the CPUs this process may run on shared among the
  host's ranks, at most MAX_FILES: a writer thread without a core of its own only adds
  contention (measured: 4 ranks of 1 GiB on 2 CPUs, 16 writers, committed later than 4);
  so the files are file_bytes or more on average, and a larger state gets larger files,
  not more: a file beyond one per writer thread adds no parallelism, only per-file work (a
  spool file and its fsync, a hand-over the service verifies and records, a manifest
  entry). Measured at 4 GiB: 4 files of 1 GiB committed about 10 % sooner than 16 of
  256 MiB (bench/README.md);
  tensors placed largest first (ties by name) into the file holding the fewest bytes so
  far (ties: the lower index); each file keeps its tensors in the caller's order.
The first file keeps the rank's usual name (rank00000.safetensors) and holds the state
document; its metadata names the tensors of each further file (format.META_FILES), which
are named rank00000-001.safetensors, ... (`sibling_name`). Whoever decides which tensors
a rank writes decides before this: the split applies to whatever the rank writes.

In the staging buffer the files lie back to back, each at an ALIGN-byte boundary, so a
tensor is viewed in place, and a restore reads them into one buffer the same way.
"""

from __future__ import annotations

import functools
import heapq
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..durable import DIRECT_BLOCK
from ..errors import CorruptCheckpoint, FormatError
from ..format import (META_FILE_SHAPES, META_FILES, Layout, TensorSpec, header_length, parse_header, plan_layout,
                      sibling_tensors)

WORKERS = 4     # threads per rank that write (or read) its files: hashing, os.write, gRPC release the GIL
MAX_FILES = WORKERS  # the most files a rank's state is split into: one per writer thread (the rule above);
                     # a reader takes any number (checkpoints written before held up to 64)
# PutShard streams a rank opens at once: the service allows max_streams_per_client (16) per
# token, and the ranks of a host usually share one: four each would overrun it on 8 ranks
STREAM_WORKERS = 2
# where each file starts in a buffer: every tensor stays aligned to its element size, and a
# restore's O_DIRECT read lands straight in the buffer (durable.read_into)
ALIGN = DIRECT_BLOCK
T = TypeVar("T")
_FURTHER = re.compile(r".+-\d{3}\.safetensors")


def files_per_rank(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """The most files this rank's state is split into (the rule above): this process's CPUs
    (its affinity: a container's cpuset counts, a CPU quota does not) over the ranks on
    this host (distributed.local_world_size), between 1 and MAX_FILES."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        from ..distributed import local_world_size  # torch, which this module does not import

        local_ranks = local_world_size()
    return max(1, min(MAX_FILES, cpus // max(1, local_ranks)))


def plan(specs: list[TensorSpec], file_bytes: int, max_files: int = MAX_FILES) -> list[list[TensorSpec]]:
    """The rank's tensors as files (lists of specs, the first holding the state): see above."""
    total = sum(s.nbytes for s in specs)
    n = 1 if file_bytes <= 0 else max(1, min(total // file_bytes, max_files, len(specs)))
    if n == 1:
        return [list(specs)]
    where = balance({s.name: s.nbytes for s in specs}, n)
    files = [[s for s in specs if where[s.name] == i] for i in range(n)]
    return [f for f in files if f]


def balance(sizes: dict[str, int], bins: int) -> dict[str, int]:
    """name -> bin: largest first (ties by name), each into the bin with the fewest bytes so
    far (ties: the lowest index). Depends only on the names, sizes and `bins`, never on
    their order: ranks computing it apart agree (replicas.assign relies on it)."""
    heap = [(0, i) for i in range(bins)]
    where: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, i = heapq.heappop(heap)
        where[name] = i
        heapq.heappush(heap, (load + sizes[name], i))
    return where


def layouts(specs: list[TensorSpec], metadata: dict[str, str], file_bytes: int,
            max_files: int = MAX_FILES) -> list[Layout]:
    """Each file's layout (format.plan_layout); the first carries `metadata` and, when there
    are several, the tensor names of the others."""
    files = plan(specs, file_bytes, max_files)
    if len(files) == 1:
        return [plan_layout(files[0], metadata)]
    compact = {"separators": (",", ":")}
    meta = {**metadata, META_FILES: json.dumps([[s.name for s in f] for f in files[1:]], **compact),
            META_FILE_SHAPES: json.dumps([[list(s.shape) for s in f] for f in files[1:]], **compact)}
    return [plan_layout(files[0], meta)] + [plan_layout(f, {}) for f in files[1:]]


def offsets(sizes: list[int]) -> list[int]:
    """Where each file starts in one buffer holding them all (the last entry: the buffer's size)."""
    out, pos = [], 0
    for n in sizes:
        out.append(pos)
        pos += -(-n // ALIGN) * ALIGN
    return out + [pos]


def sibling_name(main: str, index: int) -> str:
    """The name of further file `index` (1, 2, ...) of the rank whose first file is `main`."""
    return f"{main.removesuffix('.safetensors')}-{index:03d}.safetensors"


def file_names(main: str, count: int) -> list[str]:
    return [main] + [sibling_name(main, i) for i in range(1, count)]


def is_sibling(main: str, name: str) -> bool:
    return re.fullmatch(re.escape(main.removesuffix(".safetensors")) + r"-\d{3}\.safetensors", name) is not None


def is_further(name: str) -> bool:
    """Is `name` a further file of some rank (rank00000-001.safetensors)?"""
    return _FURTHER.fullmatch(name) is not None


def run_all(fns: list[Callable[[], T]], workers: int = WORKERS, transport=None,
            undo: Callable[[T], None] | None = None) -> list[T]:
    """Call every function, at most `workers` at a time; results in order. Every call has
    finished before the first error is raised, so nothing runs on behind the caller; then
    `undo(result)` is called for each call that did succeed. `transport`: each worker's
    calls stop retrying when the caller's would (Transport.stoppable is per thread)."""
    stop = getattr(transport, "current_stop", lambda: None)()

    def call(fn):
        if stop is None:
            return fn()
        with transport.stoppable(stop):
            return fn()

    if len(fns) <= 1 or workers <= 1:
        futures = []
        for fn in fns:
            try:
                futures.append((fn(), None))
            except BaseException as e:  # noqa: BLE001 - raised below, after undo
                futures.append((None, e))
                break
        results = futures
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(fns)), thread_name_prefix="lastgood-file") as pool:
            futures = [pool.submit(call, fn) for fn in fns]
            results = [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]
    first = next((e for _, e in results if e is not None), None)
    if first is not None:
        if undo is not None:
            for value, e in results:
                if e is None:
                    undo(value)
        raise first
    return [value for value, _ in results]


# ---------------------------------------------------------------------- restore
def fetch_rank(transport, manifest, rank: int, main: str, alloc: Callable[[int], object]):
    """Read every file of `rank` (its first file `main`, and its siblings) concurrently into
    one buffer from `alloc(nbytes)` (a uint8 tensor), each hashed as it arrives and checked
    against the commit; returns (StoredFile, buffer). CorruptCheckpoint when a file is
    missing or its bytes are not the commit's; FormatError when the files do not agree."""
    from ..sharding import StoredFile

    cid = manifest.checkpoint_id
    entries = manifest.files(rank)
    first = next((f for f in entries if f.name == main), None)
    if first is None:
        raise CorruptCheckpoint(f"checkpoint {cid} has no file {main} for rank {rank}")
    siblings = sorted((f for f in entries if is_sibling(main, f.name)), key=lambda f: f.name)
    files = [first, *siblings]
    at = offsets([f.size for f in files])
    buf = alloc(at[-1])
    view = memoryview(buf.numpy()).cast("B")

    def read(i: int) -> memoryview:
        e = files[i]
        data, got = transport.read_file(cid, rank, e.name, e.size, into=view[at[i]:at[i] + e.size])
        if got != e.xxh3_128:
            raise CorruptCheckpoint(f"checkpoint {cid} (step {manifest.step}) rank {rank} file {e.name}: "
                                    f"xxh3-128 {got} does not match the committed {e.xxh3_128}")
        return data

    datas = run_all([lambda i=i: read(i) for i in range(len(files))])
    if len(files) == 1:
        _, meta = parse_header(datas[0], file_size=len(datas[0]))
        if sibling_tensors(meta):  # its tensors would be missing at restore: a KeyError, no fallback
            raise CorruptCheckpoint(f"checkpoint {cid} rank {rank}: {main} names {len(sibling_tensors(meta))} "
                                    f"further files, the checkpoint holds none")
        return StoredFile(rank, datas[0]), buf
    return _split_file()(rank, datas[0], datas[1:], main), buf


@functools.cache
def _split_file():
    """SplitFile, made on first use: it needs torch (sharding.py), this module does not."""
    from ..sharding import StoredFile
    from ..state import array_from_buffer, tensor_from_buffer

    class SplitFile(StoredFile):
        """One rank's files as one StoredFile: the first file's state, every file's tensors."""

        def __init__(self, rank: int, buf, others: list, main: str) -> None:
            super().__init__(rank, buf)
            _, meta = parse_header(buf, file_size=len(buf))
            declared = sibling_tensors(meta)
            if len(declared) != len(others):
                raise CorruptCheckpoint(f"rank {rank}: {main} names {len(declared)} further files, "
                                        f"the checkpoint holds {len(others)}")
            self._where: dict[str, tuple] = {}
            for i, (names, data) in enumerate(zip(declared, others), start=1):
                tensors, _ = parse_header(data, file_size=len(data))
                if sorted(tensors) != sorted(names) or any(n in self.tensors for n in names):
                    raise FormatError(f"rank {rank}: {sibling_name(main, i)} does not hold the tensors "
                                      f"{main} names for it")
                start = header_length(data)
                for n, spec in tensors.items():
                    self.tensors[n] = spec
                    self._where[n] = (data, start)

        def _at(self, name: str):
            return self._where.get(name, (self.buf, self.start))

        def tensor(self, name: str):
            buf, start = self._at(name)
            return tensor_from_buffer(buf, self.tensors[name], start, None, copy=False)

        def resolve(self, name: str, device, copy: bool):
            buf, start = self._at(name)
            return tensor_from_buffer(buf, self.tensors[name], start, device, copy=copy)

        def array(self, name: str):
            buf, start = self._at(name)
            return array_from_buffer(buf, self.tensors[name], start)

    return SplitFile
