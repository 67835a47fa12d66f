"""Where one file's DTensor shards lie, in a few bytes: what the root says of each file so
that a rank restoring at another world size fetches only the files it overlaps.

Why: only a file's header says where each stored shard lies, and fetching every old file's
index object and header is ~270 MB of metadata per rank at 1,024 -> 1,000 ranks, to read
~1 GiB. So the service, when a file is uploaded, summarises its header's DTensor
shards as `chunks` in the file's index reference (manifest.index_ref), which the commit
copies into the root: per global shape, the (offset, local shape) of each shard the file
holds of a tensor of that shape. Tensors of one global shape sharded alike (a weight and
its two Adam moments, every layer's copy of a block) share one entry, so a file's summary
is a few entries (one per distinct shape under FSDP2), not one per tensor, and the root
stays O(ranks).

A reader keeps a file if any chunk of the target's shape overlaps the region it needs:
a superset of the files that hold the region (two tensors of one shape sharded
differently both count), never fewer, so the plan over the kept files is the plan over
all of them. The chain stays whole: the root's hash is checked by the service, the
reference names the index object by hash, and each kept file's own header, verified by
its digest, must hold no chunk the root leaves out (within(); CorruptCheckpoint otherwise).

A file with more than MAX_CHUNKS distinct chunks (many shapes, or another sharding than
one chunk per tensor) gets no summary: its checkpoint is planned without one, every old
file's index object and header fetched. Torch-free: the service computes it.
"""

from __future__ import annotations

from lastgood.wire.errors import FormatError
from lastgood.wire.format import MAX_DIMS, parse_state, sibling_shapes

MAX_CHUNKS = 64  # ~40 B each in the root: at most ~2.6 KB a file; beyond it, no summary
MAX_KEY = 128    # characters of a global shape's key (6 dims of 19 digits); longer: no summary


def _key(shape) -> str:
    return ",".join(str(int(d)) for d in shape)


def _held(state: dict, tensors: dict, limit: int | None) -> dict[str, set] | None:
    """{global shape key: {(offset, local shape)}} of the `__dtensor__` shards in a shard's
    lastgood state; None if a chunk is malformed or there are more than `limit`."""
    out: dict[str, set] = {}
    n = 0
    todo = [state]
    try:
        while todo:
            node = todo.pop()
            if isinstance(node, dict):
                if "__dtensor__" in node:
                    chunk = (tuple(int(o) for o in node["offset"]),
                             tuple(int(d) for d in tensors[node["__dtensor__"]]["shape"]))
                    have = out.setdefault(_key(node["shape"]), set())
                    if chunk not in have:
                        have.add(chunk)
                        n += 1
                        if limit is not None and n > limit:
                            return None
                    continue
                todo.extend(node.values())
            elif isinstance(node, list):
                todo.extend(node)
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(inf), JSON's 1e400
        return None
    return out


def summarize(state: dict, tensors: dict) -> dict | None:
    """{global shape "d0,d1,...": [[offset, local shape], ...]} of the `__dtensor__` shards
    in a shard's lastgood state (`tensors` as parse_header returns them), sorted; {} for a
    file without shards; None if a chunk is malformed or there are more than MAX_CHUNKS."""
    out = _held(state, tensors, MAX_CHUNKS)
    if out is None:
        return None
    return checked({k: [[list(o), list(s)] for o, s in sorted(v)] for k, v in sorted(out.items())})


def within(state: dict, tensors: dict, chunks: dict) -> bool:
    """Whether every shard a file's state holds is one the root's (checked) summary names.

    Containment, not equality, is what the plan's safety needs: the summary only chooses
    which files a rank opens (overlaps), so naming more than a file holds opens one file
    too many, while leaving out one it holds could skip a file that holds part of a
    region (the cover check would then refuse the plan, or a replica would serve it).
    Equality would also refuse a root whose summary a later walk rule wrote otherwise."""
    held = _held(state, tensors, None)
    if held is None:
        return False
    named = {k: {(tuple(o), tuple(s)) for o, s in v} for k, v in chunks.items()}
    return all(have <= named.get(k, set()) for k, have in held.items())


def _ints(v, n: int) -> bool:
    return (isinstance(v, list) and len(v) == n
            and all(type(x) is int and 0 <= x < 1 << 63 for x in v))


def checked(chunks) -> dict | None:
    """`chunks` if it is a summary as summarize() writes it, else None: at most MAX_CHUNKS,
    keys of at most MAX_KEY characters naming a global shape of at most MAX_DIMS dims, and
    per chunk an offset and a local shape of that many dims within the global shape. The
    one rule of what the service writes to the root and what a reader uses from it (a
    reader treats anything else as no summary: every old file, never a TypeError)."""
    if not isinstance(chunks, dict):
        return None
    n = 0
    for key, entries in chunks.items():
        if not isinstance(key, str) or len(key) > MAX_KEY or not isinstance(entries, list):
            return None
        try:
            dims = [int(d) for d in key.split(",")] if key else []
        except ValueError:
            return None
        if len(dims) > MAX_DIMS or key != _key(dims):
            return None
        for e in entries:
            n += 1
            if n > MAX_CHUNKS or not isinstance(e, list) or len(e) != 2:
                return None
            o, sz = e
            if not (_ints(o, len(dims)) and _ints(sz, len(dims))
                    and all(a + m <= d for a, m, d in zip(o, sz, dims))):
                return None
    return chunks


def of_header(meta: dict, tensors: dict) -> dict | None:
    """summarize() of a shard's header (parse_header's metadata and tensors); None when its
    state cannot be read (not a lastgood shard, or damaged: restore finds out on its own).
    The first file of a rank split into several (state/split.py) is summarised for all of
    them: its further files' tensors by the shapes it declares (format.sibling_shapes),
    which a reader checks against those files' own headers (within(), on the whole rank)."""
    try:
        state = parse_state(meta, tensors)
        shapes = sibling_shapes(meta)
    except FormatError:
        return None
    if shapes:
        tensors = {**{n: {"shape": s} for n, s in shapes.items()}, **tensors}
    return summarize(state, tensors)


def overlaps(chunks: dict, shape, offset, lengths) -> bool:
    """Whether a file with this summary (checked) may hold part of the region (offset,
    lengths) of a tensor of global `shape`."""
    if not all(int(n) > 0 for n in lengths):
        return False
    for o, s in chunks.get(_key(shape), ()):
        if all(a < t + n and t < a + m for a, m, t, n in zip(o, s, offset, lengths)) and all(m > 0 for m in s):
            return True
    return False
