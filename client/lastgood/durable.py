"""Durable file-system steps, torch-free: shared by the client's writers (export) and the
service's local blob store, so there is one way to make a rename survive a crash."""

from __future__ import annotations

import os


def fsync_dir(path) -> None:
    """fsync a directory: a rename or a new entry in it is durable only after this."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
