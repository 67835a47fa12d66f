"""What lastgood is measured against: the limits (a plain CPU copy, a raw write + fsync) and
the peers (torch.save / torch.load, DCP's FileSystemWriter / FileSystemReader), each timed
the way bench/run.py times lastgood."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from bench.common import MiB, fsync_path, rm, timed
from lastgood.common import durable

# ---------------------------------------------------------------------------- limits
class CopyFloor:
    """Copy every tensor of the state into one preallocated (already touched) CPU buffer:
    what any snapshot must at least do. Measured rep by rep between the other cases."""

    def __init__(self, tensors: list) -> None:
        total = sum(t.nbytes for t in tensors)
        self.buf = torch.empty(total, dtype=torch.uint8)
        self.buf.fill_(1)
        self.pairs, pos = [], 0
        for t in tensors:
            self.pairs.append((self.buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape), t))
            pos += t.nbytes
        self.once()  # warm

    def once(self) -> float:
        t0 = time.perf_counter()
        for dst, src in self.pairs:
            dst.copy_(src)
        return time.perf_counter() - t0

    def free(self) -> None:
        self.pairs, self.buf = [], None


_RAW_BLOCK = None


def raw_write(path: Path, nbytes: int) -> float:
    """Sequential 16 MiB writes of `nbytes` to a new file, then fsync: the disk's ceiling."""
    global _RAW_BLOCK
    if _RAW_BLOCK is None:
        _RAW_BLOCK = memoryview(os.urandom(16 * MiB))
    rm(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:  # in the page cache's fast pieces (lastgood.common.durable.write_all), as lastgood writes
            left -= durable.write_all(fd, _RAW_BLOCK[: min(left, len(_RAW_BLOCK))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt_ = time.perf_counter() - t0
    rm(path)
    return dt_


# ---------------------------------------------------------------------------- peers
def torch_save(model, opt, path: Path) -> float:
    rm(path)
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    fsync_path(path)
    return time.perf_counter() - t0


def torch_load(model, opt, path: Path) -> float:
    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    dt_ = time.perf_counter() - t0
    del sd
    return dt_


def dcp_save(model, opt, path: Path, cpu: list | None = None) -> float:
    import torch.distributed.checkpoint as dcp

    rm(path)
    return timed(lambda: dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                  storage_writer=dcp.FileSystemWriter(path, thread_count=2, sync_files=True),
                                  no_dist=True), cpu)


def dcp_load(model, opt, path: Path, cpu: list | None = None) -> float:
    import torch.distributed.checkpoint as dcp

    def load():
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)  # in place
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    return timed(load, cpu)
