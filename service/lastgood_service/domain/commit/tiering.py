"""The memory tier's share of the commit (docs/memory-tier.md, "In the catalog").

A memory checkpoint commits by the same vote as a durable one; what differs is how a file
comes to be VERIFIED. Its rank's vote declares each file (name, size, xxh3-128) and no
bytes reach the service: the file is recorded DECLARED with no blob, exactly as a peer-
checked file waits (domain/peer/verification_modes.py), and the commit (protocol.commit_plan)
waits for it as it waits for those. It becomes VERIFIED when `tiers.holders_needed(replicas)`
agents on distinct hosts have reported (domain/memory/copies.py) the declared size and
digest from their own hash of the bytes they hold; a report of anything else aborts the
checkpoint. Reports may come before or after the vote: `settle` is run by both, under the
checkpoint's row lock, so whichever comes last verifies the file and tries the commit.

Only agents not retired count (a registration again of the same host and address retires
the old one: domain/memory/agents.py), and an agent counts for its host once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import select

from lastgood.wire import names, tiers

from ...catalog.models import ABANDONED, DECLARED, DURABLE, MEMORY, PENDING, VERIFIED, Agent, Copy, Shard
from ..errors import Conflict, FailedPrecondition, InvalidArgument
from ..events import add_event

log = logging.getLogger("lastgood.commit")

NO_BLOB = ""  # a memory file's shards.blob_key: its bytes are in agents' memory, not in the store
MAX_MEMORY_FILES = 1000  # files one memory vote or one copy report names at most
_HEX32 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class MemoryFile:
    name: str
    size: int
    xxh3_128: str


@dataclass(frozen=True)
class Mismatch:
    rank: int
    file: str
    declared: str
    agent_id: int
    host: str
    reported: str


def tier_of(tier: str, replicas: int) -> tuple[str, int]:
    """A begin's tier and replicas as the catalog stores them: ("durable", 0), or
    ("memory", n) with n partner copies (0: tiers.DEFAULT_REPLICAS)."""
    if tier in ("", DURABLE):
        if replicas:
            raise InvalidArgument(f"replicas is for memory checkpoints only, got {replicas} for a durable one")
        return DURABLE, 0
    if tier != MEMORY:
        raise InvalidArgument(f"tier must be {DURABLE!r} or {MEMORY!r} (or empty: durable), got {tier[:40]!r}")
    replicas = replicas or tiers.DEFAULT_REPLICAS
    if not 1 <= replicas <= tiers.MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be 1..{tiers.MAX_REPLICAS} for a memory checkpoint, got {replicas}")
    return MEMORY, replicas


def check_files(files: list[MemoryFile]) -> None:
    """A memory vote's or a copy report's files: bounded, named by the wire's rule, each once."""
    if len(files) > MAX_MEMORY_FILES:
        raise InvalidArgument(f"at most {MAX_MEMORY_FILES} memory files at once, got {len(files)}")
    seen = set()
    for f in files:
        try:
            names.check_file_name(f.name)
        except names.InvalidName as e:
            raise InvalidArgument(str(e)) from None
        if not 0 <= f.size <= names.MAX_ID:
            raise InvalidArgument(f"{f.name}: size must be 0..{names.MAX_ID}, got {f.size}")
        if len(f.xxh3_128) != 32 or not set(f.xxh3_128) <= _HEX32:
            raise InvalidArgument(f"{f.name}: xxh3_128 must be 32 lowercase hex digits")
        if f.name in seen:
            raise InvalidArgument(f"{f.name} is named twice")
        seen.add(f.name)


