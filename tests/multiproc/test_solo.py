"""A Checkpointer is collective; one that not every rank creates raises within seconds on
the ranks that did (it hung in the first collective for as long as the process group's
timeout, 30 minutes by default). A solo Checkpointer is the mode for state every rank holds
alike and one rank saves (Lightning's DDP): no collective call at all."""

from __future__ import annotations

import re
from pathlib import Path

from .launch import torchrun

HERE = Path(__file__).parent


def test_a_checkpointer_on_rank_0_alone_raises_and_solo_ones_save_and_restore(service, run_name):
    p = torchrun(HERE / "solo_ranks.py", [service.url, run_name], nproc=2, timeout=120,
                 env={"LASTGOOD_JOIN_SECONDS": "2"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    refused = re.search(r"rank 0 refused after ([\d.]+) s: (.*)", out)
    assert refused and 2 <= float(refused.group(1)) < 10, out[-3000:]
    assert "not every rank created it" in refused.group(2) and "solo=True" in refused.group(2)
    assert "rank 1 save refused: a solo Checkpointer saves on global rank 0 only" in out, out[-3000:]
    for rank in (0, 1):  # rank 1 had other weights: both hold rank 0's save now
        assert f"rank {rank} restored step 5 weight 27.0" in out, out[-3000:]
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert [(c["step"], c["world_size"], c["status"]) for c in listing] == [(5, 1, "COMMITTED")]
