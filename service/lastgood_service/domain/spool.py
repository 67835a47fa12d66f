"""The spool: a same-host hand-over of shard files, instead of streaming them over a socket.

A trainer on the service's own host writes its shard into the spool directory and sends
only the header (with `spool_file` and the spool's id). The service *takes* the file - it
renames it into a directory of its own, so the name cannot be swapped under it - opens it
without following links, checks that it is a regular file of the declared size, then hashes
every byte and publishes it exactly as it would publish streamed bytes (commit.put_shard);
a local blob store adopts the file by rename, with no second write. Nothing is trusted that
is not re-hashed.

The directory is the service user's (mode 0700): a client that cannot read the id file in
it - another user, another container, another host behind the same load balancer - streams.
The id, a random value per spool directory, tells a client that the directory it sees is the
one this service reads: a header whose id is not ours is refused before any file is touched.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import FailedPrecondition, InvalidArgument

ID_FILE = ".lastgood-spool"
_NAME = re.compile(r"^[0-9a-f]{32}\.part$")


class Spool:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory).resolve()
        self.taken_dir = self.dir / ".taken"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.taken_dir.mkdir(mode=0o700, exist_ok=True)
        id_file = self.dir / ID_FILE
        if not id_file.exists():
            tmp = self.dir / f"{ID_FILE}.{secrets.token_hex(4)}.tmp"
            tmp.write_text(secrets.token_hex(16))
            os.replace(tmp, id_file)
        self.id = id_file.read_text().strip()
        for stale in self.taken_dir.iterdir():  # taken by a process that died before publishing
            _remove(stale)

    def info(self) -> dict:
        return {"dir": str(self.dir), "id": self.id}

    def take(self, name: str, spool_id: str, size: int) -> Path:
        """Move the client's file out of its reach and check it; the caller owns it now."""
        if spool_id != self.id:
            raise FailedPrecondition("spool: the header names another spool (another host or data directory); "
                                     "stream the shard instead")
        if not _NAME.match(name):
            raise InvalidArgument(f"spool_file must be 32 hex digits + '.part', got {name[:80]!r}")
        taken = self.taken_dir / name
        try:
            os.rename(self.dir / name, taken)  # atomic; a symlink moves as a link and fails below
        except FileNotFoundError:
            raise InvalidArgument(f"spool_file {name} is not in the spool") from None
        try:
            fd = os.open(taken, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError:
            _remove(taken)
            raise InvalidArgument(f"spool_file {name} is not a regular file") from None
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            _remove(taken)
            raise InvalidArgument(f"spool_file {name} is not a regular file with one link")
        if st.st_size != size:
            _remove(taken)
            raise InvalidArgument(f"spool_file {name} holds {st.st_size} bytes, the header declares {size}")
        return taken

    def sweep(self, max_age_seconds: float) -> int:
        """Remove client files never handed over (their writer died) older than max_age."""
        now, n = time.time(), 0
        for p in self.dir.iterdir():
            if p.name.startswith(".") or not _NAME.match(p.name):
                continue
            try:
                if now - p.lstat().st_mtime > max_age_seconds:
                    _remove(p)
                    n += 1
            except FileNotFoundError:
                pass
        return n


def read_chunks(path: Path, chunk: int) -> Iterator[memoryview]:
    """The file's bytes in pieces of at most `chunk`, through one reused buffer: a consumer
    that keeps a piece must copy it."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            yield view[:n]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
