"""The reading side of an export: each rank file read once, verified, its model tensors kept.

A manifest hashes whole files, so a byte can only be trusted once the file it is in has
been read to its end and hashed. Each file therefore streams through the hasher once
(cli/download.read_verified); as it passes, the byte ranges of the model tensors that are
still needed are written into a scratch file, and nothing in the scratch file is used
before its file has verified. Memory stays at one network chunk plus the file's header;
the scratch file holds each model byte once (a replicated tensor is taken from the first
rank that has it, a DTensor shard once per distinct offset), and assembling and writing
read it back in bounded blocks (hf.py).

Which tensors are the model's comes from each file's state document, not from tensor
names: the refs (`__tensor__`, `__dtensor__`) in the state of every module component
(kind `module` or `sharded_module`), each under its state-dict key, prefixed with the
component's name (`model.` + `layers.0.self_attn.q_proj.weight`). Those under `prefix`
are exported; optimizer state, RNGs and everything else are skipped.

A file is read only if the manifest's tensor index says it holds a tensor that is still
missing, or one no state read so far has named: a DDP checkpoint is read from the ranks
that own its weights (each written once, replicas.py; a rank's `__replica__` refs name
nothing here), or from rank 0 alone when every rank holds them all; an FSDP2 one from
every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import prod

from lastgood.errors import FormatError
from lastgood.wire.format import META_STATE, REPLICA_REF, header_length, parse_header, parse_state, sibling_tensors
from lastgood.wire.format import sibling_name
from lastgood.wire.manifest import FileEntry

MODULE_KINDS = ("module", "sharded_module")


@dataclass
class Piece:
    """One stored block of a tensor: where it starts in the full tensor, its shape, and
    where its bytes are in the scratch file."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    pos: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass
class Tensor:
    """A model tensor of the checkpoint, as the training state named it."""

    key: str                      # e.g. model.layers.0.self_attn.q_proj.weight
    dtype: str                    # safetensors dtype, as stored
    shape: tuple[int, ...]        # the full (global) shape
    sharded: bool                 # a DTensor: pieces from several ranks
    pieces: list[Piece] = field(default_factory=list)
    covered: int = 0              # elements in pieces
    seen: set = field(default_factory=set)  # (offset, shape) of the pieces

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def complete(self) -> bool:
        return self.covered >= self.numel


def _refs(node, path: str) -> Iterable[tuple[str, dict]]:
    """(state-dict key path, tensor ref) for every tensor in a module's encoded state."""
    if isinstance(node, dict):
        if "__tensor__" in node or "__dtensor__" in node or REPLICA_REF in node:
            yield path, node
            return
        if any(k.startswith("__") and k.endswith("__") for k in node):  # tuples, int-keyed dicts, ...
            return
        for k, v in node.items():
            yield from _refs(v, f"{path}.{k}")


def _dims(value, n: int | None, what: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or (n is not None and len(value) != n)
            or not all(type(d) is int and d >= 0 for d in value)):
        raise FormatError(f"{what} is not a list of {n if n is not None else ''} sizes: {str(value)[:200]}")
    return tuple(value)


