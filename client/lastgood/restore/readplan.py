"""The read plan of a restore at another world size: each rank reads only what it needs.

Read by whole files (the whole-file hash the only check), each rank at 1,024 -> 1,000 ranks
would read ~1,000 times what it restores. So, when every file's index object carries range
digests (ranges.py), a rank reads:

  1. the header (its segment, verified) of its source file and of each old file that may
     hold part of its new shards, as the root says (layout.py; every old file when the
     root does not say): the stored state, with every DTensor shard's global offset;
  2. for each DTensor shard of its new sharding, the rows of each stored shard that
     overlap it (DCP's planner, sharding.ShardIndex.read_items), as one byte range;
  3. the replicated state (every tensor that is not a DTensor shard) from one source,
     old rank min(rank, old world - 1), as at the saving world size;

each range read whole-segment by whole-segment through a bounded window and checked
against its digest before a byte of it is kept (RangeReader). A mismatch is
CorruptCheckpoint, which makes the checkpoint unusable on every rank and falls back, as
any damage does (docs/recovery.md). What is kept is exactly the new shards' bytes and the
replicated state; while reading, one request's buffer and the window buffer (each at most
max(WINDOW, block)) and each kept file's header and compact digests (dropped once its
ranges are read). docs/resharding.md, "Memory".

Structure: fetch() chooses and opens the files (_needed, _open), plan_reads() decides,
given the opened files, every range to read (the one place), RangedFile.read_planned()
reads them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lastgood.wire import layout
from lastgood.state.codec import ShardRef, _is_dtensor, decode
from lastgood.state.dtypes import ST_TO_TORCH
from lastgood.errors import CorruptCheckpoint, FormatError
from lastgood.wire.format import DTYPE_SIZES, header_length, parse_header, sibling_tensors
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry, IndexMismatch, Manifest
from lastgood.wire.ranges import RangeDigests
from lastgood.wire.format import is_sibling
from lastgood.state.sharding import ShardIndex, read_header
from lastgood.state.buffers import array_from_buffer, tensor_from_buffer

WINDOW = 16 * 1024 * 1024  # the most bytes one request brings in beyond what is kept


class RangeReader:
    """Verified byte ranges of one checkpoint's files. A range is read as the segments
    that cover it, in requests of at most one window; bytes that are all kept go straight
    into the destination, the rest through the one window buffer."""

    def __init__(self, transport, checkpoint_id: int, window: int = WINDOW) -> None:
        self.transport = transport
        self.checkpoint_id = checkpoint_id
        self.window = window
        self._buf = bytearray()

    def _scratch(self, n: int) -> memoryview:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]

    def read(self, rank: int, entry: FileEntry, digests: RangeDigests, a: int, b: int, out) -> None:
        """Bytes [a, b) of the file into `out` (b - a bytes), every covering segment checked."""
        out = memoryview(out).cast("B")
        groups, cur = [], []
        for seg, want in digests.covering(a, b):
            if cur and seg.end - cur[0][0].start > self.window:
                groups.append(cur)
                cur = []
            cur.append((seg, want))
        if cur:
            groups.append(cur)
        for group in groups:
            s0, s1 = group[0][0].start, group[-1][0].end
            direct = a <= s0 and s1 <= b
            buf = out[s0 - a:s1 - a] if direct else self._scratch(s1 - s0)
            self.transport.read_range(self.checkpoint_id, rank, entry.name, s0, buf)
            for seg, want in group:
                got = hash_bytes(buf[seg.start - s0:seg.end - s0])
                if got != want:
                    what = "header" if not seg.name else f"tensor {seg.name!r}"
                    raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} rank {rank} file {entry.name}: bytes "
                                            f"[{seg.start}, {seg.end}) ({what}) hash to {got}, the commit "
                                            f"recorded {want}")
            if not direct:
                lo, hi = max(a, s0), min(b, s1)
                out[lo - a:hi - a] = buf[lo - s0:hi - s0]


class RangedFile:
    """One old rank's file of which only the header and the planned ranges were read;
    restore uses it as it uses a whole sharding.StoredFile (piece, resolve, array)."""

    def __init__(self, rank: int, entry: FileEntry, reader: RangeReader, further: bool = False) -> None:
        """`further`: one of the files a rank's state was split into beyond its first
        (state/split.py), which holds tensors only; its rank's state is in the first."""
        self.rank, self._reader = rank, reader
        self.digests: RangeDigests | None = RangeDigests(entry.data_start, entry.tensors, entry.digests)
        self.entry = replace(entry, digests=None)  # the compact RangeDigests replace the index object's hex
        head = bytearray(entry.data_start)
        reader.read(rank, entry, self.digests, 0, entry.data_start, head)
        if further:
            self.tensors, _ = parse_header(memoryview(head), file_size=entry.size)
            self.start, self.state, self.siblings = header_length(head), {}, []
        else:
            self.tensors, self.start, self.state, meta = read_header(memoryview(head), entry.size)
            self.siblings = sibling_tensors(meta)
        if self.start != entry.data_start:
            raise FormatError(f"rank {rank} file {entry.name}: the header says the data start at {self.start}, "
                              f"the tensor index at {entry.data_start}")
        self._pieces: dict[tuple, torch.Tensor] = {}
        self._whole: dict[str, tuple[memoryview, dict]] = {}
        self._wants: list[tuple[int, int, object]] = []  # (a, b, place(buf, a)): read by read_planned()

    @property
    def header_bytes(self) -> int:
        return self.start

    @property
    def index_bytes(self) -> int:
        return self.entry.index["size"]

    def want_piece(self, name: str, offsets, lengths) -> int:
        """Plan to read the stored rows that hold the part (`offsets`, `lengths`) of tensor
        `name`; its bytes (the part's own, when only rows are cut, as FSDP2 cuts)."""
        key = (name, tuple(offsets), tuple(lengths))
        if key in self._pieces:
            return 0
        spec = self.tensors[name]
        shape, dtype = list(spec["shape"]), ST_TO_TORCH[spec["dtype"]]
        base = self.start + spec["data_offsets"][0]
        if not shape:  # a 0-d shard: the whole value
            rows, first, count = [], 0, 1
            row = DTYPE_SIZES[spec["dtype"]]
        else:
            rows, first, count = shape[1:], int(offsets[0]), int(lengths[0])
            row = DTYPE_SIZES[spec["dtype"]] * math.prod(rows)
        lo, hi = base + first * row, base + (first + count) * row

        def place(buf: torch.Tensor, at: int) -> None:
            t = buf[lo - at:hi - at].view(dtype)
            t = t.view(count, *rows) if shape else t.view(())
            for dim in range(1, len(shape)):
                t = t.narrow(dim, int(offsets[dim]), int(lengths[dim]))
            self._pieces[key] = t

        self._pieces[key] = None  # planned
        self._wants.append((lo, hi, place))
        return hi - lo

    def want_whole(self, names) -> int:
        """Plan to read these tensors whole; their bytes."""
        total = 0
        for n in names:
            a, b = self.tensors[n]["data_offsets"]
            lo, hi = self.start + a, self.start + b

            def place(buf: torch.Tensor, at: int, n=n, lo=lo, hi=hi) -> None:
                self._whole[n] = (buf.numpy(), {**self.tensors[n], "data_offsets": [lo - at, hi - at]})

            self._wants.append((lo, hi, place))
            total += hi - lo
        return total

    def read_planned(self) -> None:
        """Read every planned range, then drop this file's digests (a rank would otherwise
        hold every old file's until apply). Ranges whose covering segments touch or overlap
        are read as one request of at most one window (the bytes between them would be read
        for the rounding anyway), so a rank that takes whole stored shards reads each old
        file in a few requests. Unless every byte of such a request is kept, each range is
        then copied out into a buffer of its own size and the request's buffer freed, so
        what is kept is exactly the planned bytes, however small the pieces and however
        many of them touch."""
        wants = sorted((w for w in self._wants if w[1] > w[0]), key=lambda w: w[0])
        for w in self._wants:
            if w[1] == w[0]:
                w[2](torch.empty(0, dtype=torch.uint8), w[0])
        window = self._reader.window
        cov = self.digests.covering if wants else None
        i = 0
        while i < len(wants):
            a, b = wants[i][0], wants[i][1]
            j = i + 1
            while (j < len(wants) and max(b, wants[j][1]) - a <= window
                   and cov(wants[j][0], wants[j][0] + 1)[0][0].start <= cov(b - 1, b)[-1][0].end):
                b = max(b, wants[j][1])
                j += 1
            buf = torch.empty(b - a, dtype=torch.uint8)  # uninitialised: every byte is read
            self._reader.read(self.rank, self.entry, self.digests, a, b, buf.numpy())
            covered, end = 0, a
            for lo, hi, _ in wants[i:j]:  # sorted by lo: the bytes of the union of the ranges
                covered += max(0, hi - max(lo, end))
                end = max(end, hi)
            if covered == b - a:  # every byte is kept (adjacent whole tensors): views, no copy
                for lo, _, place in wants[i:j]:
                    place(buf, a)
            else:
                for lo, hi, place in wants[i:j]:
                    place(buf[lo - a:hi - a].clone(), lo)
            del buf
            i = j
        self._wants = []
        self.digests = None

    def piece(self, name: str, offsets, lengths) -> torch.Tensor:
        t = self._pieces.get((name, tuple(offsets), tuple(lengths)))
        if t is None:
            raise LastgoodPlanError(f"rank {self.rank}: part {offsets}+{lengths} of {name!r} was not planned")
        return t

    def resolve(self, name: str, device: str | None, copy: bool) -> torch.Tensor:
        buf, spec = self._whole[name]
        return tensor_from_buffer(buf, spec, 0, device, copy=copy)

    def array(self, name: str):
        buf, spec = self._whole[name]
        return array_from_buffer(buf, spec, 0)


