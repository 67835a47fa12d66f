"""`lastgood export` on checkpoints saved in this process (one rank): a shard corrupted in
the store fails verification and leaves no DIR (control: the same export of the intact
checkpoint succeeds); an interrupted export leaves no DIR either; bad input changes
nothing; --map renames and drops; the command runs without torch. The FSDP2 / DDP / transformers round trips are in
tests/multiproc/test_export.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors import safe_open

from tests.service.helpers import shard_blob

from .conftest import COMMAND, ENV, error_line, lastgood, lastgood_many, unique_run
from .test_download import BLOCK_TORCH

torch = pytest.importorskip("torch")


def save(service, run: str, model, step: int = 1) -> int:
    import lastgood as lg

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with lg.Checkpointer(service.url, run=run) as ckpt:
        ckpt.save(step, lg.TrainState(model=model, optimizer=opt, extra={"hf_config": {"model_type": "none",
                                                                                        "id2label": {0: "a"}}}))
        ckpt.wait()
        return ckpt.last_saved.checkpoint_id


def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def tensors(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def leftovers(parent, name: str) -> list[str]:
    """DIR itself, or its temporary sibling."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.export-"))


@pytest.mark.parametrize("where", ["header", "data"])
def test_corrupted_shard_fails_verification_and_leaves_no_dir(service, tmp_path, where):
    model = small()
    cid = save(service, unique_run("export-corrupt"), model)
    control = lastgood("export", str(cid), str(tmp_path / "control"), url=service.url).out
    assert f"exported #{cid} (run " in control and "4 tensors" in control and "every xxh3-128 verified" in control
    assert "config.json: extra['hf_config']" in control and str(tmp_path / "control" / "model.safetensors") in control
    got = tensors(tmp_path / "control" / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items()) and len(got) == 4
    assert json.loads((tmp_path / "control" / "config.json").read_text())["id2label"] == {"0": "a"}

    blob = shard_blob(service, cid, 0)
    data = bytearray(blob.read_bytes())
    # the header's opening brace (the header no longer parses), or a bit of the last tensor
    data[8 if where == "header" else len(data) - 3] ^= 0x01
    blob.write_bytes(bytes(data))

    res = lastgood("export", str(cid), str(tmp_path / "hf"), url=service.url, code=5)
    line = error_line(res)
    assert f"checkpoint {cid} rank 0 file rank00000.safetensors" in line and "xxh3-128" in line, line
    assert f"nothing was written to {tmp_path / 'hf'}" in line
    assert leftovers(tmp_path, "hf") == []

    import lastgood as lg
    from lastgood.export import export_hf
    with pytest.raises(lg.CorruptCheckpoint, match="xxh3-128"):
        export_hf(cid, tmp_path / "api", url=service.url)
    assert leftovers(tmp_path, "api") == []


def test_interrupted_export_leaves_no_dir(service, tmp_path):
    """SIGTERM while the export is under way (stopped as soon as its temporary directory
    appears, so the signal always lands mid-export): no DIR, no temporary directory."""
    torch.manual_seed(0)
    cid = save(service, unique_run("export-interrupt"),
               torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)))  # 32 MiB
    out = tmp_path / "hf"
    proc = subprocess.Popen([*COMMAND, "--url", service.url, "export", str(cid), str(out)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".hf.export-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the export never made its temporary directory"
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)
        assert not out.exists()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert leftovers(tmp_path, "hf") == []


def test_bad_input_changes_nothing(service, tmp_path):
    cid = save(service, unique_run("export-bad"), small())
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    bad_map = tmp_path / "map.json"
    bad_map.write_text(json.dumps({"9.weight": "x"}))
    not_json = tmp_path / "config.json"
    not_json.write_text("{nope")
    url = ["--url", service.url]
    results = lastgood_many([
        ([*url, "export", str(cid), str(occupied)], 2),
        ([*url, "export", str(cid), str(tmp_path / "a"), "--max-shard-size", "5 parsecs"], 2),
        ([*url, "export", str(cid), str(tmp_path / "b"), "--max-shard-size", "0"], 2),
        ([*url, "export", str(cid), str(tmp_path / "c"), "--dtype", "int4"], 2),
        ([*url, "export", str(cid), str(tmp_path / "d"), "--map", str(bad_map)], 2),
        ([*url, "export", str(cid), str(tmp_path / "e"), "--prefix", "optimizer."], 2),
        ([*url, "export", str(cid), str(tmp_path / "f"), "--config", str(not_json)], 2),
        ([*url, "export", str(cid), str(tmp_path / "g"), "--format", "gguf"], 2),
        ([*url, "export", "nobody@last-good", str(tmp_path / "h")], 3),
    ])
    errors = [r.err for r in results]
    assert "exists and is not an empty directory" in errors[0]
    assert "is not a size" in errors[1] and "at least 1 byte" in errors[2]
    assert "--map names 1 tensor(s) the checkpoint does not have under prefix 'model.': 9.weight" in errors[4]
    assert "no module tensors under prefix 'optimizer.'" in errors[5] and "optimizer (optimizer)" in errors[5]
    assert "--config" in errors[6]
    assert (occupied / "keep.txt").read_text() == "mine" and sorted(os.listdir(occupied)) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "map.json", "occupied"]


