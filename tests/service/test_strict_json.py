"""Event values JSON cannot carry (issue 10, item 3).

Python's json reads NaN, Infinity, 1e999 and lone surrogates; such a value stored in one
event once made `GET /runs/{run}/events` answer 500 for good (and the page's lineage of
that run empty). Writes refuse them with 422 and change nothing; SpikeGuard sends a
non-finite loss as "nan"; reads repair rows an older service stored."""

from __future__ import annotations

import datetime as dt
import sqlite3

import pytest

from .helpers import Client, events, http, json_error

BAD_VALUES = {
    "NaN": b"NaN", "Infinity": b"Infinity", "-Infinity": b"-Infinity", "1e999": b"1e999", "-1e999": b"-1e999",
    "lone surrogate": b'"\\ud800"', "lone surrogate in a key": b'{"\\udfff": 1}',
    "not UTF-8": b'"\xff\xfe"', "41 levels": b"[" * 41 + b"]" * 41,
}


@pytest.fixture(scope="module")
def saved(svc):
    with Client(svc.grpc_target) as c:
        cid, _ = c.save("strict-json", step=1)
    return "strict-json", cid


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_event_data_json_cannot_carry_is_refused(svc, saved, name):
    run, cid = saved
    h = http(svc)
    before = events(svc, run)
    for path, body in ((f"/api/v1/runs/{run}/events", b'{"kind": "note", "data": {"x": %s}}'),
                       (f"/api/v1/runs/{run}/rollback", b'{"target_id": %d, "spike_step": 5, "data": {"loss": %%s}}'
                        % cid)):
        r = h.post(path, content=body % BAD_VALUES[name], headers={"Content-Type": "application/json"})
        err = json_error(r, 422)
        assert err["code"] == "invalid_request", err
    r = h.get(f"/api/v1/runs/{run}/events")
    assert r.status_code == 200 and r.json()["items"] == before  # nothing was stored
    assert not [t for t in h.get(f"/api/v1/checkpoints/{cid}").json()["tags"] if t["name"] == "rollback-target"]


def test_control_the_strings_nan_and_inf_are_stored_and_read(svc, saved):
    run, _ = saved
    r = http(svc).post(f"/api/v1/runs/{run}/events",
                       json={"kind": "note", "data": {"loss": "nan", "grad": "-inf", "deep": [[[1.5]]], "s": "é"}})
    assert r.status_code == 200, r.text
    last = events(svc, run)[-1]["data"]
    assert last == {"loss": "nan", "grad": "-inf", "deep": [[[1.5]]], "s": "é"}


@pytest.mark.slow
def test_rows_stored_before_the_rules_are_read(make_service):
    """Rows written straight into a real service's SQLite catalog, as an older service stored
    them: the events and the lineage still answer, with the values carried as strict JSON."""
    svc = make_service()
    with Client(svc.grpc_target) as c:
        cid, _ = c.save("old-rows", step=1)
    db = sqlite3.connect(svc.data_dir / "catalog.db")
    (run_id,) = db.execute("SELECT id FROM runs WHERE name = 'old-rows'").fetchone()
    (at,) = db.execute("SELECT max(at) FROM events WHERE run_id = ?", (run_id,)).fetchone()
    rows = ['{"loss": NaN, "grad": Infinity, "low": -Infinity}', '{"s": "a\\ud800b", "\\udfff": 1}',
            "[" * 200 + "]" * 200, "not json at all"]
    db.executemany("INSERT INTO events (run_id, checkpoint_id, kind, at, data_json) VALUES (?, ?, 'note', ?, ?)",
                   [(run_id, cid, at, text) for text in rows])
    db.commit()
    db.close()
    h = http(svc)
    r = h.get("/api/v1/runs/old-rows/events")
    assert r.status_code == 200, r.text[:300]
    data = [e["data"] for e in r.json()["items"][-4:]]
    assert data[0] == {"loss": "nan", "grad": "inf", "low": "-inf"}
    assert data[1]["s"].startswith("a") and data[1]["s"].endswith("b") and "\ufffd" in data[1]["s"]
    assert "(too deep)" in r.text and "unreadable" in data[3]
    lineage = h.get("/api/v1/runs/old-rows/lineage")
    assert lineage.status_code == 200 and [n["id"] for n in lineage.json()["nodes"]] == [cid]
