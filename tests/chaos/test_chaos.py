"""The chaos suite: seeded, reproducible fault injection with the invariants checked after
every cycle, and its figures printed so a run shows what it proved.

Each cycle starts the service on the same data directory (sometimes armed with a commit
failpoint), runs two writers saving 2-rank checkpoints (now and then one dies mid-upload)
and a GC loop against it, damages a committed checkpoint now and then (flip, truncate,
extend or delete; a shard or the manifest) and asks the service to verify it, then
SIGKILLs the service at a random moment. After the restart it checks:

- I1: every acknowledged commit is still COMMITTED, or DELETED by GC (with its event), or
  CORRUPT because this suite damaged it;
- I2: every COMMITTED checkpoint re-hashes intact (POST verify);
- I3: last-good is COMMITTED and no older than the newest acknowledged, undamaged commit;
- I4: what retention keeps (last-good, the newest commit) still has every blob (verify).

CI runs a few cycles (`LASTGOOD_CHAOS_CYCLES`, default 6); `make chaos` runs hundreds.
The storage faults with their own set-up (ENOSPC on a tmpfs, EIO) are in
tests/service/test_storage_faults.py; damaged restores with real ranks in tests/multiproc.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from tests.service.helpers import Client, ckpt_dir, http, make_shard, shard_name

pytestmark = pytest.mark.chaos

CYCLES = int(os.environ.get("LASTGOOD_CHAOS_CYCLES", "6"))
SEED = int(os.environ.get("LASTGOOD_CHAOS_SEED", "20261130"))
ENV = {"LASTGOOD_RETENTION": "latest:2,last-good,branch-heads", "LASTGOOD_GC_INTERVAL": "0",
       "LASTGOOD_GC_GRACE_SECONDS": "0", "LASTGOOD_LEASE_SECONDS": "2"}


FAILPOINTS = [None, "crash_after_manifest", None, "crash_before_manifest", None]


@dataclass
class Figures:
    cycles: int = 0
    kills: int = 0
    failpoint_crashes: int = 0
    acked: dict = field(default_factory=dict)       # checkpoint id -> (run, step)
    damaged: set = field(default_factory=set)
    rank_deaths: int = 0
    gc_passes: int = 0
    violations: list = field(default_factory=list)


def writer(target: str, run: str, steps: list, attempt: str, parent: list, fig: Figures, rng: random.Random,
           stop: threading.Event) -> None:
    with Client(target) as c:
        while not stop.is_set():
            step = steps[0] = steps[0] + 1
            try:
                cid = c.begin(run, step, 2, parent[0], attempt).checkpoint_id
                for r in range(2):
                    c.put(cid, r, shard_name(r), make_shard(r, seed=step % 250), chunk=4096)
                    if rng.random() < 0.1:  # this rank dies mid-save: its lease runs out
                        fig.rank_deaths += 1
                        raise StopIteration
                c.vote(cid, 0, [shard_name(0)])
                if c.vote(cid, 1, [shard_name(1)], wait=2).status == "COMMITTED":
                    fig.acked[cid] = (run, step)
                    parent[0] = cid
            except StopIteration:
                continue
            except grpc.RpcError:
                if stop.is_set():
                    return
                time.sleep(0.05)


def damage(svc, cid: int, rng: random.Random) -> str:
    folder = ckpt_dir(svc, cid)
    target = folder / "manifest.json" if rng.random() < 0.3 else rng.choice(sorted(folder.glob("r*/*")))
    data = bytearray(target.read_bytes())
    kind = rng.choice(["flip", "truncate", "extend", "delete"])
    if kind == "flip":
        data[rng.randrange(len(data))] ^= 0x40
        target.write_bytes(bytes(data))
    elif kind == "truncate":
        target.write_bytes(bytes(data[:rng.randrange(len(data))]))
    elif kind == "extend":
        target.write_bytes(bytes(data) + b"\0" * rng.randint(1, 64))
    else:
        target.unlink()
    return f"{kind} {target.name}"


def check(svc, fig: Figures) -> None:
    h = http(svc)
    runs = {run for run, _ in fig.acked.values()}
    deleted_by_gc = set()
    for run in runs:
        offset = 0
        while True:
            page = h.get(f"/api/v1/runs/{run}/events", params={"kind": "gc_delete", "limit": 1000,
                                                                "offset": offset}).json()
            deleted_by_gc |= {e["checkpoint_id"] for e in page["items"]}
            offset += len(page["items"])
            if not page["items"] or offset >= page["total"]:
                break
    status = {}
    for cid, (run, step) in fig.acked.items():
        view = h.get(f"/api/v1/checkpoints/{cid}").json()
        status[cid] = view["status"]
        ok = view["status"] == "COMMITTED" or (view["status"] == "CORRUPT" and cid in fig.damaged)
        if view["status"] == "DELETED":
            ok = cid in deleted_by_gc
        if not ok:
            fig.violations.append(f"I1: acknowledged checkpoint {cid} is {view['status']}")
    for run in runs:
        listing = h.get(f"/api/v1/runs/{run}/checkpoints", params={"limit": 1000}).json()["items"]
        for ck in listing:
            if ck["status"] == "COMMITTED" and not h.post(f"/api/v1/checkpoints/{ck['id']}/verify").json()["ok"]:
                if ck["id"] not in fig.damaged:
                    fig.violations.append(f"I2/I4: committed checkpoint {ck['id']} does not verify")
        lg = h.get(f"/api/v1/runs/{run}/last-good")
        good = [step for cid, (r, step) in fig.acked.items()
                if r == run and status.get(cid) == "COMMITTED" and cid not in fig.damaged]
        if lg.status_code != 200:
            if good:
                fig.violations.append(f"I3: run {run} has no last-good, acknowledged steps {good}")
            continue
        view = lg.json()
        if view["status"] != "COMMITTED":
            fig.violations.append(f"I3: last-good of {run} is {view['status']}")
        if good and view["step"] < max(good) and view["id"] not in fig.damaged:
            fig.violations.append(f"I3: last-good of {run} is step {view['step']}, acknowledged {max(good)}")


def test_chaos_cycles_keep_the_invariants(make_service, tmp_path):
    fig = run_chaos(make_service, tmp_path, CYCLES, SEED)
    assert not fig.violations, fig.violations
    assert fig.acked  # the cycles did commit work (how much depends on the machine)


def test_control_the_checks_see_a_violation(make_service, tmp_path):
    """Control: a committed blob removed behind the service's back (not recorded as damage)
    must be reported, or the suite above would prove nothing."""
    fig = Figures()
    svc = make_service(tmp_path / "svc", **ENV)
    with Client(svc.grpc_target) as c:
        parent = 0
        for step in (1, 2):
            parent, _ = c.save("chaos-control", step, world_size=2, parent_id=parent)
            fig.acked[parent] = ("chaos-control", step)
    check(svc, fig)
    assert not fig.violations, fig.violations
    next(f for f in ckpt_dir(svc, parent).glob("r1/*") if not f.name.endswith(".index")).unlink()  # the shard
    check(svc, fig)
    assert any(v.startswith("I2") for v in fig.violations), fig.violations


def run_chaos(make_service, tmp_path, cycles: int, seed: int) -> Figures:
    rng = random.Random(seed)
    fig = Figures()
    data = tmp_path / "svc"
    steps = {"chaos-a": [0], "chaos-b": [0]}
    parents = {run: [0] for run in steps}
    for cycle in range(cycles):
        failpoint = FAILPOINTS[cycle % len(FAILPOINTS)]
        svc = make_service(data, **ENV, **({"LASTGOOD_FAILPOINT": failpoint} if failpoint else {}))
        stop = threading.Event()
        threads = [threading.Thread(target=writer, daemon=True,
                                    args=(svc.grpc_target, run, steps[run], f"c{cycle}", parents[run], fig,
                                          random.Random(rng.random()), stop))
                   for run in steps]

        def collect():
            while not stop.is_set():
                try:
                    if http(svc).post("/api/v1/gc").status_code == 200:
                        fig.gc_passes += 1
                except Exception:
                    return
                time.sleep(0.1)

        threads.append(threading.Thread(target=collect, daemon=True))
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.5, 2.5))
        candidates = [cid for cid in list(fig.acked) if cid not in fig.damaged and ckpt_dir(svc, cid).exists()]
        if candidates and svc.proc.poll() is None and rng.random() < 0.4:
            cid = rng.choice(candidates)
            try:
                damage(svc, cid, rng)
                fig.damaged.add(cid)
                http(svc).post(f"/api/v1/checkpoints/{cid}/verify")
            except (OSError, IndexError, AssertionError, httpx.HTTPError):
                pass  # GC took it first, or the service is going down
        if svc.proc.poll() is None:
            svc.kill()
            fig.kills += 1
        else:
            fig.failpoint_crashes += 1
        stop.set()
        for t in threads:
            t.join(60)
        fig.cycles += 1
        svc = make_service(data, **ENV)
        check(svc, fig)
        svc.stop()
    print(f"\nchaos (seed {seed}): {fig.cycles} cycles, {fig.kills} service SIGKILLs, "
          f"{fig.failpoint_crashes} failpoint crashes, {fig.rank_deaths} ranks died mid-save, "
          f"{len(fig.acked)} acknowledged commits, {len(fig.damaged)} checkpoints damaged, "
          f"{fig.gc_passes} GC passes, {len(fig.violations)} violations")
    return fig
