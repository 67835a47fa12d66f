"""REST conformance and bounds (issue 10, items 6 and 10): integers too large for the
catalog are refused with 422, 405 answers keep their Allow header, and the OpenAPI document
declares the error answers each route gives, with one error body."""

from __future__ import annotations

import pytest

from lastgood.wire import names

from .helpers import Client, events, http, json_error

HUGE = [10**20, 2**63, names.MAX_ID + 1, -(10**20)]


@pytest.fixture(scope="module")
def saved(svc):
    with Client(svc.grpc_target) as c:
        cid, _ = c.save("conformance", step=1)
    return "conformance", cid


@pytest.mark.parametrize("value", HUGE)
def test_integers_beyond_the_bounds_are_refused_in_every_body(svc, saved, value):
    run, cid = saved
    h = http(svc)
    before = events(svc, run)
    for path, body in ((f"/api/v1/runs/{run}/rollback", {"target_id": value, "spike_step": 5}),
                       (f"/api/v1/runs/{run}/rollback", {"target_id": cid, "spike_step": value}),
                       (f"/api/v1/runs/{run}/events", {"kind": "note", "checkpoint_id": value}),
                       (f"/api/v1/checkpoints/{cid}/leases", {"seconds": value})):
        err = json_error(h.post(path, json=body), 422)
        assert err["code"] == "invalid_request", (path, body, err)
    for path in (f"/api/v1/checkpoints/{value}", f"/api/v1/checkpoints/{cid}/ranks/{value}/files/x.bin",
                 f"/api/v1/runs/{run}/checkpoints?offset={value}"):
        assert json_error(h.get(path), 422)["code"] == "invalid_request", path
    assert events(svc, run) == before
    # control: the largest allowed id is a plain 404, not a 422 and not a 500
    assert json_error(h.get(f"/api/v1/checkpoints/{names.MAX_ID}"), 404)["code"] == "not_found"


def test_405_keeps_its_allow_header(svc):
    h = http(svc)
    for method, path, allow in (("PATCH", "/api/v1/runs", {"GET"}), ("POST", "/healthz", {"GET"}),
                                ("GET", "/api/v1/gc", {"POST"})):
        r = h.request(method, path)
        assert r.status_code == 405 and r.json()["error"]["code"] == "http_error"
        assert allow <= {m.strip() for m in r.headers["allow"].split(",")}, (method, path, r.headers)


def test_the_openapi_document_declares_each_routes_errors(svc):
    doc = http(svc).get("/openapi.json").json()
    assert doc["components"]["schemas"]["ErrorBody"]["properties"]["error"]
    undeclared = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            declared = set(op["responses"])
            if path in ("/healthz", "/api/v1/info"):
                continue  # public, no parameters
            need = {"401", "403"} | ({"422"} if op.get("parameters") or op.get("requestBody") else set())
            need |= {"413"} if op.get("requestBody") else set()
            # a path with an id answers 404 for one that does not exist; PUT retention creates its run
            need |= {"404"} if "{" in path and (method, path) != ("put", "/api/v1/runs/{run}/retention") else set()
            if not need <= declared:
                undeclared.append(f"{method.upper()} {path}: {sorted(need - declared)}")
            for code in declared - {"200", "204"}:  # the success answers; every other is an error
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorBody"), (method, path, code, ref)
    assert not undeclared, "\n".join(undeclared)
    download = doc["paths"]["/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"]["get"]
    assert "416" in download["responses"]
