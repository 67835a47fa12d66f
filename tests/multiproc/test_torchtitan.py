"""torchtitan through LastgoodCheckpointManager (#37), its own components (optimizers, LR
schedulers, ParallelAwareDataloader, the manager built from its Config) in the Trainer's
loop: a run SIGKILLed mid-run and resumed through the manager's load() on start ends
bit-identical to an uninterrupted run (weights, optimizer state, LR, the dataloader's next
batch), on 1 rank (async_mode "disabled") and on 2 (FSDP2, async_mode "async": DCP's save
thread, so the save in flight at the kill is abandoned and the resume takes the one before)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import _command, one_rank, why

HERE = Path(__file__).parent
SCRIPT = HERE / "titan_train.py"


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    # one rank: a plain process with torchrun's variables, no launcher process beside it
    cmd, env = one_rank(SCRIPT, args) if nproc == 1 else _command(SCRIPT, args, nproc, None, None)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,mode", [(1, "disabled"), (2, "async")])
def test_a_killed_torchtitan_run_resumes_bit_identical(service, run_name, tmp_path, nproc, mode):
    ref, job = tmp_path / "ref", tmp_path / "job"
    policy = "latest:8,tagged,last-good,branch-heads"  # the checkpoint section's retention, set by rank 0
    how = ["--async-mode", mode, "--retention", policy]
    whole = _start(nproc, [service.url, f"{run_name}-ref", str(ref), *how])
    first = _start(nproc, [service.url, run_name, str(job), *how, "--kill-at", "7"])
    done, killed = _finish(whole), _finish(first)
    assert done.returncode == 0, why(done)
    assert killed.returncode != 0 and "done at step" not in killed.stdout, why(killed)
    resumed = _finish(_start(nproc, [service.url, run_name, str(job), *how]))
    assert resumed.returncode == 0, why(resumed)
    at = {int(s) for s in re.findall(r"rank \d resumed True at step (\d+)", resumed.stdout)}
    assert len(at) == 1 and len(re.findall("resumed True", resumed.stdout)) == nproc, resumed.stdout[-3000:]
    # saved every 3 steps; synchronously, step 6 committed before the kill at 7
    assert at == {6} if mode == "disabled" else at <= {3, 6}, at
    assert resumed.stdout.count("done at step 12, 384 tokens") == nproc, resumed.stdout[-3000:]

    for r in range(nproc):
        want, got = load_file(str(ref / f"final-rank{r}.safetensors")), load_file(str(job / f"final-rank{r}.safetensors"))
        assert want.keys() == got.keys() and any(k.startswith("opt.") for k in want), (sorted(want), sorted(got))
        assert not [k for k in want if not want[k].equal(got[k])], "not bit-identical"

    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    committed = sorted(c["step"] for c in listing if c["status"] == "COMMITTED")
    assert committed[-1] == 12 and all(c["world_size"] == nproc for c in listing), listing
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 12
    assert not (job / "checkpoint").exists()  # nothing in torchtitan's checkpoint folder
    assert service.get(f"/api/v1/runs/{run_name}/retention").json()["own"] == policy


@pytest.mark.slow  # two one-rank launches
def test_a_model_only_last_save_loads_the_model_only_and_load_step_picks_a_step(service, run_name, tmp_path):
    """torchtitan's default last save holds the model only (last_save_model_only): a start
    from it loads the model and begins at step 0, as torchtitan's seed checkpoint does;
    load_step names a committed step, and a step with no checkpoint is refused (the second
    launch loads all three in turn: the start's load, then load(step=2), then load(step=3))."""
    base = [service.url, run_name, str(tmp_path), "--steps", "4"]
    first = _finish(_start(1, [*base, "--last-model-only"]))
    assert first.returncode == 0 and "done at step 4" in first.stdout, why(first)
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert sorted(c["step"] for c in listing) == [3, 4], listing
    again = _finish(_start(1, [*base, "--then-load", "2,3"]))
    assert again.returncode == 0, why(again)
    out = again.stdout
    assert re.search(r"loading checkpoint \d+ \(step 4\) of run \S+, the model only", out), why(again)
    # in order: the model only at step 0; step 2 refused, nothing loaded; step 3 in full
    starts = [out.index("resumed True at step 0"), out.index("load_step 2 refused: "), out.index("resumed True at step 3")]
    assert starts == sorted(starts) and "has no committed checkpoint of step 2" in out, why(again)
    assert re.search(r"loading checkpoint \d+ \(step 3\) of run \S+\n", out) and "done at step 4" in out, why(again)


@pytest.mark.slow  # a torchrun launch
def test_the_torchtitan_example_runs_as_shown(service, tmp_path):
    """docs/integrations/torchtitan.md's program as printed (the kill tests above resume)."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/torchtitan.md")
    assert len(blocks) == 1 and "steps = 20" in blocks[0]
    script = tmp_path / "titan_example.py"
    script.write_text(blocks[0] + "\n")
    cmd, env = _command(script, [], 1, {"LASTGOOD_URL": service.url}, None)
    env.pop("LASTGOOD_RUN", None)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, why(run)
    assert "resumed at step 0" in run.stdout and "trained to step 20" in run.stdout, run.stdout
    listing = service.get("/api/v1/runs/titan-demo/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED") == [5, 10, 15, 20], listing
    assert not (tmp_path / "outputs" / "checkpoint").exists()
