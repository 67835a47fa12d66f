"""Validation of the user-chosen strings that cross the wire.

Run names and shard file names are user strings. They are never used to build a storage
key (keys derive from ids and hashes), but they appear in URLs and in file names on
download, so they are restricted to a safe alphabet: no '/', no '..', no control bytes.
"""

from __future__ import annotations

import re

_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_ATTEMPT = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class InvalidName(ValueError):
    pass


def _check(kind: str, value: object, pattern: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str) or not pattern.match(value) or ".." in value:
        raise InvalidName(f"invalid {kind} {value!r}: {rule}")
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
