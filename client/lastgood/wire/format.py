"""The shard file format: a plain safetensors file, laid out for zero-copy staging.

Layout: 8-byte little-endian header length N, N bytes of JSON (padded with spaces so the
data section starts 8-byte aligned), then the tensor bytes packed without holes. Tensors
are ordered by element size, largest first, so that every tensor starts at an offset
aligned to its element size: the stager can copy a tensor straight into its final place
in the file, and the reader can view it in place without a copy.

This module is torch-free: the service uses it to validate headers and build the
manifest's tensor index.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from lastgood.wire.errors import FormatError

FORMAT_VERSION = "1"
META_FORMAT = "lastgood.format"
META_STATE = "lastgood.state"
# A rank's state written as several files (state/split.py): the first holds the state
# document and, under this key, the names of the tensors each further file holds (a JSON
# list of lists, in file order), so that the state's references may name them.
META_FILES = "lastgood.files"
# Beside it, each of those tensors' shape (a JSON list of lists of shapes, parallel to
# META_FILES), so that the service can say where the rank's DTensor shards lie from the
# first file alone (layout.py); a reader checks them against the further files' own headers.
META_FILE_SHAPES = "lastgood.file_shapes"
# Bounds checked before a header is parsed or a shape multiplied out. The service parses
# the header of every shard it receives, and as Python objects JSON takes up to 30 times
# its size, so these bound the service's memory per upload (docs/security.md: the worst
# header within them). A tensor takes ~100 bytes and ~8 values of a header, plus its part
# of the JSON state: ~13,000 tensors fit in one rank's file. (safetensors allows 100 MB.)
MAX_HEADER_BYTES = 2 * 1024 * 1024
MAX_HEADER_VALUES = 2 ** 17  # JSON values, counted from the raw bytes (see _count_values)
MAX_DIMS = 64              # dimensions of one tensor
MAX_DIM = 2 ** 48          # elements along one dimension
MAX_OFFSET = 2 ** 63 - 1   # a byte offset, as int64
# The state document's nesting limit: far deeper than any state_dict (an optimizer's is
# about 10 levels), and shallow enough that decoding it never runs into Python's recursion
# limit (codec.decode takes up to two frames a level).
MAX_STATE_DEPTH = 200
# The codec's references from the state document into the tensor section (see codec.py).
TENSOR_REFS = ("__tensor__", "__dtensor__", "__ndarray__")
# A replicated tensor that another rank's file holds (replicas.py): not a tensor of this file.
REPLICA_REF = "__replica__"

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    header: bytes                    # the 8-byte length plus the padded JSON
    offsets: dict[str, tuple[int, int]]  # name -> absolute [start, end) in the file
    size: int                        # total file size

    @property
    def data_start(self) -> int:
        return len(self.header)


def plan_layout(specs: list[TensorSpec], metadata: dict[str, str]) -> Layout:
    """Order tensors for alignment, assign offsets and build the header bytes."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise FormatError("duplicate tensor names in one shard")
    for s in specs:
        if s.dtype not in DTYPE_SIZES:
            raise FormatError(f"tensor {s.name!r}: unsupported dtype {s.dtype}")
        _check_shape(s.name, list(s.shape))
        if s.name == "__metadata__":
            raise FormatError("'__metadata__' is reserved")
    ordered = sorted(specs, key=lambda s: -DTYPE_SIZES[s.dtype])  # stable
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    rel: dict[str, tuple[int, int]] = {}
    pos = 0
    for s in ordered:
        rel[s.name] = (pos, pos + s.nbytes)
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * ((-(8 + len(raw))) % 8)
    if len(raw) > MAX_HEADER_BYTES:  # refused here rather than by the service after the upload
        raise FormatError(f"the shard's safetensors header would be {len(raw)} bytes, over the "
                          f"{MAX_HEADER_BYTES}-byte limit ({len(specs)} tensors plus the state's JSON)")
    head = struct.pack("<Q", len(raw)) + raw
    start = len(head)
    return Layout(
        header=head,
        offsets={k: (start + a, start + b) for k, (a, b) in rel.items()},
        size=start + pos,
    )


def header_length(prefix: bytes | memoryview) -> int:
    """Total header size (8 + N) from the first 8 bytes of a file."""
    if len(prefix) < 8:
        raise FormatError("file shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES} limit")
    return 8 + n


