"""Export to Hugging Face: a tiny Llama (transformers, random init, no download) trained
with FSDP2 on 2 and on 4 ranks and with DDP on 2, saved through lastgood, exported from
the store, and loaded back with `AutoModelForCausalLM.from_pretrained(DIR)`: no missing
or unexpected keys, every tensor equal to the trained model's full weights, the same
logits on a fixed batch. Also as bf16, and split into several files.

Two torchrun jobs save the three checkpoints once (export_save.py); every export runs
in this process (or as the `lastgood` command) against them."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lastgood.export import export_hf
from tests.cli.conftest import lastgood
from tests.conftest import FAST, ServiceProc
from tests.multiproc.launch import torchrun, why

transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("export_save.py")
sys.path.insert(0, str(SCRIPT.parent))
from export_save import BATCH, CONFIG  # noqa: E402


@dataclass
class Saved:
    svc: ServiceProc
    work: Path
    runs: dict[str, str]  # fsdp2 / fsdp4 / ddp -> run name

    def full(self, kind: str) -> dict[str, torch.Tensor]:
        return load_file(self.work / f"{self.runs[kind]}-full.safetensors")

    def logits(self, kind: str) -> torch.Tensor:
        return load_file(self.work / f"{self.runs[kind]}-logits.safetensors")["logits"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    work = tmp_path_factory.mktemp("export")
    # a lease that outlasts a save under load: the default test service's is 3 s
    svc = ServiceProc(work / "svc", {**FAST, "LASTGOOD_LEASE_SECONDS": "30"}).start()
    tag = uuid.uuid4().hex[:6]
    runs = {k: f"export-{k}-{tag}" for k in ("fsdp2", "ddp", "fsdp4")}
    try:
        two = torchrun(SCRIPT, [svc.url, str(work), runs["fsdp2"], runs["ddp"]], nproc=2)
        assert two.returncode == 0, why(two)
        four = torchrun(SCRIPT, [svc.url, str(work), runs["fsdp4"]], nproc=4)
        assert four.returncode == 0, why(four)
        yield Saved(svc, work, runs)
    finally:
        svc.stop()


def load(d: Path, full: dict[str, torch.Tensor], dtype=torch.float32):
    """from_pretrained(d): nothing missing or unexpected, every tensor the trained one's."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and info["error_msgs"] == [], info
    sd = model.state_dict()
    assert sorted(sd) == sorted(full)
    for k, v in full.items():
        assert sd[k].dtype == dtype and torch.equal(sd[k], v.to(dtype)), k
    return model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=BATCH).logits


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp4"])
def test_fsdp2_export_loads_with_from_pretrained(saved, tmp_path, kind):
    out = tmp_path / "hf"
    doc = export_hf(f"{saved.runs[kind]}@last-good", out, url=saved.svc.url)
    ranks = int(kind[-1])
    # every rank holds a shard of every weight: every rank file is read, each once
    assert [f["rank"] for f in doc["read"]] == list(range(ranks)) and doc["skipped"] == []
    assert doc["world_size"] == ranks and doc["config"] == "extra['hf_config']" and doc["verified"] is True
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "model.safetensors.index.json"]
    assert not list(tmp_path.glob(".hf.export-*"))  # the temporary directory became hf

    model = load(out, saved.full(kind))
    assert torch.equal(logits(model), saved.logits(kind))


def test_ddp_export_reads_the_owners_of_the_weights_and_takes_config_file(saved, tmp_path):
    """DDP's weights are written once each, spread over the ranks (docs/replicated.md):
    both files hold some, both are read, once each. The command line, with --config (this
    save has no config in extra)."""
    config = tmp_path / "config.json"
    transformers.LlamaConfig(**CONFIG).to_json_file(config)
    out = tmp_path / "hf"
    doc = lastgood("--json", "export", f"{saved.runs['ddp']}@last-good", str(out), "--config", str(config),
                   url=saved.svc.url, timeout=120).json()
    assert [f["rank"] for f in doc["read"]] == [0, 1] and doc["skipped"] == []
    assert doc["bytes_read"] == sum(f["size"] for f in doc["read"]) and doc["config"] == "--config"
    model = load(out, saved.full("ddp"))
    assert torch.equal(logits(model), saved.logits("ddp"))


def test_bf16_export(saved, tmp_path):
    out = tmp_path / "hf"
    doc = export_hf(f"{saved.runs['fsdp2']}@last-good", out, url=saved.svc.url, dtype="bf16")
    full = saved.full("fsdp2")
    assert doc["total_size"] == sum(v.numel() * 2 for v in full.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = load(out, full, torch.bfloat16)  # from_pretrained takes the config's dtype
    # the same logits as the trained weights rounded to bf16 in torch
    config = transformers.LlamaConfig(**CONFIG)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ref.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()})
    assert torch.equal(logits(model), logits(ref))


def test_small_max_shard_size_writes_several_files_and_the_index(saved, tmp_path):
    out = tmp_path / "hf"
    limit = 20_000
    doc = export_hf(f"{saved.runs['fsdp4']}@last-good", out, url=saved.svc.url, max_shard_size=f"{limit}B")
    n = len(doc["files"])
    assert n >= 3
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "config.json", "model.safetensors.index.json"])

    full = saved.full("fsdp4")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    assert sorted(index["weight_map"]) == sorted(full) and set(index["weight_map"].values()) == set(names)
    for name in names:
        with safe_open(str(out / name), "pt") as f:
            keys = list(f.keys())
            assert keys and all(index["weight_map"][k] == name for k in keys)
            assert f.metadata()["format"] == "pt"
            data = sum(f.get_tensor(k).nbytes for k in keys)
            assert data <= limit or len(keys) == 1  # a tensor larger than the limit gets a file of its own
    model = load(out, full)
    assert torch.equal(logits(model), saved.logits("fsdp4"))


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_dcp_export_of_a_two_rank_save_reads_back_bitwise_with_stock_dcp(saved, tmp_path, kind):
    """--format dcp: stock FileSystemReader + dcp.load (DCP's default planner, no lastgood)
    and dcp_to_torch_save give back every trained weight bit for bit; the FSDP2 shards stay
    DCP chunks (two per weight: one per rank), DDP's replicas become one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lastgood.export import export_dcp

    out, ref = tmp_path / "dcp", f"{saved.runs[kind]}@last-good"
    if kind == "ddp":  # the command line once; in this process otherwise (a torch import less)
        doc = lastgood("--json", "export", ref, str(out), "--format", "dcp", url=saved.svc.url, timeout=120).json()
    else:
        doc = export_dcp(ref, out, url=saved.svc.url)
    full = saved.full(kind)
    assert doc["format"] == "dcp" and doc["tensors"] == len(full) and doc["verified"] is True
    assert doc["chunks"] == (2 * len(full) if kind == "fsdp2" else len(full))
    sd = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    assert all(sd["model"][k].dtype == v.dtype and torch.equal(sd["model"][k], v) for k, v in full.items())
    dcp_to_torch_save(str(out), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(full) and all(torch.equal(got[k], v) for k, v in full.items())