class RangedRank:
    """One old rank whose state was split into several files (state/split.py), read by
    ranges like one file: the first file's state, every file's tensors; each range is
    planned on, and each tensor served from, the file that holds it. The further files
    must hold exactly the tensors the first names for them, as a whole read checks."""

    def __init__(self, first: RangedFile, others: list[RangedFile]) -> None:
        cid = first._reader.checkpoint_id
        if len(first.siblings) != len(others):
            raise CorruptCheckpoint(f"checkpoint {cid} rank {first.rank}: {first.entry.name} names "
                                    f"{len(first.siblings)} further files, the checkpoint holds {len(others)}")
        self.rank, self.state, self.files = first.rank, first.state, [first, *others]
        self.tensors: dict[str, dict] = dict(first.tensors)
        self._of: dict[str, RangedFile] = dict.fromkeys(first.tensors, first)
        for names, f in zip(first.siblings, others):
            if sorted(f.tensors) != sorted(names) or any(n in self.tensors for n in names):
                raise FormatError(f"rank {first.rank}: {f.entry.name} does not hold the tensors "
                                  f"{first.entry.name} names for it")
            self.tensors.update(f.tensors)
            self._of.update(dict.fromkeys(f.tensors, f))

    @property
    def header_bytes(self) -> int:
        return sum(f.header_bytes for f in self.files)

    @property
    def index_bytes(self) -> int:
        return sum(f.index_bytes for f in self.files)

    def want_piece(self, name: str, offsets, lengths) -> int:
        return self._of[name].want_piece(name, offsets, lengths)

    def want_whole(self, names) -> int:
        return sum(self._of[n].want_whole([n]) for n in names)

    def read_planned(self) -> None:
        for f in self.files:
            f.read_planned()

    def piece(self, name: str, offsets, lengths) -> torch.Tensor:
        f = self._of.get(name)
        if f is None:
            raise LastgoodPlanError(f"rank {self.rank}: {name!r} was not planned")
        return f.piece(name, offsets, lengths)

    def resolve(self, name: str, device: str | None, copy: bool) -> torch.Tensor:
        return self._of[name].resolve(name, device, copy)

    def array(self, name: str):
        return self._of[name].array(name)


