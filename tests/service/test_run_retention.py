"""A run's own retention (issue 15): set from the Checkpointer or the API, validated like
the service default, used by GC for that run only, the default everywhere else."""

from __future__ import annotations

import pytest

import lastgood
from lastgood.errors import ServiceError

from .helpers import Client, http, json_error

GC_ENV = {"LASTGOOD_RETENTION": "latest:1,tagged,last-good,branch-heads", "LASTGOOD_GC_INTERVAL": "0"}
OWN = "latest:3,last-good,branch-heads"


def _chain(c: Client, run: str, n: int) -> list[int]:
    ids, parent = [], 0
    for step in range(n):
        parent, _ = c.save(run, step * 10, parent_id=parent)
        ids.append(parent)
    return ids


@pytest.mark.slow
def test_gc_keeps_by_the_runs_own_policy_and_the_default_elsewhere(make_service, run_name):
    svc = make_service(**GC_ENV)
    c = Client(svc.grpc_target)
    try:
        own, other = _chain(c, run_name, 4), _chain(c, run_name + "-other", 4)
    finally:
        c.close()
    h = http(svc)
    url = f"/api/v1/runs/{run_name}/retention"
    assert h.get(url).json() == {"run": run_name, "retention": GC_ENV["LASTGOOD_RETENTION"], "own": None,
                                 "default": GC_ENV["LASTGOOD_RETENTION"]}
    r = h.put(url, json={"retention": " latest:3 , last-good,branch-heads"})
    assert r.status_code == 200 and r.json()["own"] == OWN and r.json()["retention"] == OWN
    plan = h.get("/api/v1/gc/plan").json()
    assert {m["run"]: m["policy"] for m in plan["runs"]} == {run_name: OWN,
                                                             run_name + "-other": GC_ENV["LASTGOOD_RETENTION"]}
    assert sorted(d["checkpoint_id"] for d in plan["checkpoints"]) == [own[0]] + other[:3]
    events = h.get(f"/api/v1/runs/{run_name}/events", params={"kind": "retention"}).json()["items"]
    assert [e["data"] for e in events] == [{"retention": OWN, "was": None}]
    # cleared: the default again
    assert h.put(url, json={"retention": None}).json()["own"] is None
    assert sorted(d["checkpoint_id"] for d in h.get("/api/v1/gc/plan").json()["checkpoints"]) == own[:3] + other[:3]


@pytest.mark.parametrize("spec,status", [("latest:x,last-good,branch-heads", 400), ("latest:3", 400),
                                         ("keep-everything", 400), ("latest:1," * 100, 422)])
def test_a_bad_retention_is_refused_and_changes_nothing(service, run_name, spec, status):
    c = Client(service.grpc_target)
    try:
        _chain(c, run_name, 1)
    finally:
        c.close()
    h = http(service)
    url = f"/api/v1/runs/{run_name}/retention"
    assert h.put(url, json={"retention": OWN}).status_code == 200
    err = json_error(h.put(url, json={"retention": spec}), status)
    assert err["message"]
    assert h.get(url).json()["own"] == OWN
    # on a run that does not exist yet, a bad spec creates nothing either
    fresh = f"/api/v1/runs/{run_name}-fresh/retention"
    json_error(h.put(fresh, json={"retention": spec}), status)
    json_error(h.get(fresh), 404)


@pytest.mark.slow
def test_a_policy_set_before_the_first_save_is_in_force_from_it(make_service, run_name):
    """docs/training.md sets a run's retention before its job starts: the run is created with
    it (it answered 404), and GC applies it to the checkpoints the first launch saves."""
    svc = make_service(**GC_ENV)
    h = http(svc)
    url = f"/api/v1/runs/{run_name}/retention"
    r = h.put(url, json={"retention": OWN})
    assert r.status_code == 200 and r.json()["own"] == OWN, r.text
    c = Client(svc.grpc_target)
    try:
        ids = _chain(c, run_name, 4)
    finally:
        c.close()
    assert h.get(url).json()["own"] == OWN
    plan = h.get("/api/v1/gc/plan").json()
    assert [d["checkpoint_id"] for d in plan["checkpoints"]] == ids[:1]  # latest:3 kept, not latest:1


def test_the_checkpointer_sends_the_runs_retention(service, run_name):
    ck = lastgood.Checkpointer(service.url, run=run_name, retention="latest:5,every:1000,tagged,last-good,branch-heads")
    try:
        assert http(service).get(f"/api/v1/runs/{run_name}/retention").json()["own"] == \
            "latest:5,every:1000,tagged,last-good,branch-heads"
    finally:
        ck.close()
    with pytest.raises(ServiceError) as bad:
        lastgood.Checkpointer(service.url, run=run_name + "-bad", retention="latest:5")
    assert bad.value.code == 400 and "last-good" in str(bad.value)
    assert http(service).get(f"/api/v1/runs/{run_name}/retention").json()["own"] is not None


@pytest.mark.slow
def test_a_pinned_or_tagged_checkpoint_survives_a_policy_without_tagged(make_service, run_name):
    """I4: tags and pins keep a checkpoint whatever the retention says. A run's own policy
    may leave out `tagged`; GC must still keep what a user pinned or tagged."""
    svc = make_service(**GC_ENV)
    c = Client(svc.grpc_target)
    try:
        ids = _chain(c, run_name, 5)
    finally:
        c.close()
    h = http(svc)
    pinned, tagged, plain = ids[0], ids[1], ids[2]
    assert h.put(f"/api/v1/checkpoints/{pinned}/pin").status_code == 200
    assert h.post(f"/api/v1/checkpoints/{tagged}/tags", json={"name": "eval"}).status_code == 200
    assert h.put(f"/api/v1/runs/{run_name}/retention", json={"retention": "latest:1,last-good,branch-heads"}
                 ).status_code == 200
    planned = sorted(d["checkpoint_id"] for d in h.get("/api/v1/gc/plan").json()["checkpoints"])
    assert planned == [plain, ids[3]]  # control: the policy does delete what nothing protects
    assert h.post("/api/v1/gc").status_code == 200
    status = {cid: h.get(f"/api/v1/checkpoints/{cid}").json()["status"] for cid in ids}
    assert status == {pinned: "COMMITTED", tagged: "COMMITTED", plain: "DELETED", ids[3]: "DELETED",
                      ids[4]: "COMMITTED"}
