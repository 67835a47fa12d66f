"""GET /api/v1/gc/plan (#36, finding 10): it plans only the runs where something changed
since the last GC pass (O(changed runs); `full=true` plans every run and lists the store),
and a scoped reader sees the plan of its own runs alone, never the store-wide full plan.
The 3,000-run figure is bench/gc_plan.py's."""

from __future__ import annotations

import httpx
import pytest

from .helpers import Client

BOOT = "gc-plan-bootstrap-admin"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.conftest import FAST, ServiceProc

    svc = ServiceProc(tmp_path_factory.mktemp("gcplan"), {
        **FAST, "LASTGOOD_RETENTION": "latest:1,last-good,branch-heads", "LASTGOOD_GC_INTERVAL": "0",
        "LASTGOOD_GC_GRACE_SECONDS": "0", "LASTGOOD_ADMIN_TOKEN": BOOT}).start()  # a token sent is checked
    yield svc
    svc.stop()


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def token(svc, role: str, prefix: str | None = None) -> dict:
    r = httpx.post(f"{svc.url}/api/v1/tokens", json={"name": f"{role}-{prefix}", "role": role, "run_prefix": prefix},
                   headers=bearer(BOOT), timeout=30)
    assert r.status_code == 200, r.text
    return bearer(r.json()["token"])


def save_two(svc, run: str, step: int = 1, parent: int = 0) -> tuple[int, int]:
    """Two checkpoints of `run`; the older is not kept (latest:1): the one GC would delete."""
    with Client(svc.grpc_target) as c:
        old, _ = c.save(run, step, parent_id=parent)
        new, _ = c.save(run, step + 1, parent_id=old)
    return old, new


def plan(svc, headers: dict, **params) -> httpx.Response:
    return httpx.get(f"{svc.url}/api/v1/gc/plan", params=params, headers=headers, timeout=30)


def test_the_plan_covers_changed_runs_and_a_scoped_reader_sees_its_own(svc, run_name):
    a, b = f"team-a-{run_name}", f"team-b-{run_name}"
    (doomed_a, _), (doomed_b, head_b) = save_two(svc, a), save_two(svc, b)
    doomed = {a: doomed_a, b: doomed_b}
    reader, scoped = token(svc, "reader"), token(svc, "reader", "team-a-")

    # control: an unscoped reader's plan holds both runs' deletions
    every = plan(svc, reader).json()
    assert {d["checkpoint_id"] for d in every["checkpoints"]} >= set(doomed.values())
    mine = plan(svc, scoped)
    assert mine.status_code == 200, mine.text
    assert {d["run"] for d in mine.json()["checkpoints"]} == {a}
    assert all(r["run"].startswith("team-a-") for r in mine.json()["runs"])
    r = plan(svc, scoped, full="true")  # the store listing spans every run
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    assert plan(svc, reader, full="true").json()["full"] is True

    # after a pass, a run where nothing happened is not planned again; one that saved is.
    # (A pass that deleted in a run records gc_delete events there: the next pass plans the
    # run once more, finds nothing, and marks it settled.)
    for _ in range(2):
        assert httpx.post(f"{svc.url}/api/v1/gc", headers=bearer(BOOT), timeout=60).status_code == 200
    quiet = plan(svc, reader).json()
    assert quiet["full"] is False and quiet["runs"] == [] and quiet["checkpoints"] == []
    newer, _ = save_two(svc, b, step=3, parent=head_b)
    changed = plan(svc, reader).json()
    assert [r["run"] for r in changed["runs"]] == [b]
    assert {d["checkpoint_id"] for d in changed["checkpoints"]} == {head_b, newer}
    # the full plan still plans every run (control of the incremental one)
    assert {r["run"] for r in plan(svc, reader, full="true").json()["runs"]} >= {a, b}
