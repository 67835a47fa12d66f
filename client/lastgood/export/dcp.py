"""The DCP export's torch side: a checkpoint's verified tensors written as a stock
`torch.distributed.checkpoint` directory by torch's own `FileSystemWriter`.

`lastgood export RUN@REF DIR --format dcp` (export/__init__.py owns the frame: the lease,
the temporary directory, the rename) reads every rank file it needs once, through
xxh3-128, into the scratch file (source.py), exactly as the Hugging Face export does.
Then a single-process `dcp.save` runs with `FileSystemWriter` over a planner of our own
(`_Planner`) whose plan is the checkpoint's chunks - each stored block of a tensor keeps
its place in the global tensor (an FSDP2 shard stays a chunk, a replicated tensor is
one) - and whose `resolve_data` reads one chunk at a time from the scratch file; the
writer (`_BoundedWriter`) writes each before the next is read, so memory holds one chunk,
not the checkpoint. `.metadata` and `__0_0.distcp` are written by torch's own code
(`_write_item`, `FileSystemWriter.finish`), in the layout of the torch that runs the
export, and stock `FileSystemReader` / `dcp.load` / `dcp_to_torch_save` read them.

What is exported:
- a checkpoint `lastgood.Checkpointer` saved: the module tensors (Collector's choice, under
  the prefix, renamed by the map), named as the state names them (`model.0.weight`), which
  is the key `dcp.load({"model": model.state_dict()}, ...)` asks for;
- a checkpoint `lastgood.dcp.StorageWriter` saved (`DcpSource`): every entry under its
  DCP name, tensors and non-tensor values alike (a value, stored as typed JSON, is written
  the way DCP's default planner writes one: `torch.save` of the decoded object).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from math import prod

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.futures import Future

from lastgood.errors import FormatError
from lastgood.export.source import Collector, Tensor
from lastgood.state.dcp_metadata import value_from_json
from lastgood.state.dtypes import ST_TO_TORCH
from lastgood.wire.format import META_STATE, parse_header


@dataclasses.dataclass
class Chunk:
    """One block of a tensor of the export: its place in the global tensor, and where its
    bytes (row-major) are in the scratch file; or a non-tensor value (`value` set)."""

    fqn: str
    size: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    pos: int = 0
    value: object = None
    is_value: bool = False


def chunks_of(name: str, t: Tensor) -> list[Chunk]:
    """A Checkpointer's tensor (its pieces, coverage checked) as DCP chunks."""
    dtype = ST_TO_TORCH[t.dtype]
    if t.numel == 0:
        return [Chunk(name, t.shape, dtype, (0,) * len(t.shape), t.shape)]
    return [Chunk(name, t.shape, dtype, p.offset, p.shape, p.pos) for p in t.pieces]


class DcpSource(Collector):
    """Reads the rank files of a checkpoint lastgood.dcp saved: every tensor of every file
    into the scratch file, and each file's non-tensor values (the state's `dcp_values`)."""

    def __init__(self, metadata: Metadata, scratch_path: str) -> None:
        super().__init__("", scratch_path)
        self.metadata = metadata
        self.stored: dict[tuple[int, str, str], tuple[int, str, tuple[int, ...]]] = {}  # -> (pos, dtype, shape)
        self.values: dict[tuple[int, str], dict] = {}

    def wants(self, entry) -> bool:
        return True

    def _plan(self, head: bytes, rank: int, entry) -> list[tuple[int, int, int]]:
        tensors, meta = parse_header(head, file_size=entry.size)
        try:
            values = json.loads(meta[META_STATE])["dcp_values"]
        except (KeyError, TypeError, ValueError):
            raise FormatError("not a file lastgood.dcp wrote (no dcp_values)") from None
        if not isinstance(values, dict):
            raise FormatError("its dcp_values is not an object")
        self.values[(rank, entry.name)] = values
        plan, start = [], len(head)
        for name, spec in tensors.items():
            a, b = spec["data_offsets"]
            self.stored[(rank, entry.name, name)] = (self._end, spec["dtype"], tuple(spec["shape"]))
            plan.append((start + a, start + b, self._end))
            self._end += b - a
        return sorted(plan)

    def chunks(self) -> list[Chunk]:
        """Every entry of the DCP metadata, found in the files read (all verified)."""
        out = []
        md = self.metadata
        for index, where in sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ()))):
            fqn, sdm = index.fqn, md.state_dict_metadata.get(index.fqn)
            if not isinstance(where, dict) or sdm is None:
                raise FormatError(f"{fqn}: the DCP metadata does not say where it is")
            key = (where.get("rank"), where.get("file"))
            if isinstance(sdm, BytesStorageMetadata):
                values = self.values.get(key, {})
                if where.get("json") not in values:
                    raise FormatError(f"{fqn}: no value {str(where.get('json'))[:200]!r} in rank {key[0]}'s {key[1]}")
                out.append(Chunk(fqn, value=value_from_json(values[where["json"]]), is_value=True))
                continue
            offsets = tuple(index.offset or (0,) * len(sdm.size))
            chunk = next((c for c in sdm.chunks if tuple(c.offsets) == offsets), None)
            stored = self.stored.get((*key, where.get("tensor")))
            if chunk is None or stored is None:
                raise FormatError(f"{fqn}: chunk at {list(offsets)} is not in rank {key[0]}'s {key[1]}")
            pos, st, shape = stored
            if ST_TO_TORCH.get(st) != sdm.properties.dtype or shape != tuple(chunk.sizes):
                raise FormatError(f"{fqn}: stored as {st} {list(shape)}, the DCP metadata says "
                                  f"{sdm.properties.dtype} {list(chunk.sizes)}")
            out.append(Chunk(fqn, tuple(sdm.size), sdm.properties.dtype, offsets, shape, pos))
        return out


