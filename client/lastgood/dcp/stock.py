"""A stock DCP directory (`dcp.save` with `FileSystemWriter`) read without running its
pickles, and imported into a run.

    from lastgood.dcp.stock import import_dcp
    import_dcp("ckpt/step-1000", url=url, run="gpt", step=1000)   # lastgood import-dcp DIR ...

DCP's `.metadata` is a pickle (`pickle.dump` of its `Metadata`), and stock
`FileSystemReader.read_metadata` reads it with the `pickle` module's own loader, which runs whatever the file
asks. Here it is read only through torch's weights-only unpickler
(`torch._weights_only_unpickler`, what torch's weights-only load uses) with DCP's
metadata classes, and nothing else, allow-listed (`torch.serialization.safe_globals`): a
global outside that list is refused before anything is called, and no module is imported
to look it up. That unpickler reads pickle protocol 2; DCP writes protocol 4, so the
opcodes are first rewritten (`_protocol2`) from `pickletools.genops`, a parser that runs
nothing: FRAME dropped, SHORT_BINUNICODE widened, MEMOIZE made an explicit BINPUT,
STACK_GLOBAL made GLOBAL from the two strings it names. A file that needs anything more
is refused.

The tensors come through `FileSystemReader.read_data`, which loads each with
torch's weights-only load; non-tensor values (DCP's default planner `torch.save`s
them) through `StockLoadPlanner.load_bytes`, with `weights_only=True` as well (DCP's own
default planner loads them without that restriction).

The import loads the whole state into memory (every tensor at its full size, on the CPU),
then saves it as one `dcp.save` through `lastgood.dcp.StorageWriter` (one rank, the
two-phase commit), so it restores through `lastgood.dcp.StorageReader` at any world size.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import struct
from math import prod
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch._weights_only_unpickler import Unpickler
from torch.distributed.checkpoint import filesystem, metadata as md_classes
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lastgood.errors import FormatError, LastgoodError

METADATA_NAME = ".metadata"  # torch's name for it (filesystem._metadata_fn)
MAX_METADATA_BYTES = 256 << 20  # a .metadata larger than this is refused unread
# DCP's metadata classes: the only globals a .metadata may name (beyond torch's own
# weights-only defaults: torch.Size, dtypes, layouts, memory formats, ...), and paths
ALLOWED = [md_classes.Metadata, md_classes.TensorStorageMetadata, md_classes.BytesStorageMetadata,
           md_classes.ChunkStorageMetadata, md_classes.TensorProperties, md_classes.MetadataIndex,
           md_classes.StorageMeta, md_classes._MEM_FORMAT_ENCODING, filesystem._StorageInfo,
           pathlib.PosixPath, pathlib.PurePosixPath]  # StorageMeta.checkpoint_id: the directory saved to

_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")


def _string(text: str) -> tuple[bytes, str]:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw, text


def _protocol2(raw: bytes) -> bytes:
    """The same pickle in the opcodes torch's weights-only unpickler reads; parsed, never run."""
    try:
        ops = list(pickletools.genops(raw))
    except Exception as e:  # noqa: BLE001 - genops raises ValueError and others on bad input
        raise FormatError(f"not a pickle: {str(e)[:200]}") from None
    out: list[tuple[bytes, str | None]] = []  # (bytes, the string it pushes, if it pushes one)
    strings: dict[int, str] = {}  # memo index -> a memoized string (inlined where it is fetched)
    memo: set[int] = set()
    for n, (op, arg, pos) in enumerate(ops):
        name, end = op.name, ops[n + 1][2] if n + 1 < len(ops) else len(raw)
        if name == "PROTO":
            out.append((b"\x80\x02", None))
        elif name == "FRAME":
            continue
        elif name in _STRINGS:
            out.append(_string(arg))
        elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            i = len(memo) if name == "MEMOIZE" else int(arg)
            memo.add(i)
            if out and out[-1][1] is not None:
                strings[i] = out[-1][1]
            else:
                out.append((b"r" + struct.pack("<I", i), None))  # LONG_BINPUT
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            i = int(arg)
            out.append(_string(strings[i]) if i in strings else (b"j" + struct.pack("<I", i), None))
        elif name == "STACK_GLOBAL":
            if len(out) < 2 or out[-1][1] is None or out[-2][1] is None:
                raise FormatError("a STACK_GLOBAL whose module and name are not plain strings")
            module, qualname = out[-2][1], out.pop()[1]
            out.pop()
            if "\n" in module or "\n" in qualname:
                raise FormatError("a global whose name holds a newline")
            out.append((b"c" + f"{module}\n{qualname}\n".encode(), None))
        else:
            out.append((raw[pos:end], None))
    return b"".join(b for b, _ in out)


