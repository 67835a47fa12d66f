"""Storage faults as the caller should hear them, and the room GC needs on a full disk.

A full disk, a failing device or a catalog database that is away is not a bug in the
service: the trainer should read "store full: N bytes free" (RESOURCE_EXHAUSTED / 507),
"I/O error on ..." or "the catalog is unavailable (...)" (UNAVAILABLE / 503, which the
client retries), never "failed inside the service". `as_domain_error` is the one place that
maps them; both transports call it before falling back to INTERNAL.

GC must be able to free a full disk, yet it records each deletion in the catalog before it
deletes the blobs (a crash must leave orphans, never holes), and SQLite cannot write a byte
at 0 bytes free. So the service keeps a *ballast* file beside an SQLite catalog: space
held back that GC gives up when the catalog reports a full disk, then takes again once
the pass has freed room.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from .errors import DomainError, StoreFull, Unavailable

log = logging.getLogger("lastgood.faults")

_FULL = {errno.ENOSPC, errno.EDQUOT}
_IO = {errno.EIO, errno.EROFS, errno.ENXIO, errno.ENODEV}


def free_bytes(path: str | os.PathLike | None) -> int | None:
    """Free bytes of the file system holding path (its nearest existing parent)."""
    if path is None:
        return None
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC from the OS, SQLite's "database or disk is full", PostgreSQL's 53100."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        text = str(e)
        if "database or disk is full" in text or getattr(e, "sqlstate", None) == "53100":
            return True
    return False


def as_domain_error(exc: BaseException) -> DomainError | None:
    """The typed error a storage fault means, or None for anything else."""
    if isinstance(exc, DomainError):
        return exc
    if is_disk_full(exc):
        where = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
        free = free_bytes(where)
        return StoreFull("store full" + (f": {free} bytes free" if free is not None else "")
                         + (f" on the file system of {Path(where).parent}" if where else "")
                         + "; free space (GC, retention) or grow the volume")
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _IO:
            return Unavailable(f"I/O error on {e.filename or 'the store'}: {os.strerror(e.errno)}")
    fault = catalog_fault(exc)
    if fault is not None:
        return Unavailable(f"the catalog is unavailable ({fault}); the request did not complete: retry")
    return None


# SQLite primary result codes (an sqlite3 error's sqlite_errorcode & 0xFF) of a catalog file
# that cannot be read or written now: busy or locked past the busy timeout, an I/O error
# (EIO on the file), the file unopenable, the WAL's lock protocol failing
_SQLITE_TRANSIENT = {5: "SQLITE_BUSY", 6: "SQLITE_LOCKED", 10: "SQLITE_IOERR", 14: "SQLITE_CANTOPEN",
                     15: "SQLITE_PROTOCOL"}
# PostgreSQL SQLSTATEs of a server that is away, restarting, overloaded or that ended a
# transaction which may succeed when sent again; class 08 is every connection exception
_PG_TRANSIENT = {"57P01": "admin shutdown", "57P02": "crash shutdown", "57P03": "cannot connect now",
                 "53300": "too many connections", "40001": "serialization failure", "40P01": "deadlock",
                 "55P03": "lock not available", "57014": "statement cancelled"}


def catalog_fault(exc: BaseException) -> str | None:
    """What makes this a transient fault of the catalog database -- a lost or refused
    connection, a server restarting, an I/O error on an SQLite file, a full connection pool
    -- in a few words; None for anything else (a bug stays INTERNAL). The words name the
    fault, never the database's address or message."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    for e in _chain(exc):
        if getattr(e, "connection_invalidated", False):  # SQLAlchemy saw a disconnect
            return "connection lost"
        if isinstance(e, PoolTimeout):
            return "no free catalog connection"
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE_TRANSIENT:
            return _SQLITE_TRANSIENT[code & 0xFF]
        state = getattr(e, "sqlstate", None)
        if isinstance(state, str) and (state in _PG_TRANSIENT or state.startswith("08")):
            return f"PostgreSQL {state}: {_PG_TRANSIENT.get(state, 'connection exception')}"
        if state is None and type(e).__module__.startswith("psycopg") and type(e).__name__ == "OperationalError":
            return "PostgreSQL unreachable"  # refused, reset or closed before the server sent a code
    return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "orig", None)


class Ballast:
    """A file of `size` bytes held on the catalog's file system, given up so GC can write."""

    def __init__(self, path: Path | None, size: int) -> None:
        self.path, self.size = path, size

    def ensure(self) -> bool:
        """Hold the space again (if it is there to be had); True when held."""
        if self.path is None or self.size <= 0:
            return False
        try:
            if self.path.exists() and self.path.stat().st_size == self.size:
                return True
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, self.size)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            return True
        except OSError as e:
            self.path.with_suffix(".tmp").unlink(missing_ok=True)
            log.warning("cannot hold %d bytes of ballast at %s (%s); GC on a full disk may fail",
                        self.size, self.path, e)
            return False

    def release(self) -> bool:
        """Give the space back; True if there was any to give."""
        if self.path is None or not self.path.exists():
            return False
        self.path.unlink()
        log.warning("disk full: released %d bytes of ballast (%s) so that GC can record its deletions",
                    self.size, self.path)
        return True
