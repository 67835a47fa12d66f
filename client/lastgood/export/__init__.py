"""Export a committed checkpoint as a Hugging Face model directory, verified, in bounded memory
(or, `export_dcp` / `--format dcp`, as a stock DCP directory: export/dcp.py, with torch).

    from lastgood.export import export_hf
    export_hf("gpt-small@last-good", "out/gpt-small", url="http://127.0.0.1:8000", dtype="bf16")
    # then: transformers.AutoModelForCausalLM.from_pretrained("out/gpt-small")

`lastgood export RUN@TAG|ID DIR` is the same on the command line (cli/export.py). From the
store, at whatever world size the checkpoint was saved with, without torch, GPUs or a
process group. The order of work:

1. check every option (nothing is read or written for bad input), resolve the checkpoint,
   take a read lease (GC keeps the checkpoint meanwhile), read the manifest;
2. in a new temporary sibling of DIR (`.DIR.export-<random>.tmp`), read the rank files
   that hold model tensors, each streamed once through xxh3-128 with the tensors' bytes
   copied into a scratch file (source.py); a file that does not verify ends the export;
3. check that the pieces of every tensor cover it exactly, name the tensors (strip
   `prefix`, then the optional map), write the safetensors files, the index and
   config.json under temporary names, fsync, rename each (hf.py); remove the scratch file;
4. rename the temporary directory to DIR. Until then DIR does not exist: an export that
   fails or is interrupted removes its temporary directory (a SIGKILL leaves it, hidden,
   beside DIR) and never leaves a DIR.

Only the model's weights are exported (not optimizer state, RNGs or the data position);
the reverse direction, a Hugging Face model into a training checkpoint, is not a thing
this module does. docs/export.md has the details and the measured memory bound.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import logging
import uuid
from pathlib import Path

from lastgood.errors import CorruptCheckpoint, FormatError, LastgoodError
from lastgood.export.convert import DTYPES, target
from lastgood.remote import reading
from lastgood.remote.config import DEFAULT_URL, ClientConfig
from lastgood.remote.reading import CkptRef, ReadLease, parse_ckpt, read_manifest, read_verified
from lastgood.remote.rest import RestClient
from lastgood.wire.format import is_further
from lastgood.wire.manifest import IndexMismatch
from lastgood.export.hf import CONFIG, INDEX, Item, check_coverage, file_names, shard_size, split, write_file, write_json
from lastgood.export.source import Collector
from lastgood.common.durable import fsync_dir as _fsync_dir

log = logging.getLogger("lastgood")

__all__ = ["export_hf", "export_dcp", "ExportError", "HF_CONFIG_KEY", "DEFAULT_PREFIX", "DEFAULT_MAX_SHARD_SIZE"]

# where a training state may carry its model's Hugging Face config: TrainState(extra={"hf_config": {...}})
HF_CONFIG_KEY = "hf_config"
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_PREFIX = "model."
DEFAULT_MAX_SHARD_SIZE = "5GB"


class ExportError(LastgoodError, ValueError):
    """The export was asked for something it cannot do (a bad option, a map that names no
    tensor, an occupied DIR); nothing was written."""


def _json_object(value, what: str) -> dict:
    """A dict, or the path of a JSON file holding an object."""
    if isinstance(value, dict):
        return value
    try:
        doc = json.loads(Path(value).read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{what} {str(value)[:200]}: {e}") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{what} {str(value)[:200]} is not a JSON object")
    return doc


def _check_map(name_map) -> dict[str, str | None]:
    doc = _json_object(name_map, "--map") if name_map is not None else {}
    bad = [k for k, v in doc.items() if not (v is None or (isinstance(v, str) and v))]
    if bad:
        raise ExportError(f"--map: each value must be a tensor name or null (drop it); {bad[0]!r} maps to "
                          f"{doc[bad[0]]!r}")
    return doc


def _check_dest(dest: Path) -> None:
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise ExportError(f"{dest} exists and is not an empty directory; export into a new one")


FORMATS = ("hf", "dcp")
DEFAULT_PREFIXES = {"hf": DEFAULT_PREFIX, "dcp": ""}  # dcp: names as the state has them, model.<key>


class Options:
    def __init__(self, dtype, max_shard_size, prefix, name_map, config, fmt: str = "hf") -> None:
        if fmt not in FORMATS:
            raise ExportError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
        if fmt == "dcp" and (dtype is not None or config is not None):
            raise ExportError("--dtype and --config apply to --format hf; --format dcp writes the tensors as stored")
        self.fmt = fmt
        prefix = DEFAULT_PREFIXES[fmt] if prefix is None else prefix
        if dtype is not None and dtype not in DTYPES:
            raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        try:
            self.max_bytes = shard_size(max_shard_size)
        except ValueError as e:
            raise ExportError(f"--max-shard-size: {e}") from None
        if not isinstance(prefix, str):
            raise ExportError("--prefix must be a string")
        self.dtype = DTYPES.get(dtype) if dtype else None
        self.dtype_name = dtype
        self.prefix = prefix
        self.name_map = _check_map(name_map)
        self.config = _json_object(config, "--config") if config is not None else None


def _hf_config(extra) -> dict | None:
    """extra["hf_config"] of the stored state as plain JSON, if it is an object."""
    if not isinstance(extra, dict) or HF_CONFIG_KEY not in extra:
        return None
    config = _plain(extra[HF_CONFIG_KEY], f"extra[{HF_CONFIG_KEY!r}]")
    return config if isinstance(config, dict) else None


def _plain(value, path: str):
    """The codec's typed JSON (codec.py's table) as the plain JSON a config.json holds:
    `config.to_dict()` has int-keyed dicts (id2label) and may have tuples; a tensor in a
    config is refused. Torch-free, unlike codec.decode."""
    if isinstance(value, list):
        return [_plain(v, path) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return [_plain(v, path) for v in value["__tuple__"]]
    if "__dict__" in value:
        return {str(_plain(k, path)): _plain(v, path) for k, v in value["__dict__"]}
    if "__float__" in value:
        return float(value["__float__"])
    if "__np__" in value:
        return _plain(value["v"], path)
    if "__dtype__" in value or "__device__" in value:
        return value.get("__dtype__", value.get("__device__"))
    tags = [k for k in value if k.startswith("__") and k.endswith("__")]
    if tags:
        raise ExportError(f"{path} holds a {tags[0]} value, which config.json cannot; pass --config FILE")
    return {k: _plain(v, f"{path}.{k}") for k, v in value.items()}


def _with_dtype(config: dict, items: list[Item]) -> dict:
    """The config, saying the weights' float dtype (when they share one), as save_pretrained
    does: from_pretrained loads them in it instead of its float32 default. Both keys:
    transformers 5 reads `dtype`, earlier releases `torch_dtype`."""
    floats = {it.dtype for it in items if it.dtype in TORCH_NAMES}
    if len(floats) != 1:
        return config
    name = TORCH_NAMES[floats.pop()]
    return {**config, "dtype": name, "torch_dtype": name}


def _name(collector: Collector, opts: Options) -> list[Item]:
    """Output names: the state's key minus the prefix, then the map."""
    items, taken = [], {}
    unused = set(opts.name_map)
    for key, t in collector.tensors.items():
        name = key[len(opts.prefix):]
        if name in opts.name_map:
            unused.discard(name)
            name = opts.name_map[name]
            if name is None:
                continue
        if name in taken:
            raise ExportError(f"two tensors would be named {name!r} in the export: {taken[name]} and {key}")
        taken[name] = key
        items.append(Item(name, t, target(t.dtype, opts.dtype)))
    if unused:
        raise ExportError(f"--map names {len(unused)} tensor(s) the checkpoint does not have under prefix "
                          f"{opts.prefix!r}: {', '.join(sorted(unused)[:5])}")
    return items


