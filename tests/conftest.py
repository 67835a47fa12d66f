"""Shared fixtures: real service processes on loopback, never mocks.

`service` is one service process for the whole session (tests use unique run names);
`make_service` starts extra ones a test owns (restarts, failpoints, short leases).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from lastgood_service.launcher import ServiceProcess, free_port  # noqa: F401 - free_port is used by the tests
from tests import deepspeed_ops

deepspeed_ops.use()  # every DeepSpeed process of a test loads the ops built at install

pytest_plugins = ["tests.pg", "tests.s3", "tests.localstack", "tests.slurm"]  # real PostgreSQL, S3 (moto; LocalStack), Slurm

ROOT = Path(__file__).resolve().parents[1]

# Every test in these folders gets these markers (pytest.ini describes them), so a new test
# there is deselected by `make test-fast` without anyone remembering to mark it. catalog/
# starts PostgreSQL servers and replicas: slow as a whole.
MARKERS_BY_FOLDER = {"multiproc": ("multiproc", "slow"), "ui": ("ui", "slow"), "bench": ("bench", "slow"),
                     "catalog": ("slow",), "chaos": ("chaos", "slow"), "fuzz": ("fuzz", "slow")}


def pytest_collection_modifyitems(config, items):
    tests = ROOT / "tests"
    for item in items:
        try:
            folder = item.path.relative_to(tests).parts[0]
        except ValueError:
            continue
        for name in MARKERS_BY_FOLDER.get(folder, ()):
            item.add_marker(name)


@dataclass
class ServiceProc(ServiceProcess):
    """The launcher's service process, with the few conveniences the tests use."""

    @property
    def blob_root(self) -> Path:
        return self.data_dir / "blobs"

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kw)


FAST = {"LASTGOOD_LEASE_SECONDS": "3", "LASTGOOD_REAPER_INTERVAL": "0.2", "LASTGOOD_COMMIT_WAIT_MAX": "2"}


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    svc = ServiceProc(tmp_path_factory.mktemp("service"), dict(FAST)).start()
    yield svc
    svc.stop()


@pytest.fixture
def make_service(tmp_path):
    started: list[ServiceProc] = []

    def make(data_dir: Path | None = None, **env) -> ServiceProc:
        svc = ServiceProc(data_dir or tmp_path / f"svc{len(started)}", {**FAST, **env}).start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


def through_its_data_path(transport) -> None:
    """The client as against a service that takes no file with a vote (LASTGOOD_INLINE_BYTES=0):
    for tests of a data path (the spool, the streams) whose files are small enough to travel
    with the vote otherwise (CommitRank.inline_files)."""
    transport.info = replace(transport.info, inline_bytes=0)


@pytest.fixture
def run_name(request) -> str:
    return f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def spool_inodes(monkeypatch) -> set[int]:
    """The inodes of the files this process writes into a spool, written whole before the
    hand-over (Transport.spool_write) or while the service follows them (put_followed):
    both start each piece's writeback through a lastgood.common.durable.Writeback, whose making is
    watched here (the real one is still made)."""
    import os

    from lastgood.common import durable

    seen: set[int] = set()

    class Watched(durable.Writeback):
        __slots__ = ()

        def __init__(self, fd: int) -> None:
            seen.add(os.fstat(fd).st_ino)
            super().__init__(fd)

    monkeypatch.setattr(durable, "Writeback", Watched)
    return seen
