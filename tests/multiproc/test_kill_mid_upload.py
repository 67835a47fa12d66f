"""A rank SIGKILLed in the middle of its upload: that checkpoint never becomes visible,
last-good stays on the previous one, and after the lease it is ABANDONED.
Control: the same job without the kill commits the second checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

from tests.multiproc.launch import torchrun, why

SCRIPT = Path(__file__).with_name("upload_and_die.py")


def _checkpoints(svc, run):
    items = svc.get(f"/api/v1/runs/{run}/checkpoints").json()["items"]
    return {c["step"]: c for c in items}


def test_rank_killed_mid_upload_leaves_nothing_visible(make_service, run_name):
    svc = make_service()
    res = torchrun(SCRIPT, [svc.url, run_name], env={"DIE_RANK": "1", "LASTGOOD_USE_SPOOL": "0"})
    assert res.returncode != 0
    assert "dying mid-upload" in res.stdout

    cks = _checkpoints(svc, run_name)
    assert cks[0]["status"] == "COMMITTED"
    assert cks[1]["status"] in ("PENDING", "ABANDONED")
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["id"] == cks[0]["id"]
    detail = svc.get(f"/api/v1/checkpoints/{cks[1]['id']}").json()
    assert detail["manifest"] is None
    for rank in (0, 1):
        r = svc.get(f"/api/v1/checkpoints/{cks[1]['id']}/ranks/{rank}/files/rank{rank:05d}.safetensors")
        assert r.status_code == 409 and "only COMMITTED checkpoints can be read" in r.json()["error"]["message"]

    deadline = time.monotonic() + 20
    while _checkpoints(svc, run_name)[1]["status"] == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _checkpoints(svc, run_name)[1]["status"] == "ABANDONED"
    events = svc.get(f"/api/v1/runs/{run_name}/events").json()["items"]
    assert any(e["kind"] == "expired" and e["checkpoint_id"] == cks[1]["id"] for e in events)
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == cks[0]["id"]
    # the half-received stream left no temporary file behind
    assert list((svc.blob_root / "tmp").iterdir()) == []


def test_control_without_the_kill_the_second_checkpoint_commits(make_service, run_name):
    svc = make_service()
    res = torchrun(SCRIPT, [svc.url, run_name])
    assert res.returncode == 0, why(res)
    cks = _checkpoints(svc, run_name)
    assert cks[1]["status"] == "COMMITTED"
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == cks[1]["id"]
