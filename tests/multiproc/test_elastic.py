"""torchrun elastic: a killed worker makes the agent restart the group, and every rank
resumes from last-good with no change to the training script; a node lost for good and a
relaunch on fewer ranks goes on from last-good without repeating or skipping a sample."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port
from tests.multiproc.launch import train, why

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare  # noqa: E402


def test_elastic_restart_resumes_bit_identically(service, run_name, tmp_path):
    # Four ranks, plain DDP: the restarted group reduces in the gradient-bucket layout the
    # uninterrupted run has (docs/training.md, "DDP's gradient buckets").
    ref = tmp_path / "reference"
    res = train(service.url, f"{run_name}-ref", ref, nproc=4)
    assert res.returncode == 0, why(res)

    out = tmp_path / "elastic"
    elastic = ["--nnodes=1", "--max-restarts=3", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_name}"]
    # no --run-name: the run is torchrun's --rdzv-id (TORCHELASTIC_RUN_ID). The launcher
    # setting works around a PyTorch 2.13 bug: the agent's shared TCPStore outlives a round,
    # so a restarted gloo group reads the dead round's addresses (docs/training.md, "torchrun elastic").
    res = train(service.url, None, out, kill="2:10:after_step", nproc=4,
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
