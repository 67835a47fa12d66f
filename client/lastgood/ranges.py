"""Range digests: any byte range of a stored shard file can be verified without the rest.

The manifest's xxh3-128 covers a whole file, so a reader that wants a few tensors of it
(a restore at another world size, docs/resharding.md) would have to read all of it to
check them. Each file's tensor index object therefore also records the xxh3-128 of every
*segment* of the file:

  - the header, [0, data_start): one segment (at most format.MAX_HEADER_BYTES);
  - each tensor, cut into blocks of `block` bytes from the tensor's own start (the last
    one shorter); a tensor of `block` bytes or less is one segment.

Why per tensor *and* per block: segments never straddle two tensors, so reading one
tensor (the replicated state, a whole stored shard) reads exactly its bytes, while a
huge tensor still costs at most one block of extra bytes at each end of a range within
it. A reader verifies a range [a, b) by reading the segments that cover it, whole, and
checking each against its digest: at most 2 x `block` bytes more than the range.

The service computes them (RangeHasher) from the stream it already hashes and checks
against the client's whole-file hash when the file is uploaded: one more hash pass over
bytes in the CPU's cache, and the digests are of exactly the bytes the client committed.
The index object's own hash is in the manifest's root, whose hash the service checks, so
the chain from the commit to every segment is whole. A file whose index has no digests
(uploaded before them) is read whole, as before. This module is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FormatError
from .hashing import StreamHasher, is_valid_hex

MiB = 1024 * 1024
DEFAULT_BLOCK = 1 * MiB  # 1 GiB of tensors: 1,024 digests, ~35 KB in the index object
MIN_BLOCK = 4 * 1024  # below this the digests outweigh the bytes they save reading (36 B per block)
MAX_BLOCK = 64 * MiB
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


def iter_segments(data_start: int, tensors: dict, block: int):
    """Every segment of a file, in file order, made as they are asked for (a file of many
    small blocks never has them all in memory); `tensors` as in the tensor index (name ->
    {"offsets": [a, b]} relative to the data section). Empty tensors have none."""
    spans = _spans(data_start, tensors)
    yield Segment(HEADER, 0, data_start)
    for a, b, name in spans[1:]:
        for s in range(a, b, block):
            yield Segment(name, s, min(s + block, b))


def segments(data_start: int, tensors: dict, block: int) -> list[Segment]:
    return list(iter_segments(data_start, tensors, block))


class RangeHasher:
    """Fed a file's bytes in order (any chunking), yields the digests of its segments."""

    def __init__(self, data_start: int, tensors: dict, block: int) -> None:
        self.block = check_block(block)
        self._n = 1 + sum(_count(a, b, block) for a, b, _ in _spans(data_start, tensors)[1:])
        self._segs = iter_segments(data_start, tensors, block)
        self._seg = next(self._segs)
        self._i, self._pos = 0, 0
        self._h = StreamHasher()
        self._header = ""
        self._tensors: dict[str, list[str]] = {}

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self._seg is None:
                raise FormatError("more bytes than the file's segments cover")
            take = min(view.nbytes, self._seg.end - self._pos)
            self._h.update(view[:take])
            view, self._pos = view[take:], self._pos + take
            if self._pos == self._seg.end:
                if self._seg.name == HEADER:
                    self._header = self._h.hexdigest()
                else:
                    self._tensors.setdefault(self._seg.name, []).append(self._h.hexdigest())
                self._h, self._i = StreamHasher(), self._i + 1
                self._seg = next(self._segs, None)

    def digests(self) -> dict:
        """The index object's "digests": {"block", "header", "tensors": {name: [hex, ...]}}."""
        if self._i != self._n:
            raise FormatError(f"the file ended inside segment {self._i} of {self._n}")
        return {"block": self.block, "header": self._header, "tensors": self._tensors}


class RangeDigests:
    """One file's segment digests, checked for shape against its tensor index: which
    segments cover a byte range, and what each must hash to.

    Kept small, since a rank holds one per old file it reads from: the bounds of each
    tensor (the segments follow from the block) and the digests as 16 raw bytes each,
    not Segment objects and hex strings (~120 B per segment more)."""

    def __init__(self, data_start: int, tensors: dict, digests: dict) -> None:
        try:
            block = check_block(digests["block"])
            spans = _spans(data_start, tensors)
            per = digests["tensors"]
            hexes = [digests["header"]]
            firsts = [0]
            for a, b, name in spans[1:]:  # one pass: a count per tensor, not per segment
                want = _count(a, b, block)
                if len(per[name]) != want:
                    raise ValueError(f"tensor {name!r}: {len(per[name])} digests for {want} segments")
                firsts.append(len(hexes))
                hexes.extend(per[name])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"the file's range digests do not fit its tensor index: {type(e).__name__}: "
                              f"{str(e)[:200]}") from None
        if not all(is_valid_hex(h) for h in hexes):
            raise FormatError("the file's range digests are not xxh3-128 hex digests")
        self.block = block
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
            step = tb - ta if name == HEADER else self.block
            k = max(a - ta, 0) // step if tb > ta else 0
            while ta + k * step < min(b, tb):
                s = ta + k * step
                j = self._firsts[i] + k
                out.append((Segment(name, s, min(s + step, tb)), self._raw[16 * j:16 * j + 16].hex()))
                k += 1
            i += 1
        return out
