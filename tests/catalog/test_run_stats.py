"""Migration 0007 on a catalog that already has checkpoints: run_stats is backfilled from
a recount and the branches from lineage.assign_branches; at head every trigger that keeps
run_stats exists (a later migration that rebuilds a table on SQLite would drop them)."""

from __future__ import annotations

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from lastgood_service.catalog.db import alembic_config, upgrade_head
from lastgood_service.domain.runs.lineage import assign_branches

from .conftest import BACKENDS, MIGRATIONS, empty_catalog

SQLITE_TRIGGERS = {"trg_run_stats_run_insert", "trg_run_stats_ck_insert", "trg_run_stats_ck_update",
                   "trg_run_stats_ck_delete", "trg_run_stats_tag_insert", "trg_run_stats_tag_update",
                   "trg_run_stats_tag_delete", "trg_run_stats_last_good"}
PG_TRIGGERS = {"trg_run_stats_run_insert", "trg_run_stats_ck_insert_delete", "trg_run_stats_ck_update",
               "trg_run_stats_tags", "trg_run_stats_last_good"}
# (id, parent, status, committed): a chain, a restart from 1 (a branch), a pending child, a second root
ROWS = [(1, None, "DELETED", True), (2, 1, "COMMITTED", True), (3, 2, "CORRUPT", True), (4, 1, "COMMITTED", True),
        (5, 4, "PENDING", False), (6, None, "ABANDONED", False), (7, None, "COMMITTED", True)]


def triggers(engine) -> set[str]:
    with engine.connect() as c:
        if engine.dialect.name == "postgresql":
            return set(c.scalars(text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")))
        return set(c.scalars(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_0007_backfills_counters_and_branches_and_its_triggers_exist_at_head(backend, request, tmp_path):
    url = empty_catalog(request, tmp_path, backend)
    command.upgrade(alembic_config(url, MIGRATIONS), "0006")
    engine = create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO runs (id, name, created_at) VALUES (1, 'old', CURRENT_TIMESTAMP), "
                           "(2, 'empty', CURRENT_TIMESTAMP)"))
            for cid, parent, status, committed in ROWS:
                c.execute(text("INSERT INTO checkpoints (id, run_id, step, attempt, world_size, parent_id, status, "
                               "bytes, lease_expires_at, created_at, committed_at) VALUES (:i, 1, :step, 'a', 1, :p, "
                               ":s, :b, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, "
                               + ("CURRENT_TIMESTAMP" if committed else "NULL") + ")"),
                          {"i": cid, "step": cid * 10, "p": parent, "s": status, "b": cid * 100})
        upgrade_head(url, MIGRATIONS)
        with engine.connect() as c:
            stats = {r[0]: tuple(r[1:]) for r in c.execute(text(
                "SELECT run_id, pending, committed, abandoned, corrupt, deleted, bytes_stored, newest_step "
                "FROM run_stats"))}
            stored = dict(c.execute(text("SELECT id, branch FROM checkpoints")).all())
        # not DELETED: 2, 3, 4, 5, 6, 7 -> 2700 bytes
        assert stats == {1: (1, 3, 1, 1, 1, 2700, 70), 2: (0, 0, 0, 0, 0, 0, None)}
        assert stored == assign_branches([(i, p, committed) for i, p, _, committed in ROWS])
        assert len(set(stored.values())) == 3  # the rows made branches at all
        assert triggers(engine) >= (PG_TRIGGERS if backend == "postgresql" else SQLITE_TRIGGERS)
    finally:
        engine.dispose()
