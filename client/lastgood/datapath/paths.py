"""Data paths: how one file of a rank reaches the service's store. torch-free.

The save session (session.py) runs the commit protocol and knows nothing of bytes on the
move; a data path moves them and knows nothing of the protocol. Each file goes through
three calls:

    handle = path.prepare(name, data)   # before begin where the caller can: no checkpoint id yet
    path.send(cid, rank, handle)        # after begin: the file is the service's, verified
    path.discard(handle)                # what prepare left that send did not hand over

`prepare` does what needs no checkpoint: hashing, and writing the bytes somewhere the
service will take them from. Done before begin, a long write never runs into the
checkpoint's lease. (The spool's followed hand-over writes in `send` instead, while the
service reads behind it and renews the lease as the bytes come: below.) Its handle
carries what the protocol needs:

- `digest`: the whole file's xxh3-128, sent with the file and compared with the manifest
  when a reply was lost (the session's lost-reply check); None until `send` for a file
  written as it is sent;
- `expected_bytes`: what begin tells the service the store must still find room for (the
  service refuses a begin the store cannot hold): the file's size when its bytes travel
  to the service, 0 when they are already written where the service takes them from.

`send` must be safe to retry after a lost reply (the service answers a file it has
already with `already_present`) and is final: whatever the path tried, after it returns
the service holds the file as `file_name` of `rank`, verified, or it raised. The session
then votes with the names of every file the rank sent (`CommitRank.files`, in the order
they were added). A path whose service side must hear more at the vote (S3's parts) keeps
it on its handle (`token`); `Upload._vote` is the one place that would pass it on.

Two paths here, chosen per save by `choose.default_path`:

- `StreamPath`: the bytes go over gRPC (PutShard, chunked).
- `SpoolPath`: on the service's host, the file is written into its spool, hashed as it is
  written, and only its name is sent (docs/architecture.md, *The spool*). Where the
  service offers it (GET /api/v1/info: spool.follow), the file is written in `send`,
  after begin, and the service hashes each piece a moment after it is written instead
  of re-reading the whole file afterwards (Transport.put_followed). Anything that fails on
  the way falls back to the stream, so it is never worse than streaming; a refusal of
  the file or of the checkpoint itself is raised, as streaming would not change it.

A `direct` path (the rank writes to the store itself: a shared file system, S3 through
grants) is a third implementation of the same calls; `choose.default_path` is the one
place that chooses a path, for writes and reads alike.

Reads: `read_file` (a whole file into a buffer, hashed as it arrives) and `read_range`
(bytes the caller verifies by their range digests). The stream reads through the service
(GetShard; on the service's host a lent link in its spool); direct S3 reads the store
through presigned GETs. `directs3.DirectS3Path` is the S3 one: chosen whenever the
service offers direct uploads, it keeps the part checksums on the handle (`token`) and
hands the upload over in `send`, so the vote names files as for every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lastgood.wire.hashing import StreamHasher, hash_bytes


@dataclass
class Prepared:
    """One file, ready to send. `token` is the path's own (a spool file's name, a staging
    path, an upload id); nobody else reads it."""

    name: str
    data: memoryview
    digest: str | None  # None: written as it is sent (SpoolPath, FOLLOW), known once sent
    expected_bytes: int
    token: object = None


FOLLOW = "follow"  # a SpoolPath handle's token: the file is written while the service follows it
# a handle's token: a file small enough (Info.inline_bytes) to travel with the vote, its bytes in
# CommitRank.inline_files (one call fewer for a small state); `send` streams it if it does not fit
INLINE = "inline"


def carried(handles: list[Prepared], budget: int) -> list[Prepared]:
    """Of `handles`, those the vote carries (token INLINE), in order, while their bytes fit
    `budget` in all (the service's inline_bytes); the rest are sent as any file is."""
    out = []
    for h in handles:
        if h.token is INLINE and h.data.nbytes <= budget:
            out.append(h)
            budget -= h.data.nbytes
    return out


@runtime_checkable
class DataPath(Protocol):
    name: str

    def prepare(self, name: str, data) -> Prepared: ...

    def send(self, checkpoint_id: int, rank: int, handle: Prepared) -> None: ...

    def discard(self, handle: Prepared) -> None: ...

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                  into=None) -> tuple[memoryview, str]: ...

    def read_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None: ...


class StreamPath:
    """The bytes over the gRPC stream (PutShard); works from anywhere the service answers."""

    name = "stream"

    def __init__(self, transport) -> None:
        self.transport = transport

    def prepare(self, name: str, data) -> Prepared:
        data = memoryview(data).cast("B")
        return Prepared(name, data, hash_bytes(data), expected_bytes=data.nbytes,
                        token=INLINE if self._small(data) else None)

    def _small(self, data: memoryview) -> bool:
        """Small enough to travel with the vote (the service's GET /api/v1/info: inline_bytes)."""
        return data.nbytes <= self.transport.info.inline_bytes

    def send(self, checkpoint_id: int, rank: int, handle: Prepared) -> None:
        self.transport.put_shard(checkpoint_id, rank, handle.name, handle.data, handle.digest)
        handle.token = None

    def discard(self, handle: Prepared) -> None:
        pass

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                  into=None) -> tuple[memoryview, str]:
        return self.transport.stream_file(checkpoint_id, rank, file_name, size, into)

    def read_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
        self.transport.stream_range(checkpoint_id, rank, file_name, offset, into)


class SpoolPath(StreamPath):
    """On the service's host: the file handed over through its spool (transport.spool_write,
    put_shard(spooled=...)); streamed whenever that is not possible."""

    name = "spool"

    def prepare(self, name: str, data) -> Prepared:
        data = memoryview(data).cast("B")
        if self._small(data):  # no spool file: its bytes go with the vote (or are streamed)
            return super().prepare(name, data)
        if (self.transport.spool or {}).get("follow"):  # written in send(), behind the checkpoint's begin
            # its bytes are still to be written on the service's disk: begin checks there is room
            return Prepared(name, data, None, expected_bytes=data.nbytes, token=FOLLOW)
        hasher = StreamHasher()  # fed as the spool file is written: one pass over the bytes
        spooled = self.transport.spool_write(data, hasher)
        if not spooled:  # no spool here, or writing failed: streamed
            return super().prepare(name, data)
        digest = hasher.hexdigest() if hasher.size == data.nbytes else hash_bytes(data)
        # the spool it was written to, kept: the transport forgets its spool when the service
        # declines one hand-over, and the files written before that must still be removed
        return Prepared(name, data, digest, expected_bytes=0, token=(spooled, self.transport.spool))

    def send(self, checkpoint_id: int, rank: int, handle: Prepared) -> None:
        if handle.token is None or handle.token is INLINE:  # bytes in memory only: streamed
            return super().send(checkpoint_id, rank, handle)
        if handle.token is FOLLOW:  # written now, read by the service as it is written
            handle.digest = self.transport.put_followed(checkpoint_id, rank, handle.name, handle.data)
            handle.token = None
            return
        # a hand-over that fails for any reason is streamed, and the spool file removed
        name, spool = handle.token
        try:
            self.transport.put_shard(checkpoint_id, rank, handle.name, handle.data, handle.digest, spooled=name)
        finally:
            self.transport.spool_discard(name, spool)  # gone already when the service took it
        handle.token = None

    def discard(self, handle: Prepared) -> None:
        if handle.token not in (None, FOLLOW, INLINE):  # a followed file is not written yet, a small one never
            self.transport.spool_discard(*handle.token)
        handle.token = None
