"""The store is the source of truth: check the catalog against it (`fsck`) and rebuild the
catalog's lost commits from it (`rebuild`). restic's `check` / `rebuild-index` are the model.

Every committed checkpoint's manifest is a blob (domain/keys.py names it), written before
the commit transaction and holding run, step, attempt, world size, parent and every file
with size and xxh3-128. A catalog that lost acknowledged commits (a destroyed SQLite WAL,
an old backup restored) is *behind* the store: it lacks a checkpoint whose manifest is
there. The service detects that at start-up and refuses writes and last-good look-ups
(UNAVAILABLE, naming the command to run) until `rebuild` has put the lost commits back:
serving on would silently hand trainers an older step and reissue the lost ids.

What a rebuild cannot bring back, because no manifest holds it: tags, aliases, pins,
suspect marks, events, read leases, and the lost checkpoints' times (they get the time of
the rebuild, in id order, so the commit rule makes the newest rebuilt commit last-good).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import Manifest

from ..blobstore import BlobStore
from ..catalog.models import (ABANDONED, COMMITTED, CORRUPT, DELETED, PENDING, VERIFIED, Checkpoint, Run, Shard, Vote,
                              utcnow)
from . import keys
from .runs import branches, last_good
from .commit import indexes
from .runs.fencing import GENERATION_GAP
from .events import add_event

log = logging.getLogger("lastgood.repair")


@dataclass
class Finding:
    kind: str  # lost_commit, missing_manifest, manifest_mismatch, missing_blob, orphan, unknown, id_conflict
               # (docs/storage.md says what each means and what to do)
    detail: str
    checkpoint_id: int | None = None
    key: str | None = None


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    checkpoints: int = 0
    blobs: int = 0

    def add(self, kind: str, detail: str, checkpoint_id: int | None = None, key: str | None = None) -> None:
        self.findings.append(Finding(kind, detail, checkpoint_id, key))

    def of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def ok(self) -> bool:
        return not [f for f in self.findings if f.kind != "orphan"]

    def to_dict(self) -> dict:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        return {"ok": self.ok, "checkpoints": self.checkpoints, "blobs": self.blobs, "counts": counts,
                "findings": [asdict(f) for f in self.findings]}


class Repair:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore,
                 clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.clock = clock

    # ---------------------------------------------------------------- looking
    def _rows(self, s: Session) -> dict[int, tuple[Checkpoint, str]]:
        return {ck.id: (ck, name) for ck, name in s.execute(
            select(Checkpoint, Run.name).join(Run, Run.id == Checkpoint.run_id))}

    def lost_manifests(self) -> list[keys.ParsedKey]:
        """Manifests in the store of checkpoints the catalog does not hold as committed (or
        as corrupt or deleted since): rows it lost, or whose commit it lost. Start-up runs
        this after recovery, which rolls forward what it can by itself."""
        found = [p for info in self.blobs.list(keys.ROOT) if (p := keys.parse(info.key)) and p.is_manifest]
        with self.sessions() as s, s.begin():
            rows = self._rows(s)
            return [p for p in found if not self._known(p, rows)]

    def _known(self, p: keys.ParsedKey, rows) -> bool:
        """Known: the catalog decided this checkpoint's fate. A PENDING row with a live lease
        is a commit in flight on another replica (its manifest is written just before its
        commit transaction); an ABANDONED one lost the race for its commit (a newer launch
        fenced it, a rank aborted it, its lease ran out): its manifest was never visible, GC
        takes it, and rebuild must not bring it back. A PENDING row whose lease ran out, or
        no row at all, is a commit the catalog lost."""
        row = rows.get(p.checkpoint_id)
        if row is None:
            return False
        ck, run = row
        in_flight = ck.status == PENDING and ck.lease_expires_at > self.clock()
        return keys.belongs_to(p, ck.id, run, ck.step, ck.attempt) and (
            in_flight or ck.status in (COMMITTED, CORRUPT, DELETED, ABANDONED))

    def fsck(self, rehash: bool = False) -> Report:
        """Compare catalog and store; read nothing but manifests (and every shard with rehash)."""
        report = Report()
        stored = {info.key: info.size for info in self.blobs.list(keys.ROOT)}
        report.blobs = len(stored)
        accounted: set[str] = set()
        with self.sessions() as s, s.begin():
            rows = self._rows(s)
            shards_of: dict[int, list[Shard]] = {}
            for sh in s.scalars(select(Shard)):
                shards_of.setdefault(sh.checkpoint_id, []).append(sh)
        report.checkpoints = len(rows)
        for cid, (ck, _run) in sorted(rows.items()):
            pfx = ck.manifest_key[:-len(keys.MANIFEST)] if ck.manifest_key else None
            index_keys = {(sh.rank, sh.file_name): key for sh in shards_of.get(cid, []) if pfx and (key := indexes.key_of(pfx, sh))}
            mine = [sh.blob_key for sh in shards_of.get(cid, [])] + ([ck.manifest_key] if ck.manifest_key else []) \
                + list(index_keys.values())
            accounted.update(mine)
            if ck.status == DELETED:
                for key in mine:
                    if key in stored:
                        report.add("orphan", f"checkpoint {cid} is DELETED; its blob remains", cid, key)
                continue
            if ck.status != COMMITTED:
                continue
            if ck.manifest_key not in stored:
                report.add("missing_manifest", f"checkpoint {cid}: manifest {ck.manifest_key} is missing", cid,
                           ck.manifest_key)
            elif hash_bytes(self.blobs.read_all(ck.manifest_key)) != ck.manifest_hash:
                report.add("manifest_mismatch", f"checkpoint {cid}: manifest does not hash as recorded", cid,
                           ck.manifest_key)
            for sh in shards_of.get(cid, []):
                size = stored.get(sh.blob_key)
                if size != sh.size:
                    what = "is missing" if size is None else f"holds {size} bytes, not {sh.size}"
                    report.add("missing_blob", f"checkpoint {cid} rank {sh.rank} {sh.file_name}: blob {what}",
                               cid, sh.blob_key)
                elif rehash and hash_bytes(self.blobs.read_all(sh.blob_key)) != sh.xxh3_128:
                    report.add("missing_blob", f"checkpoint {cid} rank {sh.rank} {sh.file_name}: bytes differ",
                               cid, sh.blob_key)
                if (key := index_keys.get((sh.rank, sh.file_name))) and stored.get(key) != indexes.ref_of(sh)["size"]:
                    report.add("missing_blob", f"checkpoint {cid} rank {sh.rank} {sh.file_name}: its tensor index "
                               f"is missing or truncated", cid, key)
        for p in self.lost_manifests():
            manifest_key = keys.manifest_key(p.prefix)
            row = rows.get(p.checkpoint_id)
            mine = row is not None and keys.belongs_to(p, row[0].id, row[1], row[0].step, row[0].attempt)
            kind = "id_conflict" if row is not None and not mine else "lost_commit"
            report.add(kind, f"checkpoint {p.checkpoint_id}: manifest in the store, not in the catalog"
                       + (" (its id now names another checkpoint)" if kind == "id_conflict" else ""),
                       p.checkpoint_id, manifest_key)
            accounted.update(k for k in stored if k.startswith(p.prefix))
        for key in sorted(set(stored) - accounted):
            p = keys.parse(key)
            row = rows.get(p.checkpoint_id) if p else None
            if row and keys.belongs_to(p, row[0].id, row[1], row[0].step, row[0].attempt) and row[0].status != DELETED:
                continue  # a pending or abandoned checkpoint's blob: lease expiry and GC own it
            if row and row[0].status == DELETED and keys.belongs_to(p, row[0].id, row[1], row[0].step,
                                                                    row[0].attempt):
                report.add("orphan", f"checkpoint {p.checkpoint_id} is DELETED; its blob remains",
                           p.checkpoint_id, key)
            else:
                report.add("unknown", "no catalog row or manifest accounts for this blob", None, key)
        return report

    # ---------------------------------------------------------------- rebuilding
    def rebuild(self) -> dict:
        """Put every lost commit back into the catalog, from its manifest; idempotent."""
        restored, conflicts, corrupt = [], [], []
        lost = sorted(self.lost_manifests(), key=lambda p: p.checkpoint_id)  # parents before children
        stored = {info.key: info.size for info in self.blobs.list(keys.ROOT)}
        base = self.clock()
        fenced_from: dict[int, int] = {}  # run id -> the newest generation its restored manifests name
        for i, p in enumerate(lost):
            key = keys.manifest_key(p.prefix)
            body = self.blobs.read_all(key)
            try:
                m = Manifest.from_bytes(body)
            except (ValueError, KeyError, TypeError) as e:
                conflicts.append({"checkpoint_id": p.checkpoint_id, "why": f"unreadable manifest: {e}"})
                continue
            if m.checkpoint_id != p.checkpoint_id or not keys.belongs_to(p, m.checkpoint_id, m.run, m.step,
                                                                         m.attempt):
                conflicts.append({"checkpoint_id": p.checkpoint_id, "why": f"{key} does not match its key"})
                continue
            now = base + dt.timedelta(microseconds=i)
            with self.sessions() as s, s.begin():
                ck = s.get(Checkpoint, m.checkpoint_id)
                if ck is not None and not keys.belongs_to(p, ck.id, s.get(Run, ck.run_id).name, ck.step, ck.attempt):
                    conflicts.append({"checkpoint_id": m.checkpoint_id,
                                      "why": "the catalog gave this id to another checkpoint"})
                    continue
                run = s.scalar(select(Run).where(Run.name == m.run))
                if run is None:
                    run = Run(name=m.run, created_at=now)
                    s.add(run)
                    s.flush()
                parent = s.get(Checkpoint, m.parent_id) if m.parent_id else None
                # a shard under its name, or under an older store's (keys.shard_keys)
                key_of = {(r, f.name): next((k for k in keys.shard_keys(p.prefix, r, f.xxh3_128) if k in stored),
                                            keys.shard_key(p.prefix, r, f.xxh3_128))
                          for r, files in m.ranks.items() for f in files}
                complete = all(stored.get(key_of[r, f.name]) == f.size
                               and (f.index is None or stored.get(keys.index_key(p.prefix, r, f.index["xxh3_128"]))
                                    == f.index["size"])
                               for r, files in m.ranks.items() for f in files)
                if ck is None:
                    ck = Checkpoint(id=m.checkpoint_id, run_id=run.id, step=m.step, attempt=m.attempt,
                                    created_at=now)
                    s.add(ck)
                else:  # its begin survived, its commit did not: the manifest says what the votes were
                    for table in (Shard, Vote):
                        for row in s.scalars(select(table).where(table.checkpoint_id == ck.id)):
                            s.delete(row)
                    s.flush()
                ck.world_size, ck.parent_id = m.world_size, parent.id if parent else None
                ck.generation = m.generation
                fenced_from[run.id] = max(fenced_from.get(run.id, 0), m.generation)
                ck.status, ck.bytes = (COMMITTED if complete else CORRUPT), m.total_bytes()
                ck.lease_expires_at, ck.committed_at = now, now
                ck.manifest_key, ck.manifest_hash = key, hash_bytes(body)
                s.flush()
                branches.settle(s, run.id, ck.id)  # rebuilt as committed: stored branches from it on
                for r, files in m.ranks.items():
                    for f in files:
                        # /2: the reference to its index object; /1: the index itself (indexes.py reads both)
                        index = f.index or ({"data_start": f.data_start, "tensors": f.tensors}
                                            if f.tensors is not None else None)
                        s.add(Shard(checkpoint_id=ck.id, rank=r, file_name=f.name, size=f.size,
                                    xxh3_128=f.xxh3_128, blob_key=key_of[r, f.name],
                                    status=VERIFIED, index_json=json.dumps(index) if index else None,
                                    created_at=now))
                    s.add(Vote(checkpoint_id=ck.id, rank=r, files_json=json.dumps(sorted(f.name for f in files)),
                               created_at=now))
                moved = complete and last_good.advance(s, ck)
                add_event(s, "rebuilt", run.id, ck.id, step=ck.step, status=ck.status, last_good=moved,
                          parent_missing=bool(m.parent_id) and parent is None)
            (restored if complete else corrupt).append(m.checkpoint_id)
        self._advance_id_sequence()
        self._advance_generations(fenced_from)
        log.warning("rebuild: %d commits restored, %d incomplete (CORRUPT), %d conflicts",
                    len(restored), len(corrupt), len(conflicts))
        return {"restored": restored, "corrupt": corrupt, "conflicts": conflicts}

    def _advance_generations(self, newest: dict[int, int]) -> None:
        """A lost catalog may have registered launches after its newest commit, and their
        zombies may still run. Each run whose commits came back from the store continues
        GENERATION_GAP generations past the newest one its manifests name, so a relaunch
        never draws a generation an older launch holds, and every older launch is fenced."""
        with self.sessions() as s, s.begin():
            for run_id, gen in newest.items():
                run = s.get(Run, run_id)
                run.generation = max(run.generation or 0, gen + GENERATION_GAP)

    def _advance_id_sequence(self) -> None:
        """PostgreSQL hands ids out from a sequence that rows inserted with explicit ids do
        not move; SQLite takes max(id) + 1 by itself."""
        with self.sessions() as s, s.begin():
            if s.bind.dialect.name == "postgresql":
                from sqlalchemy import text

                s.execute(text("SELECT setval(pg_get_serial_sequence('checkpoints', 'id'), "
                               "GREATEST((SELECT COALESCE(MAX(id), 0) FROM checkpoints), 1))"))
