"""The OpenAPI document says what every route answers (issue 39): a description for every
operation, a schema for every success answer, and real answers of a real service hold to
those schemas (api/answers.py), so a client generated from /openapi.json can trust them."""

from __future__ import annotations

import jsonschema
import pytest
import torch

import lastgood

from .helpers import Client, http

NO_CONTENT = "204"


@pytest.fixture(scope="module")
def doc(svc) -> dict:
    return http(svc).get("/openapi.json").json()


def test_every_operation_has_a_description_and_every_success_a_schema(doc):
    undescribed, unshaped = [], []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if not op.get("description", "").strip():
                undescribed.append(f"{method.upper()} {path}")
            for code, answer in op["responses"].items():
                if code.startswith("2") and code != NO_CONTENT:
                    content = answer.get("content") or {}
                    if not content or any(not c.get("schema") for c in content.values()):
                        unshaped.append(f"{method.upper()} {path} {code}")
    assert not undescribed, f"operations without a description: {undescribed}"
    assert not unshaped, f"success answers without a schema: {unshaped}"


def _check(doc: dict, method: str, template: str, answer) -> None:
    assert answer.status_code < 300, (method, template, answer.status_code, answer.text[:300])
    op = doc["paths"][template][method]
    schema = op["responses"][str(answer.status_code)]["content"]["application/json"]["schema"]
    try:
        jsonschema.validate(answer.json(), {**schema, "components": doc["components"]})
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{method.upper()} {template}: {e.message} at {list(e.absolute_path)}") from None


def test_real_answers_hold_to_the_declared_schemas(svc, doc, run_name):
    h = http(svc)
    run = run_name[:60]
    ck = lastgood.Checkpointer(svc.url, run=run)
    try:
        state = lastgood.TrainState(model=torch.nn.Linear(4, 4))
        ck.step(0)
        for step in (1, 2):
            ck.save(step, state)
            ck.wait()
    finally:
        ck.close()
    gen = h.get(f"/api/v1/runs/{run}/launches/current").json()["generation"]
    with Client(svc.grpc_target) as c:
        c.begin(run, step=3, generation=gen)  # a PENDING checkpoint in the listings
    cid = h.get(f"/api/v1/runs/{run}/last-good").json()["id"]
    file_name = h.get(f"/api/v1/checkpoints/{cid}/manifest").json()["ranks"][0]["files"][0]["name"]
    r, k = f"/api/v1/runs/{run}", f"/api/v1/checkpoints/{cid}"
    calls = [
        ("get", "/healthz", "/healthz", None),
        ("get", "/api/v1/info", "/api/v1/info", None),
        ("get", "/api/v1/runs", "/api/v1/runs", None),
        ("get", "/api/v1/runs/{run}", r, None),
        ("get", "/api/v1/runs/{run}/checkpoints", r + "/checkpoints", None),
        ("get", "/api/v1/runs/{run}/last-good", r + "/last-good", None),
        ("get", "/api/v1/runs/{run}/last-good", r + "/last-good?manifest=true", None),
        ("get", "/api/v1/runs/{run}/events", r + "/events", None),
        ("post", "/api/v1/runs/{run}/events", r + "/events", {"kind": "note", "data": {"a": 1}}),
        ("get", "/api/v1/overview", "/api/v1/overview", None),
        ("get", "/api/v1/runs/{run}/lineage", r + "/lineage", None),
        ("get", "/api/v1/runs/{run}/health", r + "/health", None),
        ("get", "/api/v1/runs/{run}/launches/current", r + "/launches/current", None),
        ("get", "/api/v1/runs/{run}/retention", r + "/retention", None),
        ("put", "/api/v1/runs/{run}/retention", r + "/retention", {"retention": "latest:3,last-good,branch-heads"}),
        ("get", "/api/v1/checkpoints/{checkpoint_id}", k, None),
        ("get", "/api/v1/checkpoints/{checkpoint_id}/manifest", k + "/manifest", None),
        ("get", "/api/v1/checkpoints/{checkpoint_id}/ancestors", k + "/ancestors", None),
        ("get", "/api/v1/checkpoints/{checkpoint_id}/outcome", k + "/outcome", None),
        ("get", "/api/v1/checkpoints/{checkpoint_id}/shards", k + "/shards", None),
        ("get", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/index/{file_name}",
         f"{k}/ranks/0/index/{file_name}", None),
        ("post", "/api/v1/checkpoints/{checkpoint_id}/verify", k + "/verify", None),
        ("post", "/api/v1/checkpoints/{checkpoint_id}/tags", k + "/tags", {"name": "best"}),
        ("delete", "/api/v1/checkpoints/{checkpoint_id}/tags/{name}", k + "/tags/best", None),
        ("put", "/api/v1/checkpoints/{checkpoint_id}/pin", k + "/pin", None),
        ("delete", "/api/v1/checkpoints/{checkpoint_id}/pin", k + "/pin", None),
        ("get", "/api/v1/gc/plan", "/api/v1/gc/plan", None),
        ("get", "/api/v1/gc/policy", "/api/v1/gc/policy", None),
        ("get", "/api/v1/tokens", "/api/v1/tokens", None),
        ("post", "/api/v1/runs/{run}/rollback", r + "/rollback", {"target_id": cid - 1, "spike_step": 2}),
        ("post", "/api/v1/runs/{run}/launches", r + "/launches", {"attempt": "openapi", "world_size": 1}),
    ]
    for method, template, path, body in calls:
        _check(doc, method, template, h.request(method.upper(), path, json=body))
    lease = h.post(f"{k}/leases", json={"seconds": 60})
    _check(doc, "post", "/api/v1/checkpoints/{checkpoint_id}/leases", lease)
    _check(doc, "delete", "/api/v1/leases/{lease_id}", h.delete(f"/api/v1/leases/{lease.json()['lease_id']}"))
    _check(doc, "post", "/api/v1/gc", h.post("/api/v1/gc"))
    made = h.post("/api/v1/tokens", json={"name": "openapi", "role": "reader"})
    _check(doc, "post", "/api/v1/tokens", made)
    _check(doc, "delete", "/api/v1/tokens/{token_id}", h.delete(f"/api/v1/tokens/{made.json()['id']}"))
    # control: the schemas are not vacuous; an answer without a field they name fails them
    body = h.get(k).json()
    del body["manifest"]["ranks"]
    schema = doc["paths"]["/api/v1/checkpoints/{checkpoint_id}"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    with pytest.raises(jsonschema.ValidationError, match="ranks"):
        jsonschema.validate(body, {**schema, "components": doc["components"]})
    # a lineage node names its tier (docs/memory-tier.md): an answer without it fails the schema
    page = h.get(r + "/lineage").json()
    del page["nodes"][0]["tier"]
    schema = doc["paths"]["/api/v1/runs/{run}/lineage"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    with pytest.raises(jsonschema.ValidationError, match="tier"):
        jsonschema.validate(page, {**schema, "components": doc["components"]})
    # a file's bytes are declared as bytes, and come as bytes
    download = h.get(f"{k}/ranks/0/files/{file_name}")
    assert download.status_code == 200 and download.content
    assert "application/octet-stream" in doc["paths"][
        "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"]["get"]["responses"]["200"]["content"]
