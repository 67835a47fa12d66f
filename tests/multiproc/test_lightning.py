"""Lightning through LastgoodCheckpointIO, with the stock Trainer and strategies (#37): a
run SIGKILLed mid-run and resumed through trainer.fit(ckpt_path=...) ends bit-identical to
an uninterrupted run, on 1 rank and on 2 (DDP, which saves on rank 0 only: a collective
Checkpointer would deadlock). ModelCheckpoint's top-k, save_last and every_n_train_steps
work on the pointers the plugin writes; two saves of one step both commit; paths, enums and
namespaces in hparams come back as such; other values are refused with the key named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import _command, inherited_env, why

HERE = Path(__file__).parent
SCRIPT = HERE / "lightning_train.py"


def _start(nproc: int, args: list[str]) -> subprocess.Popen:
    cmd, env = _command(SCRIPT, args, nproc, None, None)
    if nproc == 1:  # Lightning on one device: no launcher
        cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def _final(out: Path, nproc: int) -> list[dict]:
    return [load_file(str(out / f"final-rank{r}.safetensors")) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_killed_lightning_run_resumes_bit_identical(service, run_name, tmp_path, nproc):
    ref, job = tmp_path / "ref", tmp_path / "job"
    # the uninterrupted run and the one killed after step 7 are independent: run together
    whole, first = _start(nproc, [service.url, f"{run_name}-ref", str(ref)]), \
        _start(nproc, [service.url, run_name, str(job), "--kill-at", "7"])
    done, killed = _finish(whole), _finish(first)
    assert done.returncode == 0, why(done)
    assert killed.returncode != 0 and "done at step" not in killed.stdout, why(killed)
    resumed = _finish(_start(nproc, [service.url, run_name, str(job)]))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, why(resumed)
    assert "resume from last-good" in out and "rank 0 done at step 12" in out, out[-3000:]

    want, got = _final(ref, nproc), _final(job, nproc)
    for w, g in zip(want, got):
        assert w.keys() == g.keys(), (sorted(w), sorted(g))
        assert not [k for k in w if not w[k].equal(g[k])], "not bit-identical"
    if nproc > 1:  # DDP: every rank holds the same state
        assert all(got[0][k].equal(got[1][k]) for k in got[0])

    # resumed from step 6 (saved before the kill at 7), then saved 9 and 12; a step with
    # a top-k and a save_last save is saved twice, each save its own commit
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    steps = sorted(c["step"] for c in listing if c["status"] == "COMMITTED")
    assert set(steps) == {3, 6, 9, 12} and steps.count(3) == steps.count(6) == 2, steps
    assert all(c["world_size"] == 1 for c in listing)  # rank 0 saves Lightning's whole checkpoint
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 12 and lg["parent_id"] is not None
    pointers = re.search(r"pointers \[(.*)\]", out).group(1)
    assert pointers.count(".ckpt") == 3 and "'last.ckpt'" in pointers, pointers  # top-2 and last
    pinned = sorted(c["step"] for c in listing
                    if "pinned" in {t["name"] for t in service.get(f"/api/v1/checkpoints/{c['id']}").json()["tags"]})
    assert len(pinned) == 3 and pinned[-1] == 12, pinned  # what the pointers name; the rest unpinned

    assert "loaded weights equal True; hparams PosixPath <Mode.FAST: 'fast'> Namespace tiny" in out, out[-3000:]
    refused = re.search(r"refused: (\w+): (.*)", out)
    assert refused and refused.group(1) == "LastgoodError" and "'lightning.hyper_parameters.tokenizer'" in \
        refused.group(2) and "never pickles" in refused.group(2), out[-3000:]


@pytest.mark.slow  # two Lightning processes
def test_the_lightning_example_runs_as_shown_and_resumes(service, tmp_path):
    """docs/integrations/lightning.md's program as printed; then again with more steps,
    resuming through ModelCheckpoint's own ckpt_path="last", which finds the pointer."""
    from tests.client.test_doc_examples import marked_blocks

    blocks = marked_blocks("docs/integrations/lightning.md")
    assert len(blocks) == 1 and "max_steps=40" in blocks[0] and "ckpt_path=resume" in blocks[0]
    env = {**inherited_env(), "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
    env.pop("LASTGOOD_RUN", None)
    runs = []
    for i, text in enumerate([blocks[0], blocks[0].replace("max_steps=40", "max_steps=60")
                              .replace("ckpt_path=resume", 'ckpt_path="last"')]):
        script = tmp_path / f"lightning_example_{i}.py"
        script.write_text(text + "\n")
        runs.append(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                                   cwd=tmp_path, timeout=300))
        assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
    assert "resumed from None; trained to step 40" in runs[0].stdout, runs[0].stdout
    assert "loaded step 40 with lr 0.01" in runs[0].stdout, runs[0].stdout
    second = runs[1].stdout + runs[1].stderr
    assert "Restoring states from the checkpoint path at" in second and "last.ckpt" in second, second[-3000:]
    assert "trained to step 60" in runs[1].stdout, second[-3000:]
    lg = service.get("/api/v1/runs/lightning-demo/last-good").json()
    assert lg["step"] == 60
