"""Which database errors are transient faults of the catalog (domain/faults.catalog_fault):
the service answers those UNAVAILABLE, which the client retries, and every other one INTERNAL."""

import sqlite3

import pytest
from sqlalchemy.exc import OperationalError, ProgrammingError

from lastgood_service.domain.errors import Unavailable
from lastgood_service.domain.faults import as_domain_error, catalog_fault


def sqlite_error(message: str, code: int) -> sqlite3.Error:
    e = sqlite3.OperationalError(message)
    e.sqlite_errorcode = code
    return e


class PgError(Exception):
    """Stands in for a psycopg error: what catalog_fault reads is its `sqlstate`."""

    def __init__(self, sqlstate):
        super().__init__("x")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("orig, words", [
    (sqlite_error("disk I/O error", 10), "SQLITE_IOERR"),
    (sqlite_error("disk I/O error", 10 | (4 << 8)), "SQLITE_IOERR"),  # SQLITE_IOERR_SHORT_READ
    (sqlite_error("database is locked", 5), "SQLITE_BUSY"),
    (sqlite_error("unable to open database file", 14), "SQLITE_CANTOPEN"),
    (PgError("57P03"), "cannot connect now"),
    (PgError("08006"), "connection exception"),
    (PgError("55P03"), "lock not available"),
])
def test_transient_catalog_faults_are_unavailable(orig, words):
    wrapped = OperationalError("SELECT 1", {}, orig)  # as SQLAlchemy raises it
    assert words in catalog_fault(wrapped)
    mapped = as_domain_error(wrapped)
    assert isinstance(mapped, Unavailable) and "catalog is unavailable" in str(mapped)


@pytest.mark.parametrize("orig", [sqlite_error("no such table: runs", 1), PgError("42P01"), PgError(None),
                                  ValueError("a bug")])
def test_other_errors_stay_internal(orig):
    """The control: a missing table, an undefined relation or a plain bug is no catalog outage."""
    wrapped = ProgrammingError("SELECT 1", {}, orig)
    assert catalog_fault(wrapped) is None and as_domain_error(wrapped) is None


def test_a_disconnect_sqlalchemy_saw_is_unavailable():
    wrapped = OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"),
                               connection_invalidated=True)
    assert catalog_fault(wrapped) == "connection lost"
