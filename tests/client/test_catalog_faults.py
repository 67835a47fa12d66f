"""The catalog's own faults are transient (#36, item 7): a PostgreSQL server that is down
or restarting, and an SQLite catalog file that answers EIO, make the service answer
UNAVAILABLE / 503 `unavailable`, never INTERNAL, so the client's retry policy keeps the save
going and it lands once the catalog is back.

The PostgreSQL server is real and this test's own (tests/pg.py `own_pg_server`), crash-stopped
and started again on its port. The SQLite EIO is the testing-only failpoint `catalog_eio`:
an sqlite3.OperationalError "disk I/O error" (SQLITE_IOERR) raised at the DB-API level by
SQLAlchemy's before_cursor_execute hook in the real service process (catalog/db.py), for as
long as a switch file exists."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from torch import nn

import lastgood
from lastgood.remote.retry import RetryPolicy
from tests.service.helpers import Client

pytestmark = pytest.mark.slow  # a PostgreSQL server of its own, saves across an outage

OUTAGE_S = 3.0


def unavailable_everywhere(svc, run: str, fault: str) -> None:
    """While the catalog is down: REST 503 `unavailable` naming the fault, gRPC UNAVAILABLE."""
    r = httpx.get(f"{svc.url}/api/v1/runs/{run}", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    assert "catalog is unavailable" in r.json()["error"]["message"] and fault in r.json()["error"]["message"]
    with Client(svc.grpc_target) as c, pytest.raises(grpc.RpcError) as e:
        c.begin(run, 99, attempt="probe")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "catalog is unavailable" in e.value.details()


def save_across_outage(svc, run: str, monkeypatch, down, up, fault: str) -> None:
    monkeypatch.setenv("LASTGOOD_ATTEMPT", "launch-1")
    ck = lastgood.Checkpointer(svc.url, run=run, retry=RetryPolicy(deadline=90.0))
    model = nn.Linear(4, 4)
    ck.save(1, lastgood.TrainState(model=model))
    ck.wait()  # control: the catalog works before the outage
    down()
    try:
        unavailable_everywhere(svc, run, fault)
        done = threading.Event()
        failure: list[BaseException] = []

        def save() -> None:
            try:
                ck.save(2, lastgood.TrainState(model=model))
                ck.wait()
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)
            done.set()

        threading.Thread(target=save, daemon=True).start()
        time.sleep(OUTAGE_S)
        assert not done.is_set(), f"the save ended during the outage: {failure}"  # it retries, not gives up
    finally:
        up()
    assert done.wait(90), "the save did not land after the catalog came back"
    assert not failure, failure
    lg = httpx.get(f"{svc.url}/api/v1/runs/{run}/last-good", timeout=30).json()
    assert lg["step"] == 2 and lg["id"] == ck.last_saved.checkpoint_id
    ck.close()


def test_a_save_survives_a_postgresql_outage(make_service, own_pg_server, run_name, monkeypatch):
    name = own_pg_server.create_database()
    svc = make_service(LASTGOOD_CATALOG_URL=own_pg_server.url(name), LASTGOOD_LEASE_SECONDS="60")
    save_across_outage(svc, run_name, monkeypatch, lambda: own_pg_server.stop("immediate"), own_pg_server.start,
                       "PostgreSQL")


def test_a_save_survives_eio_on_the_sqlite_catalog(make_service, run_name, monkeypatch, tmp_path):
    data = tmp_path / "svc"
    switch = data / "catalog_eio.on"
    svc = make_service(data, LASTGOOD_FAILPOINT="catalog_eio", LASTGOOD_LEASE_SECONDS="60")
    save_across_outage(svc, run_name, monkeypatch, switch.touch, switch.unlink, "SQLITE_IOERR")
