"""The page's and the CLI's queries use indexes, on SQLite and PostgreSQL: every statement
the runs list, the overview, a lineage page, events by kind and checkpoints by status
send is EXPLAINed, and none may read the whole checkpoints, events, shards or votes table.
On SQLite the intended indexes (catalog/models.py, migration 0005) must be the ones used;
PostgreSQL runs with enable_seqscan off (tiny tables would be read whole by choice) and
picks among equivalent run_id-led indexes by cost, so there a plan without a sequential
scan is what proves an index serves the query.
"""

from __future__ import annotations

import pytest
from sqlalchemy import event

from bench.seed import seed
from lastgood_service.domain.queries import Queries

BIG_TABLES = ("checkpoints", "events", "shards", "votes")


class Captured:
    """The statements (with their parameters) a block sends through an engine."""

    def __init__(self, engine) -> None:
        self.engine, self.statements = engine, []

    def _on(self, conn, cursor, statement, params, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            self.statements.append((statement, params))

    def __enter__(self):
        event.listen(self.engine, "before_cursor_execute", self._on)
        return self

    def __exit__(self, *exc):
        event.remove(self.engine, "before_cursor_execute", self._on)


def explain(engine, statement: str, params) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")  # a tiny table would be read whole anyway
            rows = conn.exec_driver_sql("EXPLAIN " + statement, params).all()
            return "\n".join(r[0] for r in rows)
        rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params).all()
        return "\n".join(r[-1] for r in rows)


def full_scans(plan: str, dialect: str) -> list[str]:
    out = []
    for line in plan.splitlines():
        text = line.strip()
        for table in BIG_TABLES:
            if dialect == "postgresql" and f"Seq Scan on {table}" in text:
                out.append(text)
            # SQLite: "SCAN t" reads the table; "SCAN t USING (COVERING) INDEX" walks an index whole
            if dialect == "sqlite" and (text == f"SCAN {table}" or text.startswith(f"SCAN {table} ")):
                out.append(text)
    return out


VIEWS = {
    "runs list": (lambda q: q.list_runs(limit=100), ["run_stats"]),
    "overview": (lambda q: q.overview(limit=100), ["run_stats", "ix_events_run_id", "ix_events_run_kind_at"]),
    # its rows by (run_id, id), each one's last vote by the votes' key (checkpoint_id, rank)
    "lineage page": (lambda q: q.lineage_json("plan-00002", limit=100, offset=50),
                     ["ix_checkpoints_run_id", "SEARCH votes USING INDEX"]),
    "events by kind": (lambda q: q.events("plan-00002", kinds=["spike", "rollback", "restart"]),
                       ["ix_events_run_kind_at"]),
    "events": (lambda q: q.events("plan-00002", limit=100), ["ix_events_run_at"]),
    "checkpoints by status": (lambda q: q.list_checkpoints("plan-00002", status="COMMITTED"),
                              ["ix_checkpoints_run_status_step"]),
}


@pytest.fixture
def seeded(catalog_url, engine):
    seed(catalog_url, runs=4, checkpoints=200, ranks=2, migrate=False, prefix="plan")
    return engine


@pytest.mark.parametrize("view", list(VIEWS))
def test_the_page_and_cli_queries_use_indexes(seeded, sessions, view):
    engine = seeded
    call, intended = VIEWS[view]
    with Captured(engine) as cap:
        call(Queries(sessions))
    assert cap.statements, "the view sent no query"
    plans = [explain(engine, st, params) for st, params in cap.statements]
    scans = [(st.split("FROM", 1)[-1][:120], s) for (st, _), p in zip(cap.statements, plans)
             for s in full_scans(p, engine.dialect.name)]
    assert not scans, scans
    if engine.dialect.name == "sqlite":  # PostgreSQL picks among the run_id-led indexes by cost
        used = "\n".join(plans)
        assert all(ix in used for ix in intended), (intended, used)


@pytest.mark.parametrize("view", ["runs list", "overview"])
def test_runs_list_and_overview_read_checkpoints_by_primary_key_only(seeded, sessions, view):
    """Their counts come from run_stats (migration 0007), O(runs) rows: the only
    checkpoints they read are the runs' last-good, by id, never a run's checkpoints."""
    engine = seeded
    with Captured(engine) as cap:
        VIEWS[view][0](Queries(sessions))
    for st, params in cap.statements:
        if " checkpoints" not in st.split("FROM", 1)[-1]:
            continue
        plan = explain(engine, st, params)
        by_id = "checkpoints.id IN" in st or "checkpoints.id =" in st
        assert by_id and "run_id" not in st.split("WHERE", 1)[-1], (st, plan)


def test_control_a_scan_is_seen(seeded, sessions):
    """CONTROL: a query no index serves is reported as a full scan."""
    engine = seeded
    plan = explain(engine, "SELECT count(*) FROM events WHERE length(data_json) > 3", {})
    assert full_scans(plan, engine.dialect.name)


def test_a_gc_plan_reads_a_runs_rows_through_indexes(seeded, sessions, blobs):
    """GC's plan of a run (domain/gc/): its live rows through (run_id, status), its
    DELETED rows' prunable events probed by checkpoint: no statement reads a whole table."""
    from lastgood_service.domain.gc import GarbageCollector
    from lastgood_service.domain.runs.retention import Retention

    engine = seeded
    gc = GarbageCollector(sessions, blobs, Retention.parse("latest:3,tagged,last-good,branch-heads"), 3600)
    with Captured(engine) as cap:
        plan = gc.plan(full=False)
    assert len(plan.runs) == 4
    plans = [explain(engine, st, params) for st, params in cap.statements]
    scans = [(st.split("FROM", 1)[-1][:120], s) for (st, _), p in zip(cap.statements, plans)
             for s in full_scans(p, engine.dialect.name)]
    assert not scans, scans
    if engine.dialect.name == "sqlite":
        used = "\n".join(plans)
        # the live rows by their statuses, not the run's whole (run_id, id) range
        assert "(run_id=? AND status=?)" in used, used  # either run_id-status index serves it
        assert "ix_events_checkpoint" in used, used