class LastgoodPlanError(RuntimeError):
    """Restore asked for a part the plan did not read: a bug here, never the checkpoint's."""


def _refs(saved, target, out: list) -> None:
    """The (ShardRef, live DTensor) pairs of a decoded saved state beside the live one:
    the walk of sharding.fill_tree, recording instead of filling."""
    if isinstance(saved, ShardRef):
        if _is_dtensor(target):  # otherwise apply says what is wrong
            out.append((saved, target))
    elif isinstance(saved, dict):
        tgt = target if isinstance(target, dict) else {}
        for k, v in saved.items():
            _refs(v, tgt.get(k), out)
    elif isinstance(saved, list):
        tgt = target if isinstance(target, list) else []
        for i, v in enumerate(saved):
            _refs(v, tgt[i] if i < len(tgt) else None, out)


def fetch(transport, state, manifest: Manifest, rank: int, file_name) -> tuple[list, int, dict] | None:
    """Plan and read this rank's part of a checkpoint saved at another world size:
    (files read from, source rank, counts), or None when a file it needs has no range
    digests (written before them: the caller reads whole files).

    Which old files: the source (the replicated state, and the stored state's tree), then
    only those whose root entry says they may hold part of a new shard of this rank
    (layout.py), or every one when a root entry has no such summary (written before it)."""
    cid, old_world = manifest.checkpoint_id, manifest.world_size
    reader = RangeReader(transport, cid)
    entries = [_entry(manifest, r, file_name(r)) for r in range(old_world)]
    if any(e.index is None for e in entries):
        return None
    opened: dict[int, RangedFile | RangedRank] = {}
    try:
        src = min(rank, old_world - 1)
        source = opened[src] = _open(transport, src, entries[src], reader, manifest)
        if source is None:
            return None
        pairs = _pairs(source.state, state)
        if pairs is None:
            return None  # a factored moment, or a model that does not match: whole files, apply() says which
        for r in _needed(entries, pairs):
            if r not in opened:
                opened[r] = _open(transport, r, entries[r], reader, manifest)
                if opened[r] is None:
                    return None
    except IndexMismatch as e:
        raise CorruptCheckpoint(f"checkpoint {cid}: {e}") from None
    files = [opened[r] for r in sorted(opened)]
    counts = plan_reads(files, source, pairs)
    counts.update(header_bytes=sum(f.header_bytes for f in files), index_bytes=sum(f.index_bytes for f in files),
                  old_files_read=len(files), window=reader.window)
    for f in files:
        f.read_planned()
    return files, source.rank, counts


