"""Rank script: save step 0 and wait for its commit, then save step 1; with DIE_RANK set,
that rank SIGKILLs itself in the middle of streaming its step-1 shard."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import lastgood
from lastgood.datapath import transport
from lastgood.wire.v1 import lastgood_pb2 as pb


def dying_put_shard(self, checkpoint_id, rank, file_name, data, xxh3, spooled=None):
    assert spooled is None, "the test streams (LASTGOOD_USE_SPOOL=0): the kill must land mid-stream"

    def messages():
        yield pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=checkpoint_id, rank=rank,
                                                       file_name=file_name, size=data.nbytes, xxh3_128=xxh3))
        yield pb.PutShardRequest(chunk=bytes(data[: self.chunk]))
        print(f"[rank {rank}] first chunk of {data.nbytes} bytes sent; dying mid-upload", flush=True)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    return self._stub.PutShard(messages())


def main() -> None:
    url, run = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])  # ~6 MiB: several chunks
    state = lastgood.TrainState(model=model)
    ckpt = lastgood.Checkpointer(url, run=run)
    ckpt.save(0, state)
    ckpt.wait()
    dist.barrier()
    if os.environ.get("DIE_RANK") == str(rank):
        transport.Transport.put_shard = dying_put_shard
    with torch.no_grad():
        model[0].weight.add_(1)
    ckpt.save(1, state)
    ckpt.wait()
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
