"""The read-only REST routes the page needs: /api/v1/overview, /api/v1/gc/policy,
/api/v1/checkpoints/{id}/shards, and the `kind` filter of a run's events."""

from __future__ import annotations

import httpx

from ..service.helpers import Client, json_error, make_shard, shard_name
from . import seed
from .conftest import UI_ENV, wait_graph


def get(svc, path: str, **params) -> httpx.Response:
    return httpx.get(svc.url + path, params=params, timeout=30)


def test_overview_counts_bytes_activity_pending_and_failures(ui_service, world):
    r = get(ui_service, "/api/v1/overview", limit=1000)
    assert r.status_code == 200
    body = r.json()
    runs = {item["name"]: item for item in body["items"]}
    alpha = runs[world.alpha]
    lineage = get(ui_service, f"/api/v1/runs/{world.alpha}/lineage").json()
    assert alpha["total_checkpoints"] == lineage["total"] == 10
    assert alpha["checkpoints"] == {"PENDING": 1, "COMMITTED": 7, "ABANDONED": 1, "CORRUPT": 1, "DELETED": 0}
    assert alpha["pending"] == 1
    assert alpha["recent_failures"] == 3  # the abort, the corruption and the restart (events.FAILURE_EVENTS)
    assert alpha["last_good"] == {"id": world.ids["c7"], "step": 500}
    assert alpha["bytes_stored"] == sum(n["bytes"] for n in lineage["nodes"])
    events = get(ui_service, f"/api/v1/runs/{world.alpha}/events", limit=1000).json()["items"]
    assert alpha["last_event_id"] == max(e["id"] for e in events)
    assert alpha["last_activity"] == max(e["at"] for e in events)
    beta = runs[world.beta]
    assert beta["recent_failures"] == 0 and beta["pending"] == 0 and beta["last_failure_at"] is None
    assert body["total"] >= 3 and body["failure_window_seconds"] == 86400
    json_error(get(ui_service, "/api/v1/overview", limit=0), 422)


def test_shards_of_committed_pending_and_unknown_checkpoints(ui_service, world):
    committed = get(ui_service, f"/api/v1/checkpoints/{world.ids['c7']}/shards").json()
    manifest = get(ui_service, f"/api/v1/checkpoints/{world.ids['c7']}").json()["manifest"]
    assert committed["status"] == "COMMITTED" and committed["world_size"] == 1
    assert [(r["rank"], r["voted"], [(f["name"], f["size"], f["xxh3_128"]) for f in r["files"]])
            for r in committed["ranks"]] == [
        (0, True, [(f["name"], f["size"], f["xxh3_128"]) for f in manifest["ranks"][0]["files"]])]
    pending = get(ui_service, f"/api/v1/checkpoints/{world.ids['c10']}/shards").json()
    assert pending["status"] == "PENDING"
    assert pending["ranks"] == [{"rank": 0, "voted": False, "files": [
        {"name": shard_name(0), "size": len(make_shard(0, seed=7)), "xxh3_128": pending["ranks"][0]["files"][0]["xxh3_128"],
         "status": "VERIFIED"}]}]
    aborted = get(ui_service, f"/api/v1/checkpoints/{world.ids['c8']}/shards").json()
    assert aborted["status"] == "ABANDONED" and aborted["ranks"] == []
    json_error(get(ui_service, "/api/v1/checkpoints/999999999/shards"), 404)
    json_error(get(ui_service, "/api/v1/checkpoints/0/shards"), 422)


def test_gc_policy(ui_service):
    policy = get(ui_service, "/api/v1/gc/policy").json()
    assert policy["retention"] == "latest:3,tagged,last-good,branch-heads"
    assert [p["spec"] for p in policy["policies"]] == ["latest:3", "tagged", "last-good", "branch-heads"]
    assert policy["policies"][0]["keeps"] == "keeps the 3 newest committed checkpoints of each run"
    assert policy["grace_seconds"] == 0 and policy["interval_seconds"] == 0
    assert get(ui_service, "/api/v1/gc/plan").json()["policy"] == policy["retention"]


def test_events_filtered_by_kind(ui_service, world):
    path = f"/api/v1/runs/{world.alpha}/events"
    every = get(ui_service, path, limit=1000).json()
    some = get(ui_service, path, kind="spike,rollback,restart", limit=1000).json()
    assert [e["kind"] for e in some["items"]] == ["spike", "rollback", "restart"]
    assert some["total"] == 3 and every["total"] > 3
    assert [e for e in every["items"] if e["kind"] in ("spike", "rollback", "restart")] == some["items"]
    assert get(ui_service, path, kind="nothing_like_this").json() == {"items": [], "total": 0, "limit": 100, "offset": 0}
    for bad in ("", "spike,", "Spike", "spike;drop", "x" * 33):
        json_error(get(ui_service, path, kind=bad), 400)
    json_error(get(ui_service, path, kind="a," * 300), 422)  # longer than the route takes


def test_deleted_checkpoints_are_not_stored_bytes_and_show_as_deleted(make_service, open_page):
    svc = make_service(**UI_ENV)
    client = Client(svc.grpc_target)
    try:
        run = seed.unique("gc")
        ids, parent = [], 0
        for step in (10, 20, 30, 40, 50):
            parent = seed.save(client, run, step, parent)
            ids.append(parent)
    finally:
        client.close()
    result = httpx.post(svc.url + "/api/v1/gc", params={"dry_run": "false"}, timeout=60).json()["result"]
    assert sorted(result["deleted"]) == ids[:2]  # latest:3 keeps 30, 40, 50
    item = get(svc, "/api/v1/overview").json()["items"][0]
    nodes = get(svc, f"/api/v1/runs/{run}/lineage").json()["nodes"]
    assert item["checkpoints"]["DELETED"] == 2 and item["total_checkpoints"] == 5
    assert item["bytes_stored"] == sum(n["bytes"] for n in nodes if n["status"] != "DELETED") > 0
    page, _ = open_page(f"{svc.url}/#run={run}")
    snap = wait_graph(page, run)
    assert [n["status"] for n in snap["nodes"]] == ["deleted", "deleted", "committed", "committed", "committed"]
