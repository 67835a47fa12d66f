"""SQLAlchemy 2.0 models of the catalog. The Alembic migrations must agree with these."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (BigInteger, DateTime, Float, ForeignKey, Index, Integer, MetaData, String, Text,
                        TypeDecorator, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from lastgood.wire.names import LAST_GOOD_TAG
from lastgood.wire.tiers import LAST_GOOD_DURABLE_TAG, Tier
from lastgood.wire.vocab import ShardStatus, Status

# the wire's words as plain strings, the form the catalog stores and SQL compares
PENDING, COMMITTED, ABANDONED, CORRUPT, DELETED = (Status[n].value for n in
                                                  ("PENDING", "COMMITTED", "ABANDONED", "CORRUPT", "DELETED"))
STATUSES = tuple(s.value for s in Status)
VERIFIED = ShardStatus.VERIFIED.value
# a shard handed over unhashed, until a peer checks it (domain/peer/verification_modes.py)
DECLARED = ShardStatus.DECLARED.value

# tag kinds: a plain tag may name many checkpoints of a run; an alias names at most one and
# moves when set again; a pin keeps a checkpoint from GC; system tags are set by lastgood
# itself (suspect, rollback-target). "last-good" is shown as a system tag but derived from
# runs.last_good_id, so there is one source of truth.
TAG, ALIAS, PIN, SYSTEM = "tag", "alias", "pin", "system"
SUSPECT, ROLLBACK_TARGET, LAST_GOOD, PINNED = "suspect", "rollback-target", LAST_GOOD_TAG, "pinned"
LAST_GOOD_DURABLE = LAST_GOOD_DURABLE_TAG  # a stored system tag, moved by every durable commit
DURABLE, MEMORY = Tier.DURABLE.value, Tier.MEMORY.value


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to the catalog")
        return value.astimezone(dt.timezone.utc) if value is not None else None

    def process_result_value(self, value, dialect):
        return None if value is None else as_utc(value)


def as_utc(value: dt.datetime) -> dt.datetime:
    """The catalog's rule for a time read back: a naive one (SQLite keeps no zone) is UTC."""
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value


# a UTCDateTime column read without the decorator (type_coerce(column, RAW_UTC)): a hot read
# of thousands of values (a lineage page) skips SQLAlchemy's call a value; iso_utc then gives
# what the decorated value's isoformat() is, by the same rule
RAW_UTC = DateTime(timezone=True)


