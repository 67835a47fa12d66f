"""The mission: a two-rank training run, SIGKILLed and relaunched, ends bit-identical to
one that never failed: per-step losses and sample ids after the resume point, final
parameters, optimizer state and RNG states.

The example trainer (examples/gpt/train.py) runs 20 steps of 6 steps per epoch
(several epochs) and saves after steps 2, 5, 8, 11, 14, 17; steps 5, 11 and 17 end an
epoch. Scenarios:
  in-flight:   rank 1 dies right after save(11) returned, its upload still in flight:
               checkpoint 11 never commits, the job resumes from 8 (mid-epoch);
  between:     rank 0 dies after step 13, between two saves: resumes from 11, the last
               batch of epoch 1 (an epoch boundary);
  plain:       the same with a plain DataLoader over lastgood.ResumableDistributedSampler,
               rank 1 dies after step 9: resumes from 8 (mid-epoch).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT
from tests.multiproc.launch import train, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare, load_steps  # noqa: E402

STEPS_PER_EPOCH = 6


@pytest.fixture(scope="module")
def references(service, tmp_path_factory):
    out = {}
    for loader in ("stateful", "plain"):
        d = tmp_path_factory.mktemp(f"ref-{loader}")
        res = train(service.url, f"mission-ref-{loader}-{d.name}", d, "--loader", loader)
        assert res.returncode == 0, why(res)
        out[loader] = d
    return out


SCENARIOS = {
    "in-flight": ("stateful", "1:11:after_save", 8, 11),
    "between": ("stateful", "0:13:after_step", 11, 13),
    "plain": ("plain", "1:9:after_step", 8, 9),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_killed_and_relaunched_run_is_bit_identical(service, references, tmp_path, run_name, scenario):
    loader, kill, resume_from, died_at = SCENARIOS[scenario]
    out = tmp_path / "run"
    crashed = train(service.url, run_name, out, "--loader", loader, kill=kill)
    assert crashed.returncode != 0, "the fault injection did not kill the job"
    assert f"SIGKILL at step {died_at}" in crashed.stdout + crashed.stderr

    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == resume_from  # the failed or in-flight save did not move last-good
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    assert all(c["status"] != "COMMITTED" for c in listing if c["step"] > resume_from)

    relaunched = train(service.url, run_name, out, "--loader", loader)
    assert relaunched.returncode == 0, why(relaunched)
    assert f"starting at step {resume_from + 1} (restored: {resume_from})" in relaunched.stdout

    # the resume point is where the scenario says: mid-epoch, or the last batch of an epoch
    at_boundary = resume_from % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1
    assert at_boundary == (scenario == "between")
    # a real resume happened: the steps after the resume point were trained twice
    _, repeated = load_steps(out / "losses-rank0.jsonl")
    assert repeated == list(range(resume_from + 1, died_at + 1))

    diffs = compare(references[loader], out, world=2)
    assert diffs == [], "\n".join(diffs[:20])

    final = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert final["step"] == 17 and final["status"] == "COMMITTED"
    assert json.loads((out / "final-rank0.json").read_text())["step"] == 20
