"""Accelerate through LastgoodAccelerator (#37): save_state / load_state go through a
lastgood run and write no file; a loop SIGKILLed mid-epoch (a StatefulDataLoader, gradient
accumulation, a registered object, each rank's own dropout masks) and resumed with
load_state(accelerator.resume()) ends bit-identical to an uninterrupted run, on 1 rank and
on 2 (torchrun, gloo, DDP)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import _command, inherited_env, why

SCRIPT = Path(__file__).parent / "accelerate_train.py"


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    cmd, env = _command(SCRIPT, args, nproc, None, None)
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def _final(out: Path, nproc: int) -> list[dict]:
    return [load_file(str(out / f"final-rank{r}.safetensors")) for r in range(nproc)]


def _differing(want: list[dict], got: list[dict]) -> list[str]:
    assert all(w.keys() == g.keys() for w, g in zip(want, got))
    return [f"rank{r}.{k}" for r, (w, g) in enumerate(zip(want, got)) for k in w if not w[k].equal(g[k])]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_killed_accelerate_run_resumes_bit_identical(service, run_name, tmp_path, nproc):
    ref, job = tmp_path / "ref", tmp_path / "job"
    # independent: the uninterrupted run and the one killed after batch 14 (saved 4, 8, 12)
    # and on 1 rank the stock Accelerator killed there too, resumed from its own folder
    native = tmp_path / "native"
    whole, first = (_start(nproc, [service.url, f"{run_name}-ref", str(ref)]),
                    _start(nproc, [service.url, run_name, str(job), "--kill-at", "14"]))
    stock = _start(1, [service.url, "unused", str(native), "--native", "--kill-at", "14"]) if nproc == 1 else None
    done, killed = _finish(whole), _finish(first)
    if stock is not None:
        stock = _start(1, [service.url, "unused", str(native), "--native"]) if _finish(stock).returncode else None
    assert done.returncode == 0, why(done)
    assert killed.returncode != 0 and "done at batch" not in killed.stdout, why(killed)
    resumed = _finish(_start(nproc, [service.url, run_name, str(job)]))
    assert resumed.returncode == 0, why(resumed)
    assert "rank 0 resume from last-good at batch 12" in resumed.stdout, why(resumed)
    assert f"rank {nproc - 1} done at batch 20" in resumed.stdout, why(resumed)

    want, got = _final(ref, nproc), _final(job, nproc)
    assert any(k.startswith("opt.") for k in want[0]) and want[0]["losses"].numel() == 20, sorted(want[0])
    assert not _differing(want, got), "not bit-identical"
    if stock is not None:  # the control: Accelerate's own resume from its folder of pickles
        stock_resumed = _finish(stock)
        assert stock_resumed.returncode == 0 and "resume from " + str(native / "native" / "12") in stock_resumed.stdout, \
            why(stock_resumed)
        assert {"optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= \
            {p.name for p in (native / "native" / "12").iterdir()}
        theirs = _final(native, 1)
        differ = _differing(want, theirs)
        gap = max((want[0][k] - theirs[0][k]).abs().max().item() for k in want[0])
        print(f"stock Accelerate resume vs uninterrupted: {len(differ)} tensors differ, max abs diff {gap:.3g}")
        assert differ, "the stock resume is bit-identical here"
    if nproc > 1:  # DDP: the same weights everywhere, each rank's own dropout masks (its own RNG states)
        assert want[0]["model.0.weight"].equal(want[1]["model.0.weight"])
        assert not want[0]["losses"].equal(want[1]["losses"])

    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED") == [4, 8, 12, 16, 20], listing
    assert all(c["world_size"] == nproc for c in listing)  # every rank saves its own RNG states
    assert not [p for p in job.rglob("*") if p.is_file() and p.suffix != ".safetensors"]  # no file of Accelerate's


@pytest.mark.slow  # two accelerate processes
def test_the_accelerate_example_runs_as_shown_and_resumes(service, tmp_path):
    """docs/integrations/accelerate.md's program as printed; then again with more batches,
    loading the run's last-good."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/accelerate.md")
    assert len(blocks) == 1 and "total = 24" in blocks[0] and "accelerator.load_state(resume)" in blocks[0]
    env = {**inherited_env(), "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
    env.pop("LASTGOOD_RUN", None)
    outs = []
    for i, text in enumerate([blocks[0], blocks[0].replace("total = 24", "total = 36")]):
        script = tmp_path / f"accelerate_example_{i}.py"
        script.write_text(text + "\n")
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        outs.append(res.stdout)
    assert "resumed from None; trained to batch 24" in outs[0], outs[0]
    assert "resumed from last-good; trained to batch 36" in outs[1], outs[1]
    listing = service.get("/api/v1/runs/accelerate-demo/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED")[-1] == 36, listing
    assert [p.name for p in tmp_path.iterdir()] and not [p for p in tmp_path.rglob("*") if p.suffix != ".py"]