def iso_utc(value: dt.datetime) -> str:
    return as_utc(value).isoformat()


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    })


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    last_good_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True), nullable=True)
    # the newest launch's generation (domain/runs/fencing.py); 0 until a launch registers
    generation: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # the run's own retention (domain/runs/retention.py syntax); None: the service's default
    retention: Mapped[str | None] = mapped_column(String(512), nullable=True)
    # GC's bookkeeping (domain/gc/): the newest event of the run its last pass saw, the
    # policy it applied, and when time alone (a grace period, a read lease) may make
    # something deletable. A pass plans a run again only if one of the three says so.
    gc_event_id: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    gc_policy: Mapped[str | None] = mapped_column(String(512), nullable=True)
    gc_due_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step", "attempt", name="uq_checkpoints_run_step_attempt"),
        Index("ix_checkpoints_run_status_step", "run_id", "status", "step"),
        Index("ix_checkpoints_status_lease", "status", "lease_expires_at"),
        # the runs list and overview count and sum by status without reading the table
        Index("ix_checkpoints_run_status_bytes", "run_id", "status", "bytes"),
        # a run's checkpoints in creation order: the lineage and its pages, GC's view of a run
        Index("ix_checkpoints_run_id", "run_id", "id"),
        # stored branches (domain/runs/branches.py): a parent's children, a run's highest branch
        Index("ix_checkpoints_run_parent", "run_id", "parent_id"),
        Index("ix_checkpoints_run_branch", "run_id", "branch"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[str] = mapped_column(String(64))
    world_size: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    committed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    manifest_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    manifest_hash: Mapped[str | None] = mapped_column(String(32), nullable=True)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # the generation of the launch that began it; 0: a client that did not register (never fenced)
    generation: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # its branch in the run's lineage, stored by domain/runs/branches.py (the rule: lineage.assign_branches)
    branch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # docs/memory-tier.md: `memory` files live in node agents' shared memory, not in the store
    tier: Mapped[str] = mapped_column(String(16), default=DURABLE, server_default=DURABLE)
    # memory only: the partner copies each file needs besides its own node's (lastgood.wire.tiers)
    replicas: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Launch(Base):
    """One launch of a job, registered once per (run, attempt): its generation is the run's
    counter at that moment, so generations of a run are monotone (domain/runs/fencing.py)."""

    __tablename__ = "launches"
    __table_args__ = (
        UniqueConstraint("run_id", "attempt", name="uq_launches_run_attempt"),
        UniqueConstraint("run_id", "generation", name="uq_launches_run_generation"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    attempt: Mapped[str] = mapped_column(String(64))
    generation: Mapped[int] = mapped_column(BigInteger)
    world_size: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "rank", "file_name", name="uq_shards_ckpt_rank_file"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    rank: Mapped[int] = mapped_column(Integer)
    file_name: Mapped[str] = mapped_column(String(200))
    size: Mapped[int] = mapped_column(BigInteger)
    xxh3_128: Mapped[str] = mapped_column(String(32))
    blob_key: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    index_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # safetensors tensor index
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class Vote(Base):
    """A rank's commit vote: the exact list of files it uploaded."""

    __tablename__ = "votes"
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    files_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    # the commitment of the rank's peer-check secret (lastgood/wire/peerkey.py); None: none sent
    peer_key: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Agent(Base):
    """A node agent of the memory tier (domain/memory/agents.py). Only the SHA-256 of its key
    is stored (lastgood.wire.tiers.key_digest). A registration again of the same host and
    address retires the older row: its reports stop counting, its key stops opening."""

    __tablename__ = "agents"
    __table_args__ = (Index("ix_agents_host_address", "host", "address"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(64))
    rack: Mapped[str] = mapped_column(String(64), default="", server_default="")
    switch: Mapped[str] = mapped_column(String(64), default="", server_default="")
    address: Mapped[str] = mapped_column(String(255))
    key_digest: Mapped[str] = mapped_column(String(64))
    registered_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    retired_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # its last registration, copy report or live list: the placement list leaves out an
    # agent not seen for the settings' agent_ttl_seconds (a dead node is no partner)
    seen_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Copy(Base):
    """An agent's report that it holds one file of a memory checkpoint, with the size and
    xxh3-128 of its own hash of the bytes it holds (domain/memory/copies.py)."""

    __tablename__ = "copies"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "rank", "file_name", "agent_id", name="uq_copies_ckpt_rank_file_agent"),
        Index("ix_copies_agent", "agent_id", "checkpoint_id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    rank: Mapped[int] = mapped_column(Integer)
    file_name: Mapped[str] = mapped_column(String(200))
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id"))
    size: Mapped[int] = mapped_column(BigInteger)
    xxh3_128: Mapped[str] = mapped_column(String(32))
    reported_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class Tag(Base):
    __tablename__ = "tags"
    __table_args__ = (Index("ix_tags_run_name", "run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    name: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # tag, alias, pin, system
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class ReadLease(Base):
    """A restore or download in progress: GC keeps the checkpoint's blobs until it expires."""

    __tablename__ = "read_leases"
    __table_args__ = (Index("ix_read_leases_ckpt_expires", "checkpoint_id", "expires_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class Token(Base):
    """An API token. Only the SHA-256 of its secret is stored; the secret is shown once."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))  # reader, writer, admin
    run_prefix: Mapped[str | None] = mapped_column(String(128), nullable=True)  # scope: runs starting with it
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_run_at", "run_id", "at"),
        # a run's newest event (the overview, GC's "anything new?") and its events by kind
        Index("ix_events_run_id", "run_id", "id"),
        Index("ix_events_run_kind_at", "run_id", "kind", "at"),
        # the events of a checkpoint (pruned when GC deleted it long enough ago)
        Index("ix_events_checkpoint", "checkpoint_id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), nullable=True)
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    data_json: Mapped[str] = mapped_column(Text, default="{}")


class Heartbeat(Base):
    """The latest beat of one rank of a run: one row per (run, rank), updated in place, so a
    job of N ranks costs N rows however long it runs (domain/health/heartbeats.py). Times are the
    service's clock, never the client's. The smoothed step times, the progress time and
    the outlier start are what the verdicts need from the past beats."""

    __tablename__ = "heartbeats"
    __table_args__ = (Index("ix_heartbeats_beat_at", "beat_at"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    world_size: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    attempt: Mapped[str | None] = mapped_column(String(64), nullable=True)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    step_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)     # as the rank last said
    typical_step_s: Mapped[float | None] = mapped_column(Float, nullable=True)   # smoothed over beats
    slowest_step_s: Mapped[float | None] = mapped_column(Float, nullable=True)   # a slowly decaying maximum
    save_stall_s: Mapped[float | None] = mapped_column(Float, nullable=True)     # smoothed over saves
    period_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    phase: Mapped[str] = mapped_column(String(16))
    beats: Mapped[int] = mapped_column(BigInteger, default=0)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())   # first beat of this generation
    beat_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    progress_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())  # the step or the phase last changed
    outlier_since: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    verdict: Mapped[str] = mapped_column(String(16), default="ok")   # as last recorded (events on change)


class RunStats(Base):
    """A run's counters, O(1) rows a run for the runs list and the overview: its
    checkpoints by status, the bytes of those not DELETED, the newest step begun. Kept by
    triggers on `checkpoints` (migration 0007) in the transaction of each change, so no
    domain code writes them and none can forget to; read-only here."""

    __tablename__ = "run_stats"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    pending: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    committed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    abandoned: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    corrupt: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    deleted: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    bytes_stored: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    newest_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # every change that may alter what a retention policy keeps (domain/gc/ reads it)
    changes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    def by_status(self) -> dict[str, int]:
        return {PENDING: self.pending, COMMITTED: self.committed, ABANDONED: self.abandoned, CORRUPT: self.corrupt,
                DELETED: self.deleted}
