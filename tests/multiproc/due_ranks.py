"""Two ranks under torchrun save under a time-based Interval whose clocks disagree (rank 1's
steps are slower, so its own clock would fire at other steps): `ckpt.due()` must give both
the same steps. Writes each rank's saved steps to OUT/rank{r}.json.

    torchrun --nproc-per-node=2 due_ranks.py URL RUN OUT
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lastgood

url, run, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
state = lastgood.TrainState(model=torch.nn.Linear(4, 4))
ckpt = lastgood.Checkpointer(url, run=run, interval="0.01m", heartbeat_seconds=0.3)  # every 0.6 s
saved = []
for step in range(120):
    time.sleep(0.03 if rank == 0 else 0.06)  # no collective in the loop: the ranks drift apart
    if ckpt.due(step):
        ckpt.save(step, state)
        saved.append(step)
ckpt.close()
(out / f"rank{rank}.json").write_text(json.dumps(saved))
dist.destroy_process_group()
