"""Agents' copies of memory checkpoints: the reports that verify them, the copies a restore
reads, and the segments an agent keeps.

`report`: an agent hashed the bytes it holds of some files of one rank of a memory
checkpoint (its own node's, or a partner's it received) and says so. Each report is
recorded (one row per agent and file; a report again replaces its row), then the
checkpoint's DECLARED files of that rank are settled by the commit's rule
(commit/tiering.py): enough distinct hosts with the declared size and digest make a file
VERIFIED, and the last file verified (every rank voted) commits the checkpoint, as the last
peer report does (domain/peer/verification_modes.py); a report of other bytes aborts it. A
report before the rank's vote is kept and counted when the vote declares the files.
A wrong key is refused (403), recorded (copy_report_refused), and changes nothing else.
"""

from __future__ import annotations

import logging

from sqlalchemy import and_, or_, select

from ...catalog.models import COMMITTED, DURABLE, MEMORY, PENDING, Agent, Checkpoint, Copy, Run, Shard
from ..commit import tiering
from ..errors import Conflict, FailedPrecondition, PermissionDenied
from ..events import add_event
from . import agents

log = logging.getLogger("lastgood")

MAX_LIVE = 10_000  # memory checkpoints one live answer names at most


class Copies:
    def __init__(self, commits) -> None:
        self.commits = commits

    # ------------------------------------------------------------------ reports
    def report(self, checkpoint_id: int, agent_id: int, key: str | None, rank: int,
               files: list[tiering.MemoryFile]) -> dict:
        try:
            return self._report(checkpoint_id, agent_id, key, rank, files)
        except PermissionDenied as denied:  # recorded in a transaction of its own: nothing else changed
            c = self.commits
            with c.sessions() as s, s.begin():
                ck = c.get_checkpoint(s, checkpoint_id)
                add_event(s, "copy_report_refused", ck.run_id, ck.id, agent_id=agent_id, rank=rank,
                          reason=str(denied)[:300])
            log.warning("checkpoint %s: %s", checkpoint_id, denied)
            raise

    def _report(self, checkpoint_id, agent_id, key, rank, files) -> dict:
        c = self.commits
        c.gate.check()
        tiering.check_files(files)
        with c.sessions() as s, s.begin():
            ck = c.get_checkpoint(s, checkpoint_id, lock=True)  # serialises with votes and commits
            if ck.tier == DURABLE:
                raise Conflict(f"checkpoint {ck.id} is durable: its files are in the store, agents report "
                               f"copies of memory checkpoints only")
            c.check_rank(ck, rank)
            now = c.clock()
            agent = agents.authenticate(s, agent_id, key, now, c.settings.agent_ttl_seconds)
            if ck.status not in (PENDING, COMMITTED):  # decided otherwise: nothing to record
                return {"status": ck.status}
            mine = {cp.file_name: cp for cp in s.scalars(select(Copy).where(
                Copy.checkpoint_id == ck.id, Copy.rank == rank, Copy.agent_id == agent.id))}
            for f in files:
                row = mine.get(f.name)
                if row is None:
                    s.add(Copy(checkpoint_id=ck.id, rank=rank, file_name=f.name, agent_id=agent.id, size=f.size,
                               xxh3_128=f.xxh3_128, reported_at=now))
                else:
                    row.size, row.xxh3_128, row.reported_at = f.size, f.xxh3_128, now
            s.flush()
            if ck.status != PENDING:  # a late copy of a committed checkpoint: one more place to read it
                return {"status": ck.status}
            ck.lease_expires_at = c.lease_from_now()  # copies are progressing: the checkpoint is alive
            bad = tiering.settle(s, ck, rank)
            if bad:
                tiering.abandon(s, c, ck, bad)
            plan = None if bad else self._plan(s, ck)
        if bad:
            c.ended_by_contest(checkpoint_id)
            return {"status": "ABANDONED"}
        if plan is not None and c.try_commit(checkpoint_id, plan=plan):
            return {"status": COMMITTED}
        with c.sessions() as s, s.begin():
            return {"status": c.get_checkpoint(s, checkpoint_id).status}

    def _plan(self, s, ck):
        """The commit's plan when this report verified the last file and every rank voted
        (read under the row lock this report holds, as the last peer report does)."""
        try:
            return self.commits.commit_plan(s, ck)
        except FailedPrecondition:  # votes and files disagree: the commit says so when tried
            return None

    # ------------------------------------------------------------------ reads
    def copies(self, checkpoint_id: int) -> dict:
        """Where each file of a memory checkpoint is held: the agents (not retired) whose
        reported size and digest are the declared ones, by file."""
        c = self.commits
        with c.sessions() as s, s.begin():
            ck = c.get_checkpoint(s, checkpoint_id)
            if ck.tier != MEMORY:
                raise Conflict(f"checkpoint {ck.id} is durable: its files are in the store (GET "
                               f"/api/v1/checkpoints/{ck.id}/manifest)")
            shards = s.execute(select(Shard.rank, Shard.file_name, Shard.size, Shard.xxh3_128)
                               .where(Shard.checkpoint_id == ck.id).order_by(Shard.rank, Shard.file_name)).all()
            held: dict[tuple[int, str], list[dict]] = {}
            for r, name, size, digest, a_id, host, address in s.execute(
                    select(Copy.rank, Copy.file_name, Copy.size, Copy.xxh3_128, Agent.id, Agent.host, Agent.address)
                    .join(Agent, Agent.id == Copy.agent_id)
                    .where(Copy.checkpoint_id == ck.id, Agent.retired_at.is_(None)).order_by(Agent.id)):
                held.setdefault((r, name, size, digest), []).append(
                    {"agent_id": a_id, "host": host, "address": address})
            return {"checkpoint_id": ck.id, "status": ck.status, "tier": ck.tier, "replicas": ck.replicas,
                    "copies": [{"rank": r, "file": name, "agents": held.get((r, name, size, digest), [])}
                               for r, name, size, digest in shards]}

    def live(self, agent_id: int, key: str | None) -> dict:
        """The memory checkpoints this agent keeps segments of: those PENDING (it may still
        receive or report a copy) and those COMMITTED it reported a copy of; it frees the rest."""
        c = self.commits
        with c.sessions() as s, s.begin():
            agent = agents.authenticate(s, agent_id, key, c.clock(), c.settings.agent_ttl_seconds)
            held = select(Copy.checkpoint_id).where(Copy.agent_id == agent.id)
            rows = s.execute(select(Checkpoint.id, Checkpoint.run_id).where(
                Checkpoint.tier == MEMORY,
                or_(Checkpoint.status == PENDING, and_(Checkpoint.status == COMMITTED, Checkpoint.id.in_(held))))
                .order_by(Checkpoint.id.desc()).limit(MAX_LIVE)).all()
            runs = {i: n for i, n in s.execute(select(Run.id, Run.name).where(Run.id.in_(sorted({r for _i, r in rows}))))}
            return {"live": [{"run": runs[r], "checkpoint_id": i} for i, r in sorted(rows)]}