def _count_values(raw: bytes) -> int:
    """An upper bound on the JSON values (and object members) in `raw`, without parsing it:
    each follows a comma or opens a container. Those inside strings count too, so it is an
    over-estimate; what json.loads builds is at most this many objects (and their keys)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def _check_shape(name: str, shape) -> None:
    """Each bound before anything is multiplied out."""
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise FormatError(f"tensor {name[:200]!r}: bad shape {_short(shape)} (at most {MAX_DIMS} dimensions "
                          f"of 0..{MAX_DIM})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text) - 200} more characters)"


def parse_header(head: bytes | memoryview, file_size: int | None = None) -> tuple[dict, dict[str, str]]:
    """Parse and validate a safetensors header.

    Returns (tensors, metadata) where tensors maps name -> {dtype, shape, data_offsets}
    with offsets relative to the data section, as in the file. Checks that every entry is
    well formed, that the sizes agree with dtype and shape, and that the tensors cover the
    data section exactly, with no holes or overlaps (as safetensors requires).
    """
    total = header_length(head)
    if len(head) < total:
        raise FormatError("truncated safetensors header")
    raw = bytes(head[8:total])
    values = _count_values(raw)
    if values > MAX_HEADER_VALUES:
        raise FormatError(f"safetensors header holds up to {values} JSON values, over the limit of "
                          f"{MAX_HEADER_VALUES}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, absurd numbers, absurd nesting
        raise FormatError(f"safetensors header is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise FormatError("safetensors header is not a JSON object")
    meta = obj.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError("__metadata__ must map strings to strings")
    spans = []
    for name, e in obj.items():
        if not isinstance(e, dict):
            raise FormatError(f"tensor {name[:200]!r}: entry is not an object")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"tensor {name[:200]!r}: unknown dtype {_short(dtype)}")
        _check_shape(name, shape)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int and 0 <= o <= MAX_OFFSET for o in offs) or offs[0] > offs[1]):
            raise FormatError(f"tensor {name[:200]!r}: bad data_offsets {_short(offs)}")
        if TensorSpec(name, dtype, tuple(shape)).nbytes != offs[1] - offs[0]:
            raise FormatError(f"tensor {name[:200]!r}: {offs[1] - offs[0]} bytes do not fit dtype {dtype} and "
                              f"shape {shape}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos = 0
    for a, b, name in spans:
        if a != pos:
            raise FormatError(f"tensor {name[:200]!r}: data section has a hole or overlap at byte {pos}")
        pos = b
    if file_size is not None and total + pos != file_size:
        raise FormatError(f"data section is {file_size - total} bytes but the tensors cover {pos}")
    return obj, meta


def tensor_index(tensors: dict) -> dict[str, dict]:
    """The manifest's tensor index: name -> dtype, shape, [start, end) relative to the data section."""
    return {
        name: {"dtype": e["dtype"], "shape": e["shape"], "offsets": e["data_offsets"]}
        for name, e in sorted(tensors.items())
    }


