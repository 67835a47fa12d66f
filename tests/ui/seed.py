"""What the browser tests look at, made through the service's real interfaces (gRPC saves,
REST rollback, tags, pins, verify) — except the bulk of the 2,000-checkpoint run, which a
batch insert writes straight into the catalog (2,000 real saves take ~45 s on two cores).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

from lastgood_service.catalog.models import COMMITTED, Checkpoint, Run

from ..service.helpers import Client, make_shard, shard_blob, shard_name

# hostile strings: the page must show them as text and run none of them. Run names cannot
# carry markup (the service allows only A-Z a-z 0-9 . _ -); tags and event data can.
XSS_TAG_IMG = '<img src=x onerror="window.__xss=1;alert(1)">'
XSS_TAG_SCRIPT = "<script>window.__xss=2;alert(2)</script>"
XSS_ALIAS = '"><svg onload="window.__xss=3;alert(3)">'
XSS_NOTE = "<img src=x onerror=alert(4)>"
XSS_REASON = "</pre><script>alert(5)</script>"
XSS_ABORT = "<b onmouseover=alert(6)>aborted</b>"
BIG = 2000


@dataclass
class World:
    alpha: str  # the run with everything: branch, tags, abandoned, pending, corrupt
    beta: str   # a small plain run
    big: str    # 2,000 checkpoints
    ids: dict[str, int] = field(default_factory=dict)   # alpha's checkpoints by name, c1..c10
    big_ids: dict[str, int] = field(default_factory=dict)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def save(client: Client, run: str, step: int, parent: int = 0, attempt: str = "attempt-1") -> int:
    """One real single-rank save through gRPC (begin, put, vote); the checkpoint id."""
    # make_shard's values are uint8-sized: keep seed + step (what it receives) small
    cid, _ = client.save(run, step, parent_id=parent, attempt=attempt, seed=step % 200 - step)
    return cid


def tag(svc, cid: int, name: str, alias: bool = False) -> None:
    ok(svc.post(f"/api/v1/checkpoints/{cid}/tags", json={"name": name, "alias": alias}))


def pin(svc, cid: int) -> None:
    ok(httpx.put(svc.url + f"/api/v1/checkpoints/{cid}/pin", timeout=30))


def seed_alpha(svc, client: Client, run: str) -> dict[str, int]:
    """c1 -> c2 -> c3 -> c4 -> c5; a spike at 450 rolls back to c3 (c4, c5 suspect); the job is
    relaunched (attempt-2) from c3: c6 -> c7 (last-good); from c7: c8 aborted, c9 committed
    then found corrupt (a later attempt), c10 pending."""
    ids: dict[str, int] = {}
    parent = 0
    for i, step in enumerate((100, 200, 300, 400, 500), start=1):
        ids[f"c{i}"] = save(client, run, step, parent)
        parent = ids[f"c{i}"]
    ok(svc.post(f"/api/v1/runs/{run}/rollback", json={
        "target_id": ids["c3"], "spike_step": 450, "data": {"loss": 9.5, "median": 2.1, "note": XSS_NOTE}}))
    ids["c6"] = save(client, run, 400, ids["c3"], "attempt-2")
    ids["c7"] = save(client, run, 500, ids["c6"], "attempt-2")
    ok(svc.post(f"/api/v1/runs/{run}/events", json={
        "kind": "restart", "checkpoint_id": ids["c6"], "data": {"reason": XSS_REASON}}))
    ids["c8"] = client.begin(run, 600, parent_id=ids["c7"], attempt="attempt-2").checkpoint_id
    client.abort(ids["c8"], reason=XSS_ABORT)
    ids["c9"] = save(client, run, 600, ids["c7"], "attempt-3")
    blob = shard_blob(svc, ids["c9"], 0)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert ok(svc.post(f"/api/v1/checkpoints/{ids['c9']}/verify"))
    ids["c10"] = client.begin(run, 700, parent_id=ids["c7"], attempt="attempt-2").checkpoint_id
    client.put(ids["c10"], 0, shard_name(0), make_shard(0, seed=7))
    pin(svc, ids["c1"])
    tag(svc, ids["c2"], "best", alias=True)
    tag(svc, ids["c7"], XSS_TAG_IMG)
    tag(svc, ids["c7"], XSS_TAG_SCRIPT)
    tag(svc, ids["c6"], XSS_ALIAS, alias=True)
    return ids


def seed_big(svc, client: Client, run: str, n: int = BIG) -> dict[str, int]:
    """n checkpoints in one line, 10 steps apart: the first and the last are real gRPC saves
    (the last moves last-good), the n-2 between are one batch insert into the catalog, and a
    few of those get tags and a pin through REST."""
    first = save(client, run, 0)
    engine = sa.create_engine(f"sqlite:///{svc.data_dir / 'catalog.db'}", connect_args={"timeout": 30})
    now = dt.datetime.now(dt.timezone.utc)
    with Session(engine) as s, s.begin():
        run_id = s.scalar(sa.select(Run.id).where(Run.name == run))
        start = s.scalar(sa.select(sa.func.max(Checkpoint.id))) + 1
        rows = [{"id": start + i, "run_id": run_id, "step": 10 * (i + 1), "attempt": "attempt-1", "world_size": 1,
                 "parent_id": first if i == 0 else start + i - 1, "status": COMMITTED, "bytes": 4096,
                 "lease_expires_at": now, "created_at": now, "committed_at": now} for i in range(n - 2)]
        s.execute(sa.insert(Checkpoint), rows)
    engine.dispose()
    last_bulk = start + n - 3
    ids = {"first": first, "tagged": start + 499, "pinned": start + 1199, "last_bulk": last_bulk}
    tag(svc, ids["tagged"], "warmup-done")
    pin(svc, ids["pinned"])
    ids["last"] = save(client, run, 10 * (n - 1), last_bulk)
    return ids


def seed_world(svc, client: Client) -> World:
    world = World(alpha=unique("train-alpha"), beta=unique("train-beta"), big=unique("big"))
    world.ids = seed_alpha(svc, client, world.alpha)
    parent = 0
    for step in (10, 20, 30):
        parent = save(client, world.beta, step, parent)
    world.big_ids = seed_big(svc, client, world.big)
    return world
