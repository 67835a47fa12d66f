"""Range digests: any byte range of a stored shard file can be verified without the rest.

The manifest's xxh3-128 covers a whole file, so a reader that wants a few tensors of it
(a restore at another world size, docs/resharding.md) would have to read all of it to
check them. Each file's tensor index object therefore also records the xxh3-128 of every
*segment* of the file:

  - the header, [0, data_start): one segment (at most format.MAX_HEADER_BYTES);
  - each tensor, cut into blocks from the tensor's own start (the last one shorter); a
    tensor no larger than its block is one segment. A tensor's block follows from its
    size (block_for): about 1/32 of it, a power of two, at least FLOOR and at most the
    service's `block` (its cap). Index objects written before that rule have one block
    for every tensor (no "split" in their digests) and are read as such.

Why per tensor *and* per block: segments never straddle two tensors, so reading one
tensor (the replicated state, a whole stored shard) reads exactly its bytes, while a
huge tensor still costs at most one block of extra bytes at each end of a range within
it. Why the block follows the tensor's size: a fixed block larger than a rank's stored
piece of a tensor (1 MiB blocks, 256 KiB pieces) made every partly needed piece a whole
read (1.5x the bytes needed at 4 -> 3 ranks); a block of at most 1/32 of its tensor
bounds the rounding to ~3 % of the tensor at each cut end, at any size, while the floor
bounds the digests: at most 1 GiB / FLOOR (+1 a tensor) segments per GiB of tensors.
A reader verifies a range [a, b) by reading the segments that cover it, whole, and
checking each against its digest: at most 2 x `block` bytes more than the range.

The service computes them (RangeHasher) from the stream it already hashes and checks
against the client's whole-file hash when the file is uploaded: one more hash pass over
bytes in the CPU's cache, and the digests are of exactly the bytes the client committed.
The index object's own hash is in the manifest's root, whose hash the service checks, so
the chain from the commit to every segment is whole. A file the service never reads (a
direct upload) gets them from its writer, by the same rule, checked for shape by the
service and recomputed by a checking peer (hasher_of, check_declared, FileCheck below;
the service's domain/commit/declared_ranges.py). A file whose index has no digests
(uploaded before them) is read whole. This module is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from lastgood.wire.errors import FormatError
from lastgood.wire.hashing import StreamHasher, is_valid_hex

MiB = 1024 * 1024
DEFAULT_BLOCK = 1 * MiB  # 1 GiB of tensors: 1,024 digests, ~35 KB in the index object
MIN_BLOCK = 4 * 1024  # below this the digests outweigh the bytes they save reading (36 B per block)
MAX_BLOCK = 64 * MiB
SPLIT = 32           # a tensor's block is at most 1/SPLIT of it (above FLOOR): rounding <= ~3 % a cut end
FLOOR = 16 * 1024    # ...and at least this: <= 65,536 digests (2.3 MB of index JSON) per GiB of tensors
HEADER = ""  # the header's segment name (no tensor has an empty name: names come from state paths)


@dataclass(frozen=True, slots=True)
class Segment:
    name: str       # the tensor's name, HEADER for the header
    start: int      # absolute [start, end) in the file
    end: int


def check_block(block: int) -> int:
    """A block a reader accepts: any up to MAX_BLOCK (files written with small blocks stay
    readable); the service writes none under MIN_BLOCK (its settings refuse it)."""
    if type(block) is not int or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"range digest block must be 1..{MAX_BLOCK} bytes, got {block!r}")
    return block


def block_for(nbytes: int, cap: int, split: int | None = SPLIT, floor: int = FLOOR) -> int:
    """The block of a tensor of `nbytes` bytes: the largest power of two <= nbytes / split,
    at least `floor`, at most `cap` (the cap wins over the floor: a service set to 4 KiB
    blocks gets 4 KiB blocks). Powers of two, so that the even row splits of FSDP2 at
    power-of-two world sizes fall on block edges. `split` None: every tensor `cap` (index
    objects written before this rule). The one place the rule is computed."""
    if split is None:
        return cap
    want = nbytes // split
    return min(cap, max(floor, 1 << (want.bit_length() - 1) if want else 1))


@dataclass(frozen=True, slots=True)
class Blocks:
    """The block rule of one file's digests, as its index object records it."""

    cap: int
    split: int | None = SPLIT
    floor: int = FLOOR

    def of(self, nbytes: int) -> int:
        return block_for(nbytes, self.cap, self.split, self.floor)

    def record(self) -> dict:
        return {"block": self.cap, **({"split": self.split, "floor": self.floor} if self.split else {})}

    @classmethod
    def read(cls, digests: dict) -> "Blocks":
        """From an index object's digests: adaptive when they name a split, fixed before."""
        cap = check_block(digests["block"])
        if "split" not in digests:
            return cls(cap, None)
        split, floor = digests["split"], digests["floor"]
        if type(split) is not int or not 1 <= split <= 1 << 20 or type(floor) is not int or not 1 <= floor <= MAX_BLOCK:
            raise ValueError(f"range digest rule split={split!r} floor={floor!r} is out of bounds")
        return cls(cap, split, floor)


