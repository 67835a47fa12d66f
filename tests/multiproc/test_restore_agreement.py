"""Ranks agree on every restore outcome: one rank's missing blob makes all ranks fall back
to the previous checkpoint (it used to leave the other rank blocked in a collective)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import shard_blob

HERE = Path(__file__).parent


def test_one_ranks_missing_blob_makes_every_rank_fall_back(make_service, run_name):
    svc = make_service()
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name])
    assert saved.returncode == 0, why(saved)
    newest = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert newest["step"] == 2

    # control: intact, every rank restores step 2
    ok = torchrun(HERE / "restore_missing_blob.py", [svc.url, run_name], timeout=120)
    assert ok.returncode == 0, why(ok)
    assert "[rank 0] restored step 2 weight 10.0" in ok.stdout and "[rank 1] restored step 2 weight 11.0" in ok.stdout

    shard_blob(svc, newest["id"], 1).unlink()
    res = torchrun(HERE / "restore_missing_blob.py", [svc.url, run_name], timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 1 weight 1.0" in res.stdout
    assert "[rank 1] restored step 1 weight 2.0" in res.stdout
    assert svc.get(f"/api/v1/checkpoints/{newest['id']}").json()["status"] == "CORRUPT"
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 1