def declare(s, core, ck, rank: int, files: list[MemoryFile], now) -> list[Mismatch]:
    """Record a memory vote's files DECLARED (no blob), in the caller's transaction under the
    checkpoint's row lock; then `settle` them against the copies already reported. A file
    declared again with the same size and digest is left as it is (a vote sent again)."""
    if ck.tier != MEMORY:
        raise InvalidArgument(f"checkpoint {ck.id} is {ck.tier}: only a memory checkpoint's vote declares its "
                              f"files (a durable one's are put first)")
    core.require_pending(ck, "declare memory files")
    have = {sh.file_name: sh for sh in s.scalars(select(Shard).where(Shard.checkpoint_id == ck.id,
                                                                       Shard.rank == rank))}
    for f in files:
        sh = have.get(f.name)
        if sh is None:
            s.add(Shard(checkpoint_id=ck.id, rank=rank, file_name=f.name, size=f.size, xxh3_128=f.xxh3_128,
                        blob_key=NO_BLOB, status=DECLARED, index_json=None, created_at=now))
        elif (sh.size, sh.xxh3_128) != (f.size, f.xxh3_128):
            raise Conflict(f"rank {rank} declared {f.name} of checkpoint {ck.id} with another size or digest")
    s.flush()
    return settle(s, ck, rank)


def settle(s, ck, rank: int | None = None) -> list[Mismatch]:
    """Mark VERIFIED every DECLARED file of the checkpoint (of `rank`, if given) that enough
    distinct hosts have reported as declared; the mismatches among the reports, if any (the
    caller aborts the checkpoint: `abandon`)."""
    where = [Shard.checkpoint_id == ck.id, Shard.status == DECLARED]
    if rank is not None:
        where.append(Shard.rank == rank)
    declared = {(sh.rank, sh.file_name): sh for sh in s.scalars(select(Shard).where(*where))}
    if not declared:
        return []
    q = (select(Copy.rank, Copy.file_name, Copy.size, Copy.xxh3_128, Agent.id, Agent.host)
         .join(Agent, Agent.id == Copy.agent_id)
         .where(Copy.checkpoint_id == ck.id, Agent.retired_at.is_(None)))
    if rank is not None:
        q = q.where(Copy.rank == rank)
    hosts: dict[tuple[int, str], set[str]] = {}
    bad = []
    for r, name, size, digest, agent_id, host in s.execute(q):
        sh = declared.get((r, name))
        if sh is None:
            continue
        if (size, digest) != (sh.size, sh.xxh3_128):
            bad.append(Mismatch(r, name, sh.xxh3_128, agent_id, host, f"{digest} ({size} bytes)"))
        else:
            hosts.setdefault((r, name), set()).add(host)
    if bad:
        return bad
    need = tiers.holders_needed(ck.replicas)
    for key, sh in declared.items():
        if len(hosts.get(key, ())) >= need:
            sh.status = VERIFIED
    return []


def abandon(s, core, ck, bad: list[Mismatch]) -> str:
    """Abort a memory checkpoint an agent reported other bytes of, in the caller's transaction
    under the row lock (no report after it can verify the file): a hash_mismatch event per
    mismatch, naming the agent, and the abort. The caller tells the waiters after its
    transaction (core.ended_by_contest). Returns the reason."""
    for b in bad:
        add_event(s, "hash_mismatch", ck.run_id, ck.id, rank=b.rank, file=b.file, declared=b.declared,
                  received=b.reported, agent_id=b.agent_id, host=b.host)
        core.metrics.hash_mismatches.inc()
    b = bad[0]
    reason = (f"memory copy: agent {b.agent_id} on {b.host} holds rank {b.rank}'s {b.file} with xxh3-128 "
              f"{b.reported}, its rank declared {b.declared}; the checkpoint is not committed")
    if ck.status == PENDING:
        ck.status, ck.lease_expires_at = ABANDONED, core.clock()
        add_event(s, "abort", ck.run_id, ck.id, reason=reason[:1000], rank=b.rank)
    log.warning("checkpoint %s: %s", ck.id, reason, extra={"checkpoint_id": ck.id, "rank": b.rank})
    return reason


def refuse_blob(ck, what: str) -> None:
    """A memory checkpoint has no bytes in the store or the service: FailedPrecondition."""
    if ck.tier == MEMORY:
        raise FailedPrecondition(f"checkpoint {ck.id} is a memory checkpoint: read it from its agents "
                                 f"(GET /api/v1/checkpoints/{ck.id}/copies), not {what}")
