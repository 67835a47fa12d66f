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

from .launch import _command, why

HERE = Path(__file__).parent
SCRIPT = HERE / "titan_train.py"


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    cmd, env = _command(SCRIPT, args, nproc, None, None)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,mode", [(1, "disabled"), (2, "async")])
def test_a_killed_torchtitan_run_resumes_bit_identical(service, run_name, tmp_path, nproc, mode):
    ref, job = tmp_path / "ref", tmp_path / "job"
    how = ["--async-mode", mode]
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


@pytest.mark.slow  # two torchrun launches
def test_the_torchtitan_example_runs_as_shown_and_resumes(service, tmp_path):
    """docs/integrations/torchtitan.md's program as printed; then again with more steps,
    resuming from the run's last-good through the manager's load()."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/torchtitan.md")
    assert len(blocks) == 1 and "steps = 20" in blocks[0]
    runs = []
    for i, text in enumerate([blocks[0], blocks[0].replace("steps = 20", "steps = 30")]):
        script = tmp_path / f"titan_example_{i}.py"
        script.write_text(text + "\n")
        cmd, env = _command(script, [], 1, {"LASTGOOD_URL": service.url}, None)
        env.pop("LASTGOOD_RUN", None)
        runs.append(subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300))
        assert runs[-1].returncode == 0, why(runs[-1])
    assert "resumed at step 0" in runs[0].stdout and "trained to step 20" in runs[0].stdout, runs[0].stdout
    assert "resumed at step 20" in runs[1].stdout and "trained to step 30" in runs[1].stdout, runs[1].stdout
    listing = service.get("/api/v1/runs/titan-demo/checkpoints", params={"limit": 100}).json()["items"]
    assert sorted(c["step"] for c in listing if c["status"] == "COMMITTED") == [5, 10, 15, 20, 25, 30], listing
    assert not (tmp_path / "outputs" / "checkpoint").exists()
