"""`gc --dry-run` and `gc`, and the read lease `download` holds, on a service of its own
whose retention keeps only the newest checkpoint (and GC has no grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.service.helpers import Client

from .conftest import COMMAND, ENV, error_line, lastgood, lastgood_many

MiB = 1024 * 1024


def plan(svc) -> dict:
    r = httpx.get(svc.url + "/api/v1/gc/plan", params={"full": "true"}, timeout=30)  # as `gc --dry-run` asks
    assert r.status_code == 200, r.text
    return r.json()


def planned(svc) -> set[int]:
    return {d["checkpoint_id"] for d in plan(svc)["checkpoints"]}


def save_big(c: Client, run: str, step: int, size: int) -> int:
    """Two ranks of `size` bytes each (not safetensors: the service indexes only those)."""
    cid = c.begin(run, step, world_size=2).checkpoint_id
    for rank in range(2):
        c.put(cid, rank, f"state{rank}.bin", os.urandom(size), chunk=4 * MiB)
    c.vote(cid, 0, ["state0.bin"])
    assert c.vote(cid, 1, ["state1.bin"], wait=5.0).status == "COMMITTED"
    return cid


def stopped_mid_download(url: str, cid: int, dest, tries: int = 5) -> subprocess.Popen:
    """Start `download` and SIGSTOP it once its first partial file exists, i.e. while it
    holds its read lease. A download that finished before we saw it is tried again."""
    for attempt in range(tries):
        target = dest / f"try{attempt}"
        proc = subprocess.Popen(COMMAND + ["--url", url, "download", str(cid), str(target), "--no-progress"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        while proc.poll() is None:
            if target.exists() and any(p.name.endswith(".part") for p in target.rglob("*")):
                proc.send_signal(signal.SIGSTOP)
                return proc
            time.sleep(0.001)
        out, err = proc.communicate()
        assert proc.returncode == 0, err
    raise AssertionError(f"download finished before it could be stopped, {tries} times")


@pytest.mark.slow
def test_gc_plan_execute_and_download_lease(make_service, tmp_path):
    svc = make_service(LASTGOOD_RETENTION="latest:1,last-good,branch-heads", LASTGOOD_GC_GRACE_SECONDS="0",
                       LASTGOOD_GC_INTERVAL="0")
    run = "cli-gc"
    c = Client(svc.grpc_target)
    try:
        old = save_big(c, run, 1, 12 * MiB)
        mid, _ = c.save(run, 2, parent_id=old)
        new, _ = c.save(run, 3, parent_id=mid)
    finally:
        c.close()

    dry, text = lastgood_many([(["--url", svc.url, "--json", "gc", "--dry-run"], 0),
                               (["--url", svc.url, "gc", "--dry-run"], 0)])
    doc = dry.json()
    assert doc == {"plan": plan(svc), "dry_run": True}
    assert [d["checkpoint_id"] for d in doc["plan"]["checkpoints"]] == [old, mid]
    assert doc["plan"]["bytes_freed"] == sum(d["bytes"] for d in doc["plan"]["checkpoints"]) > 24 * MiB
    row = next(ln for ln in text.out.splitlines() if ln.startswith(f"#{old} "))
    assert run in row and "COMMITTED" in row and "24.0 MiB" in row and "not kept by the retention policy" in row
    assert f"would delete 2 checkpoints, freeing 24.0 MiB ({doc['plan']['bytes_freed']:,} bytes)" in text.out
    assert _statuses(svc, run) == {old: "COMMITTED", mid: "COMMITTED", new: "COMMITTED"}  # a dry run deletes nothing

    # while `download` runs it holds a read lease: GC plans around the checkpoint
    proc = stopped_mid_download(svc.url, old, tmp_path)
    try:
        assert planned(svc) == {mid}
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert planned(svc) == {old, mid}  # released when it finished

    # without a terminal to ask, gc refuses (exit 2, nothing deleted) until told --yes
    refused = lastgood("gc", url=svc.url, code=2)
    assert "gc would delete 2 checkpoints, freeing 24.0 MiB" in refused.err and "pass --yes" in refused.err
    assert _statuses(svc, run) == {old: "COMMITTED", mid: "COMMITTED", new: "COMMITTED"}
    done = lastgood("--json", "gc", "--yes", url=svc.url).json()
    assert done["dry_run"] is False and done["result"]["deleted"] == [old, mid]
    assert done["result"]["bytes_freed"] == doc["plan"]["bytes_freed"]
    assert _statuses(svc, run) == {old: "DELETED", mid: "DELETED", new: "COMMITTED"}
    again = lastgood("gc", url=svc.url).out  # nothing to delete: nothing to ask
    assert "deleting 0 checkpoints, freeing 0 B" in again and "deleted 0 checkpoints" in again
    res = lastgood("download", str(old), str(tmp_path / "gone"), url=svc.url, code=4)
    assert f"checkpoint {old} is DELETED" in error_line(res)

    # --run: one run's part of the plan, as the page's "this run only"
    other = "cli-gc-other"
    c = Client(svc.grpc_target)
    try:
        first = save_big(c, other, 1, MiB)
        c.save(other, 2, parent_id=first)
    finally:
        c.close()
    assert planned(svc) == {first}
    mine, theirs, text, wet = lastgood_many([
        (["--url", svc.url, "--json", "gc", "--dry-run", "--run", run], 0),
        (["--url", svc.url, "--json", "gc", "--dry-run", "--run", other], 0),
        (["--url", svc.url, "gc", "--dry-run", "--run", other], 0),
        (["--url", svc.url, "gc", "--run", other], 2)])
    assert mine.json()["run"] == run and mine.json()["plan"]["checkpoints"] == []
    assert [d["checkpoint_id"] for d in theirs.json()["plan"]["checkpoints"]] == [first]
    assert theirs.json()["plan"]["bytes_freed"] == theirs.json()["plan"]["checkpoints"][0]["bytes"] > 2 * MiB
    assert "would delete 1 checkpoint of run cli-gc-other, freeing 2.0 MiB" in text.out
    assert "--run filters the plan of --dry-run" in wet.err
    assert _statuses(svc, other)[first] == "COMMITTED"


def _statuses(svc, run: str) -> dict[int, str]:
    r = httpx.get(f"{svc.url}/api/v1/runs/{run}/checkpoints", timeout=30)
    return {c["id"]: c["status"] for c in r.json()["items"]}