def _blocks(block) -> Blocks:
    return block if isinstance(block, Blocks) else Blocks(check_block(block), None)


def _spans(data_start: int, tensors: dict) -> list[tuple[int, int, str]]:
    """(start, end, name) of the header and each non-empty tensor, absolute, in file order."""
    out = [(0, data_start, HEADER)]
    for name, t in sorted(tensors.items(), key=lambda kv: tuple(kv[1]["offsets"])):
        a, b = t["offsets"]
        if b > a:
            out.append((data_start + a, data_start + b, name))
    return out


def _count(a: int, b: int, block: int) -> int:
    return -(-(b - a) // block)


def iter_segments(data_start: int, tensors: dict, block):
    """Every segment of a file, in file order, made as they are asked for (a file of many
    small blocks never has them all in memory); `tensors` as in the tensor index (name ->
    {"offsets": [a, b]} relative to the data section); `block` a Blocks rule, or one
    block for every tensor. Empty tensors have none."""
    rule = _blocks(block)
    spans = _spans(data_start, tensors)
    yield Segment(HEADER, 0, data_start)
    for a, b, name in spans[1:]:
        step = rule.of(b - a)
        for s in range(a, b, step):
            yield Segment(name, s, min(s + step, b))


def segments(data_start: int, tensors: dict, block) -> list[Segment]:
    return list(iter_segments(data_start, tensors, block))


class RangeHasher:
    """Fed a file's bytes in order (any chunking), yields the digests of its segments.
    `block` is the cap of the adaptive rule (block_for); `split=None` writes one block for
    every tensor, the form of index objects written before the per-tensor rule (for tests of them)."""

    def __init__(self, data_start: int, tensors: dict, block: int, split: int | None = SPLIT,
                 floor: int = FLOOR) -> None:
        self.rule = Blocks(check_block(block), split, floor)
        self.block = self.rule.cap
        self._n = 1 + sum(_count(a, b, self.rule.of(b - a)) for a, b, _ in _spans(data_start, tensors)[1:])
        self._where = (data_start, tensors)
        self._segs = iter_segments(data_start, tensors, self.rule)
        self._seg = next(self._segs)
        self._i, self._pos = 0, 0
        self._h = StreamHasher()
        # every segment's digest, 16 raw bytes each in file order, until digests(): the
        # service holds them while the file streams in (hex strings in lists: ~90 B each)
        self._raw = bytearray()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self._seg is None:
                raise FormatError("more bytes than the file's segments cover")
            take = min(view.nbytes, self._seg.end - self._pos)
            self._h.update(view[:take])
            view, self._pos = view[take:], self._pos + take
            if self._pos == self._seg.end:
                self._raw += self._h.digest()
                self._h, self._i = StreamHasher(), self._i + 1
                self._seg = next(self._segs, None)

    def digests(self) -> dict:
        """The index object's "digests": {"block", "split", "floor", "header", "tensors":
        {name: [hex, ...]}} ("block" alone, no "split": one block for every tensor)."""
        if self._i != self._n:
            raise FormatError(f"the file ended inside segment {self._i} of {self._n}")
        raw, header, tensors = self._raw, "", {}
        for i, seg in enumerate(iter_segments(*self._where, self.rule)):  # the order they were hashed in
            h = raw[16 * i:16 * i + 16].hex()
            if seg.name == HEADER:
                header = h
            else:
                tensors.setdefault(seg.name, []).append(h)
        return {**self.rule.record(), "header": header, "tensors": tensors}


class RangeDigests:
    """One file's segment digests, checked for shape against its tensor index: which
    segments cover a byte range, and what each must hash to.

    Kept small, since a rank holds one per old file it reads from: the bounds and block
    of each tensor (the segments follow from them) and the digests as 16 raw bytes each,
    not Segment objects and hex strings (~120 B per segment more)."""

    def __init__(self, data_start: int, tensors: dict, digests: dict) -> None:
        try:
            rule = Blocks.read(digests)
            spans = _spans(data_start, tensors)
            per = digests["tensors"]
            hexes = [digests["header"]]
            firsts = [0]
            steps = [max(data_start, 1)]  # the header: one segment
            for a, b, name in spans[1:]:  # one pass: a count per tensor, not per segment
                steps.append(rule.of(b - a))
                want = _count(a, b, steps[-1])
                if len(per[name]) != want:
                    raise ValueError(f"tensor {name!r}: {len(per[name])} digests for {want} segments")
                firsts.append(len(hexes))
                hexes.extend(per[name])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"the file's range digests do not fit its tensor index: {type(e).__name__}: "
                              f"{str(e)[:200]}") from None
        if not all(is_valid_hex(h) for h in hexes):
            raise FormatError("the file's range digests are not xxh3-128 hex digests")
        self.rule = rule
        self._steps = steps
        self._spans = spans
        self._starts = [a for a, _, _ in spans]
        self._firsts = firsts
        self._raw = bytes.fromhex("".join(hexes))

    def covering(self, a: int, b: int) -> list[tuple[Segment, str]]:
        """The segments that cover [a, b) (a < b), each with its digest, in file order."""
        import bisect

        end = self._spans[-1][1]
        if not 0 <= a < b <= end:
            raise ValueError(f"range [{a}, {b}) is outside the file's {end} bytes")
        i = max(bisect.bisect_right(self._starts, a) - 1, 0)
        out = []
        while i < len(self._spans) and self._spans[i][0] < b:
            ta, tb, name = self._spans[i]
            step = self._steps[i]
            k = max(a - ta, 0) // step if tb > ta else 0
            while ta + k * step < min(b, tb):
                s = ta + k * step
                j = self._firsts[i] + k
                out.append((Segment(name, s, min(s + step, tb)), self._raw[16 * j:16 * j + 16].hex()))
                k += 1
            i += 1
        return out


