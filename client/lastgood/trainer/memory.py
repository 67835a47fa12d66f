"""The Checkpointer's memory tier (docs/memory-tier.md): a save at the memory interval is a
memory checkpoint, written into the node agent's segment (datapath/memory.py) and voted
with its files declared; the agent hashes it and replicates it, and the service commits it
once the agents' copy reports verify every file.

A memory save never fails the job: an agent that is away or refuses (its budget: 507; too
few partners: 409), a service that refuses the begin, a partner the agent could not reach
(asked of the agent while the rank waits), or a checkpoint that does not commit
within the commit timeout gives the memory save up, with a
`memory_given_up` event, and training and the durable saves go on. A memory checkpoint that
commits becomes the parent of the next save, as a durable one does: one lineage for both tiers.
"""

from __future__ import annotations

import logging
import time

import os

from lastgood.common import joblog
from lastgood.common.interval import Decider, Interval
from lastgood.datapath.agents import AgentRefused
from lastgood.datapath.memory import MemoryPath
from lastgood.errors import Fenced, LastgoodError, ServiceError
from lastgood.remote import config
from lastgood.state import distributed
from lastgood.wire import tiers
from lastgood.wire.vocab import Status

log = logging.getLogger("lastgood")
# While a memory commit is awaited the own agent is asked how replication stands between the
# outcome polls, which start at this and double up to 10 s: a partner that cannot be reached
# shows within seconds, and a long wait costs the service no more polls than before
AGENT_POLL_SECONDS = 1.0


class MemoryGivenUp(Exception):
    """This memory save did not commit; the reason is in the message."""


def start(transport, run: str, rank: int, memory, agent: str | None, replicas: int):
    """(MemoryTier, its Decider) for `memory` (an Interval or its text), or (None, None)."""
    if memory is None:
        return None, None
    agent = agent or os.environ.get(config.ENV_AGENT)
    if not agent:
        raise LastgoodError(f"a memory interval needs the node agent: pass agent='HOST:PORT' or set {config.ENV_AGENT}")
    memory = Interval.parse(memory) if isinstance(memory, str) else memory
    return MemoryTier(transport, run, rank, agent, replicas), Decider(memory, lambda: None, distributed.broadcast_int)


def tier_of(step: int, tier: str | None, decided: tuple[int, str] | None, has_memory: bool) -> str:
    """The tier of save(step): the one named, else what due(step) decided, else durable."""
    if tier is None:
        tier = decided[1] if decided and decided[0] == step else tiers.Tier.DURABLE
    if tier not in (tiers.Tier.DURABLE, tiers.Tier.MEMORY):
        raise ValueError(f"tier must be 'durable' or 'memory', got {tier!r}")
    if tier == tiers.Tier.MEMORY and not has_memory:
        raise LastgoodError("a memory save needs Checkpointer(..., memory=Interval(...))")
    return tier


class MemoryTier:
    """One Checkpointer's memory saves (counts in `stats`)."""

    def __init__(self, transport, run: str, rank: int, agent: str, replicas: int = tiers.DEFAULT_REPLICAS) -> None:
        self.transport, self.run, self.rank, self.agent = transport, run, rank, agent
        self.path = MemoryPath(agent, replicas)
        self.stats = {"memory_committed": 0, "memory_given_up": 0}

    def save(self, session, step: int, world_size: int, attempt: str, files: list[tuple[str, object]]) -> int | None:
        """The memory checkpoint of `step` (its id once COMMITTED; the session's parent then
        moves to it), or None when given up (an event says why)."""
        cid = None
        try:
            cid = self.transport.begin(self.run, step, world_size, session.parent_id, attempt, self.rank,
                                       tier=self.path.tier, replicas=self.path.replicas).checkpoint_id
            declared = self.path.write(self.run, cid, self.rank, files)
            self.transport.commit_rank(cid, self.rank, [], wait=0.0, memory_files=declared)
            self._wait(cid, step, time.monotonic() + session.commit_timeout)
        except Fenced:
            raise
        except (AgentRefused, ServiceError, MemoryGivenUp, OSError) as e:
            self._give_up(cid, step, e)
            return None
        session.parent_id = cid
        self.stats["memory_committed"] += 1
        return cid

    def _wait(self, cid: int, step: int, deadline: float) -> None:
        """Until the outcome; the own agent is asked between polls, and a partner it could not
        reach gives the save up at once, not at the commit timeout (which would hold the
        save thread, and every durable save behind it, that long)."""
        poll = AGENT_POLL_SECONDS
        while True:
            out = self.transport.outcome(cid, wait=max(0.01, min(poll, deadline - time.monotonic())))
            poll = min(2 * poll, 10.0)
            if out["status"] == Status.COMMITTED:
                return
            if out["status"] != Status.PENDING:
                raise MemoryGivenUp(f"memory checkpoint {cid} (step {step}) is {out['status']}")
            failed = self.path.replication_failed(self.run, cid, self.rank, timeout=AGENT_POLL_SECONDS)
            # committed meanwhile (a copy that made it before the failure was reported)? then it stands
            if failed and self.transport.outcome(cid, wait=0.0)["status"] != Status.COMMITTED:
                raise MemoryGivenUp(f"memory checkpoint {cid} (step {step}) cannot commit: {failed}")
            if failed:
                return
            if time.monotonic() > deadline:
                raise MemoryGivenUp(f"memory checkpoint {cid} (step {step}) not committed in time (its copies "
                                    f"were not all reported; ranks not voted: {out.get('missing_ranks')})")

    def _give_up(self, cid: int | None, step: int, e: BaseException) -> None:
        self.stats["memory_given_up"] += 1
        joblog.incident(log, logging.WARNING, "lastgood: run %s: memory save of step %s given up, training and "
                        "durable saves go on: %s", self.run, step, e)
        if cid is not None:
            try:
                self.transport.abort(cid, f"rank {self.rank}: memory save given up: {e}"[:1000], self.rank)
            except Exception:  # noqa: BLE001 - committed or expired meanwhile: the lease settles it
                pass
        try:
            self.transport.record_event(self.run, "memory_given_up",
                                        {"rank": self.rank, "step": step, "checkpoint_id": cid, "reason": str(e)[:500]})
        except ServiceError as err:
            log.warning("lastgood: could not record the given-up memory save: %s", err)
