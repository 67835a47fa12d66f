"""An FSDP2 model with AdamW saved by 4 ranks restores on 2, and one saved by 2 restores
on 3: every full tensor (weights, Adam moments, steps) identical, and across the change
no sample of the epoch is repeated or skipped (sample ids recorded on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.multiproc.launch import torchrun, why

SCRIPT = Path(__file__).with_name("fsdp_reshard.py")


def full(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("before,after", [(4, 2), (2, 3)])
def test_fsdp2_restores_at_another_world_size(service, run_name, tmp_path, before, after):
    saved = torchrun(SCRIPT, ["save", service.url, run_name, str(tmp_path)], nproc=before)
    assert saved.returncode == 0, why(saved)
    lg = service.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["world_size"] == before and len(lg["manifest"]["ranks"]) == before
    restored = torchrun(SCRIPT, ["restore", service.url, run_name, str(tmp_path)], nproc=after)
    assert restored.returncode == 0, why(restored)

    a, b = full(tmp_path / "full-save.safetensors"), full(tmp_path / "full-restore.safetensors")
    assert sorted(a) == sorted(b) and any(k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k

    seen = [i for r in range(before) for i in json.loads((tmp_path / f"ids-save-rank{r}.json").read_text())]
    rest = [i for r in range(after) for i in json.loads((tmp_path / f"ids-restore-rank{r}.json").read_text())]
    assert sorted(seen + rest) == list(range(48))  # each sample of the epoch exactly once


def test_control_each_rank_stores_only_its_own_shard(service, run_name, tmp_path):
    saved = torchrun(SCRIPT, ["save", service.url, run_name, str(tmp_path)], nproc=2)
    assert saved.returncode == 0, why(saved)
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    manifest = service.get(f"/api/v1/checkpoints/{lg['id']}").json()["manifest"]  # the full view, with tensors
    shapes = [{name: t["shape"] for name, t in r["files"][0]["tensors"].items()} for r in manifest["ranks"]]
    # layer 0's weight is 30x16 in full: each rank holds 15 rows, not all 30
    assert shapes[0]["model.0.weight"] == [15, 16] and shapes[1]["model.0.weight"] == [15, 16]
    assert shapes[0]["optimizer.state.0.weight.exp_avg"] == [15, 16]
