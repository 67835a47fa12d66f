"""Writes that curate a run: tags, aliases, pins, rollbacks after a loss spike, client
events, and read leases that keep a checkpoint from GC while it is being restored."""

from __future__ import annotations

import datetime as dt
import unicodedata
from collections.abc import Callable

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from ...catalog.models import (ALIAS, COMMITTED, CORRUPT, LAST_GOOD, PIN, PINNED, ROLLBACK_TARGET, SUSPECT, SYSTEM,
                               TAG, Checkpoint, ReadLease, Run, Tag, utcnow)
from . import fencing, last_good
from ..events import add_event
from ..gate import CatalogGate
from ..errors import FailedPrecondition, InvalidArgument, NotFound, not_committed
from .lineage import descendants

RESERVED = {SUSPECT, ROLLBACK_TARGET, LAST_GOOD, PINNED}
CLIENT_EVENTS = {"spike", "restart", "note", "save_given_up", "memory_given_up",  # a memory save (trainer/memory.py)
                 "supervisor_restart", "supervisor_gave_up", "supervisor_stopped"}  # lastgood supervise
MAX_LEASE_SECONDS = 24 * 3600


def check_tag_name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 128 or name != name.strip():
        raise InvalidArgument("a tag is 1-128 characters without leading or trailing spaces")
    if any(unicodedata.category(ch)[0] == "C" for ch in name):
        raise InvalidArgument("a tag may not contain control or format characters")
    if name in RESERVED:
        raise InvalidArgument(f"{name!r} is a system tag; lastgood sets it itself")
    return name


