"""What hashing while writing saves: the client's CPU per GiB to hash and write a file, with
the hash as a separate pass before the write (the bytes read from memory twice) or fed
each piece just before it is written (Transport.spool_write: the piece is in the CPU's
cache when the write copies it). One thread or several files at once (state/split.py).

    python -m bench.hash_fused [--dir /dev/shm] [--mib 512] [--reps 5]

The default target is tmpfs, so the figure is the CPU of hashing plus the kernel's copy
into the page cache, without the disk's writeback (which costs no client CPU but makes
wall times swing). Prints one line per variant: median CPU seconds per GiB (this
process, every thread) and the spread over the reps.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import GiB, MiB, median, spread
from lastgood.wire.hashing import StreamHasher, hash_bytes

PIECE = 8 * MiB  # as Transport.spool_write


def write(view: memoryview, path: str, fused: bool) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        hasher = StreamHasher()
        digest = None if fused else hash_bytes(view)  # a pass of its own
        for off in range(0, view.nbytes, PIECE):
            piece = view[off:off + PIECE]
            if fused:
                hasher.update(piece)
            while piece.nbytes:
                piece = piece[os.write(fd, piece):]
        return hasher.hexdigest() if fused else digest
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.mib * MiB, dtype=np.uint8)
    view = memoryview(data).cast("B")
    gib = view.nbytes / GiB
    print(f"{args.mib} MiB into {args.dir}, {args.reps} reps alternating; load average {os.getloadavg()[0]:.1f}")
    variants = [(threads, fused) for threads in (1, 4) for fused in (False, True)]
    cpu: dict = {v: [] for v in variants}
    for _ in range(args.reps):
        for threads, fused in variants:  # alternating, rep by rep
            n = -(-view.nbytes // threads)
            c0 = time.process_time()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: write(view[i * n:(i + 1) * n],
                                              os.path.join(args.dir, f"hf-{uuid.uuid4().hex}"), fused), range(threads)))
            cpu[(threads, fused)].append((time.process_time() - c0) / gib)
    for (threads, fused), xs in cpu.items():
        print(f"  {threads} file(s) at once, {'hash while writing' if fused else 'hash, then write'}: "
              f"{median(xs):.3f} CPU s/GiB (spread {spread(xs) * 100:.0f}%)")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
