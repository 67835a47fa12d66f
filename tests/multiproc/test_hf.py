"""Hugging Face Trainer through LastgoodTrainer (#37): a run SIGKILLed mid-epoch and resumed
through trainer.train(resume_from_checkpoint=...) ends bit-identical to an uninterrupted
run, and to the stock Trainer's uninterrupted run, where the stock Trainer's own resume
does not (its collator draws from the global RNG); nothing but save_model()'s safetensors
and JSON is written to output_dir. One rank: a plain subprocess, no launcher; two ranks:
torchrun, gloo, DDP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import _command, inherited_env, why

SCRIPT = Path(__file__).parent / "hf_train.py"


def _start(args: list[str]) -> subprocess.Popen:
    env = {**inherited_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


@pytest.mark.slow
def test_a_killed_hf_run_resumes_bit_identical_and_writes_no_pickle(service, run_name, tmp_path):
    ref, job, native, native_job = tmp_path / "ref", tmp_path / "job", tmp_path / "native", tmp_path / "native-job"
    # a collator that draws from the global RNG; independent runs, together: the uninterrupted run,
    # the one killed after step 10 (saved 3, 6, 9), the stock Trainer's uninterrupted and killed ones
    runs = [_start([service.url, f"{run_name}-ref", str(ref), "--noisy"]),
            _start([service.url, run_name, str(job), "--noisy", "--kill-at", "10"]),
            _start([service.url, "unused", str(native), "--noisy", "--native"]),
            _start([service.url, "unused", str(native_job), "--noisy", "--native", "--kill-at", "10"])]
    done, killed, stock, stock_killed = (_finish(p) for p in runs)
    assert done.returncode == 0 and stock.returncode == 0, why(done) + why(stock)
    assert killed.returncode != 0 and "done at step" not in killed.stdout, why(killed)
    assert stock_killed.returncode != 0, why(stock_killed)
    resumes = [_start([service.url, run_name, str(job), "--noisy"]),
               _start([service.url, "unused", str(native_job), "--noisy", "--native"])]
    resumed, stock_resumed = (_finish(p) for p in resumes)
    assert resumed.returncode == 0 and stock_resumed.returncode == 0, why(resumed) + why(stock_resumed)
    assert "resume from last-good" in resumed.stdout and "done at step 12" in resumed.stdout, why(resumed)
    assert "checkpoint-9" in stock_resumed.stdout, why(stock_resumed)

    want, got = load_file(str(ref / "final.safetensors")), load_file(str(job / "final.safetensors"))
    assert want.keys() == got.keys() and any(k.startswith("opt.") for k in want), sorted(want)
    assert not [k for k in want if not want[k].equal(got[k])], "not bit-identical"
    theirs = load_file(str(native / "final.safetensors"))  # the stock Trainer trains the same
    assert not [k for k in want if not want[k].equal(theirs[k])], "differs from the stock Trainer"
    # the control: the stock Trainer's own resume collates the batch it fetched ahead from other draws
    theirs_resumed = load_file(str(native_job / "final.safetensors"))
    assert [k for k in want if not want[k].equal(theirs_resumed[k])], "the stock resume is bit-identical here"

    # resumed from step 9 (mid-epoch 2: the Trainer skips the trained batches), then saved 12
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED") == [3, 6, 9, 12], listing
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 12 and lg["parent_id"] is not None
    # the Trainer's output_dir: no checkpoint-N, optimizer.pt, rng_state.pth or training_args.bin;
    # save_model() wrote safetensors and JSON only. The control: the stock Trainer's pickles
    for d in (ref, job):
        written = sorted(str(p.relative_to(d / "hf")) for p in (d / "hf").rglob("*") if p.is_file())
        assert written == ["final/config.json", "final/generation_config.json", "final/model.safetensors",
                           "final/training_args.json"], written
    pickles = {p.name for p in (native / "hf").rglob("*") if p.suffix in (".pt", ".pth", ".bin")}
    assert {"optimizer.pt", "rng_state.pth", "training_args.bin"} <= pickles, pickles


@pytest.mark.slow  # two transformers processes
def test_the_hf_example_runs_as_shown_and_resumes(service, tmp_path):
    """docs/integrations/hf.md's program as printed; then again with more steps, resuming
    from the run's last-good."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/hf.md")
    assert len(blocks) == 1 and "max_steps=20" in blocks[0] and "resume_from_checkpoint=resume" in blocks[0]
    env = {**inherited_env(), "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
    env.pop("LASTGOOD_RUN", None)
    outs = []
    for i, text in enumerate([blocks[0], blocks[0].replace("max_steps=20", "max_steps=30")]):
        script = tmp_path / f"hf_example_{i}.py"
        script.write_text(text + "\n")
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        outs.append(res.stdout)
    assert "resumed from None; trained to step 20" in outs[0], outs[0]
    assert "resumed from last-good; trained to step 30" in outs[1], outs[1]
    assert service.get("/api/v1/runs/hf-demo/last-good").json()["step"] == 30
    written = sorted(p.name for p in (tmp_path / "hf-out").rglob("*") if p.is_file())
    assert written == ["config.json", "generation_config.json", "model.safetensors", "training_args.json"], written


@pytest.mark.slow
def test_a_killed_two_rank_hf_run_resumes_bit_identical_where_the_stock_resume_differs(service, run_name,
                                                                                        tmp_path):
    """DDP on 2 ranks (torchrun, gloo): rank 0 saves, both ranks restore. One uninterrupted
    run is the reference for both resumes: ours equals it bit for bit on every rank; the
    stock Trainer's own resume from its checkpoint-9 folder does not (its diff is printed)."""
    def start(args: list[str]) -> subprocess.Popen:
        cmd, env = _command(SCRIPT, [service.url, *args, "--noisy"], 2, None, None)
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    ref, job, native_job = tmp_path / "ref", tmp_path / "job", tmp_path / "native-job"
    runs = [start([f"{run_name}-ref", str(ref)]), start([run_name, str(job), "--kill-at", "10"]),
            start(["unused", str(native_job), "--native", "--kill-at", "10"])]
    done, killed, stock_killed = (_finish(p) for p in runs)
    assert done.returncode == 0, why(done)
    assert killed.returncode != 0 and "done at step" not in killed.stdout, why(killed)
    assert stock_killed.returncode != 0, why(stock_killed)
    resumed, stock_resumed = (_finish(p) for p in [start([run_name, str(job)]),
                                                   start(["unused", str(native_job), "--native"])])
    assert resumed.returncode == 0 and stock_resumed.returncode == 0, why(resumed) + why(stock_resumed)
    assert resumed.stdout.count("resume from last-good") == 2 and "done at step 12" in resumed.stdout, why(resumed)
    assert "checkpoint-9" in stock_resumed.stdout, why(stock_resumed)

    names = ["final.safetensors", "final-rank1.safetensors"]
    want = [load_file(str(ref / n)) for n in names]
    assert any(k.startswith("opt.") for k in want[0]) and all(want[0][k].equal(want[1][k]) for k in want[0])
    for n, w in zip(names, want):
        got, theirs = load_file(str(job / n)), load_file(str(native_job / n))
        assert not [k for k in w if not w[k].equal(got[k])], f"{n}: not bit-identical"
        differ = [k for k in w if not w[k].equal(theirs[k])]
        gap = max((w[k] - theirs[k]).abs().max().item() for k in w)
        print(f"{n}: the stock resume differs from the uninterrupted run in {len(differ)} of {len(w)} tensors, "
              f"max abs diff {gap:.3g}")
        assert differ, f"{n}: the stock resume is bit-identical here"
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED") == [3, 6, 9, 12], listing
    assert all(c["world_size"] == 1 for c in listing)  # rank 0 saves the state every rank holds
