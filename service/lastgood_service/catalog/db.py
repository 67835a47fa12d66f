"""Engine construction and migrations. Called from `main`, never at import."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker


def _ensure_sqlite_dir(url: str) -> None:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        _ensure_sqlite_dir(url)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        _sqlite_pragmas(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _sqlite_pragmas(engine: Engine) -> None:
    """WAL for concurrent readers; BEGIN IMMEDIATE so that a transaction that reads and
    then writes takes the write lock up front instead of failing with SQLITE_BUSY when a
    concurrent writer got there first (the busy timeout cannot retry that case)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let us emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str, migrations_dir: Path):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(url: str, migrations_dir: Path) -> None:
    """`alembic upgrade head` against url, in process."""
    from alembic import command

    if not (migrations_dir / "env.py").exists():
        raise RuntimeError(f"no Alembic environment at {migrations_dir}; set LASTGOOD_MIGRATIONS_DIR")
    _ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url, migrations_dir), "head")
