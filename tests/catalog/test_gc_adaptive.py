"""GC's batches are bounded by time, not only by count (domain/gc/, next_batch_size):
a batch's cost per checkpoint depends on the run and on the machine's load, so each
batch's size follows from how long the previous one held the catalog."""

from __future__ import annotations

from sqlalchemy import func, select

from bench.seed import seed
from lastgood_service.catalog import txtimer
from lastgood_service.catalog.db import read_sessionmaker
from lastgood_service.catalog.models import DELETED, Checkpoint
from lastgood_service.domain.gc import next_batch_size

from .test_gc_batches import collector


def test_next_batch_size_follows_the_hold_within_its_bounds():
    assert next_batch_size(100, 0.04, 0.02, 100) == 50      # held twice the target: half
    assert next_batch_size(40, 0.01, 0.02, 100) == 80       # quick: grows, at most doubling
    assert next_batch_size(80, 0.001, 0.02, 100) == 100     # never past the cap
    assert next_batch_size(100, 5.0, 0.02, 100) == 10       # a slow batch: the floor, a tenth of the cap
    assert next_batch_size(1, 5.0, 0.02, 1) == 1
    assert next_batch_size(10, 0.0, 0.02, 100) == 20


def _pass(catalog_url, sessions, blobs, clock, prefix, batch_seconds):
    seed(catalog_url, runs=1, checkpoints=200, ranks=2, gc_done=False, migrate=False, prefix=prefix)
    gc = collector(sessions, blobs, clock, batch_size=20, batch_seconds=batch_seconds,
                   read_sessions=read_sessionmaker(sessions.kw["bind"]))  # as main.py wires it: reads apart
    timer = txtimer.of(sessions)
    mark = timer.total
    result = gc.execute(gc.plan(full=False))
    writes = [t for t in timer.since(mark, "gc") if not t.read_only]
    return result, writes


def test_batches_shrink_when_a_batch_holds_longer_than_its_target(catalog_url, sessions, blobs, clock):
    # a target no batch can meet: after the first batch (20), batches of the floor (2)
    result, writes = _pass(catalog_url, sessions, blobs, clock, "slow", batch_seconds=1e-9)
    assert len(result["deleted"]) == 200 - 3 and not result["skipped"]
    assert len(writes) >= 1 + (200 - 3 - 20) // 2
    # CONTROL: a target every batch meets keeps the batches at gc_batch_size (20)
    result, control = _pass(catalog_url, sessions, blobs, clock, "quick", batch_seconds=60)
    assert len(result["deleted"]) == 200 - 3
    assert len(control) <= -(-(200 - 3) // 20) + 1  # its batches, and the runs' marks
    with sessions() as s:  # I4's outcome either way: exactly the policy's deletions
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.status == DELETED)) == 2 * 197
