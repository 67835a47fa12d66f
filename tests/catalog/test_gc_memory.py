"""GC's plan of a run reads what it may decide about, not the run's whole history: a run
that has saved for months is mostly DELETED rows, and reading them all on every pass made
the service's memory peaks (and so its RSS, which keeps a peak's free space) grow with the
run's age (the 30-minute soak: RSS 166 -> 298 MiB)."""

from __future__ import annotations

import tracemalloc

from bench.seed import seed

from .test_gc_batches import collector

DELETED_ROWS = 4000


def _plan_peak(gc) -> tuple[int, object]:
    gc.plan(full=False)  # warm: compiled statements and the like are not what is measured
    tracemalloc.start()
    try:
        plan = gc.plan(full=False)
        return tracemalloc.get_traced_memory()[1], plan
    finally:
        tracemalloc.stop()


def test_a_plan_does_not_read_a_runs_deleted_history(catalog_url, sessions, blobs, clock):
    seed(catalog_url, runs=1, checkpoints=DELETED_ROWS + 3, ranks=1, gc_done=True, migrate=False, prefix="old")
    gc = collector(sessions, blobs, clock)  # events kept 30 days: none of these is old enough
    peak, plan = _plan_peak(gc)
    assert [m.run for m in plan.runs] == ["old-00001"] and plan.checkpoints == [] and plan.events_of == []
    assert plan.runs[0].due_at is not None  # when the oldest deletion's events come of age
    # a DELETED row as planning held it cost ~1 KB (a peak of ~4 MB here)
    assert peak < 30 * DELETED_ROWS, f"planning one run peaked at {peak} bytes"
