"""Shard chunks framed by hand: the protobuf encoding of a message that holds one bytes field.

A shard moves as 4 MiB chunks. Through the generated protobuf classes every chunk is copied
three times on the way out (`bytes(view)`, into the message, `SerializeToString`) and twice
on the way in (parse, `.chunk`). The wire bytes of `PutShardRequest{chunk}` and
`GetShardResponse{chunk}` are just a tag byte, the length as a varint, and the chunk, so
both ends write and read that directly: one copy to send (grpc needs a `bytes`), none to
receive (a `memoryview` into the message grpc handed over). The bytes on the wire are the
ones protobuf would write, so the .proto does not change and any protobuf peer interoperates;
a message in any other valid encoding is parsed with protobuf instead.
"""

from __future__ import annotations

# tag byte = field number << 3 | wire type 2 (length-delimited)
PUT_CHUNK = 2 << 3 | 2  # PutShardRequest.chunk (field 2)
GET_CHUNK = 1 << 3 | 2  # GetShardResponse.chunk (field 1)

def varint(n: int) -> bytes:
    if n < 0:
        raise ValueError("varint of a negative number")
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def frame(tag: int, chunk) -> bytes:
    """The wire form of a message whose only field is the bytes field `tag`: one copy of `chunk`."""
    view = memoryview(chunk).cast("B")
    return b"".join((bytes((tag,)), varint(view.nbytes), view))


def unframe(raw: bytes, tag: int) -> memoryview | None:
    """The chunk of a message framed as `frame` writes it, without copying, or None when the
    message is encoded any other way (empty, another field, a field repeated, a long varint):
    the caller then parses it with protobuf, which gives the same meaning."""
    end = len(raw)
    if end < 2 or raw[0] != tag:
        return None
    n = shift = 0
    i = 1
    while i < end and i <= 10:
        b = raw[i]
        n |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return memoryview(raw)[i:] if i + n == end else None
        shift += 7
    return None
