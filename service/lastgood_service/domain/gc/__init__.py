"""Garbage collection: `plan()` lists what would go and the bytes freed; `execute(plan)`
deletes at most that, re-checking each checkpoint under a row lock first.

What may go: committed checkpoints no retention policy keeps (the run's own policy, else
the service's default: domain/runs/retention.py); CORRUPT and ABANDONED checkpoints older than
the grace period; blobs of checkpoints already DELETED (left by a crash between the
catalog update and the blob deletion). Never (I4): a PENDING checkpoint, anything a
committed manifest that is kept, a tag, a pin or a live read lease still needs. The
catalog row stays, with status DELETED, so the lineage keeps its shape; its events other
than `gc_delete` go once it has been deleted for `event_retention_seconds`.

Why it stays cheap as the catalog grows (docs/operations.md, "GC at scale"):
- a pass plans only runs where something happened since the last pass (a newer event),
  whose policy changed, or where time alone may free something (a grace period or a read
  lease ends: `runs.gc_due_at`). A full pass (`plan(full=True)`: the API's dry run, the
  first scheduled pass after a start and every `gc_full_every`-th) plans every run and
  lists the blob store for orphans and unknown blobs.
- every catalog transaction is short and bounded: planning takes one per run; execution
  marks at most `gc_batch_size` checkpoints per transaction, so commits run between
  batches; blobs are deleted outside any transaction, after their batch committed.

The collector, one idea a module:

  base.py     the state and the decisions planning and execution share
  plan.py     plan(): what would go now (Plan), run by run
  execute.py  execute(plan): the deletions, in batches that adapt their size

`GarbageCollector` is both on one object, with the scheduled pass.
"""

from __future__ import annotations

import time

from .execute import GCExecution, next_batch_size
from .plan import GCPlanning, Plan, PlannedDeletion, RunMark

__all__ = ["GarbageCollector", "Plan", "PlannedDeletion", "RunMark", "next_batch_size"]


class GarbageCollector(GCPlanning, GCExecution):
    def run_pass(self) -> dict:
        """One scheduled pass: incremental, but full on the first after a start, after a
        failed pass, and every `full_every`-th (orphans come only from a crash or a failure)."""
        full = self._need_full or self.passes % self.full_every == 0
        mark = self.timer.total if self.timer else 0
        t0 = time.perf_counter()
        self._need_full = True
        plan = self.plan(full=full)
        t1 = time.perf_counter()
        result = self.execute(plan)
        t2 = time.perf_counter()
        self._need_full = False
        self.passes += 1
        holds = [r.hold for r in self.timer.since(mark, "gc")] if self.timer else []
        for h in holds:
            self.metrics.gc_transaction_seconds.observe(h)
        self.last_pass = {"full": full, "runs_planned": len(plan.runs), "planned": len(plan.checkpoints),
                          "deleted": len(result["deleted"]), "plan_seconds": t1 - t0, "execute_seconds": t2 - t1,
                          "transactions": len(holds), "longest_transaction_seconds": max(holds, default=0.0),
                          "events_pruned": result["events_pruned"]}
        return self.last_pass

    def incremental_pass(self) -> dict:
        """Plan and delete in the runs where something changed since the last executed pass
        (the memory tier's prompt retention, main.py), without counting as a scheduled pass:
        the scheduled passes' rhythm of full passes stays as it is."""
        return {"deleted": len(self.execute(self.plan(full=False))["deleted"])}
