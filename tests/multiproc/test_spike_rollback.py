"""A trainer whose data holds a poisoned batch: the loss spikes at step 9; SpikeGuard rolls
back, the run completes, the poisoned batch is never fed again, and the lineage shows
the branch and the tags. Control: without the guard the poison goes into the weights.

Example trainer: 2 ranks, 6 steps per epoch, saves after steps 2, 5, 8, ...; in epoch 1
sample 29 reads corrupted (loss weight 1e4); rank 1 meets it at step 9 (rank 0's loss
stays ordinary: the spike event must carry rank 1's numbers). With margin 2 the guard
trusts only checkpoints saved before step 7: it rolls back to step 5, and the checkpoint
of step 8 becomes suspect.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import FAST, ServiceProc
from tests.multiproc.launch import train, why

POISON = ["--loader", "plain", "--poison", "1:29", "--spike-margin", "2"]


def records(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines()]


def max_exp_avg_sq(out: Path) -> float:
    with safe_open(str(out / "final-rank0.safetensors"), "pt") as f:
        return max(f.get_tensor(k).max().item() for k in f.keys() if k.endswith("exp_avg_sq"))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A service of this module's own with a 30 s lease: the session's 3 s lease ran out in a
    clean CI run while both ranks restored after the rollback (the saves of steps 14 and 17
    were abandoned and the job failed)."""
    svc = ServiceProc(tmp_path_factory.mktemp("spike-service"), {**FAST, "LASTGOOD_LEASE_SECONDS": "30"}).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def guarded(service, tmp_path_factory):
    out = tmp_path_factory.mktemp("guarded")
    run = f"spike-guarded-{out.name}"
    res = train(service.url, run, out, *POISON, "--spike-guard")
    assert res.returncode == 0, why(res)
    return run, out


def test_spike_rolls_back_and_the_poison_is_never_fed_again(service, guarded):
    run, out = guarded
    rec0, rec1 = records(out, 0), records(out, 1)
    spike1 = [r for r in rec1 if r.get("spike")]
    assert [r["step"] for r in spike1] == [9] and 29 in spike1[0]["ids"]
    assert float.fromhex(spike1[0]["loss"]) > 1000
    spikes = [r for r in rec0 if r.get("spike")]
    assert [r["step"] for r in spikes] == [9]  # every rank rolled back together
    assert float.fromhex(spikes[0]["loss"]) < 100  # rank 0 saw nothing unusual itself
    after = rec0[rec0.index(spikes[0]) + 1:] + rec1[rec1.index(spike1[0]) + 1:]
    assert len(after) == 2 * 14  # steps 6..19 again, on both ranks
    assert all(29 not in r["ids"] for r in after)  # never fed again, in any later epoch, on any rank
    # the training went on from step 6 (the step after the target) to the end
    steps0 = [r["step"] for r in rec0]
    assert steps0[rec0.index(spikes[0]) + 1] == 6 and steps0[-1] == 19
    assert all(math.isfinite(float.fromhex(r["loss"])) and float.fromhex(r["loss"]) < 100 for r in after)

    evs = service.get(f"/api/v1/runs/{run}/events").json()["items"]
    spike = next(e for e in evs if e["kind"] == "spike")
    assert spike["data"]["step"] == 9 and spike["data"]["metric"] == "loss"
    assert spike["data"]["z"] > spike["data"]["threshold"] and spike["data"]["median"] > 0
    # the numbers of the rank that saw it (rank 1), not of rank 0, which only heard of it
    assert spike["data"]["rank"] == 1
    assert spike["data"]["loss"] == spike["data"]["value"] == float.fromhex(spike1[0]["loss"]) > 1000
    rollback = next(e for e in evs if e["kind"] == "rollback")
    assert rollback["data"]["target_step"] == 5 and rollback["data"]["lr_factor"] == 0.5
    assert rollback["data"]["skipped"]["steps"] == [6, 9] and 29 in rollback["data"]["skipped"]["samples"]

    g = service.get(f"/api/v1/runs/{run}/lineage").json()
    by_step_branch = {(n["step"], n["branch"]): n for n in g["nodes"]}
    tags = {k: {t["name"] for t in n["tags"]} for k, n in by_step_branch.items()}
    assert g["branches"] == 2
    assert "rollback-target" in tags[(5, 0)] and "suspect" in tags[(8, 0)]
    new_branch = [n for n in g["nodes"] if n["branch"] == 1]
    assert [n["step"] for n in new_branch] == [8, 11, 14, 17]
    assert new_branch[0]["parent_id"] == by_step_branch[(5, 0)]["id"]
    last_good = next(n for n in g["nodes"] if n["last_good"])
    assert last_good["step"] == 17 and last_good["branch"] == 1 and "suspect" not in {t["name"] for t in last_good["tags"]}
    assert all(n["status"] == "COMMITTED" for n in g["nodes"])  # the re-saved steps did not collide

    # the learning rate was halved: LambdaLR recomputes lr from base_lrs, which the guard scaled
    final = json.loads((out / "final-rank0.json").read_text())
    steps, warmup = 20, 4
    t = (steps - warmup) / (steps - warmup)
    expected = 3e-3 * 0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    assert math.isclose(final["param_groups"][0]["lr"], expected, rel_tol=1e-9)


def test_control_without_the_guard_the_poison_stays_in_the_weights(service, guarded, tmp_path, run_name):
    out = tmp_path / "unguarded"
    res = train(service.url, run_name, out, *POISON)
    assert res.returncode == 0, why(res)
    rec1 = records(out, 1)
    assert any(r["step"] == 9 and 29 in r["ids"] and float.fromhex(r["loss"]) > 1000 for r in rec1)
    assert not [e for e in service.get(f"/api/v1/runs/{run_name}/events").json()["items"] if e["kind"] == "rollback"]
    # Adam's second moments still carry the poisoned gradient, orders of magnitude above the guarded run's
    assert max_exp_avg_sq(out) > 1000 * max_exp_avg_sq(guarded[1])
