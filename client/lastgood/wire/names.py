"""Validation of the user-chosen values that cross the wire: names and integer bounds.

Run names and shard file names are user strings. They are never used to build a storage
key (keys derive from ids and hashes), but they appear in URLs and in file names on
download, so they are restricted to a safe alphabet: no '/', no '..', no control bytes.
Every pattern must match the *whole* value (`fullmatch`): `re.match(r"...$")` also
accepts a trailing newline, and a committed file named `x\\n` could never be downloaded.

Integers a client sends (ids, steps, ranks, sizes, offsets) are bounded here too, once, so
that the REST models, the path parameters and the gRPC handlers refuse the same values
before any of them reaches the catalog (SQLite and PostgreSQL integers are 64-bit signed).

The hand-over contract is spelled here too, once for both sides. Two data paths hand a
file over by name instead of streaming it, and share it: the spool (the same-host hand-over,
docs/architecture.md) and direct-FS (a trainer that mounts the local store's directory
writes its file in place, from any host: docs/dataplane.md). Each hand-over directory holds
an id file that tells a client it sees the directory the service reads; the files a client
hands over have one name pattern; the spool's `.out/` holds the links the service lends
back; direct-FS's staging directory sits under the store's root, and a peer that checks
another rank's file reads it at a store path the service names (`check_store_path`).
"""

from __future__ import annotations

import re
import secrets

# the system tag every run has, naming its last-good checkpoint (derived, never stored as a tag)
LAST_GOOD_TAG = "last-good"

_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_ATTEMPT = re.compile(r"[A-Za-z0-9._:-]{1,64}")
SPOOL_ID_FILE = ".lastgood-spool"  # in the spool directory: the service's random id for it
DIRECT_STAGING_DIR = "direct"  # under the local store's root: where direct-FS writers put their files
SPOOL_OUT_DIR = ".out"  # in the spool directory: links to blobs the service lends to same-host readers
_SPOOL_PATTERN = r"[0-9a-f]{32}\.part"
_SPOOL = re.compile(_SPOOL_PATTERN)  # a file a client hands over in the spool
_STORE_PATH = re.compile(r"[A-Za-z0-9._-]{1,200}(/[A-Za-z0-9._-]{1,200}){0,15}")  # a blob, relative to the store's root
_LENT = re.compile(re.escape(SPOOL_OUT_DIR) + "/" + _SPOOL_PATTERN)  # a link the service lends, relative to the spool

# The same rules as JSON Schema (ECMA-262) patterns, for the OpenAPI document, so that a
# request a client builds from the schema is one the checks below accept (no '..' is spelt
# without a lookahead: a dot is never followed by another dot). tests/unit/test_names_schema.py
# holds each pattern to its check.
_NO_DOTDOT = r"(?:\.?[A-Za-z0-9_-])*\.?"
SCHEMA = {
    "run": {"pattern": r"^[A-Za-z0-9]" + _NO_DOTDOT + "$", "minLength": 1, "maxLength": 128},
    "file": {"pattern": r"^[A-Za-z0-9]" + _NO_DOTDOT + "$", "minLength": 1, "maxLength": 200},
    "attempt": {"pattern": r"^(?:\.|\.?(?:[A-Za-z0-9_:-]\.?)+)$", "minLength": 1, "maxLength": 64},
    # a tag may hold any printable text but for its system names; the schema names the
    # portable part of it: printable ASCII, no leading or trailing space
    "tag": {"pattern": r"^[!-~](?:[ -~]*[!-~])?$", "minLength": 1, "maxLength": 128},
}

MAX_ID = 2**62      # checkpoint, lease and token ids; steps; byte offsets (headroom under int64)
MAX_RANK = 2**31 - 1  # ranks and world sizes (int32)


class InvalidValue(ValueError):
    """A value outside the bounds the wire allows."""


class InvalidName(InvalidValue):
    pass


def _check(kind: str, value: object, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value:
        raise InvalidName(f"invalid {kind} {value[:80] if isinstance(value, str) else value!r}: {rule}")
    return value


def check_run_name(value: object) -> str:
    return _check(
        "run name", value, _RUN,
        "1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'",
    )


def check_file_name(value: object) -> str:
    return _check(
        "file name", value, _FILE,
        "1-200 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, no '/' or '..'",
    )


def check_attempt(value: object) -> str:
    return _check("attempt", value, _ATTEMPT, "1-64 characters from A-Z a-z 0-9 . _ : -")


def new_spool_name() -> str:
    """A fresh name of the spool's pattern: a file to hand over, or a link to lend."""
    return f"{secrets.token_hex(16)}.part"


def new_lent_name(now: float) -> str:
    """A name of the spool's pattern for a link the service lends, saying when: the first
    12 hex digits are the second it was made, the rest random. The link's inode is the
    blob's, whose ctime every other link or unlink of the same blob moves, so only the
    name can age it (lent_at)."""
    return f"{int(now):012x}{secrets.token_hex(10)}.part"


def lent_at(name: str) -> int | None:
    """When a link named by new_lent_name was made (seconds); None for another name."""
    return int(name[:12], 16) if is_spool_name(name) else None


def is_spool_name(value: object) -> bool:
    return isinstance(value, str) and _SPOOL.fullmatch(value) is not None


def is_lent_name(value: object) -> bool:
    return isinstance(value, str) and _LENT.fullmatch(value) is not None


def check_store_path(value: object) -> str:
    """A blob's path relative to a direct-FS mount, as the service names it for a peer
    check: relative, no '..', no hidden component; it never leaves the mount."""
    if (not isinstance(value, str) or not _STORE_PATH.fullmatch(value)
            or any(part.startswith(".") for part in value.split("/"))):
        raise InvalidName(f"invalid store path {str(value)[:80]!r}: relative, A-Z a-z 0-9 . _ - and '/', "
                          f"no component starting with '.'")
    return value


def check_int(kind: str, value: object, high: int = MAX_ID, low: int = 0) -> int:
    """`value` as an int within [low, high], else InvalidValue (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidValue(f"{kind} must be an integer in {low}..{high}, got {str(value)[:40]}")
    return value