class Curator:
    def __init__(self, sessions: sessionmaker[Session], clock: Callable[[], dt.datetime] = utcnow,
                 gate: CatalogGate | None = None, max_tags: int = 64) -> None:
        self.sessions = sessions
        self.max_tags = max_tags  # tags and aliases per checkpoint (settings.max_tags_per_checkpoint)
        self.clock = clock
        self.gate = gate or CatalogGate()  # closed: tags, pins, rollbacks and events wait for `rebuild`

    @staticmethod
    def _tagged_checkpoint(s: Session, checkpoint_id: int) -> Checkpoint:
        # FOR SHARE: GC marks a checkpoint DELETED under FOR UPDATE after reading its tags; a
        # tag added meanwhile would otherwise land on a checkpoint whose blobs are going (I4)
        ck = s.get(Checkpoint, checkpoint_id, with_for_update={"read": True})
        if ck is None:
            raise NotFound(f"checkpoint {checkpoint_id} does not exist")
        if ck.status not in (COMMITTED, CORRUPT):
            raise not_committed(checkpoint_id, ck.status, "tagged", "COMMITTED (or CORRUPT)")
        return ck

    def set_tag(self, checkpoint_id: int, name: str, alias: bool = False, generation: int | None = None) -> dict:
        """A plain tag may name many checkpoints; an alias names one per run and moves.
        `generation`: the caller's launch; a fenced one is refused (domain/runs/fencing.py)."""
        self.gate.check()
        check_tag_name(name)
        with self.sessions() as s, s.begin():
            ck = self._tagged_checkpoint(s, checkpoint_id)
            fencing.check(s, ck.run_id, generation, f"tag {name!r}")
            kind, other = (ALIAS, TAG) if alias else (TAG, ALIAS)
            if s.scalar(select(Tag.id).where(Tag.run_id == ck.run_id, Tag.name == name, Tag.kind == other).limit(1)):
                raise FailedPrecondition(f"{name!r} is already a {other} in this run; remove it first")
            moved_from = None
            if alias:
                old = s.scalar(select(Tag).where(Tag.run_id == ck.run_id, Tag.name == name, Tag.kind == ALIAS))
                if old is not None and old.checkpoint_id != ck.id:
                    moved_from = old.checkpoint_id
                    s.delete(old)
                elif old is not None:
                    return {"checkpoint_id": ck.id, "name": name, "kind": kind, "moved_from": None}
            elif s.scalar(select(Tag).where(Tag.checkpoint_id == ck.id, Tag.name == name, Tag.kind == TAG)):
                return {"checkpoint_id": ck.id, "name": name, "kind": kind, "moved_from": None}
            held = s.scalar(select(func.count()).select_from(Tag).where(Tag.checkpoint_id == ck.id,
                                                                        Tag.kind.in_((TAG, ALIAS))))
            if held >= self.max_tags:
                raise FailedPrecondition(f"checkpoint {ck.id} carries {held} tags and aliases, the most one may "
                                         f"(LASTGOOD_MAX_TAGS_PER_CHECKPOINT); remove one first")
            s.add(Tag(run_id=ck.run_id, checkpoint_id=ck.id, name=name, kind=kind, created_at=self.clock()))
            add_event(s, "tag", ck.run_id, ck.id, name=name, kind=kind, moved_from=moved_from)
            return {"checkpoint_id": ck.id, "name": name, "kind": kind, "moved_from": moved_from}

    def remove_tag(self, checkpoint_id: int, name: str, generation: int | None = None) -> dict:
        self.gate.check()
        with self.sessions() as s, s.begin():
            ck = s.get(Checkpoint, checkpoint_id)
            if ck is None:
                raise NotFound(f"checkpoint {checkpoint_id} does not exist")
            fencing.check(s, ck.run_id, generation, f"untag {name!r}")
            if name in RESERVED:
                raise InvalidArgument(f"{name!r} is a system tag; lastgood removes it itself")
            n = s.execute(delete(Tag).where(Tag.checkpoint_id == ck.id, Tag.name == name,
                                            Tag.kind.in_((TAG, ALIAS)))).rowcount
            if n == 0:
                raise NotFound(f"checkpoint {checkpoint_id} has no tag {name!r}")
            add_event(s, "untag", ck.run_id, ck.id, name=name)
            return {"checkpoint_id": ck.id, "removed": name}

    def pin(self, checkpoint_id: int, pinned: bool, generation: int | None = None) -> dict:
        self.gate.check()
        with self.sessions() as s, s.begin():
            ck = self._tagged_checkpoint(s, checkpoint_id) if pinned else s.get(Checkpoint, checkpoint_id)
            if ck is None:
                raise NotFound(f"checkpoint {checkpoint_id} does not exist")
            fencing.check(s, ck.run_id, generation, "pin" if pinned else "unpin")
            have = s.scalar(select(Tag).where(Tag.checkpoint_id == ck.id, Tag.kind == PIN))
            if pinned and have is None:
                s.add(Tag(run_id=ck.run_id, checkpoint_id=ck.id, name=PINNED, kind=PIN, created_at=self.clock()))
                add_event(s, "pin", ck.run_id, ck.id)
            elif not pinned and have is not None:
                s.delete(have)
                add_event(s, "unpin", ck.run_id, ck.id)
            return {"checkpoint_id": ck.id, "pinned": pinned}

    def rollback(self, run_name: str, target_id: int, spike_step: int, data: dict,
                 generation: int | None = None) -> dict:
        """After a loss spike: every committed checkpoint after the target on its lineage
        becomes `suspect` (never last-good again), the target becomes `rollback-target`,
        last-good moves back to it if it was suspect, and the spike and rollback are events."""
        self.gate.check()
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name).with_for_update())
            if run is None:
                raise NotFound(f"run {run_name!r} does not exist")
            fencing.check(s, run.id, generation, "rollback")
            target = s.get(Checkpoint, target_id)
            if target is None or target.run_id != run.id:
                raise NotFound(f"checkpoint {target_id} is not in run {run_name!r}")
            if target.status != COMMITTED:
                raise FailedPrecondition(f"cannot roll back to checkpoint {target_id}: it is {target.status}")
            if s.scalar(select(Tag).where(Tag.checkpoint_id == target.id, Tag.name == SUSPECT)):
                raise FailedPrecondition(f"cannot roll back to checkpoint {target_id}: it is suspect")
            after = descendants(s, target.id, run.id)
            suspects = sorted(s.scalars(select(Checkpoint.id).where(
                Checkpoint.id.in_(after), Checkpoint.status.in_((COMMITTED, CORRUPT)))))
            now = self.clock()
            already = set(s.scalars(select(Tag.checkpoint_id).where(Tag.run_id == run.id, Tag.name == SUSPECT)))
            for cid in suspects:
                if cid not in already:
                    s.add(Tag(run_id=run.id, checkpoint_id=cid, name=SUSPECT, kind=SYSTEM, created_at=now))
            s.execute(delete(Tag).where(Tag.run_id == run.id, Tag.name == ROLLBACK_TARGET))
            s.add(Tag(run_id=run.id, checkpoint_id=target.id, name=ROLLBACK_TARGET, kind=SYSTEM, created_at=now))
            previous = run.last_good_id
            last_good.roll_back_to(run, target, suspects)
            add_event(s, "spike", run.id, None, step=spike_step, **{k: v for k, v in data.items() if k != "skipped"})
            add_event(s, "rollback", run.id, target.id, target_step=target.step, spike_step=spike_step,
                      suspect=suspects, last_good_before=previous, last_good=run.last_good_id,
                      skipped=data.get("skipped"), lr_factor=data.get("lr_factor"))
            return {"target_id": target.id, "target_step": target.step, "suspect": suspects,
                    "last_good_id": run.last_good_id}

    def record_event(self, run_name: str, kind: str, checkpoint_id: int | None, data: dict) -> dict:
        self.gate.check()
        if kind not in CLIENT_EVENTS:
            raise InvalidArgument(f"event kind must be one of {sorted(CLIENT_EVENTS)}, got {kind!r}")
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name))
            if run is None:
                raise NotFound(f"run {run_name!r} does not exist")
            if checkpoint_id is not None:
                ck = s.get(Checkpoint, checkpoint_id)
                if ck is None or ck.run_id != run.id:
                    raise NotFound(f"checkpoint {checkpoint_id} is not in run {run_name!r}")
            add_event(s, kind, run.id, checkpoint_id, **data)
        return {"recorded": kind}

    # ---------------------------------------------------------------- read leases
    def acquire_lease(self, checkpoint_id: int, holder: str, seconds: float) -> dict:
        if not 1 <= seconds <= MAX_LEASE_SECONDS:
            raise InvalidArgument(f"lease seconds must be 1..{MAX_LEASE_SECONDS}")
        with self.sessions() as s, s.begin():
            # row lock: GC re-checks leases under the same lock before it deletes
            ck = s.scalar(select(Checkpoint).where(Checkpoint.id == checkpoint_id).with_for_update())
            if ck is None:
                raise NotFound(f"checkpoint {checkpoint_id} does not exist")
            if ck.status != COMMITTED:
                raise not_committed(checkpoint_id, ck.status, "read")
            lease = ReadLease(checkpoint_id=ck.id, holder=holder[:128],
                              expires_at=self.clock() + dt.timedelta(seconds=seconds))
            s.add(lease)
            s.flush()
            return {"lease_id": lease.id, "checkpoint_id": ck.id, "expires_at": lease.expires_at.isoformat()}

    def release_lease(self, lease_id: int) -> dict:
        with self.sessions() as s, s.begin():
            n = s.execute(delete(ReadLease).where(ReadLease.id == lease_id)).rowcount
        if n == 0:
            raise NotFound(f"lease {lease_id} does not exist")
        return {"released": lease_id}
