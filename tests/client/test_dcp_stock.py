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
    # without torch: both commands that need it say so (exit 1), nothing is written
    import subprocess
    import sys

    from tests.cli.conftest import ENV
    from tests.cli.test_download import BLOCK_TORCH
    (tmp_path / "stock").mkdir()
    for argv, what in ((["export", "1", str(tmp_path / "o"), "--format", "dcp"], "export --format dcp"),
                       (["import-dcp", str(tmp_path / "stock"), "--run", "r", "--step", "1"], "import-dcp")):
        proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "--url", service.url, *argv], capture_output=True,
                              text=True, env=ENV, timeout=60)
        assert proc.returncode == 1 and f"lastgood: error: {what} needs torch" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- import
def stock_save(d) -> dict:
    """A stock DCP save (FileSystemWriter, DCP's default planner: values pickled)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {"model": model.state_dict(), "step": torch.tensor(7), "h": torch.randn(5).bfloat16(),
             "meta": {"epoch": 2, "lrs": [0.1, 0.01], "name": "stock"}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    return state


def test_a_stock_dcp_directory_imports_and_restores_through_lastgood_bitwise(service, run_name, tmp_path):
    from lastgood.dcp.stock import import_dcp

    want = stock_save(tmp_path / "stock")
    doc = import_dcp(tmp_path / "stock", url=service.url, run=run_name, step=7)
    assert doc["run"] == run_name and doc["step"] == 7 and doc["tensors"] == 6 and doc["values"] == 3
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["id"] == doc["checkpoint_id"] and lg["step"] == 7 and lg["status"] == "COMMITTED"
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": torch.tensor(0),
           "h": torch.zeros(5, dtype=torch.bfloat16), "meta": {"epoch": 0, "lrs": [0.0, 0.0], "name": ""}}
    dcp.load(got, storage_reader=lgdcp.StorageReader(service.url, run=run_name), planner=lgdcp.LoadPlanner())
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert torch.equal(got["step"], want["step"]) and torch.equal(got["h"], want["h"]) and got["meta"] == want["meta"]


class _Evil:
    def __init__(self, how: str, marker) -> None:
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        import builtins
        import os
        if self.how == "eval":
            return builtins.eval, (f"open({self.marker!r}, 'w').close()",)
        if self.how == "import":
            return __import__, ("lastgood_evil_module",)
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("how", ["system", "system-protocol2", "eval", "import", "value"])
def test_a_hostile_stock_dcp_directory_is_refused_and_nothing_of_it_runs(service, run_name, tmp_path, how,
                                                                         monkeypatch):
    import pickle
    import sys

    from lastgood.dcp.stock import import_dcp

    d, marker = tmp_path / "stock", tmp_path / "PWNED"
    (tmp_path / "lastgood_evil_module.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, were anything to import it
    if how == "value":  # a non-tensor value DCP's default planner torch.save'd: the pickle is in __0_0.distcp
        dcp.save({"w": torch.ones(2), "x": _Evil("system", marker)}, storage_writer=dcp.FileSystemWriter(str(d)),
                 no_dist=True)
    else:
        stock_save(d)
        (d / ".metadata").write_bytes(pickle.dumps(_Evil(how.split("-")[0], marker),
                                                   protocol=2 if how.endswith("protocol2") else 4))
    with pytest.raises(lastgood.errors.FormatError, match="refused") as e:
        import_dcp(d, url=service.url, run=run_name, step=1)
    assert not marker.exists() and "lastgood_evil_module" not in sys.modules, e.value
    assert service.get(f"/api/v1/runs/{run_name}/checkpoints").status_code == 404  # nothing made, not even the run
    # the control: stock DCP runs the same file
    try:
        if how == "value":
            dcp.load({"w": torch.zeros(2), "x": None}, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)
        else:
            dcp.FileSystemReader(str(d)).read_metadata()
    except BaseException:  # noqa: BLE001 - what it returns is not Metadata; what it ran is the point
        pass
    assert marker.exists()
    sys.modules.pop("lastgood_evil_module", None)


def test_import_dcp_bad_input_is_refused_before_anything_is_read(service, run_name, tmp_path):
    """The command line's own checks (torch is not even imported for them)."""
    from lastgood.dcp.stock import import_dcp

    (tmp_path / "empty").mkdir()
    calls = [(["import-dcp", str(tmp_path / "nope"), "--run", run_name, "--step", "1"], "does not exist"),
             (["import-dcp", str(tmp_path / "empty"), "--run", run_name, "--step", "-1"], "--step"),
             (["import-dcp", str(tmp_path / "empty"), "--run", "bad name!", "--step", "1"], "run")]
    for argv, says in calls:
        res = lastgood_cli(*argv, url=service.url, code=2)
        assert says in res.err, res.err
    with pytest.raises(lastgood.errors.LastgoodError, match="cannot read .*empty/.metadata"):
        import_dcp(tmp_path / "empty", url=service.url, run=run_name, step=1)
    assert service.get(f"/api/v1/runs/{run_name}/checkpoints").status_code == 404