class Collector:
    """Reads rank files one at a time and keeps what the export needs of them."""

    def __init__(self, prefix: str, scratch_path: str) -> None:
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}   # key -> tensor, in the order the state lists them
        self._selected: dict[str, str] = {}    # stored tensor name -> key
        self._other: set[str] = set()          # stored names that are not exported
        self.replicas: dict[str, tuple] = {}   # key -> (owner rank, stored name): written once by another rank
        self.components: dict[str, str] = {}   # component name -> kind (for messages)
        self.extra = None                      # the first file's encoded `extra`
        self.files_read: list[tuple[int, str, int]] = []
        self.bytes_read = 0
        self._pending: dict[tuple[int, str], list] = {}  # a rank's further file -> its plan (state/split.py)
        self.entries: dict[tuple[int, str], FileEntry] = {}  # (rank, name) -> manifest entry, with its tensors
        self._fd = os.open(scratch_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._end = 0

    def close(self) -> None:
        os.close(self._fd)

    def pread(self, n: int, pos: int) -> bytes:
        data = os.pread(self._fd, n, pos)
        if len(data) != n:
            raise OSError(f"the export's scratch file is {pos + len(data)} bytes, expected at least {pos + n}")
        return data

    def _pwrite(self, view: memoryview, pos: int) -> None:
        while view:  # a regular file may take less than asked (a full disk raises on the next call)
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def wants(self, entry: FileEntry) -> bool:
        """Does this file hold a tensor still missing, or one no state read so far named, or
        is it a further file of a rank with tensors planned already (state/split.py)?"""
        if any(name == entry.name for _, name in self._pending):
            return True
        for name in entry.tensors or ():
            key = self._selected.get(name)
            if key is None and name not in self._other:
                return True
            if key is not None and not self.tensors[key].complete:
                return True
        return False

    def read(self, chunks: Iterable[bytes], rank: int, entry: FileEntry) -> None:
        """Consume one file's verified stream (`chunks` raises at its end unless the bytes
        match the manifest). A header or state that does not parse is reported only after
        the stream has verified: corrupt bytes are a verification failure, not a format
        error."""
        head = bytearray()
        plan: list[tuple[int, int, int]] | None = None  # (file start, file end, scratch pos), sorted
        error: Exception | None = None
        at, i = 0, 0  # file position of `data`; first plan entry that may still overlap it
        for chunk in chunks:
            self.bytes_read += len(chunk)
            data, at_data = chunk, at
            at += len(chunk)
            if plan is None and error is None:
                head += chunk
                try:
                    if len(head) >= 8 and len(head) >= header_length(head):
                        plan = self._plan(bytes(head[:header_length(head)]), rank, entry)
                        data, at_data = bytes(head), 0  # everything received so far
                        head = bytearray()
                except FormatError as e:  # reported once the stream has verified (or not)
                    error, head = e, bytearray()
            if plan is None:
                continue
            end = at_data + len(data)
            while i < len(plan) and plan[i][1] <= at_data:
                i += 1
            j = i
            while j < len(plan) and plan[j][0] < end:
                a, b, pos = plan[j]
                lo, hi = max(a, at_data), min(b, end)
                self._pwrite(memoryview(data)[lo - at_data:hi - at_data], pos + lo - a)
                j += 1
        if error is not None:
            raise FormatError(f"rank {rank} file {entry.name}: {error}")
        if plan is None:
            raise FormatError(f"rank {rank} file {entry.name}: shorter than its safetensors header")
        self.files_read.append((rank, entry.name, entry.size))

    def _plan(self, head: bytes, rank: int, entry: FileEntry) -> list[tuple[int, int, int]]:
        """From a file's header: which of its byte ranges go where in the scratch file."""
        tensors, meta = parse_header(head, file_size=entry.size)
        if META_STATE not in meta and (rank, entry.name) in self._pending:
            # a further file of a rank split into several (state/split.py): planned with its first
            if len(head) != entry.data_start:
                raise FormatError(f"its header is {len(head)} bytes, its index says {entry.data_start}")
            return sorted(self._pending.pop((rank, entry.name)))
        state = parse_state(meta, tensors)
        outside = {n: sibling_name(entry.name, i) for i, names in enumerate(sibling_tensors(meta), 1) for n in names}
        components = state.get("components")
        if not isinstance(components, dict):
            raise FormatError("saved through lastgood.dcp, not as a TrainState" if "dcp_values" in state
                              else "the state document has no components")
        if self.extra is None:
            self.extra = state.get("extra")
        start = len(head)
        plan, chosen = [], set()
        for cname, comp in components.items():
            kind = comp.get("kind") if isinstance(comp, dict) else None
            self.components.setdefault(cname, str(kind))
            if kind not in MODULE_KINDS:
                continue
            for key, ref in _refs(comp.get("state"), cname):
                if not key.startswith(self.prefix):
                    continue
                if REPLICA_REF in ref:  # in its owner's file, read for it (wants); missing(): it was not there
                    self.replicas.setdefault(key, (ref.get("rank"), ref[REPLICA_REF]))
                    continue
                stored = ref.get("__tensor__", ref.get("__dtensor__"))
                # parse_state checked that every ref names a tensor of the file or of the rank's others
                spec, at, into = tensors.get(stored), start, plan
                if spec is None:
                    spec, at, into = self._elsewhere(rank, outside[stored], stored)
                chosen.add(stored)
                piece = self._piece(key, stored, ref, spec, rank)
                if piece is not None:
                    a, b = spec["data_offsets"]
                    into.append((at + a, at + b, piece.pos))
        self._other.update(n for n in [*tensors, *outside] if n not in chosen)
        return sorted(plan)

    def missing(self) -> list[str]:
        """After every file wanted was read: the model tensors a rank names as written once by
        another rank (replicas.py) that no file read held: a damaged checkpoint."""
        return [f"{key} (rank {str(owner)[:20]}'s {str(name)[:200]!r})"
                for key, (owner, name) in self.replicas.items() if key not in self.tensors]

    def _elsewhere(self, rank: int, name: str, stored: str) -> tuple[dict, int, list]:
        """(spec, data start, plan) of a tensor in a further file of the rank, from its index."""
        e = self.entries.get((rank, name))
        if e is None or e.tensors is None or stored not in e.tensors or e.data_start is None:
            raise FormatError(f"tensor {stored!r} is in the rank's file {name}, which the checkpoint does not "
                              f"index")
        t = e.tensors[stored]
        return ({"dtype": t["dtype"], "shape": t["shape"], "data_offsets": t["offsets"]}, e.data_start,
                self._pending.setdefault((rank, name), []))

    def _piece(self, key: str, stored: str, ref: dict, spec: dict, rank: int) -> Piece | None:
        """Record one stored block of tensor `key`; None if it is not needed (a replica of
        a block taken already, or empty)."""
        local = tuple(spec["shape"])
        sharded = "__dtensor__" in ref
        if sharded:
            shape = _dims(ref.get("shape"), len(local), f"{key}: the DTensor's global shape")
            offset = _dims(ref.get("offset"), len(local), f"{key}: the shard's offset")
            if any(o + n > s for o, n, s in zip(offset, local, shape)):
                raise FormatError(f"{key}: rank {rank}'s shard {list(local)} at {list(offset)} lies outside the "
                                  f"global shape {list(shape)}")
        else:
            shape, offset = local, (0,) * len(local)
        t = self.tensors.get(key)
        if t is None:
            t = self.tensors[key] = Tensor(key, spec["dtype"], shape, sharded)
        elif (t.dtype, t.shape, t.sharded) != (spec["dtype"], shape, sharded):
            raise FormatError(f"{key}: rank {rank} stores it as {spec['dtype']} {list(shape)}"
                              f"{' sharded' if sharded else ''}, an earlier rank as {t.dtype} {list(t.shape)}"
                              f"{' sharded' if t.sharded else ''}")
        self._selected[stored] = key
        if prod(local) == 0 or t.complete or (offset, local) in t.seen:
            return None
        piece = Piece(offset, local, self._end)
        self._end += spec["data_offsets"][1] - spec["data_offsets"][0]
        t.pieces.append(piece)
        t.seen.add((offset, local))
        t.covered += piece.numel
        return piece
