"""Lineage (branches, ancestors, events), tags / aliases / pins, and rollbacks, through
the real service (gRPC saves, REST reads and writes)."""

from __future__ import annotations

import pytest

from .helpers import checkpoint, events, http, json_error, last_good_id


def lineage(svc, run, **params):
    r = http(svc).get(f"/api/v1/runs/{run}/lineage", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def names(node_or_view):
    return {t["name"] for t in node_or_view["tags"]}


def test_lineage_branches_edges_and_ancestors(service, client, run_name):
    a, _ = client.save(run_name, 10)
    b, _ = client.save(run_name, 20, parent_id=a)
    c, _ = client.save(run_name, 30, parent_id=b)
    # the trainer restored b and saved again under a new attempt: a branch
    d, _ = client.save(run_name, 25, parent_id=b, attempt="second")
    e, _ = client.save(run_name, 35, parent_id=d, attempt="second")
    # a save of the new branch that died: stays on its parent's branch, is no branch itself
    p = client.begin(run_name, step=45, parent_id=e, attempt="third").checkpoint_id
    client.abort(p)

    g = lineage(service, run_name)
    nodes = {n["id"]: n for n in g["nodes"]}
    assert g["total"] == 6 and g["branches"] == 2
    assert [nodes[i]["branch"] for i in (a, b, c, d, e, p)] == [0, 0, 0, 1, 1, 1]
    assert {(x["from"], x["to"]) for x in g["edges"]} == {(a, b), (b, c), (b, d), (d, e), (e, p)}
    assert g["last_good_id"] == e and nodes[e]["last_good"] and "last-good" in names(nodes[e])
    assert nodes[p]["status"] == "ABANDONED" and nodes[p]["save_seconds"] is None
    for i in (a, b, c, d, e):
        assert nodes[i]["bytes"] > 0 and nodes[i]["save_seconds"] >= 0 and nodes[i]["commit_seconds"] >= 0

    anc = http(service).get(f"/api/v1/checkpoints/{e}/ancestors").json()
    assert [x["id"] for x in anc["items"]] == [d, b, a]
    assert [x["step"] for x in anc["items"]] == [25, 20, 10]

    page = lineage(service, run_name, limit=2, offset=1)
    assert [n["id"] for n in page["nodes"]] == [b, c] and page["total"] == 6
    assert page["nodes"][1]["branch"] == 0  # branches are computed over the whole run

    kinds = [ev["kind"] for ev in events(service, run_name)]
    assert kinds.count("begin") == 6 and kinds.count("commit") == 5 and kinds[-1] == "abort"
    ats = [ev["at"] for ev in events(service, run_name)]
    assert ats == sorted(ats)


def test_tags_aliases_and_pins(service, client, run_name):
    a, _ = client.save(run_name, 1)
    b, _ = client.save(run_name, 2, parent_id=a)
    h = http(service)

    for cid in (a, b):  # plain tags are not unique
        assert h.post(f"/api/v1/checkpoints/{cid}/tags", json={"name": "best"}).status_code == 200
    assert "best" in names(checkpoint(service, a)) and "best" in names(checkpoint(service, b))

    h.post(f"/api/v1/checkpoints/{a}/tags", json={"name": "prod", "alias": True})
    moved = h.post(f"/api/v1/checkpoints/{b}/tags", json={"name": "prod", "alias": True}).json()
    assert moved["moved_from"] == a  # an alias moves, like W&B and MLflow aliases
    assert "prod" not in names(checkpoint(service, a)) and "prod" in names(checkpoint(service, b))
    json_error(h.post(f"/api/v1/checkpoints/{a}/tags", json={"name": "best", "alias": True}), 409)

    payload = "<img src=x onerror=alert(1)>\"'&"
    assert h.post(f"/api/v1/checkpoints/{a}/tags", json={"name": payload}).status_code == 200
    assert payload in names(checkpoint(service, a))  # stored and returned as plain text

    for bad in ("suspect", "last-good", "rollback-target", "pinned", "", " x", "a\x00b", "x" * 129):
        json_error(h.post(f"/api/v1/checkpoints/{a}/tags", json={"name": bad}), 400)
    json_error(h.post("/api/v1/checkpoints/999999/tags", json={"name": "x"}), 404)
    json_error(h.delete(f"/api/v1/checkpoints/{a}/tags/nothere"), 404)
    assert h.delete(f"/api/v1/checkpoints/{a}/tags/best").status_code == 200
    assert "best" not in names(checkpoint(service, a)) and "best" in names(checkpoint(service, b))

    assert h.put(f"/api/v1/checkpoints/{a}/pin").json()["pinned"] is True
    assert "pinned" in names(checkpoint(service, a))
    assert h.delete(f"/api/v1/checkpoints/{a}/pin").json()["pinned"] is False
    assert "pinned" not in names(checkpoint(service, a))

    pending = client.begin(run_name, step=3, parent_id=b).checkpoint_id
    json_error(h.post(f"/api/v1/checkpoints/{pending}/tags", json={"name": "x"}), 409)
    kinds = [ev["kind"] for ev in events(service, run_name)]
    assert {"tag", "untag", "pin", "unpin"} <= set(kinds)


def test_rollback_marks_suspects_and_suspects_never_become_last_good(service, client, run_name):
    a, _ = client.save(run_name, 10)
    b, _ = client.save(run_name, 20, parent_id=a)
    c, _ = client.save(run_name, 30, parent_id=b)
    assert last_good_id(service, run_name) == c
    h = http(service)
    res = h.post(f"/api/v1/runs/{run_name}/rollback",
                 json={"target_id": a, "spike_step": 25, "data": {"loss": 1e4, "median": 2.0, "mad": 0.1}})
    assert res.status_code == 200, res.text
    assert res.json()["suspect"] == [b, c] and res.json()["last_good_id"] == a
    assert last_good_id(service, run_name) == a
    assert "rollback-target" in names(checkpoint(service, a))
    assert all("suspect" in names(checkpoint(service, x)) for x in (b, c))
    evs = events(service, run_name)
    spike = next(ev for ev in evs if ev["kind"] == "spike")
    assert spike["data"]["step"] == 25 and spike["data"]["loss"] == 1e4 and spike["data"]["mad"] == 0.1
    assert next(ev for ev in evs if ev["kind"] == "rollback")["data"]["suspect"] == [b, c]

    # a straggler continuing the suspect line commits, but is suspect and not last-good
    late, _ = client.save(run_name, 40, parent_id=c, attempt="late")
    assert "suspect" in names(checkpoint(service, late)) and last_good_id(service, run_name) == a
    # control: the new branch from the target becomes last-good
    d, _ = client.save(run_name, 20, parent_id=a, attempt="after-rollback")
    assert last_good_id(service, run_name) == d
    assert "suspect" not in names(checkpoint(service, d))

    json_error(h.post(f"/api/v1/runs/{run_name}/rollback", json={"target_id": b, "spike_step": 1}), 409)
    json_error(h.post(f"/api/v1/runs/{run_name}/rollback", json={"target_id": 999999, "spike_step": 1}), 404)
    json_error(h.post("/api/v1/runs/no-such-run/rollback", json={"target_id": a, "spike_step": 1}), 404)


@pytest.mark.parametrize("kind,status", [("restart", 200), ("spike", 200), ("commit", 400), ("x" * 40, 400)])
def test_client_events(service, client, run_name, kind, status):
    client.save(run_name, 1)
    r = http(service).post(f"/api/v1/runs/{run_name}/events", json={"kind": kind, "data": {"n": 1}})
    assert r.status_code == status
    if status == 200:
        assert events(service, run_name)[-1]["kind"] == kind


def test_a_tag_with_a_slash_can_be_removed(service, client, run_name):
    from urllib.parse import quote

    a, _ = client.save(run_name, 1)
    h = http(service)
    assert h.post(f"/api/v1/checkpoints/{a}/tags", json={"name": "exp/lr-0.1"}).status_code == 200
    r = h.delete(f"/api/v1/checkpoints/{a}/tags/{quote('exp/lr-0.1', safe='')}")
    assert r.status_code == 200, r.text
    assert "exp/lr-0.1" not in names(checkpoint(service, a))


def test_a_long_runs_lineage_comes_a_page_at_a_time(make_service, tmp_path):
    """Without a limit the answer is one page (LINEAGE_PAGE), not the whole run: a page that
    polls a long run held every checkpoint in one answer, a peak the service's RSS kept."""
    from bench.seed import seed
    from lastgood_service.domain.queries import LINEAGE_PAGE

    seed(f"sqlite:///{tmp_path / 'svc' / 'catalog.db'}", runs=1, checkpoints=2 * LINEAGE_PAGE + 5, ranks=1,
         prefix="long")
    svc = make_service(tmp_path / "svc")
    first = lineage(svc, "long-00001")
    assert len(first["nodes"]) == LINEAGE_PAGE and first["total"] == 2 * LINEAGE_PAGE + 5
    ids = [n["id"] for n in first["nodes"]]
    while len(ids) < first["total"]:
        ids += [n["id"] for n in lineage(svc, "long-00001", offset=len(ids))["nodes"]]
    assert ids == sorted(set(ids)) and len(ids) == first["total"]
    whole = lineage(svc, "long-00001", limit=10000)  # a client may still ask for up to 10,000
    assert [n["id"] for n in whole["nodes"]] == ids and whole["nodes"][-1]["last_good"]
