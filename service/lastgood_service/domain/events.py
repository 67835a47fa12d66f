"""The run's event log: one row per thing that happened (a commit, an abort, a rollback,
a GC pass), read back by the lineage page and `lastgood events`."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from ..catalog.models import Event, utcnow


def add_event(s: Session, kind: str, run_id: int | None, checkpoint_id: int | None, /, **data) -> None:
    """Positional-only, so that event data may use any key, `kind` included."""
    s.add(Event(run_id=run_id, checkpoint_id=checkpoint_id, kind=kind, at=utcnow(),
                data_json=json.dumps(data, sort_keys=True, default=str)))

