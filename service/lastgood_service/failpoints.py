"""Failpoints: the testing-only points where the service crashes, holds or fails on purpose,
so that a test reaches what a real crash, a slow store or a failing catalog or device
leaves behind. LASTGOOD_FAILPOINT arms one (settings.failpoint); `Failpoint` lists every
point the code has, and the settings refuse any other name at start: a misspelt one would
arm nothing, and the test that meant it would pass without testing anything.

Each member is the very string the setting takes (a str enum), but
VOTE_FAILS_ON_CHECKPOINT, which takes a checkpoint id in its place: `vote_fails_on_checkpoint_17`.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("lastgood.commit")  # every crash or hold point lies on a commit or its uploads

_ID = "<id>"


class Failpoint(str, enum.Enum):
    # the commit (domain/commit/protocol.py)
    CRASH_BEFORE_MANIFEST = "crash_before_manifest"
    """The process exits (77) as a commit is about to write its manifest."""
    HOLD_MANIFEST = "hold_manifest"
    """Every commit waits before its manifest write until <data_dir>/hold_manifest.release exists."""
    CRASH_AFTER_MANIFEST = "crash_after_manifest"
    """The process exits (77) between a commit's manifest write and its transaction."""
    COMMIT_FAILS_ONCE = "commit_fails_once"
    """The process's first commit attempt fails before it reads anything, as a transient catalog error would."""
    LOSE_COMMIT_REPLY = "lose_commit_reply"
    """Every CommitRank reply after the commit happened fails."""
    # the vote batches (domain/commit/votebatch.py)
    VOTE_BATCH_FAILS_ONCE = "vote_batch_fails_once"
    """The first vote batch's transaction fails after its rows were written."""
    VOTE_FAILS_ON_CHECKPOINT = "vote_fails_on_checkpoint_" + _ID
    """That checkpoint's part of every vote batch fails with an SQL error."""
    # direct S3 uploads (domain/dataplane/grants.py)
    CRASH_AFTER_DIRECT_COMPLETE = "crash_after_direct_complete"
    """The process exits (77) after a direct upload's completion, before the file is recorded."""
    HOLD_DECLARED_INDEX = "hold_declared_index"
    """A direct hand-over that declares range digests waits before they are checked, until
    <data_dir>/hold_declared_index.release exists."""
    # the blob store (main.py)
    BLOB_EIO = "blob_eio"
    """Every blob write fails with EIO (blobstore/faulty.py)."""
    # the catalog (main.py, catalog/db.py)
    CATALOG_EIO = "catalog_eio"
    """While <data_dir>/catalog_eio.on exists, every catalog statement fails as SQLite's does on
    an EIO from its file (sqlite3.OperationalError "disk I/O error", SQLITE_IOERR), raised at
    the DB-API level through SQLAlchemy's before_cursor_execute hook (catalog/db.inject_eio)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def parse(cls, value: str) -> tuple[Failpoint, int | None]:
        """The point a setting names, and the checkpoint id it carries (None but for
        VOTE_FAILS_ON_CHECKPOINT). ValueError, listing every valid name, for any other."""
        for point in cls:
            if not point.value.endswith(_ID):
                if value == point.value:
                    return point, None
            elif value.startswith(stem := point.value[:-len(_ID)]) and value[len(stem):].isdigit():
                return point, int(value[len(stem):])
        raise ValueError(f"unknown failpoint {value!r}: LASTGOOD_FAILPOINT is one of "
                         f"{', '.join(p.value for p in cls)} (testing only; unset it otherwise)")


def reach(point: Failpoint, armed: str | None, data_dir: Path) -> None:
    """Where the code has a crash or hold point: when `armed` (settings.failpoint) names it,
    exit the process abruptly (77), or for a hold_* point block until the file
    <data_dir>/<point>.release exists (a test holds a call right there, to see what other
    calls do meanwhile)."""
    if armed != point:
        return
    if point.value.startswith("hold_"):
        log.warning("failpoint %s: holding until %s.release exists", point, point)
        while not (data_dir / f"{point}.release").exists():
            time.sleep(0.05)
    else:
        log.critical("failpoint %s: exiting abruptly", point)
        os._exit(77)
