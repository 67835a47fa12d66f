"""The manifest: the one document that makes a checkpoint complete.

The service writes it (canonical JSON, so the same checkpoint always yields the same
bytes) before the commit transaction; clients read it to find and verify every file.

Two layouts (docs/architecture.md, "Checkpoint metadata"):
  lastgood.manifest/1  monolithic: every file of every rank with its full tensor index.
                       At 1,024 ranks that is hundreds of MB, which every restoring rank
                       fetched; still read everywhere, no longer written.
  lastgood.manifest/2  a root of O(ranks): every file's name, size and xxh3-128, and for a
                       safetensors file a reference (xxh3-128, size, tensor count) to its
                       tensor index, which is an object of its own ("lastgood.index/1",
                       written by the service when the file is uploaded). A reader that
                       needs a file's tensors fetches that object and checks it against
                       the root's hash (FileEntry.with_index): the root's hash is checked
                       by the service, so the chain is whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from lastgood.wire import names
from lastgood.wire.hashing import HEX_LEN, hash_bytes, is_valid_hex

FORMAT = "lastgood.manifest/1"       # monolithic
FORMAT_ROOT = "lastgood.manifest/2"  # root + per-file index objects
INDEX_FORMAT = "lastgood.index/1"
# Where an index object keeps its range digests (ranges.py): digests by the per-tensor block
# rule (they name a "split") under RANGE_DIGESTS; digests by one block for every tensor under
# FIXED_DIGESTS, which stores also hold. A reader that knows only FIXED_DIGESTS reads a file
# with RANGE_DIGESTS whole instead of finding a segment-count mismatch and taking the
# checkpoint for damaged. Readers take RANGE_DIGESTS, else FIXED_DIGESTS (ranges.Blocks.read
# tells the two forms apart by "split"). The one place of this rule (docs/format.md).
RANGE_DIGESTS = "range_digests"
FIXED_DIGESTS = "digests"
_VERSIONS = {FORMAT: 1, FORMAT_ROOT: 2}


class IndexMismatch(ValueError):
    """A tensor index object that does not match the root's reference: a damaged object."""


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


class ManifestError(ValueError):
    """A manifest that does not parse, or holds a value outside the wire's bounds."""


def _bounded(d: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = d[key] if default is None else (d.get(key) or default)
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here, nor is 1.0
        raise ManifestError(f"manifest member {key!r} is {repr(value)[:40]}, not an integer in {lo}..{hi}")
    return value


def _list(d: dict, key: str) -> list:
    value = d[key]
    if not isinstance(value, list):
        raise ManifestError(f"manifest member {key!r} is not a list")
    return value


def _hex(d: dict, key: str) -> str:
    value = d[key]
    if not is_valid_hex(value):
        raise ManifestError(f"manifest member {key!r} is {str(value)[:40]!r}, not {HEX_LEN} lowercase hex digits")
    return value


def _file_entry(f: dict, version: int) -> FileEntry:
    if not isinstance(f, dict):
        raise ManifestError("a file entry is a JSON object")
    index = f.get("index") if version == 2 else None
    if index is not None:
        if not isinstance(index, dict):
            raise ManifestError("a file's index reference is a JSON object")
        _hex(index, "xxh3_128")
        _bounded(index, "size", 0, names.MAX_ID)
        _bounded(index, "tensors", 0, names.MAX_ID)
    data_start, tensors = f.get("data_start"), f.get("tensors")
    if data_start is not None:
        _bounded(f, "data_start", 0, names.MAX_ID)
    if tensors is not None and not isinstance(tensors, dict):
        raise ManifestError("a file's tensors are a JSON object")
    return FileEntry(names.check_file_name(f["name"]), _bounded(f, "size", 0, names.MAX_ID), _hex(f, "xxh3_128"),
                     data_start, tensors, index)


def index_bytes(rank: int, file_name: str, data_start: int, tensors: dict, digests: dict | None = None) -> bytes:
    """The tensor index object of one safetensors file (canonical JSON). `digests`: its
    range digests (ranges.py), absent in objects written before them; under the key their
    form calls for (RANGE_DIGESTS)."""
    key = RANGE_DIGESTS if digests is not None and "split" in digests else FIXED_DIGESTS
    return _canonical({"format": INDEX_FORMAT, "rank": rank, "file": file_name, "data_start": data_start,
                       "tensors": tensors, **({key: digests} if digests is not None else {})})


def index_ref(body: bytes, tensors: int, chunks: dict | None = None) -> dict:
    """What the root says of an index object: enough to fetch it and to check it, and,
    when given, `chunks`: where the file's DTensor shards lie (layout.py), so that a
    restore at another world size fetches only the index objects of the files it needs."""
    return {"xxh3_128": hash_bytes(body), "size": len(body), "tensors": tensors,
            **({"chunks": chunks} if chunks is not None else {})}


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh3_128: str
    data_start: int | None = None           # safetensors data section start, when indexed
    tensors: dict[str, dict] | None = None  # name -> {dtype, shape, offsets}; in a /2 root: once fetched
    index: dict | None = None               # /2: {xxh3_128, size, tensors} of the index object
    digests: dict | None = None             # range digests (ranges.py), from the index object, if it has them

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "size": self.size, "xxh3_128": self.xxh3_128}
        if self.index is not None:
            d["index"] = self.index
        if self.tensors is not None:
            d["data_start"] = self.data_start
            d["tensors"] = self.tensors
            if self.digests is not None:
                d["digests"] = self.digests
        return d

    def with_index(self, rank: int, body: bytes) -> "FileEntry":
        """This entry with its tensors, from its index object; IndexMismatch unless the
        object is exactly the one the root names."""
        ref = self.index
        if ref is None:
            raise IndexMismatch(f"rank {rank} file {self.name!r} has no tensor index")
        got = hash_bytes(body)
        if len(body) != ref["size"] or got != ref["xxh3_128"]:
            raise IndexMismatch(f"rank {rank} file {self.name!r}: the tensor index hashes to {got} "
                                f"({len(body)} bytes), the root says {ref['xxh3_128']} ({ref['size']} bytes)")
        try:
            d = json.loads(body)
            ok = (d.get("format") == INDEX_FORMAT and d.get("rank") == rank and d.get("file") == self.name)
        except ValueError:
            ok = False
        if not ok:  # the right hash over the wrong content: only a service bug gets here
            raise IndexMismatch(f"rank {rank} file {self.name!r}: the tensor index is not this file's")
        return replace(self, data_start=int(d["data_start"]), tensors=d["tensors"],
                       digests=d.get(RANGE_DIGESTS, d.get(FIXED_DIGESTS)))


