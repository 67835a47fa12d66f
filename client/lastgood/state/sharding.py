"""Sharded state (FSDP2 / DTensor) and restores at another world size.

Each rank stores only its own shards: the local tensor of every DTensor, with the
DTensor's global shape and the global offset of the shard (codec's `__dtensor__`). To
restore, the live model is asked for its own, current sharding (via
torch.distributed.checkpoint.state_dict), and every local shard is filled from the stored
shards it overlaps, wherever they came from; the overlaps are computed by DCP's own
resharding planner (`create_read_items_for_chunk_list`). The same code restores at the
same world size (one exact overlap: the rank's own shard) and at another one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lastgood.state.codec import ShardRef, _is_dtensor, decode
from lastgood.errors import CorruptCheckpoint, FormatError, LastgoodError
from lastgood.wire.format import header_length, parse_header, parse_state
from lastgood.state.buffers import array_from_buffer, tensor_from_buffer


def is_sharded(module: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in module.parameters())


@dataclass
class StoredFile:
    """One rank's shard file, downloaded and verified: its bytes hash right, and its state
    can be read (checked here, before the ranks agree on the checkpoint, so that a file
    that cannot be applied is a damaged checkpoint to fall back from, on every rank)."""

    rank: int
    buf: memoryview
    tensors: dict = field(init=False)
    start: int = field(init=False)
    state: dict = field(init=False)

    def __post_init__(self) -> None:
        self.tensors, self.start, self.state, _ = read_header(self.buf, len(self.buf))

    def tensor(self, name: str) -> torch.Tensor:
        return tensor_from_buffer(self.buf, self.tensors[name], self.start, None, copy=False)

    def piece(self, name: str, offsets, lengths) -> torch.Tensor:
        """The part of stored tensor `name` that one read item of ShardIndex names."""
        return narrow_tensor_by_index(self.tensor(name), offsets, lengths)

    def resolve(self, name: str, device: str | None, copy: bool) -> torch.Tensor:
        """A replicated tensor, for the codec's decode: a view of the buffer or a copy."""
        return tensor_from_buffer(self.buf, self.tensors[name], self.start, device, copy=copy)

    def array(self, name: str):
        return array_from_buffer(self.buf, self.tensors[name], self.start)


def read_header(head, file_size: int) -> tuple[dict, int, dict, dict[str, str]]:
    """(tensors, data start, state, metadata) of a shard file from its header bytes,
    checked before the ranks agree on the checkpoint: a file that cannot be applied is a
    damaged checkpoint to fall back from, on every rank."""
    tensors, meta = parse_header(head, file_size=file_size)
    start = header_length(head)
    state = parse_state(meta, tensors)
    try:  # a dry run of the decode restore will do: the codec's own forms, nothing made
        decode(state, lambda name, device: None, lambda name: None)
    except Exception as e:  # noqa: BLE001 - whatever the codec chokes on is damage
        raise FormatError(f"the shard's state cannot be decoded: {type(e).__name__}: {str(e)[:200]}") from None
    return tensors, start, state, meta


class ShardIndex:
    """Where every stored shard of every DTensor is: name -> [(offset, shape, file)]."""

    def __init__(self, files: list[StoredFile]) -> None:
        self.chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], StoredFile]]] = {}
        for f in files:
            self._walk(f.state.get("components", {}), f)

    def _walk(self, node, f: StoredFile) -> None:
        if isinstance(node, dict):
            if "__dtensor__" in node:
                name = node["__dtensor__"]
                self.chunks.setdefault(name, []).append(
                    (tuple(node["offset"]), tuple(f.tensors[name]["shape"]), f))
                return
            for v in node.values():
                self._walk(v, f)
        elif isinstance(node, list):
            for v in node:
                self._walk(v, f)

    def read_items(self, ref: ShardRef, target) -> list:
        """(file, read item) for every stored shard that overlaps the live DTensor's local
        shard, by DCP's planner: what fill() copies and what a resharding restore reads
        (readplan.py), computed once, here. CorruptCheckpoint unless they cover it exactly
        once (_check_cover)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if tuple(target.shape) != ref.shape:
            raise LastgoodError(f"{ref.name}: stored with global shape {ref.shape}, the model has {tuple(target.shape)}")
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        # HSDP stores each shard once per replica: identical chunks are one, read from the
        # first file that holds it (else every byte would be planned, and counted, twice)
        stored: dict[tuple, tuple] = {}
        for o, s, f in self.chunks.get(ref.name, []):
            stored.setdefault((tuple(o), tuple(s)), (o, s, f))
        md = TensorStorageMetadata(properties=TensorProperties(dtype=target.dtype), size=torch.Size(ref.shape),
                                   chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                           for o, s, _ in stored.values()])
        by_offset = {tuple(o): f for o, _, f in reversed(stored.values())}  # the first for an offset
        items = [(by_offset[tuple(item.storage_index.offset)], item)
                 for item in create_read_items_for_chunk_list(ref.name, md, [ChunkStorageMetadata(
                     torch.Size(offset), torch.Size(shape))])]
        _check_cover(ref.name, [(i.dest_offsets, i.lengths) for _, i in items], shape)
        return items

    def fill(self, ref: ShardRef, target) -> None:
        """Copy into the live DTensor's local shard every stored overlap; all of it must be covered."""
        local = target.to_local()
        with torch.no_grad():
            for f, item in self.read_items(ref, target):  # which cover it exactly once
                src = f.piece(ref.name, item.storage_offsets, item.lengths)
                narrow_tensor_by_index(local, item.dest_offsets, item.lengths).copy_(src)


def _check_cover(name: str, boxes: list, shape) -> None:
    """CorruptCheckpoint unless the boxes (offset, lengths) in the local shard tile it: no
    two overlap and their sizes add up to it, i.e. their union is the whole shard. (A sum
    alone lets two overlapping chunks stand in for a region none holds.) Pairwise: a local
    shard overlaps a few stored ones."""
    import math

    for i, (oa, la) in enumerate(boxes):
        for ob, lb in boxes[:i]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, la, ob, lb)) and math.prod(la) and math.prod(lb):
                raise CorruptCheckpoint(f"{name}: two stored shards cover the same part of this rank's shard "
                                        f"({list(oa)}+{list(la)} and {list(ob)}+{list(lb)})")
    covered, want = sum(math.prod(n) for _, n in boxes), math.prod(shape)
    if covered != want:
        raise CorruptCheckpoint(f"{name}: the stored shards cover {covered} of this rank's {want} elements")


def fill_tree(saved, target, index: ShardIndex):
    """Walk the decoded saved state beside the live state dict: ShardRefs are filled into
    the live DTensors; every other value is taken as saved."""
    if isinstance(saved, ShardRef):
        if not _is_dtensor(target):
            raise LastgoodError(f"{saved.name}: stored as a DTensor shard, but the model's value is not a DTensor")
        index.fill(saved, target)
        return target
    if isinstance(saved, dict):
        tgt = target if isinstance(target, dict) else {}
        return {k: fill_tree(v, tgt.get(k), index) for k, v in saved.items()}
    if isinstance(saved, list):
        tgt = target if isinstance(target, list) else []
        return [fill_tree(v, tgt[i] if i < len(tgt) else None, index) for i, v in enumerate(saved)]
    return saved