def test_map_renames_drops_and_converts(service, tmp_path):
    model = small()
    cid = save(service, unique_run("export-map"), model)
    from lastgood.export import export_hf

    doc = export_hf(cid, tmp_path / "hf", url=service.url, dtype="fp16",
                    name_map={"0.weight": "encoder.weight", "2.bias": None}, config={"model_type": "mine"})
    got = tensors(tmp_path / "hf" / "model.safetensors")
    sd = model.state_dict()
    assert sorted(got) == ["0.bias", "2.weight", "encoder.weight"] and doc["tensors"] == 3
    assert torch.equal(got["encoder.weight"], sd["0.weight"].half()) and got["0.bias"].dtype == torch.float16
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "mine", "dtype": "float16",
                                                                          "torch_dtype": "float16"}
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: "model.safetensors" for k in got}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())


def test_command_line_export_runs_without_torch(service, tmp_path):
    """NumPy does the conversions: `lastgood export` needs no torch, like every command."""
    model = small()
    cid = save(service, unique_run("export-notorch"), model)
    renames = tmp_path / "map.json"
    renames.write_text(json.dumps({"2.weight": "head.weight"}))
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "--url", service.url, "--json", "export", str(cid),
                           str(tmp_path / "hf"), "--dtype", "bf16", "--map", str(renames), "--max-shard-size", "40B"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["dtype"] == "bf16" and len(doc["files"]) == 4  # 96, 12, 36 and 6 bytes: no two fit in 40
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    sd = model.state_dict()
    for name, src in (("0.weight", "0.weight"), ("0.bias", "0.bias"), ("head.weight", "2.weight"),
                      ("2.bias", "2.bias")):
        got = tensors(tmp_path / "hf" / index["weight_map"][name])[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, sd[src].to(torch.bfloat16)), name


@pytest.mark.slow  # a Python process with torch and transformers
def test_the_docs_example_runs_as_shown(service, tmp_path):
    pytest.importorskip("transformers")
    from tests.client.test_doc_examples import marked_blocks

    (block,) = marked_blocks("docs/export.md")
    script = tmp_path / "example.py"
    script.write_text(block + "\n")
    env = {**ENV, "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch.bfloat16 torch.Size([1, 3, 64])" in res.stdout, res.stdout
    assert (tmp_path / "tiny-llama-hf" / "config.json").exists()


def test_a_model_tensor_written_once_whose_owner_lacks_it_fails_the_export(service, tmp_path):
    """A DDP checkpoint's weight is written once (replicas.py); if the rank the reference
    names does not hold it, export says so instead of writing a model without it. Control:
    the same checkpoint with the reference resolving exports both tensors."""
    from tests.service.test_replica_refs import commit, rank_file

    run = unique_run("export-replica")
    ok = commit(service, run, 1, 0, [rank_file(["model.b"], {"w": {"__replica__": "model.w", "rank": 1}}),
                                     rank_file(["model.w"], {})])
    bad = commit(service, run, 2, ok, [rank_file(["model.b"], {"w": {"__replica__": "model.w", "rank": 1}}),
                                       rank_file(["model.x"], {})])
    lastgood("export", str(ok), str(tmp_path / "ok"), url=service.url)
    assert sorted(tensors(tmp_path / "ok" / "model.safetensors")) == ["b", "w"]
    res = lastgood("export", str(bad), str(tmp_path / "bad"), url=service.url, code=None)
    assert res.code != 0 and "model.w" in res.err and "rank 1" in res.err, res.err
    assert not (tmp_path / "bad").exists()