@dataclass(frozen=True)
class Manifest:
    checkpoint_id: int
    run: str
    step: int
    attempt: str
    world_size: int
    parent_id: int | None
    ranks: dict[int, list[FileEntry]] = field(default_factory=dict)
    # the launch generation that committed it (0: a client that never registered). Written
    # only when set, so a manifest of an unfenced checkpoint keeps its bytes; a rebuild of the
    # catalog from the store reads it to fence the launches the lost catalog knew about.
    generation: int = 0
    version: int = 1  # 1: monolithic (FORMAT), 2: a root (FORMAT_ROOT)

    def files(self, rank: int) -> list[FileEntry]:
        return self.ranks.get(rank, [])

    def total_bytes(self) -> int:
        return sum(f.size for fs in self.ranks.values() for f in fs)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_ROOT if self.version == 2 else FORMAT,
            "checkpoint_id": self.checkpoint_id,
            "run": self.run,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "parent_id": self.parent_id,
            **({"generation": self.generation} if self.generation else {}),
            "ranks": [
                {"rank": r, "files": [f.to_dict() for f in sorted(self.ranks[r], key=lambda f: f.name)]}
                for r in sorted(self.ranks)
            ],
        }

    def to_bytes(self) -> bytes:
        """The committed bytes: a /2 root never carries tensors, even once they are fetched."""
        if self.version == 2:
            bare = {r: [replace(f, data_start=None, tensors=None, digests=None) for f in fs]
                    for r, fs in self.ranks.items()}
            return _canonical(replace(self, ranks=bare).to_dict())
        return _canonical(self.to_dict())

    def as_monolithic(self) -> "Manifest":
        """The /1 manifest of the same checkpoint (needs every index fetched): what the
        service wrote before /2, for tools and for tests of old checkpoints."""
        return replace(self, version=1, ranks={r: [replace(f, index=None) for f in fs]
                                               for r, fs in self.ranks.items()})

    def with_indexes(self, fetch: Callable[[int, FileEntry], bytes],
                     ranks: Iterable[int] | None = None) -> "Manifest":
        """The full view of `ranks` (default: all): every indexed file with its tensors,
        fetched with `fetch(rank, entry)` and checked against the root (IndexMismatch).
        A /1 manifest has them already."""
        want = set(self.ranks if ranks is None else ranks)
        return replace(self, ranks={
            r: [f.with_index(r, fetch(r, f)) if r in want and f.index is not None and f.tensors is None else f
                for f in fs]
            for r, fs in self.ranks.items()})

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """The manifest `d` describes; ManifestError (a ValueError) unless every member is of
        its type and within the wire's bounds (names.py): ids, steps, sizes and generations
        in 0..MAX_ID, ranks below the world size, names by their rules, hashes as hex. A
        manifest read from the store is untrusted input to `rebuild` (docs/format.md §6)."""
        try:
            return cls._from_dict(d)
        except ManifestError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ManifestError(f"not a valid manifest: {type(e).__name__}: {str(e)[:200]}") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError("a manifest is a JSON object")
        version = _VERSIONS.get(d.get("format"))
        if version is None:
            raise ManifestError(f"unknown manifest format {str(d.get('format'))[:40]!r}")
        world_size = _bounded(d, "world_size", 1, names.MAX_RANK)
        ranks: dict[int, list[FileEntry]] = {}
        for r in _list(d, "ranks"):
            rank = _bounded(r, "rank", 0, world_size - 1)
            if rank in ranks:
                raise ManifestError(f"rank {rank} is listed twice")
            files = [_file_entry(f, version) for f in _list(r, "files")]
            if len({f.name for f in files}) != len(files):
                raise ManifestError(f"rank {rank} lists a file twice")
            ranks[rank] = files
        parent = d.get("parent_id")
        return cls(_bounded(d, "checkpoint_id", 1, names.MAX_ID), names.check_run_name(d["run"]),
                   _bounded(d, "step", 0, names.MAX_ID), names.check_attempt(d["attempt"]), world_size,
                   None if parent is None else _bounded(d, "parent_id", 1, names.MAX_ID), ranks,
                   _bounded(d, "generation", 0, names.MAX_ID, default=0), version)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        return cls.from_dict(json.loads(data))