# ---------------------------------------------------------------- declared by the writer
# A file the service never reads (a direct upload to S3, a direct-FS file a peer checks)
# gets its digests from its writer, computed with the same rule (block_for) in the pass
# that hashes the file for its upload; the service checks their shape (check_declared)
# and, in `peer` mode, the checking rank recomputes them from the stored bytes (FileCheck).

def hasher_of(data, cap: int | None) -> RangeHasher | None:
    """A RangeHasher for the safetensors file in `data` (its header parsed from its first
    bytes), to be fed the whole file; None when `cap` is 0/None (the service writes no
    digests), `data` is not a safetensors file (then it has no tensor index either), or
    the header says there would be too many digests to declare (`declarable`): the
    writers call this, and would hash the file a second time for nothing."""
    from lastgood.wire.format import header_length, parse_header, tensor_index

    if not cap:
        return None
    view = memoryview(data).cast("B")
    try:
        n = header_length(view[:8])
        tensors, _meta = parse_header(view[:n], file_size=view.nbytes)
        hasher = RangeHasher(n, tensor_index(tensors), cap)
        return hasher if hasher._n * DIGEST_JSON_BYTES <= DECLARE_BYTES else None
    except (FormatError, ValueError):
        return None


def check_declared(data_start: int, tensors: dict, digests, cap: int) -> dict:
    """Range digests a writer declared, checked for shape before the service writes them
    into the file's index object: the service's rule (cap `cap`, SPLIT, FLOOR), one list
    per non-empty tensor of the file's own tensor index (no other names), exactly as many
    digests as the rule cuts that tensor into, each an xxh3-128 hex. Bounded by the file:
    a declaration of other counts is refused before its digests are looked at one by one.
    Returns the canonical dict (known keys only); raises FormatError, saying what is wrong.
    Whether the digests are *of the bytes* is the verification mode's business."""
    if not isinstance(digests, dict) or not isinstance(digests.get("tensors"), dict):
        raise FormatError("declared range digests must be an object with a \"tensors\" object")
    rule = Blocks(check_block(cap)).record()
    extra = sorted(set(digests) - set(rule) - {"header", "tensors"})
    if extra:
        raise FormatError(f"declared range digests have unknown keys {[str(k)[:40] for k in extra[:5]]}")
    got = {k: digests.get(k) for k in rule}
    if got != rule:
        raise FormatError(f"declared range digests follow the rule {str(got)[:200]}, this service's is {rule}")
    named = {name for _, _, name in _spans(data_start, tensors)[1:]}
    per = digests["tensors"]
    if len(per) != len(named) or set(per) != named:
        raise FormatError(f"declared range digests name {len(per)} tensors; the file's header has {len(named)} "
                          f"non-empty ones, and the names must be the same")
    RangeDigests(data_start, tensors, digests)  # the count of each tensor's blocks, the hex: FormatError
    return {**rule, "header": digests["header"], "tensors": per}


