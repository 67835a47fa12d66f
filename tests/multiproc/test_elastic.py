"""torchrun elastic: a killed worker makes the agent restart the group, and every rank
resumes from last-good with no change to the training script; a node lost for good and a
relaunch on fewer ranks goes on from last-good without repeating or skipping a sample."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port
from tests.multiproc.launch import train, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare  # noqa: E402


def test_elastic_restart_resumes_bit_identically(service, run_name, tmp_path):
    # Four ranks: DDP's one-time gradient-bucket rebuild would make the first step after a
    # restart reduce in another order (docs/training.md, "DDP on more than two ranks"), so both
    # runs keep DDP's bucket layout fixed.
    ref = tmp_path / "reference"
    res = train(service.url, f"{run_name}-ref", ref, "--ddp-fixed-buckets", nproc=4)
    assert res.returncode == 0, why(res)

    out = tmp_path / "elastic"
    elastic = ["--nnodes=1", "--max-restarts=3", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_name}"]
    # no --run-name: the run is torchrun's --rdzv-id (TORCHELASTIC_RUN_ID). The launcher
    # setting works around a PyTorch 2.13 bug: the agent's shared TCPStore outlives a round,
    # so a restarted gloo group reads the dead round's addresses (docs/training.md, "torchrun elastic").
    res = train(service.url, None, out, "--ddp-fixed-buckets", kill="2:10:after_step", nproc=4,
                launcher=elastic, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert res.returncode == 0, why(res)  # the agent restarted the group and it finished
    assert "SIGKILL at step 10" in res.stdout + res.stderr
    assert "starting at step 9 (restored: 8)" in res.stdout

    events = service.get(f"/api/v1/runs/{run_name}/events", params={"limit": 1000}).json()["items"]
    restarts = [e for e in events if e["kind"] == "restart"]
    assert [e["data"]["restart_count"] for e in restarts] == [1] and restarts[0]["data"]["world_size"] == 4
    diffs = compare(ref, out, world=4)
    assert diffs == [], "\n".join(diffs[:20])


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads(line) for r in range(world) for line in (out / f"losses-rank{r}.jsonl").read_text().splitlines()]


def test_a_node_lost_for_good_relaunched_on_fewer_ranks(service, run_name, tmp_path):
    first, second = tmp_path / "four", tmp_path / "three"
    args = ("--loader", "plain", "--every", "2")
    crashed = train(service.url, run_name, first, *args, kill="3:8:after_step", nproc=4)
    assert crashed.returncode != 0
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 7

    relaunched = train(service.url, run_name, second, *args, nproc=3)
    assert relaunched.returncode == 0, why(relaunched)
    assert "starting at step 8 (restored: 7)" in relaunched.stdout
    final = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert final["step"] == 19 and final["world_size"] == 3

    # epoch 2 spans the change: steps 6 and 7 on four ranks, the rest on three
    before = [i for r in _records(first, 4) if r["epoch"] == 2 and r["step"] <= 7 for i in r["ids"]]
    after = [i for r in _records(second, 3) if r["epoch"] == 2 for i in r["ids"]]
    assert len(before) == 32 and sorted(set(before + after)) == list(range(48))  # nothing skipped
    assert len(before + after) - 48 == 2  # repeats only from padding 16 left-over samples to 18 for 3 ranks
    assert set(before).isdisjoint(after[:16 - 2])  # what was trained before is not trained again


def test_with_ddp_default_buckets_a_4_rank_resume_is_exact_through_the_first_resumed_step(service, run_name, tmp_path):
    """What lastgood owes without `--ddp-fixed-buckets`: the restored state is exact, so the
    resumed run matches the uninterrupted one through its first step. Later steps may differ
    in the last bits (DDP rebuilds its gradient buckets once, after a process's first step:
    docs/training.md, "DDP on more than two ranks"); that is PyTorch's behaviour, not ours,
    and this test does not hold it either way, so a PyTorch that keeps the layout passes too."""
    ref, out = tmp_path / "reference", tmp_path / "resumed"
    assert train(service.url, f"{run_name}-ref", ref, nproc=4).returncode == 0
    assert train(service.url, run_name, out, kill="2:10:after_step", nproc=4).returncode != 0
    res = train(service.url, run_name, out, nproc=4)
    assert res.returncode == 0, why(res)
    assert "starting at step 9 (restored: 8)" in res.stdout
    diffs = compare(ref, out, world=4)
    assert not any("logged by only one run" in d for d in diffs), diffs
    early = [d for d in diffs if (m := re.match(r"rank \d+ step (\d+):", d)) and int(m.group(1)) <= 9]
    assert not early, early  # exact up to and including the first step after the resume
