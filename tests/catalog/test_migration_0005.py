"""Migration 0005 on a catalog that has data (SQLite and PostgreSQL): runs keep everything
they had, get no retention of their own (the service default) and GC bookkeeping that
makes the first pass plan them; and it downgrades back to 0004 with the rows intact."""

from __future__ import annotations

import datetime as dt

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text

from lastgood_service.catalog.db import alembic_config

from .conftest import BACKENDS, MIGRATIONS, empty_catalog


@pytest.mark.parametrize("backend", BACKENDS)
def test_0005_keeps_existing_runs_and_falls_back_to_the_default(backend, request, tmp_path):
    url = empty_catalog(request, tmp_path, backend)
    cfg = alembic_config(url, MIGRATIONS)
    command.upgrade(cfg, "0004")
    engine = create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO runs (id, name, created_at, generation) VALUES (7, 'old-run', :at, 3)"),
                      {"at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)})
        command.upgrade(cfg, "0005")
        with engine.begin() as c:
            row = c.execute(text("SELECT name, generation, retention, gc_event_id, gc_policy, gc_due_at "
                                 "FROM runs WHERE id = 7")).one()
        assert tuple(row) == ("old-run", 3, None, 0, None, None)
        names = {ix["name"] for t in ("checkpoints", "events") for ix in inspect(engine).get_indexes(t)}
        assert {"ix_checkpoints_run_status_bytes", "ix_checkpoints_run_id", "ix_events_run_id",
                "ix_events_run_kind_at", "ix_events_checkpoint"} <= names
        command.downgrade(cfg, "0004")
        with engine.begin() as c:
            assert c.execute(text("SELECT name FROM runs WHERE id = 7")).scalar() == "old-run"
        assert "retention" not in {col["name"] for col in inspect(engine).get_columns("runs")}
    finally:
        engine.dispose()