def run_export(rest, ref: CkptRef, dest: Path, opts: Options, progress=None) -> dict:
    """The export of the checkpoint `ref` names, read through `rest` (a RestClient).
    `progress(n, what)`, if given, hears of every n bytes read ("read"), skipped ("skip")
    and written ("write")."""
    dest = Path(dest)
    _check_dest(dest)
    t0 = time.monotonic()
    cid = reading.resolve(rest, ref)
    lease = ReadLease(rest, cid, what="export")
    made = [p for p in reversed(dest.absolute().parents) if not p.exists()]
    tmp = None
    try:
        _, manifest = read_manifest(rest, cid)
        manifest = _with_tensors(rest, cid, manifest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.export-{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        tail, held = f"; nothing was written to {dest}", []
        try:
            if opts.fmt == "dcp":
                src, skipped, doc = _export_dcp(rest, cid, manifest, tmp, opts, lease, tail, progress, held)
            else:
                src = Collector(opts.prefix, str(tmp / ".scratch"))
                held.append(src)
                skipped = _read(rest, cid, manifest, src, lease, tail, progress)
                doc = _write(tmp, src, opts, manifest, progress)
        finally:
            for s in held:
                s.close()
            (tmp / ".scratch").unlink(missing_ok=True)
        _fsync_dir(tmp)
        os.rename(tmp, dest)  # replaces an empty DEST; anything else there now fails here
        tmp = None
        _fsync_dir(dest.parent)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            for p in reversed(made):
                try:
                    p.rmdir()
                except OSError:
                    break
        if not lease.release():
            log.warning("lastgood: could not release read lease %s; it expires by itself", lease.lease_id)
    return {"checkpoint_id": cid, "run": manifest.run, "step": manifest.step, "world_size": manifest.world_size,
            "dir": str(dest), "format": opts.fmt, "dtype": opts.dtype_name, "prefix": opts.prefix, **doc,
            "read": [{"rank": r, "name": n, "size": s} for r, n, s in src.files_read],
            "skipped": [{"rank": r, "name": n, "size": s} for r, n, s in skipped],
            "bytes_read": src.bytes_read, "verified": True, "seconds": round(time.monotonic() - t0, 3)}


def _with_tensors(rest, cid: int, manifest):
    """A format 2 manifest names each file's tensor index: fetched here, every one checked
    against the root's hash (a format 1 manifest holds them already)."""
    try:
        return manifest.with_indexes(lambda r, f: rest.index_bytes(cid, r, f.name))
    except IndexMismatch as e:
        raise CorruptCheckpoint(f"checkpoint {cid}: {e}") from None


def _read(rest, cid: int, manifest, src: Collector, lease, tail: str, progress) -> list[tuple[int, str, int]]:
    """Every rank file that holds a model tensor still missing, streamed once and verified
    (source.py); returns the files not needed."""
    skipped = _read_files(rest, cid, manifest, src, lease, tail, progress)
    if lost := src.missing():  # written once, by a rank whose files do not hold it (replicas.py)
        raise FormatError(f"checkpoint {cid}: model tensor(s) {', '.join(lost[:3])} written once by another rank "
                          f"are not in that rank's files: the checkpoint is damaged")
    if not src.tensors:
        comps = ", ".join(f"{n} ({k})" for n, k in src.components.items()) or "none"
        raise ExportError(f"checkpoint {cid} has no module tensors under prefix {src.prefix!r}; its "
                          f"components: {comps}")
    for t in src.tensors.values():
        check_coverage(t)
    return skipped


def _read_files(rest, cid: int, manifest, src: Collector, lease, tail: str, progress) -> list[tuple[int, str, int]]:
    skipped = []
    src.entries = {(r, e.name): e for r in manifest.ranks for e in manifest.files(r)}
    for r in sorted(manifest.ranks):
        # a rank's first file before the others it was split into (state/split.py): its state plans theirs
        for entry in sorted(manifest.files(r), key=lambda e: (is_further(e.name), e.name)):
            if entry.tensors is None:  # not a safetensors file (DCP's metadata)
                continue
            if not src.wants(entry):
                skipped.append((r, entry.name, entry.size))
                if progress is not None:
                    progress(entry.size, "skip")
                continue
            stream = read_verified(rest, cid, r, entry, lease, tail)
            if progress is not None:
                stream = _counting(stream, progress)
            try:
                src.read(stream, r, entry)
            except FormatError as e:
                raise FormatError(f"checkpoint {cid}: {e} (export reads checkpoints that "
                                  f"lastgood.Checkpointer or lastgood.dcp saved)") from None
    return skipped


def _export_dcp(rest, cid: int, manifest, tmp: Path, opts: Options, lease, tail: str, progress, held: list):
    """--format dcp (export/dcp.py): a checkpoint lastgood.dcp saved, every entry; one the
    Checkpointer saved, its module tensors. Every byte read is verified first."""
    from lastgood.export.dcp import DcpSource, chunks_of, nesting, write_dcp
    from lastgood.state.dcp_metadata import METADATA_FILE, metadata_from_json

    scratch = str(tmp / ".scratch")
    owner = next(((r, f) for r in sorted(manifest.ranks) for f in manifest.files(r) if f.name == METADATA_FILE), None)
    if owner is not None:
        if opts.name_map or opts.prefix:
            raise ExportError(f"checkpoint {cid} was saved through lastgood.dcp: it is exported whole, under its "
                              f"DCP names (no --prefix, no --map)")
        raw = b"".join(read_verified(rest, cid, owner[0], owner[1], lease, tail))
        try:
            src = DcpSource(metadata_from_json(raw), scratch)
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"checkpoint {cid}: its {METADATA_FILE} does not parse: {e}") from None
        held.append(src)
        skipped = _read_files(rest, cid, manifest, src, lease, tail, progress)
        chunks = src.chunks()
        planner_data = src.metadata.planner_data if isinstance(src.metadata.planner_data, dict) else {}
    else:
        src = Collector(opts.prefix, scratch)
        held.append(src)
        skipped = _read(rest, cid, manifest, src, lease, tail, progress)
        items = _name(src, opts)
        chunks = [c for it in items for c in chunks_of(it.name, it.tensor)]
        planner_data = nesting([it.name for it in items]) if not (opts.prefix or opts.name_map) else {}
    return src, skipped, write_dcp(tmp, chunks, src, planner_data)


def _write(tmp: Path, src: Collector, opts: Options, manifest, progress) -> dict:
    """The safetensors files (each as .NAME.part, fsynced, renamed), the index and config.json."""
    items = _name(src, opts)
    groups = split(items, opts.max_bytes)
    names = file_names(len(groups))
    meta = {"lastgood.checkpoint_id": str(manifest.checkpoint_id), "lastgood.run": manifest.run,
            "lastgood.step": str(manifest.step)}
    files = []
    for name, group in zip(names, groups):
        part = tmp / f".{name}.part"
        size = write_file(str(part), group, src, meta, None if progress is None else (lambda n: progress(n, "write")))
        os.replace(part, tmp / name)
        files.append({"name": name, "size": size, "tensors": len(group)})
    total = sum(it.nbytes for it in items)
    write_json(str(tmp / INDEX), {"metadata": {"total_size": total},
                                  "weight_map": {it.name: n for n, g in zip(names, groups) for it in g}})
    config, config_from = opts.config, "--config"
    if config is None:
        config, config_from = _hf_config(src.extra), f"extra[{HF_CONFIG_KEY!r}]"
    if config is not None:
        write_json(str(tmp / CONFIG), _with_dtype(config, items))
    return {"files": files, "index": INDEX, "tensors": len(items), "total_size": total,
            "config": config_from if config is not None else None}


def _counting(stream, progress):
    for chunk in stream:
        progress(len(chunk), "read")
        yield chunk


def export_hf(checkpoint, dest, *, url: str | None = None, token: str | None = None, timeout: float = 30.0,
              dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
              prefix: str = DEFAULT_PREFIX, name_map=None, config=None) -> dict:
    """Write checkpoint `checkpoint` (an id, or "RUN@TAG" such as "gpt@last-good") as a
    Hugging Face model directory `dest`, which must not exist (or be empty).

    `dtype`: "bf16", "fp16" or "fp32" for the float tensors (default: as stored).
    `max_shard_size`: "5GB", "500MiB" or bytes. `prefix`: the part of the training
    state's names to strip; tensors without it are not exported ("model." for
    `TrainState(model=...)`). `name_map`: a dict (or a JSON file's path) from names after
    the prefix to the export's names, or None to drop a tensor. `config`: a dict (or a
    JSON file's path) written as config.json; default: the state's extra["hf_config"].
    `url` and `token` default to LASTGOOD_URL and LASTGOOD_TOKEN.

    Returns a summary (files, tensors, bytes read, ...). Raises CorruptCheckpoint when a
    byte read does not match the manifest, ExportError for what cannot be exported, and
    leaves no `dest` behind when it raises."""
    opts = Options(dtype, max_shard_size, prefix, name_map, config)
    return _export(checkpoint, dest, url, token, timeout, opts)


def _export(checkpoint, dest, url: str | None, token: str | None, timeout: float, opts: Options) -> dict:
    """Either export's reference, client and run (export_hf, export_dcp)."""
    try:
        ref = parse_ckpt(str(checkpoint))
    except ValueError as e:
        raise ExportError(str(e)) from None
    cfg = ClientConfig.resolve(url=url, token=token)
    return run_export(RestClient(cfg.url or DEFAULT_URL, timeout, cfg.token), ref, Path(dest), opts)


def export_dcp(checkpoint, dest, *, url: str | None = None, token: str | None = None, timeout: float = 30.0,
               prefix: str | None = None, name_map=None) -> dict:
    """Write checkpoint `checkpoint` (an id, or "RUN@TAG") as a stock DCP directory `dest`
    (which must not exist, or be empty): `torch.distributed.checkpoint.FileSystemReader(dest)`
    and `format_utils.dcp_to_torch_save(dest, ...)` read it. A checkpoint lastgood.dcp saved
    is exported whole; of one the Checkpointer saved, the module tensors under `prefix`
    (default: all of them, named `model.<key>`), renamed by `name_map` as for export_hf.
    Needs torch (export/dcp.py); raises as export_hf does."""
    opts = Options(None, DEFAULT_MAX_SHARD_SIZE, prefix, name_map, None, fmt="dcp")
    return _export(checkpoint, dest, url, token, timeout, opts)
