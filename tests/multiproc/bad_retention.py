"""Every rank builds a Checkpointer with the retention given; prints how it ended."""

from __future__ import annotations

import sys

import torch.distributed as dist

import lastgood


def main() -> None:
    dist.init_process_group("gloo")
    url, run, retention = sys.argv[1:4]
    try:
        ckpt = lastgood.Checkpointer(url, run=run, retention=retention, heartbeat_seconds=0)
    except Exception as e:  # noqa: BLE001 - what the test reads
        print(f"rank {dist.get_rank()} refused: {type(e).__name__}: {e}", flush=True)
        sys.stdout.flush()
        import os
        os._exit(3)
    ckpt.restore(lastgood.TrainState(extra={}))
    ckpt.close()
    print(f"rank {dist.get_rank()} ok", flush=True)


if __name__ == "__main__":
    from rank_exit import run as run_main  # this folder is on sys.path: torchrun runs the script by its path

    run_main(main)
