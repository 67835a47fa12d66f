"""Handing the C allocator's free memory back to the system after a peak.

A GC pass or a long page of a query builds many objects at once and frees them; glibc's
malloc keeps the freed pages of its heaps (and CPython's freed arenas leave holes it does
not return either), so a long-running service's RSS climbs to its largest peak so far and
stays there. `malloc_trim(0)` returns what glibc can. Called once after each scheduled GC
pass (main.py), when `LASTGOOD_MALLOC_TRIM` is on; a no-op where the C library is not
glibc (musl, macOS): RSS is then whatever that allocator keeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("lastgood.alloc")

_trim = None  # glibc's malloc_trim, once looked up; False: not available here


def trim() -> bool:
    """Return the C heap's free pages to the system; False where there is no malloc_trim."""
    global _trim
    if _trim is None:
        _trim = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim  # glibc only: AttributeError elsewhere
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _trim = fn
        except (OSError, AttributeError):
            log.info("malloc_trim is not available (not glibc): RSS is left to the allocator")
    if _trim is False:
        return False
    _trim(0)
    return True