class _Planner(DefaultSavePlanner):
    """DCP's default save planner over the export's chunks instead of a state dict (its
    global plan checks, as for any save, that the chunks cover every tensor exactly once)."""

    def __init__(self, chunks: list[Chunk], src: Collector, planner_data: dict) -> None:
        super().__init__()
        self._planner_data = planner_data
        self._chunks = {MetadataIndex(c.fqn, None if c.is_value else torch.Size(c.offsets)): c for c in chunks}
        self._src = src

    def create_local_plan(self) -> SavePlan:
        items = []
        for index, c in self._chunks.items():
            if c.is_value:
                items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                continue
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                properties=TensorProperties(dtype=c.dtype), size=torch.Size(c.size))))
        # planner_data: each flat name's path in the nested state dict (dcp_to_torch_save rebuilds it)
        self.plan = SavePlan(items, planner_data=self._planner_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        c = self._chunks[dataclasses.replace(write_item.index, index=None)]
        if c.is_value:  # as DCP's default planner writes a non-tensor value
            buf = io.BytesIO()
            torch.save(c.value, buf)
            buf.seek(0)
            return buf
        n = prod(c.sizes) * c.dtype.itemsize
        if n == 0:
            return torch.empty(c.sizes, dtype=c.dtype)
        raw = bytearray(self._src.pread(n, c.pos))
        return torch.frombuffer(raw, dtype=torch.uint8).view(c.dtype).reshape(c.sizes)


class _BoundedWriter(dcp.FileSystemWriter):
    """Stock `FileSystemWriter` whose `write_data` writes each item as soon as it is
    resolved, with torch's own `_write_item` (the same bytes and `_StorageInfo`): torch's
    keeps every tensor of a file referenced until the file is written, which would hold the
    whole export in memory. `.metadata` is written by the stock `finish`."""

    def write_data(self, plan: SavePlan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{filesystem.DEFAULT_SUFFIX}"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = data.detach().contiguous()
                results.append(filesystem._write_item(self.transforms, stream, data, item, name,
                                                      self.serialization_format))
                del data  # the next chunk is read only after this one has been written
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut


WRITER = _BoundedWriter


def nesting(names: list[str]) -> dict[str, tuple[str, ...]]:
    """A Checkpointer's tensor names kept whole (`model.0.weight`) as DCP's flattening of
    {"model": model.state_dict()} maps them: (component, state-dict key)."""
    return {n: tuple(n.split(".", 1)) for n in names if "." in n}


def write_dcp(tmp, chunks: list[Chunk], src: Collector, planner_data: dict) -> dict:
    """Run torch's own single-process `dcp.save` into `tmp`; fsync'd (FileSystemWriter's
    sync_files). `planner_data`: the flat names' paths in the nested state dict."""
    if not chunks:
        raise FormatError("nothing to export")
    writer = WRITER(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1)
    dcp.save({}, storage_writer=writer, planner=_Planner(chunks, src, planner_data), no_dist=True)
    names = sorted(p.name for p in tmp.iterdir() if not p.name.startswith(".scratch"))
    tensors = {c.fqn for c in chunks if not c.is_value}
    return {"files": [{"name": n, "size": (tmp / n).stat().st_size} for n in names],
            "tensors": len(tensors), "values": sum(c.is_value for c in chunks), "chunks": len(chunks) -
            sum(c.is_value for c in chunks),
            "total_size": sum(prod(c.sizes) * c.dtype.itemsize for c in chunks if not c.is_value)}
