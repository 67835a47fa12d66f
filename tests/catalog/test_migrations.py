"""The Alembic migrations build exactly the catalog the models describe, on SQLite and on
PostgreSQL; and PostgreSQL replicas that start together do not trip over each other."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Engine, Integer, MetaData, create_engine, event, inspect

from lastgood_service.catalog.db import alembic_config, upgrade_head
from lastgood_service.catalog.models import Base

from .conftest import BACKENDS, MIGRATIONS, empty_catalog

HANG_GUARD = 60.0


def pending_diff(url: str, metadata: MetaData = Base.metadata) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": False})
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://", MIGRATIONS)).get_current_head()


@pytest.mark.parametrize("backend", BACKENDS)
def test_upgrade_of_an_empty_database_matches_the_models(backend, request, tmp_path):
    url = empty_catalog(request, tmp_path, backend)
    assert current_revision(url) is None
    upgrade_head(url, MIGRATIONS)
    assert current_revision(url) == head()
    assert pending_diff(url) == []
    # control: the comparison does see a difference when there is one
    changed = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["runs"].append_column(Column("not_migrated", Integer, nullable=True))
    diff = pending_diff(url, changed)
    assert [d[0] for d in diff] == ["add_column"] and diff[0][3].name == "not_migrated"


@pytest.mark.parametrize("backend", BACKENDS)
def test_downgrade_to_base_and_up_again(backend, request, tmp_path):
    url = empty_catalog(request, tmp_path, backend)
    upgrade_head(url, MIGRATIONS)
    command.downgrade(alembic_config(url, MIGRATIONS), "base")
    engine = create_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    upgrade_head(url, MIGRATIONS)
    assert current_revision(url) == head() and pending_diff(url) == []


def _someone_waits_for_a_lock(pg_server, database: str) -> bool:
    with pg_server.connect(database) as c:
        return c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                         (database,)).fetchone()[0] > 0


PRELUDE = "import sys; from pathlib import Path; URL, DIR = sys.argv[1], Path(sys.argv[2]); "
LOCKED = "from lastgood_service.catalog.db import upgrade_head; upgrade_head(URL, DIR)"
BARE = ("from alembic import command; from lastgood_service.catalog.db import alembic_config; "
        "command.upgrade(alembic_config(URL, DIR), 'head')")


def _two_replicas_migrate(pg_server, url: str, code: str) -> tuple[BaseException | None, int, str]:
    """Replica X (a thread here) starts migrating and is held just after its first tables;
    replica Y (another process, as replicas are) starts while X is held; X is let go once
    Y waits for a lock. Returns X's error, Y's exit code and Y's output."""
    database = url.rsplit("/", 1)[1]
    x_held, release = threading.Event(), threading.Event()
    x_result: list[BaseException | None] = []

    def hold_x(conn, cursor, statement, params, context, executemany):
        if threading.current_thread() is x and statement.lstrip().upper().startswith("CREATE TABLE CHECKPOINTS"):
            x_held.set()
            release.wait(HANG_GUARD)

    def replica_x() -> None:
        try:
            exec(code, {"URL": url, "DIR": MIGRATIONS})
            x_result.append(None)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            x_result.append(e)

    x = threading.Thread(target=replica_x)
    event.listen(Engine, "before_cursor_execute", hold_x)
    y = None
    try:
        x.start()
        assert x_held.wait(HANG_GUARD), "replica X never reached its second table"
        y = subprocess.Popen([sys.executable, "-c", PRELUDE + code, url, str(MIGRATIONS)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + HANG_GUARD
        while not _someone_waits_for_a_lock(pg_server, database) and y.poll() is None:
            assert time.monotonic() < deadline, "replica Y neither waited nor finished"
            time.sleep(0.01)
        release.set()
        x.join(HANG_GUARD)
        out, _ = y.communicate(timeout=HANG_GUARD)
    finally:
        release.set()
        event.remove(Engine, "before_cursor_execute", hold_x)
        if y is not None and y.poll() is None:
            y.kill()
    assert x_result, "replica X did not finish"
    return x_result[0], y.returncode, out


def test_replicas_starting_together_migrate_in_turn_postgres(pg_server, pg_url):
    x_error, y_code, y_out = _two_replicas_migrate(pg_server, pg_url, LOCKED)
    assert x_error is None and y_code == 0, (x_error, y_out)
    assert current_revision(pg_url) == head() and pending_diff(pg_url) == []


def test_control_replicas_without_the_migration_lock_collide_postgres(pg_server, pg_url):
    """CONTROL: plain `alembic upgrade head` in both replicas: Y blocks on X's uncommitted
    tables, and fails when X commits them."""
    x_error, y_code, y_out = _two_replicas_migrate(pg_server, pg_url, BARE)
    assert x_error is None
    assert y_code != 0 and ("already exists" in y_out or "duplicate key" in y_out), y_out[-2000:]
    assert current_revision(pg_url) == head()
