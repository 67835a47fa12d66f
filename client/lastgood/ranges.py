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
MAX_BLOCK = 64 * MiB
HEADER = ""  # the header's segment name (no tensor has an empty name: names come from state paths)


@dataclass(frozen=True)
class Segment:
    name: str       # the tensor's name, HEADER for the header
    start: int      # absolute [start, end) in the file
    end: int


def check_block(block: int) -> int:
    if type(block) is not int or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"range digest block must be 1..{MAX_BLOCK} bytes, got {block!r}")
    return block


def segments(data_start: int, tensors: dict, block: int) -> list[Segment]:
    """Every segment of a file, in file order; `tensors` as in the tensor index
    (name -> {"offsets": [a, b]} relative to the data section). Empty tensors have none."""
    out = [Segment(HEADER, 0, data_start)]
    for name, t in sorted(tensors.items(), key=lambda kv: tuple(kv[1]["offsets"])):
        a, b = t["offsets"]
        for s in range(data_start + a, data_start + b, block):
            out.append(Segment(name, s, min(s + block, data_start + b)))
    return out


class RangeHasher:
    """Fed a file's bytes in order (any chunking), yields the digests of its segments."""

    def __init__(self, data_start: int, tensors: dict, block: int) -> None:
        self.block = check_block(block)
        self._segs = segments(data_start, tensors, block)
        self._i, self._pos = 0, 0
        self._h = StreamHasher()
        self._out: list[str] = []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self._i >= len(self._segs):
                raise FormatError("more bytes than the file's segments cover")
            take = min(view.nbytes, self._segs[self._i].end - self._pos)
            self._h.update(view[:take])
            view, self._pos = view[take:], self._pos + take
            if self._pos == self._segs[self._i].end:
                self._out.append(self._h.hexdigest())
                self._h, self._i = StreamHasher(), self._i + 1

    def digests(self) -> dict:
        """The index object's "digests": {"block", "header", "tensors": {name: [hex, ...]}}."""
        if self._i != len(self._segs):
            raise FormatError(f"the file ended inside segment {self._i} of {len(self._segs)}")
        tensors: dict[str, list[str]] = {}
        for seg, h in zip(self._segs[1:], self._out[1:]):
            tensors.setdefault(seg.name, []).append(h)
        return {"block": self.block, "header": self._out[0], "tensors": tensors}


class RangeDigests:
    """One file's segment digests, checked for shape against its tensor index: which
    segments cover a byte range, and what each must hash to."""

    def __init__(self, data_start: int, tensors: dict, digests: dict) -> None:
        try:
            block = check_block(digests["block"])
            segs = segments(data_start, tensors, block)
            hexes = [digests["header"]]
            per = digests["tensors"]
            for seg in segs[1:]:
                if seg.name not in per:
                    raise KeyError(seg.name)
            names = [s.name for s in segs[1:]]
            for name in dict.fromkeys(names):
                if len(per[name]) != names.count(name):
                    raise ValueError(f"tensor {name!r}: {len(per[name])} digests for {names.count(name)} segments")
                hexes.extend(per[name])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"the file's range digests do not fit its tensor index: {type(e).__name__}: "
                              f"{str(e)[:200]}") from None
        if not all(is_valid_hex(h) for h in hexes):
            raise FormatError("the file's range digests are not xxh3-128 hex digests")
        self.block = block
        self._segs = segs
        self._hex = hexes
        self._starts = [s.start for s in segs]

    def covering(self, a: int, b: int) -> list[tuple[Segment, str]]:
        """The segments that cover [a, b) (a < b), each with its digest, in file order."""
        import bisect

        end = self._segs[-1].end
        if not 0 <= a < b <= end:
            raise ValueError(f"range [{a}, {b}) is outside the file's {end} bytes")
        i = bisect.bisect_right(self._starts, a) - 1
        out = []
        while i < len(self._segs) and self._segs[i].start < b:
            if self._segs[i].end > self._segs[i].start:
                out.append((self._segs[i], self._hex[i]))
            i += 1
        return out
