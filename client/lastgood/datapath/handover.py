"""Hand-over directories on the trainer's host: the service's spool and direct-FS's staging
directory (a file is written there and only its name is sent), and the links the service
lends in its spool's `.out/` instead of streaming a stored file to a same-host reader.
The names are the wire's (lastgood.wire.names); docs/format.md says what lies where."""

from __future__ import annotations

import os

from lastgood.common import durable
from lastgood.errors import CorruptCheckpoint, ServiceError
from lastgood.wire import names
from lastgood.wire.hashing import StreamHasher
from lastgood.wire.info import DirectFSOffer, SpoolOffer

PIECE = 8 * 1024 * 1024  # written, hashed and read back in pieces of this size


def find_dir(spec: SpoolOffer | DirectFSOffer | None, local_dir: str | None = None) -> dict | None:
    """A hand-over directory the service announced (its spool, or direct-FS's staging
    directory), if this process sees the same directory - at `local_dir` when it mounts it
    elsewhere than the service's path - (its id file matches) and may write there. The
    answer names the directory as this process sees it."""
    if not spec:
        return None
    try:
        where = local_dir or spec.dir
        with open(os.path.join(where, names.SPOOL_ID_FILE)) as f:
            same = f.read().strip() == spec.id
    except OSError:
        return None
    found = {"dir": where, "id": spec.id, "follow": getattr(spec, "follow", False)}
    return found if same and os.access(where, os.W_OK | os.X_OK) else None


def write_piece(fd: int, view: memoryview, off: int, hasher: StreamHasher | None,
                 writeback: durable.Writeback) -> int:
    """Write the spool-sized piece of `view` at `off` (hashed just before, while it is in the
    CPU's cache: one pass over the bytes), start its writeback (the disk works while the next
    piece is written), and return where the next piece starts."""
    piece = view[off:off + PIECE]
    if hasher is not None:
        hasher.update(piece)
    durable.write_all(fd, piece)
    writeback.start(off, piece.nbytes)
    return off + piece.nbytes


def _open_lent(spool_dir: str, name: str) -> int:
    """Open a link the service made in its spool and remove it (the descriptor keeps the bytes)."""
    if not names.is_lent_name(name):
        raise ServiceError(f"GetShard named a spool file {name[:80]!r} outside the spool's .out/")
    path = os.path.join(spool_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ServiceError(f"GetShard: cannot open the spool file {name}: {e}") from None
    try:
        os.unlink(path)
    except OSError:
        os.close(fd)
        raise
    return fd


def pread_lent(spool_dir: str, name: str, view: memoryview, offset: int) -> int:
    """Read bytes [offset, offset + len(view)) of a lent link into `view` (fewer when the
    file is shorter); remove the link."""
    fd = _open_lent(spool_dir, name)
    try:
        return durable.read_into(fd, view, offset, PIECE)  # past the page cache where it holds none
    finally:
        os.close(fd)


def read_lent(spool_dir: str, name: str, view: memoryview, hasher: StreamHasher) -> int:
    """Read a link the service made in its spool (the file, up to len(view) bytes and one
    more to notice a longer file) into `view`, hashing each piece; remove the link."""
    fd = _open_lent(spool_dir, name)  # ours from here on: the open descriptor keeps the bytes
    try:
        pos = durable.read_into(fd, view, 0, PIECE, hasher)  # past the page cache where it holds none
        if pos == view.nbytes and os.pread(fd, 1, pos):
            raise CorruptCheckpoint(f"the stored file lent as {name} is longer than the committed "
                                    f"{view.nbytes} bytes")
        return pos
    finally:
        os.close(fd)