class FileCheck:
    """A peer's read of a whole stored file (peer.py, and the service's own when no peer
    reported it): its xxh3-128 and, when the file's index object holds range digests under
    `rule`, the digests recomputed from the same bytes in the same pass, to compare with
    what the writer declared. Fed the file in order, any chunking."""

    def __init__(self, rule: dict | None) -> None:
        self.hasher = StreamHasher()
        self._rule = Blocks.read(rule) if rule else None
        self._head = bytearray()
        self._ranges: RangeHasher | None = None
        self._bad = False

    @property
    def size(self) -> int:
        return self.hasher.size

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()

    def update(self, data) -> None:
        self.hasher.update(data)
        if self._rule is None or self._bad:
            return
        if self._ranges is not None:
            try:
                self._ranges.update(data)
            except FormatError:
                self._bad = True
            return
        from lastgood.wire.format import header_length, parse_header, tensor_index

        self._head += memoryview(data).cast("B")
        try:
            if len(self._head) < 8 or len(self._head) < header_length(self._head[:8]):
                return
            n = header_length(self._head[:8])
            tensors, _ = parse_header(memoryview(self._head)[:n])
            r = self._rule
            self._ranges = RangeHasher(n, tensor_index(tensors), r.cap, r.split, r.floor)
            self._ranges.update(self._head)
        except (FormatError, ValueError):
            self._bad = True
        self._head = bytearray()

    def digests(self) -> dict | None:
        """The recomputed digests (RangeHasher.digests), None when there is no rule or the
        bytes are not a whole file under it (then they cannot match a declaration)."""
        if self._rule is None or self._bad or self._ranges is None:
            return None
        try:
            return self._ranges.digests()
        except FormatError:
            return None


DECLARE_BYTES = 768 * 1024  # under the service's default REST body limit (1 MiB) with room for the rest
DIGEST_JSON_BYTES = 35  # one digest in the declaration's JSON: 32 hex digits, quotes, a comma


def declarable(digests: dict | None) -> bool:
    """Whether a writer declares these digests: they fit one hand-over request. A file of
    more (over ~20,000 blocks: ~0.3 GiB of 0.5-1 MiB tensors, ~20 GiB of large ones at the
    default cap) declares none and is read whole at another world size."""
    import json

    return digests is not None and len(json.dumps(digests, separators=(",", ":"))) <= DECLARE_BYTES


def fingerprint(digests: dict | None) -> str | None:
    """One xxh3-128 of a file's digests (canonical JSON): how a peer's recomputed digests
    are compared with the declared ones, in one field of its report."""
    import json

    from lastgood.wire.hashing import hash_bytes

    if digests is None:
        return None
    return hash_bytes(json.dumps(digests, sort_keys=True, separators=(",", ":")).encode())
