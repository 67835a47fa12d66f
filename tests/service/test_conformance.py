"""REST conformance and bounds (issue 10, items 6 and 10): integers too large for the
catalog are refused with 422, 405 answers keep their Allow header, and the OpenAPI document
declares the error answers each route gives, with one error body."""

from __future__ import annotations

import pytest

from lastgood.wire import names

from .helpers import Client, events, http, json_error, shard_name

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


def test_a_405_allows_every_method_of_its_path(svc):
    """Allow lists each method the path has, from the OpenAPI document, whichever route of
    the path the router tried first (issue 36, finding 12: it named one of two)."""
    h = http(svc)
    doc = h.get("/openapi.json").json()
    checked = 0
    for path, ops in doc["paths"].items():
        declared = {m.upper() for m in ops}
        if len(declared) < 2:
            continue
        concrete = path.replace("{run}", "allow-run").replace("{name}", "t")
        for param in ("checkpoint_id", "rank", "token_id", "lease_id"):
            concrete = concrete.replace("{" + param + "}", "1")
        r = h.request("PATCH", concrete)
        assert r.status_code == 405, (path, r.status_code)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert declared <= allow, (path, sorted(declared), r.headers["allow"])
        checked += 1
    assert checked >= 4  # /tokens, .../retention, .../peer-check, .../pin at least


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
            # a path with an id answers 404 for one that does not exist; PUT retention creates its
            # run; an agent's live list answers 403 for an id that is not the key's, whether or not
            # it exists (no probe of which agent ids are registered)
            need |= {"404"} if "{" in path and (method, path) not in (
                ("put", "/api/v1/runs/{run}/retention"), ("get", "/api/v1/agents/{agent_id}/live")) else set()
            if not need <= declared:
                undeclared.append(f"{method.upper()} {path}: {sorted(need - declared)}")
            for code in declared - {"200", "204"}:  # the success answers; every other is an error
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorBody"), (method, path, code, ref)
    assert not undeclared, "\n".join(undeclared)
    download = doc["paths"]["/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"]["get"]
    assert "416" in download["responses"]


def test_every_answer_says_nosniff(svc, saved):
    """API answers, errors (the body limit's 413 included), downloads, the page and its
    files: each says X-Content-Type-Options: nosniff (api/contract.Nosniff, its one place)."""
    run, cid = saved
    h = http(svc)
    name = shard_name(0)
    answers = {
        "json": h.get(f"/api/v1/runs/{run}/checkpoints"),
        "healthz": h.get("/healthz"),
        "metrics": h.get("/metrics"),
        "openapi": h.get("/openapi.json"),
        "404": h.get("/api/v1/checkpoints/999999"),
        "405": h.request("PATCH", "/api/v1/runs"),
        "413": h.post(f"/api/v1/runs/{run}/events", content=b"x" * (2 * 1024 * 1024),
                      headers={"content-type": "application/json"}),
        "422": h.get("/api/v1/checkpoints/x"),
        "download": h.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{name}"),
        "range": h.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{name}", headers={"Range": "bytes=0-3"}),
        "page": h.get("/"),
        "static": h.get("/static/app.js"),
    }
    statuses = {k: r.status_code for k, r in answers.items()}
    assert statuses["download"] == 200 and statuses["range"] == 206 and statuses["413"] == 413, statuses
    missing = {k: r.status_code for k, r in answers.items() if r.headers.get("x-content-type-options") != "nosniff"}
    assert not missing, missing
    assert all(len(r.headers.get_list("x-content-type-options")) == 1 for r in answers.values())


def test_every_operation_has_a_description(svc):
    """Each operation of /openapi.json says what it does (issue 39, item 7: part of it)."""
    doc = http(svc).get("/openapi.json").json()
    bare = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m, op in ops.items()
            if len(op.get("description", "").strip()) < 20]
    assert not bare, bare
