"""Under torchrun, a time-based interval saves the same steps on every rank (rank 0 decides
at agreed steps and broadcasts), and both ranks' heartbeats reach the service."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc.launch import torchrun, why

HERE = Path(__file__).parent


def test_a_time_based_interval_saves_the_same_steps_on_every_rank(make_service, run_name, tmp_path):
    svc = make_service()
    res = torchrun(HERE / "due_ranks.py", [svc.url, run_name, str(tmp_path)], timeout=180)
    assert res.returncode == 0, why(res)
    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert s0 == s1 and len(s0) >= 2, (s0, s1)  # rank 1's steps are twice as slow; same decisions
    committed = svc.get(f"/api/v1/runs/{run_name}/checkpoints", params={"status": "COMMITTED"}).json()["items"]
    assert sorted(c["step"] for c in committed) == s0  # every decision a whole checkpoint: no rank waited alone
    h = svc.get(f"/api/v1/runs/{run_name}/health").json()
    assert [(r["rank"], r["phase"], r["state"]) for r in h["ranks"]] == [(0, "idle", "ok"), (1, "idle", "ok")]
    assert h["world_size"] == 2 and h["interval"]["cost_s"] > 0