def parse_state(meta: dict[str, str], tensors: dict) -> dict:
    """A shard's lastgood.state document, checked before anything is decoded from it: JSON,
    an object, nested at most MAX_STATE_DEPTH deep, and every tensor reference naming a
    tensor of this file (`tensors`, as parse_header returns them).

    A committed shard can hash right and still fail here (it was uploaded that way); the
    client then treats the checkpoint as damaged, and the service's verify, which runs
    the same check, marks it CORRUPT. FormatError says what is wrong, bounded."""
    text = meta.get(META_STATE)
    if text is None:
        raise FormatError(f"no {META_STATE} in the shard's metadata")
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, or nested beyond the parser's limit
        raise FormatError(f"{META_STATE} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(state, dict):
        raise FormatError(f"{META_STATE} is not a JSON object")
    held = set(tensors).union(*sibling_tensors(meta))
    todo: list[tuple[object, int]] = [(state, 1)]  # iterative: the depth is what is checked
    while todo:
        node, depth = todo.pop()
        if depth > MAX_STATE_DEPTH:
            raise FormatError(f"{META_STATE} is nested more than {MAX_STATE_DEPTH} levels deep")
        if isinstance(node, dict):
            for tag in TENSOR_REFS:
                if tag in node and (not isinstance(node[tag], str) or node[tag] not in held):
                    raise FormatError(f"{META_STATE} refers to tensor {str(node[tag])[:200]!r}, "
                                      f"which the shard does not hold")
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return state


def replica_refs(state) -> Iterator[tuple[object, object]]:
    """(rank, name) of every replicated-tensor reference (REPLICA_REF) in a state document,
    as written: the caller checks that the rank is an int and the name a string."""
    todo: list[object] = [state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if REPLICA_REF in node:
                yield node.get("rank"), node[REPLICA_REF]
                continue
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def dangling_replicas(states: dict[int, dict], held: dict[int, set[str]], world_size: int,
                      limit: int = 10) -> list[tuple[int, str]]:
    """(rank, what) for each replicated-tensor reference (REPLICA_REF, client replicas.py) in
    a rank's state document that resolves to nothing: its rank is not an int below
    `world_size`, or that rank's files (`held`: rank -> the tensor names of all its files)
    do not hold its name. The service's verify marks such a checkpoint CORRUPT; at most
    `limit` are listed."""
    out: list[tuple[int, str]] = []
    for rank, state in sorted(states.items()):
        for owner, name in replica_refs(state):
            if len(out) >= limit:
                break
            if type(owner) is not int or not 0 <= owner < world_size:
                out.append((rank, f"a replicated tensor reference names rank {str(owner)[:50]} of {world_size}"))
            elif not isinstance(name, str) or name not in held.get(owner, ()):
                out.append((rank, f"replicated tensor {str(name)[:200]!r} is not in rank {owner}'s files"))
    return out


def shard_file_name(rank: int) -> str:
    """The first (or only) file of a rank's shard: its state document and tensors."""
    return f"rank{rank:05d}.safetensors"


# A rank's state may be split into several files (lastgood.state.split): the first keeps the
# rank's name and names the tensors of each further file (META_FILES), which are named after
# it with a three-digit index.
_FURTHER = re.compile(r".+-\d{3}\.safetensors")


def sibling_name(main: str, index: int) -> str:
    """The name of further file `index` (1, 2, ...) of the rank whose first file is `main`."""
    return f"{main.removesuffix('.safetensors')}-{index:03d}.safetensors"


def file_names(main: str, count: int) -> list[str]:
    return [main] + [sibling_name(main, i) for i in range(1, count)]


def is_sibling(main: str, name: str) -> bool:
    return re.fullmatch(re.escape(main.removesuffix(".safetensors")) + r"-\d{3}\.safetensors", name) is not None


def is_further(name: str) -> bool:
    """Is `name` a further file of some rank (rank00000-001.safetensors)?"""
    return _FURTHER.fullmatch(name) is not None


def sibling_tensors(meta: dict[str, str]) -> list[list[str]]:
    """The tensor names each further file of a rank holds (META_FILES; empty when the rank
    wrote one file), checked: a JSON list of lists of strings, no name twice."""
    text = meta.get(META_FILES)
    if text is None:
        return []
    try:
        files = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{META_FILES} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(files, list) or not all(isinstance(f, list) and all(isinstance(n, str) for n in f)
                                              for f in files):
        raise FormatError(f"{META_FILES} must be a list of lists of tensor names")
    names = [n for f in files for n in f]
    if len(set(names)) != len(names):
        raise FormatError(f"{META_FILES} names a tensor in two files")
    return files


def sibling_shapes(meta: dict[str, str]) -> dict[str, list[int]] | None:
    """name -> shape of every tensor a rank's further files hold, from META_FILE_SHAPES
    (None when absent: written before it, or one file), checked: parallel to META_FILES,
    every shape within the bounds."""
    text = meta.get(META_FILE_SHAPES)
    if text is None:
        return None
    names = sibling_tensors(meta)
    try:
        shapes = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{META_FILE_SHAPES} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if (not isinstance(shapes, list) or len(shapes) != len(names)
            or not all(isinstance(s, list) and len(s) == len(n) for s, n in zip(shapes, names))):
        raise FormatError(f"{META_FILE_SHAPES} must give a shape for each tensor {META_FILES} names")
    out: dict[str, list[int]] = {}
    for file_names, file_shapes in zip(names, shapes):
        for name, shape in zip(file_names, file_shapes):
            _check_shape(name, shape)
            out[name] = shape
    return out
