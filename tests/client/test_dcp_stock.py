"""Stock DCP both ways, one process (DCP's single-rank mode): `lastgood export --format dcp`
of a checkpoint saved through lastgood.dcp and of one the Checkpointer saved, read back
bitwise by stock `FileSystemReader` + `dcp.load` and by `dcp_to_torch_save`; a corrupted
byte fails the export and leaves no DIR (control: the intact export). The 2-rank saves
(FSDP2, DDP) are in tests/multiproc/test_export.py and test_dcp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import lastgood
from lastgood import dcp as lgdcp
from lastgood.export import ExportError, export_dcp
from tests.cli.conftest import lastgood as lastgood_cli
from tests.service.helpers import ckpt_dir


def dcp_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(16, 8), "b": torch.arange(5, dtype=torch.int64), "h": torch.randn(3).bfloat16(),
            "nested": {"s": torch.tensor(2.5)}, "meta": {"epoch": 3, "name": "x"}}


def save_dcp(url: str, run: str) -> None:
    dcp.save(dcp_state(), storage_writer=lgdcp.StorageWriter(url, run=run), checkpoint_id="5",
             planner=lgdcp.SavePlanner())


def stock_load(d, like: dict) -> dict:
    """Stock DCP, nothing of lastgood: FileSystemReader and DCP's default planner."""
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in like.items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)
    return got


def test_a_lastgood_dcp_save_exports_whole_and_stock_dcp_reads_it_bitwise(service, run_name, tmp_path):
    save_dcp(service.url, run_name)
    doc = export_dcp(f"{run_name}@last-good", tmp_path / "out", url=service.url)
    assert doc["format"] == "dcp" and doc["verified"] and doc["values"] == 2 and doc["tensors"] == 4
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", "__0_0.distcp"]
    want = dcp_state()
    got = stock_load(tmp_path / "out", {"w": want["w"], "b": want["b"], "h": want["h"],
                                        "nested": {"s": torch.zeros(())}, "meta": {"epoch": 0, "name": ""}})
    for k in ("w", "b", "h"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert torch.equal(got["nested"]["s"], want["nested"]["s"]) and got["meta"] == want["meta"]
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(full["w"], want["w"]) and full["meta"] == want["meta"]
    assert torch.equal(full["nested"]["s"], want["nested"]["s"])


def test_a_checkpointer_save_exports_its_module_tensors(service, run_name, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters())
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    out = export_dcp(cid, tmp_path / "out", url=service.url)
    assert out["format"] == "dcp" and out["tensors"] == 4 and out["prefix"] == ""
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")), no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in model.state_dict().items())
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "full.pt"))  # nested as DCP nests it
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert sorted(full) == ["model"] and all(torch.equal(full["model"][k], v) for k, v in model.state_dict().items())
    # --prefix strips, as for hf
    export_dcp(cid, tmp_path / "bare", url=service.url, prefix="model.")
    bare = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(bare, storage_reader=dcp.FileSystemReader(str(tmp_path / "bare")), no_dist=True)
    assert all(torch.equal(bare[k], v) for k, v in model.state_dict().items())


def test_a_corrupted_byte_fails_the_dcp_export_and_leaves_no_dir(service, run_name, tmp_path):
    save_dcp(service.url, run_name)
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    export_dcp(lg["id"], tmp_path / "control", url=service.url)  # the control: intact, it exports
    blob = max((p for p in (ckpt_dir(service, lg["id"]) / "r0").iterdir() if p.is_file()),
               key=lambda p: p.stat().st_size)  # the rank file, not dcp.metadata.json
    data = bytearray(blob.read_bytes())
    data[len(data) - 3] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(lastgood.CorruptCheckpoint, match="xxh3-128"):
        export_dcp(lg["id"], tmp_path / "out", url=service.url)
    assert [p.name for p in tmp_path.iterdir() if "out" in p.name] == []


def test_bad_dcp_export_options_are_refused_before_anything_is_read(service, tmp_path):
    with pytest.raises(ExportError, match="--dtype and --config apply to --format hf"):
        from lastgood.export import Options
        Options("bf16", "5GB", None, None, None, fmt="dcp")
    res = lastgood_cli("export", "1", str(tmp_path / "o"), "--format", "dcp", "--dtype", "bf16", url=service.url,
                       code=2)
    assert "apply to --format hf" in res.err and not (tmp_path / "o").exists()
