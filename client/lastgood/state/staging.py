"""Snapshots: copy the state into reusable CPU buffers laid out as the final shard file.

`save()` blocks only for this copy. The buffer *is* the safetensors file (header, then
tensors at their final offsets), or the files a large state is split into, back to back
(state/split.py), so hashing and upload read it in place, with no second copy. Buffers come from a small pool: a snapshot never lands in a buffer whose upload is
still running, and when every buffer is busy the next `save()` waits for one, so training
can never change memory that an upload is reading. With CUDA present the buffers are
pinned, so device-to-host copies run at full speed and asynchronously until one sync.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from lastgood.state.dtypes import ST_TO_TORCH, st_dtype
from lastgood.common.durable import DIRECT_BLOCK
from lastgood.wire.format import FORMAT_VERSION, META_FORMAT, META_STATE, Layout, TensorSpec
from lastgood.state import split


@dataclass
class Snapshot:
    step: int
    buffer: torch.Tensor  # uint8: every file's bytes, file i at starts[i]
    layouts: list[Layout]  # one per file (state/split.py): the first holds the state
    starts: list[int]
    attempt: str | None = None  # the attempt it is saved under (the Checkpointer's, trainer/launch.py)
    seq: int = 0  # its save's number, in save() order

    @property
    def layout(self) -> Layout:
        return self.layouts[0]

    def view(self) -> memoryview:
        """The first file's bytes, zero-copy (the whole state, unless it was split)."""
        return self.views()[0]

    def views(self) -> list[memoryview]:
        """Each file's bytes, zero-copy."""
        whole = memoryview(self.buffer.numpy()).cast("B")
        return [whole[a:a + lay.size] for a, lay in zip(self.starts, self.layouts)]


class StagingPool:
    def __init__(self, slots: int = 2, pin: bool | None = None) -> None:
        self.slots = slots
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._cv = threading.Condition()
        self.last_wait = 0.0  # seconds the last acquire() waited for a free buffer (the benchmark reads it)

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._cv:
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._in_use < self.slots)
            self.last_wait = time.perf_counter() - t0
            self._in_use += 1
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            if self._free and len(self._free) + self._in_use > self.slots:
                # too small for this state: drop the smallest instead of growing the pool
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
        try:
            return aligned_empty(nbytes, self.pin)
        except BaseException:
            self.release(None)
            raise

    def full(self) -> bool:
        """Would acquire() wait now?"""
        with self._cv:
            return self._in_use >= self.slots

    def clear(self) -> None:
        with self._cv:
            self._free.clear()

    def release(self, buf: torch.Tensor | None) -> None:
        with self._cv:
            self._in_use -= 1
            if buf is not None:
                self._free.append(buf)
            self._cv.notify()


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 buffer whose first byte lies on a durable.DIRECT_BLOCK boundary,
    so that a restore reads a file the page cache does not hold straight into it
    (durable.read_into); split.ALIGN keeps every further file on one too. Pinned memory comes
    page-aligned from its allocator, which may round a size up to a power of two: it is
    padded only if it did not."""
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % DIRECT_BLOCK == 0:
            return raw
        del raw
    raw = torch.empty(nbytes + DIRECT_BLOCK, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % DIRECT_BLOCK
    return raw[skip:skip + nbytes]


def snapshot(step: int, json_state: dict, tensors: dict, pool: StagingPool, file_bytes: int = 0,
             max_files: int = split.MAX_FILES) -> Snapshot:
    """`file_bytes`: split the state into files of this size or more on average, at most
    `max_files` (state/split.py; 0: one file)."""
    specs = [TensorSpec(name, st_dtype(t), tuple(t.shape)) for name, t in tensors.items()]
    meta = {META_FORMAT: FORMAT_VERSION,
            META_STATE: json.dumps(json_state, separators=(",", ":"), allow_nan=False)}
    layouts = split.layouts(specs, meta, file_bytes, max_files)
    starts = split.offsets([lay.size for lay in layouts])
    where = {name: (at, lay) for at, lay in zip(starts, layouts) for name in lay.offsets}
    buf = pool.acquire(starts[-1])
    try:
        for at, lay in zip(starts, layouts):
            buf[at: at + lay.data_start].copy_(torch.frombuffer(bytearray(lay.header), dtype=torch.uint8))
        cuda_devices = set()
        for spec in specs:
            at, lay = where[spec.name]
            start, end = (at + o for o in lay.offsets[spec.name])
            if end == start:
                continue
            src = tensors[spec.name]
            if isinstance(src, np.ndarray):  # safetensors is little-endian
                little = np.ascontiguousarray(src, dtype=src.dtype.newbyteorder("<"))
                buf[start:end].numpy()[:] = little.view(np.uint8).reshape(-1)
                continue
            dst = buf[start:end].view(ST_TO_TORCH[spec.dtype]).view(spec.shape)
            if src.device.type == "cuda":
                cuda_devices.add(src.device)
                dst.copy_(src.detach(), non_blocking=pool.pin)
            else:
                dst.copy_(src.detach())
        for device in cuda_devices:  # the non-blocking copies must land before save() returns
            torch.cuda.synchronize(device)
    except BaseException:
        pool.release(buf)
        raise
    return Snapshot(step, buf, layouts, starts[:-1])