def read_metadata(path) -> Metadata:
    """A stock DCP directory's `.metadata` (or that file itself), read without running it."""
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_NAME
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise FormatError(f"{path} is {size} bytes, more than a DCP .metadata may be ({MAX_METADATA_BYTES})")
        raw = path.read_bytes()
    except OSError as e:
        raise LastgoodError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        with torch.serialization.safe_globals(ALLOWED):
            md = Unpickler(io.BytesIO(_protocol2(raw)), encoding="utf-8").load()
    except FormatError as e:
        raise FormatError(f"{path}: refused, {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RuntimeError) as e:
        raise FormatError(f"{path}: refused, it is not DCP metadata this reader accepts: {str(e)[:300]}") from None
    if not isinstance(md, Metadata):
        raise FormatError(f"{path}: refused, it holds a {type(md).__name__}, not DCP's Metadata")
    try:
        _check_structure(path, md)
    except (AttributeError, TypeError, ValueError) as e:  # an object built without its fields
        raise FormatError(f"{path}: refused, its metadata is incomplete: {str(e)[:300]}") from None
    return md


def _dims(value) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                   for d in value)


def _check_structure(path: Path, md: Metadata) -> None:
    """Every field the import reads is there and has its type (the unpickler builds objects
    from whatever state the file gives them)."""
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict) or \
            not (md.planner_data is None or isinstance(md.planner_data, dict)):
        raise FormatError(f"{path}: refused, its metadata's tables are not dictionaries")
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{path}: refused, an entry's name is a {type(fqn).__name__}")
        if isinstance(m, BytesStorageMetadata):
            continue
        if not isinstance(m, TensorStorageMetadata) or not isinstance(m.properties, md_classes.TensorProperties) \
                or not isinstance(m.properties.dtype, torch.dtype) or not _dims(m.size) \
                or not isinstance(m.chunks, list) or not all(
                    isinstance(c, md_classes.ChunkStorageMetadata) and _dims(c.offsets) and _dims(c.sizes)
                    for c in m.chunks):
            raise FormatError(f"{path}: refused, {fqn[:200]!r} is not a tensor's or a value's metadata")
    for index, where in md.storage_data.items():
        if not isinstance(index, md_classes.MetadataIndex) or not isinstance(index.fqn, str) or \
                not (index.offset is None or _dims(index.offset)):
            raise FormatError(f"{path}: refused, a storage entry is not indexed by name and offset")
        _check_where(path, where)


def _check_where(path: Path, where) -> None:
    """An entry's file is one of the directory's own (`__0_0.distcp`), never `../x` or `/x`."""
    if not isinstance(where, filesystem._StorageInfo):
        raise FormatError(f"{path}: refused, an entry is stored at a {type(where).__name__}, not a file range")
    td = where.transform_descriptors
    if not (td is None or (isinstance(td, (list, tuple)) and all(isinstance(t, str) for t in td))):
        raise FormatError(f"{path}: refused, an entry's transforms are not names")
    name = where.relative_path
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise FormatError(f"{path}: refused, an entry is stored in {str(name)[:200]!r}, which is not a file of "
                          f"the directory")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (where.offset, where.length)):
        raise FormatError(f"{path}: refused, an entry's byte range in {name} is not two whole numbers >= 0")