# ---------------------------------------------------------------------- planners torch's helpers build
def test_torch_helpers_that_build_their_own_planner_load_a_lastgood_dcp_save(service, run_name, tmp_path):
    """DCP's default planner, `_EmptyStateDictLoadPlanner` (what dcp_to_torch_save loads
    with) and `load_sharded_optimizer_state_dict`'s `_ReaderWithOffset` read values through
    lastgood.dcp.StorageReader without lastgood's LoadPlanner mixed in (they were refused:
    "load with planner=lastgood.dcp.LoadPlanner()"); a planner whose own load_bytes wants a
    pickle is refused with what to do."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    torch.manual_seed(2)
    w, exp_avg = torch.randn(4, 3), torch.randn(4, 3)
    saved = {"model": {"0.weight": w}, "meta": {"epoch": 3, "name": "x"},
             "optim": {"state": {"0.weight": {"exp_avg": exp_avg, "step": 3.0}},
                       "param_groups": [{"lr": 0.1, "params": ["0.weight"]}]}}
    dcp.save(saved, storage_writer=lgdcp.StorageWriter(service.url, run=run_name), checkpoint_id="1",
             planner=lgdcp.SavePlanner())
    reader = lambda: lgdcp.StorageReader(service.url, run=run_name)  # noqa: E731

    got = {"model": {"0.weight": torch.zeros(4, 3)}, "meta": {"epoch": 0, "name": ""}}
    dcp.load(got, storage_reader=reader())  # DCP's default planner
    assert torch.equal(got["model"]["0.weight"], w) and got["meta"] == saved["meta"]

    whole: dict = {}  # as dcp_to_torch_save loads: the state rebuilt from the metadata alone
    _load_state_dict(whole, storage_reader=reader(), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert torch.equal(whole["optim"]["state"]["0.weight"]["exp_avg"], exp_avg) and whole["meta"] == saved["meta"]
    assert whole["optim"]["param_groups"] == saved["optim"]["param_groups"]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        osd = load_sharded_optimizer_state_dict({"0.weight": torch.zeros(4, 3)}, "optim", reader())
    finally:
        dist.destroy_process_group()
    st = osd["optim"]["state"]["0.weight"]
    assert torch.equal(st["exp_avg"].local_shards()[0].tensor, exp_avg) and st["step"] == 3.0
    assert osd["optim"]["param_groups"] == saved["optim"]["param_groups"]

    class Pickling(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise AssertionError("handed bytes")

    with pytest.raises(BaseException, match="Pickling.load_bytes expects a pickle; load with DCP's default"):
        dcp.load({"meta": {"epoch": 0, "name": ""}}, storage_reader=reader(), planner=Pickling())


def test_a_stock_dcp_metadata_pointing_outside_its_directory_is_refused(service, run_name, tmp_path):
    """An entry stored in '../x' would make the reader open a file outside DIR (stock
    FileSystemReader does: the control)."""
    import pickle
    import shutil

    from lastgood.dcp.stock import import_dcp

    d = tmp_path / "stock"
    want = stock_save(d)
    shutil.copy(d / "__0_0.distcp", tmp_path / "outside.distcp")
    md = dcp.FileSystemReader(str(d)).read_metadata()  # our own file: unpickling it is what stock DCP does
    for where in md.storage_data.values():
        where.relative_path = "../outside.distcp"
    (d / "__0_0.distcp").unlink()
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(lastgood.errors.FormatError, match="stored in '../outside.distcp', which is not a file of"):
        import_dcp(d, url=service.url, run=run_name, step=1)
    assert service.get(f"/api/v1/runs/{run_name}/checkpoints").status_code == 404
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)  # the control: stock reads outside
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())


@pytest.mark.slow  # two command-line processes that import torch
def test_stock_dcp_through_lastgood_and_back_on_the_command_line(service, run_name, tmp_path):
    """import-dcp, then export --format dcp of what it committed: stock DCP reads the same
    bits; the human output of both commands."""
    want = stock_save(tmp_path / "stock")
    res = lastgood_cli("import-dcp", str(tmp_path / "stock"), "--run", run_name, "--step", "3", url=service.url,
                       timeout=120)
    assert f"imported {tmp_path / 'stock'} as #" in res.out and "6 tensors" in res.out and "committed" in res.out
    res = lastgood_cli("export", f"{run_name}@last-good", str(tmp_path / "back"), "--format", "dcp",
                       url=service.url, timeout=120)
    assert "every xxh3-128 verified; stock DCP: 6 chunk(s), 3 non-tensor value(s)" in " ".join(res.out.split())
    got = stock_load(tmp_path / "back", {"step": want["step"], "h": want["h"], "meta": {"epoch": 0, "lrs": [],
                                                                                         "name": ""}})
    assert torch.equal(got["step"], want["step"]) and torch.equal(got["h"], want["h"]) and got["meta"] == want["meta"]
    model = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    dcp.load(model, storage_reader=dcp.FileSystemReader(str(tmp_path / "back")), no_dist=True)
    assert all(torch.equal(model["model"][k], v) for k, v in want["model"].items())


@pytest.mark.parametrize("writer", ["bounded", "stock"])
def test_the_dcp_export_writes_each_chunk_before_it_reads_the_next(service, run_name, tmp_path, monkeypatch, writer):
    """Eight 512 KiB tensors: while the export writes, Python holds one of them (twice: as
    read, and the copy the tensor views; tracemalloc's peak over the write). The control, torch's own FileSystemWriter.write_data
    (it keeps every tensor of a file referenced until the file is written), holds them all."""
    import tracemalloc

    import lastgood.export.dcp as export_dcp_module

    sd = {f"t{i}": torch.full((128, 1024), float(i)) for i in range(8)}
    dcp.save(sd, storage_writer=lgdcp.StorageWriter(service.url, run=run_name), checkpoint_id="1",
             planner=lgdcp.SavePlanner())
    if writer == "stock":
        monkeypatch.setattr(export_dcp_module, "WRITER", dcp.FileSystemWriter)
    peaks, write = [], export_dcp_module.write_dcp

    def measured(*args):
        tracemalloc.start()
        try:
            return write(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(export_dcp_module, "write_dcp", measured)
    export_dcp(f"{run_name}@last-good", tmp_path / "out", url=service.url)
    got = stock_load(tmp_path / "out", sd)
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    total = 8 * 512 * 1024
    assert (peaks[0] < total / 2) if writer == "bounded" else (peaks[0] > total), peaks


def test_a_stock_dcp_metadata_that_claims_more_than_its_files_hold_is_refused_before_allocating(
        service, run_name, tmp_path):
    """A tensor declared 8 TB large (its chunk too) in a directory of a few KiB: refused
    before any memory is taken (control: the intact directory imports)."""
    import pickle

    from lastgood.dcp.stock import import_dcp

    d = tmp_path / "stock"
    stock_save(d)
    good = (d / ".metadata").read_bytes()
    md = dcp.FileSystemReader(str(d)).read_metadata()  # our own file
    m = md.state_dict_metadata["model.0.weight"]
    m.size = torch.Size([10**12, 2])
    m.chunks[0].sizes = torch.Size([10**12, 2])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(lastgood.errors.FormatError, match="refused, a chunk of model.0.weight .* does not fit"):
        import_dcp(d, url=service.url, run=run_name, step=1)
    assert service.get(f"/api/v1/runs/{run_name}/checkpoints").status_code == 404
    (d / ".metadata").write_bytes(good)
    assert import_dcp(d, url=service.url, run=run_name, step=1)["tensors"] == 6


def test_a_damaged_metadata_is_a_format_error_never_another_exception(tmp_path):
    """Every truncation of a real .metadata, and bytes flipped through it: FormatError (a
    clear, bounded message) or, where the damage leaves valid DCP metadata, Metadata."""
    import random

    from lastgood.dcp.stock import read_metadata
    from torch.distributed.checkpoint.metadata import Metadata

    stock_save(tmp_path / "stock")
    good = (tmp_path / "stock" / ".metadata").read_bytes()
    rng = random.Random(0)
    damaged = [good[:n] for n in range(0, len(good), max(1, len(good) // 97))]
    for _ in range(200):
        b = bytearray(good)
        b[rng.randrange(len(b))] = rng.randrange(256)
        damaged.append(bytes(b))
    path = tmp_path / "m"
    for raw in damaged:
        path.write_bytes(raw)
        try:
            assert isinstance(read_metadata(path), Metadata)
        except lastgood.errors.FormatError as e:
            assert len(str(e)) < 1000
