"""Catalog fixtures: the same tests on SQLite and on a real PostgreSQL server (tests/pg.py).

`catalog_url` is an empty, migrated catalog on each backend; `commits` is the domain's
CommitService on it, with an in-memory blob store and a clock the test can move.
"""

from __future__ import annotations

import datetime as dt

import pytest

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker, upgrade_head
from lastgood_service.domain.commit import CommitService
from lastgood_service.settings import Settings
from tests.conftest import ROOT

MIGRATIONS = ROOT / "service/lastgood_service/migrations"
BACKENDS = ["sqlite", "postgresql"]


def empty_catalog(request, tmp_path, backend: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(params=BACKENDS)
def catalog_url(request, tmp_path) -> str:
    url = empty_catalog(request, tmp_path, request.param)
    upgrade_head(url, MIGRATIONS)
    return url


class Clock:
    """UTC now, plus however far the test moved it."""

    def __init__(self) -> None:
        self.offset = dt.timedelta()

    def __call__(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc) + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += dt.timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(catalog_url):
    eng = make_engine(catalog_url)
    yield eng
    eng.dispose()


@pytest.fixture
def sessions(engine):
    return make_sessionmaker(engine)


@pytest.fixture
def blobs() -> MemoryBlobStore:
    return MemoryBlobStore()


@pytest.fixture
def commits(sessions, blobs, clock) -> CommitService:
    return CommitService(Settings(lease_seconds=60, commit_wait_max=2), sessions, blobs, clock=clock)
