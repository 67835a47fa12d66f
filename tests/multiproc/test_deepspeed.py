"""DeepSpeed through lastgood.integrations.deepspeed (#37): real DeepSpeed on CPU (gloo,
DS_ACCELERATOR=cpu), ZeRO stages 1 and 3 on 2 ranks, stage 2 on one: a run SIGKILLed mid-run and resumed
through engine.load_checkpoint(dir, tag="last-good") ends bit-identical to an
uninterrupted run; every rank's files of one save_checkpoint are one checkpoint, tagged
with DeepSpeed's tag."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import _command, one_rank, why

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _deepspeed():
    import deepspeed  # noqa: F401  (pinned in requirements-dev.txt: a missing install fails, never skips)

SCRIPT = Path(__file__).parent / "deepspeed_train.py"


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    # one rank: a plain process with torchrun's variables, no launcher process beside it
    ds = {"DS_ACCELERATOR": "cpu"}
    cmd, env = one_rank(SCRIPT, args, ds) if nproc == 1 else _command(SCRIPT, args, nproc, ds, None)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 400) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,stage", [(2, 1), (2, 3), (1, 2)])
def test_a_killed_deepspeed_run_resumes_bit_identical(service, run_name, tmp_path, nproc, stage):
    ref, job = tmp_path / "ref", tmp_path / "job"
    # the uninterrupted run and the one killed after step 5 (saved at 3) run together
    whole = _start(nproc, [service.url, f"{run_name}-ref", str(ref), "--stage", str(stage)])
    first = _start(nproc, [service.url, run_name, str(job), "--stage", str(stage), "--kill-at", "5"])
    done, killed = _finish(whole), _finish(first)
    assert done.returncode == 0, why(done)
    assert "resumed from None at step 0" in done.stdout, done.stdout[-3000:]
    assert killed.returncode != 0 and "done at step" not in killed.stdout, why(killed)
    resumed = _finish(_start(nproc, [service.url, run_name, str(job), "--stage", str(stage)]))
    assert resumed.returncode == 0, why(resumed)
    out = resumed.stdout
    # DeepSpeed gives back every key it does not own itself: the client_state among them
    assert f"rank 0 resumed from {run_name}@" in out and " at step 3 client {" in out, out[-3000:]
    assert "'ds_version': '0.19.8', 'epoch': 0, 'note': 'tiny'}" in out, out[-3000:]
    assert f"rank {nproc - 1} done at step 8" in out, out[-3000:]

    for r in range(nproc):
        want, got = load_file(str(ref / f"final-rank{r}.safetensors")), load_file(str(job / f"final-rank{r}.safetensors"))
        assert want.keys() == got.keys() and any(k.startswith("adam.") for k in want), (sorted(want), sorted(got))
        assert not [k for k in want if not want[k].equal(got[k])], "not bit-identical"

    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    committed = sorted(c["step"] for c in listing if c["status"] == "COMMITTED")
    assert committed == [3, 6, 8], committed  # 3 before the kill; 6 and 8 after the resume
    assert all(c["world_size"] == nproc for c in listing)
    tags = {t["name"] for c in listing for t in service.get(f"/api/v1/checkpoints/{c['id']}").json()["tags"]}
    assert {"global_step3", "global_step6", "global_step8"} <= tags, tags


@pytest.mark.slow  # two DeepSpeed launches
def test_the_deepspeed_example_runs_as_shown_and_resumes(service, tmp_path):
    """docs/integrations/deepspeed.md's program as printed, on one rank: trains to 20, then
    a second launch resumes from last-good (step 20) and has nothing left to train."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/deepspeed.md")
    assert len(blocks) == 1 and 'tag="last-good"' in blocks[0]
    script = tmp_path / "deepspeed_example.py"
    script.write_text(blocks[0] + "\n")
    outs = []
    for _ in range(2):
        cmd, env = _command(script, [], 1, {"LASTGOOD_URL": service.url, "DS_ACCELERATOR": "cpu"}, None)
        env.pop("LASTGOOD_RUN", None)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=400)
        assert res.returncode == 0, why(res)
        outs.append(res.stdout)
    assert "resumed from None at step 0" in outs[0] and "trained to step 20" in outs[0], outs[0][-3000:]
    assert "resumed from deepspeed-demo@" in outs[1] and "at step 20" in outs[1], outs[1][-3000:]
    lg = service.get("/api/v1/runs/deepspeed-demo/last-good").json()
    assert lg["step"] == 20
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step20"
