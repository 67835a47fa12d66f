"""A real PostgreSQL server for the tests, started from the PostgreSQL 15 binaries on the machine.

One server per test session: `initdb` into a temporary directory owned by the `postgres`
user (PostgreSQL refuses to run as root, and the tests run as root), `pg_ctl start` on a
free loopback port with its unix socket in that directory, then one fresh database per test
that asks for `pg_url`. Stopped and removed at the end of the session. Never a mock.

When the binaries are missing the fixture fails under CI=true (.ci/run installs them) and
skips elsewhere. Registered from tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

def _pg_bin() -> Path:
    """LASTGOOD_TEST_PG_BIN, else PostgreSQL 15's, else the newest installed (a Debian whose
    `postgresql` package is another major version); the message names 15 when none is."""
    if os.environ.get("LASTGOOD_TEST_PG_BIN"):
        return Path(os.environ["LASTGOOD_TEST_PG_BIN"])
    default = Path("/usr/lib/postgresql/15/bin")
    if (default / "postgres").exists():
        return default
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3])
                   if p.parts[-3].isdigit() else 0)
    return found[-1].parent if found else default


PG_BIN = _pg_bin()
PG_USER = "postgres"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*args: str, **kw) -> subprocess.CompletedProcess:
    cmd = list(args)
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        cmd = ["runuser", "-u", PG_USER, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _missing(why: str):
    msg = (f"PostgreSQL 15 is not usable here: {why}. Install it (apt-get install postgresql-15; "
           f".ci/run does) or point LASTGOOD_TEST_PG_BIN at its bin/ directory.")
    if os.environ.get("CI") == "true":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@dataclass
class PostgresServer:
    root: Path
    port: int
    durable: bool = False  # commits acknowledged only once written out: they survive a crash stop

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3) over TCP on loopback."""
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=PG_USER, dbname=database, autocommit=True)

    def create_database(self, stem: str = "lg") -> str:
        name = f"{stem}_{uuid.uuid4().hex[:12]}"
        with self.connect() as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with self.connect() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server: `immediate` is a crash stop (no shutdown checkpoint; connections
        are cut), `fast` a clean one."""
        r = _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed:\n{r.stdout}\n{r.stderr}")

    def start(self) -> None:
        """Start the stopped server again on the same port (its clients' URL stays valid)."""
        r = _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log),
                         "-o", _options(self.port, self.root, self.durable), "-w", "-t", "60", "start")
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed:\n{r.stdout}\n{r.stderr}")


def _options(port: int, root: Path, durable: bool = False) -> str:
    # test databases: durability against an OS crash is not what is tested (no fsync); a server
    # a test crash-stops (`durable`) still writes each commit's WAL out before acknowledging it,
    # as a production server does, so that what the service was told is committed survives
    return (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=300 "
            f"-c fsync=off -c synchronous_commit={'on' if durable else 'off'} -c full_page_writes=off")


def _start(root: Path, initdb: bool = True, durable: bool = False) -> PostgresServer:
    """`initdb=False`: start on the data directory already in root (bench/catalog.py's kept copy)."""
    data = root / "data"
    r = _as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
                     "--no-sync", "--locale=C") if initdb else None
    if r is not None and r.returncode != 0:
        raise RuntimeError(f"initdb failed:\n{r.stdout}\n{r.stderr}")
    last = ""
    for _ in range(5):  # a free port can be taken by someone else before postgres binds it
        port = _free_port()
        r = _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "postgres.log"),
                         "-o", _options(port, root, durable), "-w", "-t", "60", "start")
        if r.returncode == 0:
            return PostgresServer(root, port, durable)
        last = f"{r.stdout}\n{r.stderr}\n{(root / 'postgres.log').read_text(errors='replace')[-3000:]}"
    raise RuntimeError(f"pg_ctl start failed:\n{last}")


def _own_server(durable: bool = False):
    """A server of its own in a fresh temporary directory; yields it, then stops and removes it."""
    if not (PG_BIN / "postgres").exists():
        _missing(f"{PG_BIN / 'postgres'} does not exist")
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        _missing(f"psycopg is not installed ({e})")
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam(PG_USER)
        except KeyError:
            _missing(f"there is no {PG_USER!r} user to run the server as")
    root = Path(tempfile.mkdtemp(prefix="lastgood-pg-"))
    if os.geteuid() == 0:
        os.chown(root, pw.pw_uid, pw.pw_gid)
    try:
        server = _start(root, durable=durable)
    except Exception:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield server
    finally:
        _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server():
    yield from _own_server()


@pytest.fixture
def own_pg_server():
    """A server for one test alone, which it may stop and start (the session's server stays up)."""
    yield from _own_server(durable=True)


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database on the session's server; dropped afterwards."""
    name = pg_server.create_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)
