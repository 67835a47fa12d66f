"""Logs at scale: one line per incident for the job, not one per rank. torch-free.

A restore, a service outage, a spike's rollback: every rank of the job meets them alike,
and a job of 1,000 ranks would print each line 1,000 times. `incident()` logs such a line
once, on rank 0, at the level asked, saying how many ranks the job has; every other rank
logs its own at debug level (`logging.getLogger("lastgood").setLevel(logging.DEBUG)` on a
rank shows them). What only one rank meets -- its own error, a retry that ran out -- is
not an incident: that rank logs it as usual.

The Checkpointer says which rank this process is (`set_job`); until then a process is a
job of one rank, and every line is logged as asked.
"""

from __future__ import annotations

import logging

_job = {"rank": 0, "world": 1}


def set_job(rank: int, world_size: int) -> None:
    """This process's rank and the job's world size (one rank per process)."""
    _job.update(rank=int(rank), world=max(1, int(world_size)))


def incident(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log `msg % args`, an incident every rank of the job meets alike: at `level` on rank 0,
    with the job's rank count; at debug level, with the rank, on every other rank."""
    rank, world = _job["rank"], _job["world"]
    if world == 1:
        logger.log(level, msg, *args)
    elif rank == 0:
        logger.log(level, msg + " [rank 0 of %d ranks; the others log theirs at debug level]", *args, world)
    else:
        logger.debug(msg + " [rank %d of %d]", *args, rank, world)
