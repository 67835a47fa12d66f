"""Python's cyclic garbage collector in a service that runs for months.

CPython finds reference cycles in three generations. A collection of the oldest
(generation 2) walks every container object the process holds, and a started service
holds about 110,000 that will never be garbage (the modules, classes and functions of
SQLAlchemy, FastAPI, gRPC, pydantic and our own). Such a collection takes 60-100 ms of
CPU, in whichever thread happens to allocate when it is due: that query, or that GC
batch holding the catalog's write lock, takes 60-100 ms longer. At 100,000 checkpoints
about one query in 70 has one inside it, unless frozen: those are the p99s over 50 ms
(bench/README.md, "The catalog at scale": timed with `gc.callbacks`).

`gc.freeze()` moves every object alive at that moment to a permanent generation the
collector never walks again; later collections walk only what was allocated since
(0.4-5 ms measured). It is called once, when start-up is done (main.py), after a full
collection so that start-up's garbage is not frozen with it. The price: a frozen object
that later ends up in a garbage cycle is never freed, and start-up's objects live as long
as the process anyway. `LASTGOOD_PYTHON_GC_FREEZE=false` turns it off. Benchmarks that
run the domain in their own process call the same function.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger("lastgood.pygc")


def freeze_startup(settings: "Settings") -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many objects are frozen (0 with `settings.python_gc_freeze` off)."""
    if not settings.python_gc_freeze:
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects: Python's cyclic GC will not walk them again", frozen)
    return frozen