def plan_reads(files: list, source, pairs: list) -> dict:
    """Plan on each stored file the byte ranges this rank needs (read by read_planned):
    for each (stored ShardRef, live DTensor) pair, the rows of every stored shard that
    overlap the live local shard (DCP's planner, ShardIndex.read_items), and the
    replicated state (every tensor that is not a DTensor shard) from `source`. The one
    place that decides what is read; its counts. A live shard the kept files do not cover
    whole, exactly once, is CorruptCheckpoint now (read_items says so), before the ranks
    agree, not a failure in apply."""
    index = ShardIndex(files)
    counts = {"pieces": 0, "piece_bytes": 0, "replicated_bytes": 0, "tensors_per_file": len(source.tensors)}
    for ref, target in pairs:
        for f, item in index.read_items(ref, target):
            counts["piece_bytes"] += f.want_piece(ref.name, item.storage_offsets, item.lengths)
            counts["pieces"] += 1
    counts["replicated_bytes"] = source.want_whole([n for n in source.tensors if n not in index.chunks])
    return counts


def _pairs(saved_state: dict, state) -> list | None:
    """(ShardRef, live DTensor) of every stored shard of the live sharded components; None
    when a stored tensor's global shape is not its live parameter's."""
    saved = saved_state.get("components", {})
    out: list = []
    for name, live in state.sharded_live().items():
        if name not in saved:
            continue  # apply() names what does not match
        pairs: list = []
        _refs(decode(saved[name]["state"], lambda n, d: None, lambda n: None), live, pairs)
        if any(tuple(target.shape) != ref.shape for ref, target in pairs):
            return None
        out.extend(pairs)
    return out


def _needed(entries: list[FileEntry], pairs: list) -> list[int]:
    """The old ranks whose files may hold part of a live shard: by each root entry's
    summary (layout.overlaps, a superset), or every old rank when one has none."""
    chunks = [layout.checked(e.index.get("chunks")) for e in entries]
    if any(c is None for c in chunks):  # none, or malformed (a service bug, a later form)
        return list(range(len(entries)))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    regions = set()
    for ref, target in pairs:
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        regions.add((tuple(ref.shape), tuple(offset), tuple(shape)))
    return [r for r, c in enumerate(chunks) if any(layout.overlaps(c, *reg) for reg in regions)]


def _entry(manifest: Manifest, r: int, name: str) -> FileEntry:
    entry = next((f for f in manifest.files(r) if f.name == name), None)
    if entry is None:
        raise CorruptCheckpoint(f"checkpoint {manifest.checkpoint_id} has no file {name} for rank {r}")
    return entry


def _open(transport, r: int, entry: FileEntry, reader: RangeReader,
          manifest: Manifest | None = None) -> RangedFile | RangedRank | None:
    """Old rank r's file from its index object (checked against the root, parsed here:
    only its compact RangeDigests is kept) and its header (read, verified, and checked
    against the root's summary of where its shards lie: no shard it leaves out); with the
    further files its state was split into, if any (state/split.py), each opened the same
    way, as one RangedRank (`manifest` lists them; a file that names further files without
    one is damage); None if a file has no digests."""
    first = _ranged(transport, r, entry, reader, False)
    if first is None:
        return None
    f: RangedFile | RangedRank = first
    if first.siblings:
        others = []
        listed = manifest.files(r) if manifest is not None else []
        for e in sorted((e for e in listed if is_sibling(entry.name, e.name)), key=lambda e: e.name):
            other = _ranged(transport, r, e, reader, True)
            if other is None:
                return None
            others.append(other)
        f = RangedRank(first, others)
    want = layout.checked(first.entry.index.get("chunks"))
    if want is not None and not layout.within(f.state, f.tensors, want):  # not equality: layout.within
        raise CorruptCheckpoint(f"checkpoint {reader.checkpoint_id} rank {r} file {entry.name}: its header's "
                                f"shards are not where the root says")
    return f


def _ranged(transport, r: int, entry: FileEntry, reader: RangeReader, further: bool) -> RangedFile | None:
    entry = entry.with_index(r, transport.index_bytes(reader.checkpoint_id, r, entry.name))
    if entry.digests is None:
        return None
    return RangedFile(r, entry, reader, further)
