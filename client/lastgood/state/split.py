"""How a rank's tensors are split into files (written and read back in parallel: common/parallel.py,
restore/files.py).

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
are named rank00000-001.safetensors, ... (`wire.format.sibling_name`). Whoever decides which tensors
a rank writes decides before this: the split applies to whatever the rank writes.

In the staging buffer the files lie back to back, each at an ALIGN-byte boundary, so a
tensor is viewed in place, and a restore reads them into one buffer the same way.
"""

from __future__ import annotations

import heapq
import json
import os

from lastgood.common.durable import DIRECT_BLOCK
from lastgood.common.parallel import WORKERS
from lastgood.wire.format import META_FILE_SHAPES, META_FILES, Layout, TensorSpec, plan_layout

MAX_FILES = WORKERS  # the most files a rank's state is split into: one per writer thread (the rule above);
                     # a reader takes any number (checkpoints written before held up to 64)
# where each file starts in a buffer: every tensor stays aligned to its element size, and a
# restore's O_DIRECT read lands straight in the buffer (durable.read_into)
ALIGN = DIRECT_BLOCK


def files_per_rank(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """The most files this rank's state is split into (the rule above): this process's CPUs
    (its affinity: a container's cpuset counts, a CPU quota does not) over the ranks on
    this host (distributed.local_world_size), between 1 and MAX_FILES."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        from lastgood.state.distributed import local_world_size  # torch, which this module does not import

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


