"""torch.distributed.checkpoint through lastgood: dcp.save, dcp.async_save and dcp.load
of an FSDP2 model and its AdamW state, exact; DCP's pickling planner refused; a rank
killed during a DCP save leaves nothing visible."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.multiproc.launch import torchrun, why

SCRIPT = Path(__file__).with_name("dcp_rank.py")
EXACT = "model True optim True groups True meta {'epoch': 3, 'tokens': 123456789, 'name': 'x'}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dcp_save_and_load_through_lastgood(service, run_name, mode):
    res = torchrun(SCRIPT, [mode, service.url, run_name])
    assert res.returncode == 0, why(res)
    assert f"[rank 0] {EXACT}" in res.stdout
    assert "[rank 1] loaded meta {'epoch': 3, 'tokens': 123456789, 'name': 'x'}" in res.stdout
    lg = service.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["step"] == 5 and lg["status"] == "COMMITTED" and lg["world_size"] == 2
    names = {r["rank"]: sorted(f["name"] for f in r["files"]) for r in lg["manifest"]["ranks"]}
    assert names == {0: ["dcp.metadata.json", "rank00000.safetensors"], 1: ["rank00001.safetensors"]}
    meta = service.get(f"/api/v1/checkpoints/{lg['id']}/ranks/0/files/dcp.metadata.json")
    assert meta.status_code == 200 and meta.json()["format"] == "lastgood.dcp/1"  # JSON, not a pickle


def test_dcp_default_planner_is_refused(service, run_name):
    res = torchrun(SCRIPT, ["pickle", service.url, run_name])
    assert "[rank 0] refused: CheckpointException: True" in res.stdout and "saved with pickles" not in res.stdout
    assert service.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert listing and all(c["status"] != "COMMITTED" for c in listing)


def test_rank_killed_during_a_dcp_save_leaves_nothing_visible(service, run_name):
    res = torchrun(SCRIPT, ["die", service.url, run_name], timeout=120)
    assert res.returncode != 0
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert len(listing) == 1 and listing[0]["status"] in ("PENDING", "ABANDONED")
    assert service.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    deadline = time.monotonic() + 20
    while service.get(f"/api/v1/checkpoints/{listing[0]['id']}").json()["status"] == "PENDING":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert service.get(f"/api/v1/checkpoints/{listing[0]['id']}").json()["status"] == "ABANDONED"
