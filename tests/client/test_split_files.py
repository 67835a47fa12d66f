"""A rank's state split into several files (state/split.py), through a real service: each
file is a valid safetensors file of whole tensors, the checkpoint restores bit for bit,
and one damaged file among several makes the checkpoint CORRUPT and restore fall back.
Control: the same damage-free save restores its own step (the first test)."""

from __future__ import annotations

import torch
from safetensors.numpy import load as st_load
from torch import nn

import lastgood
from lastgood.common import parallel
from lastgood.state import split
from tests.service.helpers import ckpt_dir
from tests.conftest import through_its_data_path
from lastgood_service.domain import keys

FILE_BYTES = "16K"  # a ~100 KiB state: several files


def _training(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _files(service, cid: int) -> dict[str, dict]:
    ranks = service.get(f"/api/v1/checkpoints/{cid}/manifest").json()["ranks"]
    return {f["name"]: f for f in ranks[0]["files"]}


def _blob(service, cid: int, entry: dict):
    return ckpt_dir(service, cid) / "r0" / keys.shard_name(entry["xxh3_128"])  # the service's key rule


def test_split_state_restores_bitwise(service, run_name, monkeypatch):
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    model, opt = _training(0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(5, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    files = _files(service, cid)
    assert len(files) >= 3 and "rank00000.safetensors" in files, sorted(files)
    held = []
    for name, entry in sorted(files.items()):  # each one a safetensors file of whole tensors
        raw = _blob(service, cid, entry).read_bytes()
        held += list(st_load(raw))
    assert len(held) == len(set(held))  # every tensor in one file, whole
    assert {f"model.{k}" for k in model.state_dict()} <= set(held)

    want = _state(model, opt)
    model2, opt2 = _training(1)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 5
    got = _state(model2, opt2)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k


def test_one_damaged_file_of_several_falls_back(service, run_name, monkeypatch):
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    model, opt = _training(0)
    state = lastgood.TrainState(model=model, optimizer=opt)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        good = ckpt.last_saved.checkpoint_id
        step1 = _state(model, opt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt.save(2, state)
        ckpt.wait()
        bad = ckpt.last_saved.checkpoint_id
    files = _files(service, bad)
    sibling = sorted(n for n in files if n != "rank00000.safetensors")[-1]
    path = _blob(service, bad, files[sibling])
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0x10  # a tensor byte of the last further file
    path.write_bytes(bytes(data))

    model2, opt2 = _training(1)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 1
    got = _state(model2, opt2)
    assert all(torch.equal(step1[k], got[k]) for k in step1)
    assert service.get(f"/api/v1/checkpoints/{bad}").json()["status"] == "CORRUPT"
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == good


def _restore_by_id(service, run_name, damage: bool):
    """Save a state split into several files, damage (or not) a tensor byte of its last
    further file, restore it by id into another model: (raised, the model's state after)."""
    model, opt = _training(0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    if damage:
        files = _files(service, cid)
        path = _blob(service, cid, files[sorted(n for n in files if n != "rank00000.safetensors")[-1]])
        data = bytearray(path.read_bytes())
        data[len(data) - 3] ^= 0x10
        path.write_bytes(bytes(data))
    model2, opt2 = _training(1)
    before = _state(model2, opt2)
    raised = None
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        try:
            ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2), checkpoint_id=cid)
        except lastgood.errors.CorruptCheckpoint as e:
            raised = e
    after = _state(model2, opt2)
    return raised, [k for k in before if not torch.equal(before[k], after[k])]


def test_a_damaged_later_file_applies_nothing(service, run_name, monkeypatch):
    """Restoring by id a checkpoint with one damaged byte in its last file raises, and not
    one tensor of the state (of that file or any other) was written: every file is
    verified before the first byte is copied into the state."""
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    raised, changed = _restore_by_id(service, run_name, damage=True)
    assert raised is not None and changed == []


def test_control_an_undamaged_restore_by_id_writes_the_state(service, run_name, monkeypatch):
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    raised, changed = _restore_by_id(service, run_name, damage=False)
    assert raised is None and len(changed) > 4


def test_export_reads_a_split_checkpoint(service, run_name, monkeypatch, tmp_path):
    """`lastgood export` plans a further file's tensors from the first file's state."""
    from safetensors import safe_open

    from lastgood.export import export_hf

    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    model, opt = _training(0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(3, lastgood.TrainState(model=model, optimizer=opt, extra={"hf_config": {"model_type": "none"}}))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    assert len(_files(service, cid)) >= 3
    doc = export_hf(cid, tmp_path / "hf", url=service.url)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    sd = model.state_dict()
    assert sorted(got) == sorted(sd) and doc["tensors"] == len(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_streamed_files_of_a_rank_use_at_most_two_streams(service, run_name, monkeypatch):
    """The ranks of a host share a token's max_streams_per_client (16): a rank streams its
    files over at most parallel.STREAM_WORKERS PutShard streams at once, not parallel.WORKERS."""
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    monkeypatch.setenv("LASTGOOD_USE_SPOOL", "0")  # streamed
    calls: list[tuple[int, int, bool]] = []
    real = parallel.run_all

    def run_all(fns, workers=parallel.WORKERS, **kw):
        calls.append((len(fns), workers, "undo" in kw))  # undo: add_all's prepare, not a send
        return real(fns, workers, **kw)

    monkeypatch.setattr(parallel, "run_all", run_all)
    model, opt = _training(0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        through_its_data_path(ckpt.transport)
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
    sends = [w for n, w, prepare in calls if n >= 3 and not prepare]  # the hand-over of several files
    assert sends and max(sends) <= parallel.STREAM_WORKERS < parallel.WORKERS, calls


def test_a_rank_written_as_more_files_than_today_still_restores_bitwise(service, run_name, monkeypatch):
    """Checkpoints written before the split's cap of one file per writer thread hold up to 64
    files a rank; the reader takes any number, more than its threads (state/split.py)."""
    monkeypatch.setenv("LASTGOOD_FILE_BYTES", FILE_BYTES)
    plan = split.plan
    monkeypatch.setattr(split, "plan", lambda specs, file_bytes, max_files=0: plan(specs, file_bytes, max_files=64))
    model, opt = _training(0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(5, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    monkeypatch.setattr(split, "plan", plan)
    assert len(_files(service, cid)) > 2 * parallel.WORKERS, sorted(_files(service, cid))
    want = _state(model, opt)
    model2, opt2 = _training(1)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 5
    got = _state(model2, opt2)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
