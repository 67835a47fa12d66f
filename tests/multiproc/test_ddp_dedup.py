"""DDP's replicated state written once (lastgood/restore/replicas.py, docs/replicated.md): a 4-rank
checkpoint stores about one copy of the weights and Adam moments, not four (the catalog's
recorded bytes), each rank uploading about a quarter; it restores bitwise at 4 ranks and at
2, per-rank state (BatchNorm statistics, RNG, scheduler) from each rank's own file; the
control without dedup stores four copies (and, holding no references, restores as a
checkpoint written before dedup does); a flipped byte in a tensor written once makes
every rank fall back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import shard_blob, wait_status

SCRIPT = Path(__file__).with_name("ddp_dedup.py")
RANKS = 4


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save(svc, run: str, out: Path, dedup: bool = True, **env: str) -> dict:
    res = torchrun(SCRIPT, ["save", svc.url, run, str(out)], nproc=RANKS,
                   env={"LASTGOOD_DEDUP": "1" if dedup else "0", **env})
    assert res.returncode == 0, why(res)
    lg = svc.get(f"/api/v1/runs/{run}/last-good").json()
    assert lg["step"] == 2 and lg["world_size"] == RANKS
    return svc.get(f"/api/v1/checkpoints/{lg['id']}").json()  # the catalog's view, with the full manifest


def restore(svc, run: str, out: Path, nproc: int, step: int = 2):
    res = torchrun(SCRIPT, ["restore", svc.url, run, str(out), str(step)], nproc=nproc)
    assert res.returncode == 0, why(res)
    return res


def assert_restored(saved: Path, restored: Path, nproc: int) -> None:
    """Every tensor bitwise: weights and moments (the same on every rank), and each new
    rank's own BatchNorm statistics, RNG and scheduler from old rank r (r < old world)."""
    for r in range(nproc):
        want, got = tensors(saved / f"save-rank{r}.safetensors"), tensors(restored / f"restore-rank{r}.safetensors")
        assert sorted(want) == sorted(got) and any(k.endswith("exp_avg_sq") for k in want)
        for k in want:
            assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), (r, k)
        assert (json.loads((saved / f"save-rank{r}.json").read_text())
                == json.loads((restored / f"restore-rank{r}.json").read_text()))
    # the per-rank state really is per rank: restoring every rank from one file would fail above
    a, b = tensors(saved / "save-rank0.safetensors"), tensors(saved / "save-rank1.safetensors")
    assert not torch.equal(a["model.1.running_mean"], b["model.1.running_mean"])
    assert not torch.equal(a["rng"], b["rng"])
    assert torch.equal(a["model.0.weight"], b["model.0.weight"])


def test_ddp_state_is_stored_once_and_restores_bitwise_at_4_and_2_ranks(service, run_name, tmp_path):
    ckpt = save(service, run_name, tmp_path / "save")
    full = save(service, f"{run_name}-full", tmp_path / "full", dedup=False)  # the control: every rank in full
    one_copy = full["bytes"] / RANKS
    sizes = [r["files"][0]["size"] for r in ckpt["manifest"]["ranks"]]
    # the control stores 4 copies: its files are alike in size (the same tensors)
    assert max(r["files"][0]["size"] for r in full["manifest"]["ranks"]) <= 1.01 * one_copy
    assert ckpt["bytes"] == sum(sizes) <= 1.05 * one_copy, (ckpt["bytes"], one_copy)
    for size in sizes:  # each rank uploads about a quarter
        assert 0.2 * one_copy <= size <= 0.3 * one_copy, (sizes, one_copy)
    # each weight and moment is in exactly one rank's file; per-rank state in every file
    held = [set(r["files"][0]["tensors"]) for r in ckpt["manifest"]["ranks"]]
    for name in ("model.0.weight", "optimizer.state.model.0.weight.exp_avg", "model.7.bias"):
        assert sum(name in h for h in held) == 1, name
    assert all("model.1.running_mean" in h for h in held)

    restore(service, run_name, tmp_path / "on4", RANKS)
    assert_restored(tmp_path / "save", tmp_path / "on4", RANKS)
    restore(service, run_name, tmp_path / "on2", 2)
    assert_restored(tmp_path / "save", tmp_path / "on2", 2)
    # a checkpoint without references (every one written before dedup has this layout) restores as before
    restore(service, f"{run_name}-full", tmp_path / "full-on2", 2)
    assert_restored(tmp_path / "full", tmp_path / "full-on2", 2)


def test_a_damaged_tensor_written_once_falls_back_on_every_rank(make_service, run_name, tmp_path):
    """Without range digests every rank reads the owner's whole file and checks its hash
    (the other path; the test above reads ranges): one flipped byte in the first layer's
    weight, written by one rank only, makes every rank restore the parent, step 1."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES="0")
    ckpt = save(svc, run_name, tmp_path / "save")
    owner = next(r for r in ckpt["manifest"]["ranks"] if "model.0.weight" in r["files"][0]["tensors"])
    f = owner["files"][0]
    start, end = f["tensors"]["model.0.weight"]["offsets"]
    blob = shard_blob(svc, ckpt["id"], owner["rank"])
    data = bytearray(blob.read_bytes())
    data[f["data_start"] + end - 1] ^= 0x01
    blob.write_bytes(bytes(data))

    res = restore(svc, run_name, tmp_path / "on4", RANKS, step=1)
    for r in range(RANKS):
        assert f"[rank {r}] restored step 1" in res.stdout, why(res)
    assert "does not match the committed" in res.stdout + res.stderr
    assert wait_status(svc, ckpt["id"], "CORRUPT")["status"] == "CORRUPT"


def test_a_share_split_into_several_files_restores_at_another_world_size(service, run_name, tmp_path):
    """Each rank's share of the replicated state split into several files (state/split.py,
    LASTGOOD_FILE_BYTES): a tensor written once is found in whichever of its owner's files
    holds it, through that file's tensor index."""
    ckpt = save(service, run_name, tmp_path / "save", LASTGOOD_FILE_BYTES="100000")
    assert all(len(r["files"]) > 1 for r in ckpt["manifest"]["ranks"])
    restore(service, run_name, tmp_path / "on2", 2)
    assert_restored(tmp_path / "save", tmp_path / "on2", 2)


def test_a_save_raises_fenced_on_every_rank_together_when_one_rank_knows_it_is_fenced(service, run_name, tmp_path):
    """Ranks of a fenced launch learn it at different times (each from its own refused
    upload). The save's collective (the replicated state's fingerprint) must still be entered
    by every rank, the fenced one too, and all raise Fenced at the same save; else the fenced
    rank raises while the others block in the all-reduce."""
    res = torchrun(SCRIPT, ["fenced", service.url, run_name, str(tmp_path)], nproc=2)
    assert res.returncode == 0, why(res)
    assert [(tmp_path / f"fenced-rank{r}.txt").read_text() for r in range(2)] == ["Fenced", "Fenced"], why(res)