class SafeFileSystemReader(dcp.FileSystemReader):
    """Stock `FileSystemReader`, its `.metadata` read by read_metadata, never by `pickle` itself."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FormatError("per-rank DCP metadata files are not supported; save with one .metadata")
        md = read_metadata(self.path)
        if md.storage_meta is None:
            md.storage_meta = md_classes.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class StockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values loaded weights-only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message: advice first, then what it refused
            why = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "global" in ln), str(e)[:300])
            raise FormatError(f"{fqn}: refused, a non-tensor value that weights-only loading does not allow: "
                              f"{why[:300]}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _first_failure(e: CheckpointException) -> BaseException:
    """DCP wraps what failed in a CheckpointException (a BaseException): the first failure."""
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, BaseException):
            return exc
    return LastgoodError(str(e))


def _check_sizes(src: Path, md: Metadata) -> None:
    """Before anything is allocated: every tensor is covered by its chunks, each chunk lies
    inside it, and each chunk's bytes fit in its stored range, which lies inside its file;
    so what the import allocates is bounded by the directory's own size."""
    sizes: dict[str, int] = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        dtype = getattr(m.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in m.size):
            raise FormatError(f"{src}: refused, {fqn} has no dtype or shape")
        covered = 0
        for c in m.chunks:
            where = md.storage_data.get(md_classes.MetadataIndex(fqn, c.offsets))
            if where is None or len(c.offsets) != len(m.size) or len(c.sizes) != len(m.size) or \
                    any(o < 0 or n < 0 or o + n > d for o, n, d in zip(c.offsets, c.sizes, m.size)):
                raise FormatError(f"{src}: refused, a chunk of {fqn} lies outside it or is stored nowhere")
            if where.relative_path not in sizes:
                try:
                    sizes[where.relative_path] = (src / where.relative_path).stat().st_size
                except OSError as e:
                    raise FormatError(f"{src}: {where.relative_path}: {e.strerror or e}") from None
            nbytes = prod(c.sizes) * dtype.itemsize
            if nbytes > where.length or where.offset + where.length > sizes[where.relative_path]:
                raise FormatError(f"{src}: refused, a chunk of {fqn} ({nbytes} bytes) does not fit where it is "
                                  f"stored ({where.relative_path}, {where.length} bytes at {where.offset})")
            covered += prod(c.sizes)
        if covered < prod(m.size):
            raise FormatError(f"{src}: refused, the chunks of {fqn} cover {covered} of its {prod(m.size)} elements")


def load_stock(src) -> tuple[dict, Metadata]:
    """Everything in stock DCP directory `src`, as DCP nested it (its planner data), on the CPU."""
    src = Path(src)
    md = read_metadata(src)
    _check_sizes(src, md)
    flat = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            flat[fqn] = torch.empty(m.size, dtype=m.properties.dtype)
        elif isinstance(m, BytesStorageMetadata):
            flat[fqn] = None
        else:
            raise FormatError(f"{src}: {fqn} has metadata of type {type(m).__name__}")
    try:
        dcp.load(flat, storage_reader=SafeFileSystemReader(str(src)), planner=StockLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        exc = _first_failure(e)
        if isinstance(exc, LastgoodError):
            raise exc from None
        raise FormatError(f"{src}: DCP could not read it: {type(exc).__name__}: {str(exc)[:300]}") from None
    mappings = md.planner_data
    if isinstance(mappings, dict) and set(mappings) == set(flat):
        return unflatten_state_dict(flat, mappings), md
    return flat, md


def import_dcp(src, *, step: int, url: str | None = None, run: str | None = None, token: str | None = None,
               parent_id: int | None = None) -> dict:
    """Import stock DCP directory `src` into `run` as a checkpoint of `step`, committed;
    returns its summary. `url`, `run` and `token` default to LASTGOOD_URL, LASTGOOD_RUN and
    LASTGOOD_TOKEN; `parent_id` to the run's last-good."""
    from lastgood.dcp import SavePlanner, StorageWriter

    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LastgoodError(f"the step is a whole number >= 0, not {step!r}")
    writer = StorageWriter(url, run=run, step=step, parent_id=parent_id, token=token)  # checks url and run first
    state, md = load_stock(src)
    try:
        dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=True)
    except CheckpointException as e:
        exc = _first_failure(e)
        if isinstance(exc, Exception):
            raise exc from None
        raise
    sdm = md.state_dict_metadata
    return {"checkpoint_id": writer.checkpoint_id, "run": writer.run, "step": step, "dir": str(src),
            "tensors": sum(isinstance(m, TensorStorageMetadata) for m in sdm.values()),
            "values": sum(isinstance(m, BytesStorageMetadata) for m in sdm.values()),
            "bytes": sum(m.size.numel() * m.properties.dtype.itemsize for m in sdm.values()
                         if isinstance(m, TensorStorageMetadata))}
