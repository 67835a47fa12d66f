"""Property-based REST fuzz from the service's own OpenAPI document (issue 10).

Schemathesis generates requests for every operation, valid ones and invalid ones
(positive and negative generation), against a real service process, with tokens off and
with tokens required (an admin token, so that the calls reach the handlers). Every answer
must be below 500 and one of the statuses the operation declares, and pass schemathesis's
conformance checks (CONFORMANCE: a request the schema calls valid is accepted, statuses,
content types, headers and bodies as declared; issue 36, finding 12). Failures are
collected, not raised one by one, so that one run reports every distinct defect it met.

The normal test suite runs LASTGOOD_FUZZ_CASES (default 300) cases per mode with a fixed
seed; `make fuzz` runs 10,000 per mode with a fresh seed and prints the figures.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi import checks  # noqa: E402

from lastgood.wire import names  # noqa: E402
from tests.conftest import FAST, ServiceProc  # noqa: E402
from tests.service.helpers import Client  # noqa: E402

pytestmark = pytest.mark.fuzz

CASES = int(os.environ.get("LASTGOOD_FUZZ_CASES", "300"))
SEED = os.environ.get("LASTGOOD_FUZZ_SEED")  # unset: a fixed seed (derandomized)
REPORT = os.environ.get("LASTGOOD_FUZZ_REPORT")  # a JSON-lines file the figures are appended to
ADMIN = "fuzz-bootstrap-admin-secret"
# schemathesis's own checks of each answer against the schema (what `st run` checks, less
# not_a_server_error and the status check above, which count separately)
CONFORMANCE = [checks.positive_data_acceptance, checks.status_code_conformance, checks.content_type_conformance,
               checks.response_headers_conformance, checks.response_schema_conformance]
# rules no schema can state: a schema-valid request refused for one of these is counted, not
# failed. 400: a value against stored state or another field (a rank beyond the world size, a
# generation the run never registered, the retention syntax, a file named twice in a list of
# objects); 422: an integral float (1.0) for
# a strict integer, which JSON Schema's "integer" admits and the heartbeat refuses, and a value
# the generator rounded past the id bound (names.MAX_ID, 2^62: beyond a float's exact integers)
# (the world size's bound is the deployment's setting, LASTGOOD_MAX_WORLD_SIZE, not the schema's)
BEYOND_THE_SCHEMA = {400: re.compile(r"rank \d+ is outside world size|was never registered|retention policy|retention:"
                                     r"| is named twice|world size must be 1\.\.\d+, got"),
                     422: re.compile(r"body\.\w+: Input should be a valid integer(?!,)"
                                     rf"|body\.[\w.]+: Input should be less than or equal to {names.MAX_ID}\b")}


def _seed_catalog(data_dir) -> None:
    """Something for generated ids to hit: ids 1 and 2 committed (1 tagged, leased), 3 pending."""
    svc = ServiceProc(data_dir, {**FAST, "LASTGOOD_LEASE_SECONDS": "3600"}).start()
    try:
        with Client(svc.grpc_target) as c:
            first, _ = c.save("fuzz", step=1)
            c.save("fuzz", step=2, parent_id=first)
            c.begin("fuzz", step=3)
        assert svc.post(f"/api/v1/checkpoints/{first}/tags", json={"name": "t"}).status_code == 200
        assert svc.post(f"/api/v1/checkpoints/{first}/leases", json={"seconds": 3600}).status_code == 200
    finally:
        svc.stop()


@pytest.fixture(scope="module", params=["tokens-off", "tokens-on"])
def target(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    _seed_catalog(data_dir)
    env = {**FAST, "LASTGOOD_LEASE_SECONDS": "3600"}
    headers = {}
    if request.param == "tokens-on":
        env.update({"LASTGOOD_AUTH_REQUIRED": "true", "LASTGOOD_ADMIN_TOKEN": ADMIN})
        headers = {"Authorization": f"Bearer {ADMIN}"}
    svc = ServiceProc(data_dir, env).start()
    yield request.param, svc, headers
    svc.stop()


def test_generated_requests_get_no_5xx_and_no_undeclared_status(target):
    import requests

    mode, svc, headers = target
    schema = schemathesis.openapi.from_url(svc.url + "/openapi.json")
    declared = {}
    for result in schema.get_all_operations():
        op = result.ok()
        declared[(op.method.upper(), op.path)] = set(op.responses.status_codes)
    strategy = st.one_of(schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
                         schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    session = requests.Session()
    stats = {"cases": 0, "5xx": 0, "undeclared": 0, "nonconforming": 0, "beyond_schema": 0}
    failures: dict[tuple, str] = {}  # one example per (operation, status)

    @settings(max_examples=CASES, database=None, deadline=None, derandomize=SEED is None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case):
        r = case.call(base_url=svc.url, session=session, headers=headers, timeout=30)
        stats["cases"] += 1
        key = (case.method.upper(), case.operation.path)
        status = r.status_code
        if status >= 500:
            stats["5xx"] += 1
            kind = status
        elif str(status) not in declared[key] and "default" not in declared[key]:
            stats["undeclared"] += 1
            kind = status
        else:
            try:
                case.validate_response(r, checks=CONFORMANCE, headers=headers)
                return
            except FailureGroup as group:
                if (status in BEYOND_THE_SCHEMA and BEYOND_THE_SCHEMA[status].search(r.text)
                        and all(isinstance(f, checks.RejectedPositiveData) for f in group.exceptions)):
                    stats["beyond_schema"] += 1
                    return
                stats["nonconforming"] += 1
                kind = ",".join(sorted({f.title for f in group.exceptions}))
        body = "" if isinstance(case.body, NotSet) else f" body={str(case.body)[:200]!r}"
        failures.setdefault((*key, kind), f"[{kind}] {case.method} {case.formatted_path} query={case.query}{body} "
                                          f"-> {status} {r.text[:200]}")

    if SEED is not None:
        one = hypothesis_seed(int(SEED))(one)
    start = time.monotonic()
    one()
    stats.update(mode=mode, seconds=round(time.monotonic() - start, 1), operations=len(declared), seed=SEED)
    print(f"\nREST fuzz: {json.dumps(stats)}")
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(stats) + "\n")
    assert stats["cases"] >= min(CASES, 100)
    assert not failures, f"{stats}\n" + "\n".join(failures.values())
