"""The run's event log: one row per thing that happened (a commit, an abort, a rollback,
a GC pass), read back by the lineage page and `lastgood events`."""

from __future__ import annotations

import datetime as dt
import json

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..catalog.models import Event, utcnow

# What went wrong in a run: a save given up or aborted, a checkpoint expired, damaged or
# mismatched, a rank hung or lost, a relaunch. The runs overview (the page's badge) and the
# run's health (the page's panel, `lastgood show`) count the recent ones by this one rule.
FAILURE_EVENTS = ("abort", "expired", "corrupt", "hash_mismatch", "save_given_up", "hung", "lost", "restart",
                  "supervisor_restart")
FAILURE_WINDOW_S = 24 * 3600.0


def add_event(s: Session, kind: str, run_id: int | None, checkpoint_id: int | None, /, **data) -> None:
    """Positional-only, so that event data may use any key, `kind` included."""
    s.add(Event(run_id=run_id, checkpoint_id=checkpoint_id, kind=kind, at=utcnow(),
                data_json=json.dumps(data, sort_keys=True, default=str)))



def recent_failures(s: Session, run_ids: list[int], window_s: float = FAILURE_WINDOW_S) -> dict[int, dict]:
    """Per run: its failure events within the window -- how many, the newest's time, and how
    many of each kind. A run without any is absent."""
    since = utcnow() - dt.timedelta(seconds=window_s)
    out: dict[int, dict] = {}
    for run_id, kind, n, last in s.execute(
            select(Event.run_id, Event.kind, func.count(), func.max(Event.at))
            .where(Event.run_id.in_(run_ids), Event.kind.in_(FAILURE_EVENTS), Event.at >= since)
            .group_by(Event.run_id, Event.kind)):
        f = out.setdefault(run_id, {"count": 0, "last_at": None, "kinds": {}})
        f["count"] += n
        f["kinds"][kind] = n
        f["last_at"] = last if f["last_at"] is None else max(f["last_at"], last)
    return out
