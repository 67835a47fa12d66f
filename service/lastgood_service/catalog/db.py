"""Engine construction and migrations. Called from `main`, never at import.

SQLite (embedded) and PostgreSQL (production, psycopg 3) run the same models and the same
domain code. SQLite serializes every transaction (BEGIN IMMEDIATE, below). PostgreSQL runs
at READ COMMITTED, so domain code that reads, decides and then writes must lock the rows
it decides on (SELECT ... FOR UPDATE: the run whose last-good a commit moves, the
checkpoint a vote counts); tests/catalog forces those races on a real server. Here, for
PostgreSQL: a lock wait gives up after LOCK_TIMEOUT_MS instead of hanging (as SQLite's busy
timeout does), a connection left idle inside a transaction by a hung process is ended by
the server so its row locks go with it, and replicas that start together migrate in turn.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from .txtimer import READ_ONLY, TxTimer

# advisory lock key held while `alembic upgrade` runs ("lgmigrat"); the same in every replica
MIGRATION_LOCK = 0x6C67_6D69_6772_6174
LOCK_TIMEOUT_MS = 30_000
IDLE_IN_TXN_TIMEOUT_MS = 120_000


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def _ensure_sqlite_dir(url: str) -> None:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str, durable: bool = True) -> Engine:
    """`durable=False`: commits return before they reach the disk (SQLite synchronous=NORMAL
    in WAL mode, PostgreSQL synchronous_commit=off). Still atomic and consistent; a power
    loss may forget the last commits. For heartbeats only (domain/health/heartbeats.py): the next beat
    rewrites the row anyway, and an fsync per beat would be most of a beat's latency.
    Every engine carries a TxTimer (catalog/txtimer.py): each transaction's lock timings."""
    if url.startswith("sqlite"):
        _ensure_sqlite_dir(url)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        TxTimer().install(engine, then=lambda e: _sqlite_pragmas(e, "FULL" if durable else "NORMAL"))
        return engine
    elif is_postgres(url):
        engine = create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args={
            "options": f"-c lock_timeout={LOCK_TIMEOUT_MS} "
                       f"-c idle_in_transaction_session_timeout={IDLE_IN_TXN_TIMEOUT_MS}"
                       + ("" if durable else " -c synchronous_commit=off")})
    else:
        engine = create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    TxTimer().install(engine)
    return engine


def _sqlite_pragmas(engine: Engine, synchronous: str = "FULL") -> None:
    """WAL for concurrent readers; BEGIN IMMEDIATE so that a transaction that reads and
    then writes takes the write lock up front instead of failing with SQLITE_BUSY when a
    concurrent writer got there first (the busy timeout cannot retry that case)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let us emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        # a reader (read_sessionmaker) begins deferred: under WAL it reads a snapshot beside
        # the writer instead of holding the write lock that every commit waits for
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")


def inject_eio(engine: Engine, switch: Path) -> None:
    """Testing only (failpoint catalog_eio): while the file `switch` exists, every statement
    fails as SQLite's does when a read or write of its file gets EIO. Raised where the
    DB-API would raise it, so SQLAlchemy wraps it as it wraps the real one."""
    import sqlite3

    @event.listens_for(engine, "before_cursor_execute")
    def _eio(*_args):
        if switch.exists():
            err = sqlite3.OperationalError("disk I/O error")
            err.sqlite_errorcode, err.sqlite_errorname = 10, "SQLITE_IOERR"
            raise err


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def read_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions for transactions that only read (the page's and the CLI's queries, GC's
    planning). On SQLite they do not take the write lock; elsewhere they are plain sessions."""
    return sessionmaker(engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False)


def alembic_config(url: str, migrations_dir: Path):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(url: str, migrations_dir: Path) -> None:
    """`alembic upgrade head` against url, in process.

    On PostgreSQL, replicas that start together take turns: the first migrates while the
    others wait on an advisory lock, then find the catalog at head and do nothing.
    (SQLite needs no lock: its migration transaction already excludes every other writer.)"""
    from alembic import command

    if not (migrations_dir / "env.py").exists():
        raise RuntimeError(f"no Alembic environment at {migrations_dir}; set LASTGOOD_MIGRATIONS_DIR")
    _ensure_sqlite_dir(url)
    if not is_postgres(url):
        command.upgrade(alembic_config(url, migrations_dir), "head")
        return
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
            conn.commit()
            try:
                command.upgrade(alembic_config(url, migrations_dir), "head")
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
                conn.commit()
    finally:
        engine.dispose()
