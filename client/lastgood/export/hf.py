"""The writing side of an export: Hugging Face safetensors files and their index.

The layout `from_pretrained` reads: one `model.safetensors`, or
`model-00001-of-0000N.safetensors` files of at most --max-shard-size each (a tensor larger
than that gets a file of its own), always with `model.safetensors.index.json` (its
`weight_map` names each tensor's file, `metadata.total_size` is the bytes of all tensors)
and, when there is one, `config.json`. Each file's safetensors metadata says
`format: pt`, which transformers requires, and which checkpoint it came from.

Memory: a tensor whose pieces are dim-0 blocks (FSDP2's sharding; a replicated tensor is
one block) is copied from the scratch file to the output in blocks of BLOCK bytes,
converted block by block, never whole. A tensor sharded any other way is assembled in
memory (that tensor, once, plus one of its pieces).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from lastgood.errors import CorruptCheckpoint
from lastgood.common.sizes import parse_size
from lastgood.wire.format import DTYPE_SIZES, TensorSpec, plan_layout
from lastgood.export.convert import convert
from lastgood.export.source import Collector, Tensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
BLOCK = 4 * 1024 * 1024
def shard_size(text: str | int) -> int:
    """A shard size limit (common/sizes.py: `5GB` is 10^9 as Hugging Face counts, `500MiB`
    2^20, `1000` bytes), at least 1 byte."""
    value = parse_size(text)
    if value < 1:
        raise ValueError(f"the size must be at least 1 byte, got {text!r}")
    return value


@dataclass
class Item:
    """One tensor of the output: its name there, where it comes from, its output dtype."""

    name: str
    tensor: Tensor
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel * DTYPE_SIZES[self.dtype]


def split(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """Hugging Face's rule: fill a file in order until the next tensor would overflow it."""
    files: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if files[-1] and size + it.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(it)
        size += it.nbytes
    return files if files[0] else []


def file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


# ---------------------------------------------------------------- coverage and assembly
def _is_slabs(t: Tensor) -> bool:
    return all(all(o == 0 for o in p.offset[1:]) and p.shape[1:] == t.shape[1:] for p in t.pieces)


def check_coverage(t: Tensor) -> None:
    """Every element of the tensor is in exactly one piece, or CorruptCheckpoint."""
    if t.numel == 0:
        return
    where = f"{t.key}: the stored shards"
    if _is_slabs(t):
        row = 0
        for p in sorted(t.pieces, key=lambda p: p.offset[:1]):
            if p.offset[:1] != (row,)[:len(p.offset)]:
                raise CorruptCheckpoint(f"{where} leave rows {row}..{p.offset[0] - 1} of {list(t.shape)} uncovered"
                                        if p.offset[0] > row else f"{where} overlap at row {p.offset[0]}")
            row += p.shape[0] if p.shape else 1
        if row != (t.shape[0] if t.shape else 1):
            raise CorruptCheckpoint(f"{where} cover rows 0..{row - 1} of {list(t.shape)}")
        return
    for p, q in combinations(t.pieces, 2):
        if all(a < c + m and c < a + n for a, n, c, m in zip(p.offset, p.shape, q.offset, q.shape)):
            raise CorruptCheckpoint(f"{where} overlap: {list(p.shape)} at {list(p.offset)} and {list(q.shape)} "
                                    f"at {list(q.offset)}")
    if t.covered != t.numel:
        raise CorruptCheckpoint(f"{where} cover {t.covered} of {t.numel} elements of {list(t.shape)}")


def blocks(item: Item, src: Collector) -> Iterator:
    """The output bytes of one tensor, in order, a bounded block at a time."""
    t, size = item.tensor, DTYPE_SIZES[item.tensor.dtype]
    if _is_slabs(t):
        step = max(size, BLOCK // size * size)
        for p in sorted(t.pieces, key=lambda p: p.offset[:1]):
            total = p.numel * size
            for off in range(0, total, step):
                yield convert(src.pread(min(step, total - off), p.pos + off), t.dtype, item.dtype)
        return
    out_size = DTYPE_SIZES[item.dtype]
    full = np.empty((*t.shape, out_size), dtype=np.uint8)
    for p in t.pieces:
        data = np.frombuffer(convert(src.pread(p.numel * size, p.pos), t.dtype, item.dtype), dtype=np.uint8)
        full[tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))] = data.reshape(*p.shape, out_size)
    yield full


# ---------------------------------------------------------------- files
def write_file(path: str, items: list[Item], src: Collector, metadata: dict[str, str], progress=None) -> int:
    """One safetensors file, fsynced; returns its size."""
    layout = plan_layout([TensorSpec(it.name, it.dtype, it.tensor.shape) for it in items],
                         {"format": "pt", **metadata})
    by_name = {it.name: it for it in items}
    with open(path, "wb") as f:
        f.write(layout.header)
        for name, (start, end) in sorted(layout.offsets.items(), key=lambda kv: kv[1]):
            for block in blocks(by_name[name], src):
                view = memoryview(block).cast("B")
                f.write(view)
                if progress is not None:
                    progress(len(view))
            if f.tell() != end:
                raise CorruptCheckpoint(f"{name}: wrote {f.tell() - start} bytes, expected {end - start}")
        f.flush()
        os.fsync(f.fileno())
    return layout.size


def write_json(path: str, doc) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
