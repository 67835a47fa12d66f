"""The store is the source of truth: check the catalog against it (`fsck`) and rebuild the
catalog's lost commits from it (`rebuild`). restic's `check` / `rebuild-index` are the model.

Every committed checkpoint's manifest is a blob (domain/keys.py names it), written before
the commit transaction and holding run, step, attempt, world size, parent and every file
with size and xxh3-128. A catalog that lost acknowledged commits (a destroyed SQLite WAL,
an old backup restored) is *behind* the store: it lacks a checkpoint whose manifest is
there. The service detects that at start-up and refuses writes and last-good look-ups
(UNAVAILABLE, naming the command to run) until `rebuild` has put the lost commits back:
serving on would silently hand trainers an older step and reissue the lost ids.

The store alone is not trusted to say what committed: a manifest counts only if it is sealed
by one of the service's manifest keys (domain/sealing.py), which live outside the store, and
is within the wire's bounds (Manifest.from_dict). The start-up check ignores every other one
(it logs them), so a file planted in the store never stops writes; `rebuild` moves a forged
one to quarantine/ and reports it, and re-hashes every file of what it restores.

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

from lastgood.wire import sealing
from lastgood.wire.hashing import StreamHasher, hash_bytes
from lastgood.wire.manifest import Manifest

from ..blobstore import BlobStore
from ..catalog.models import (ABANDONED, COMMITTED, CORRUPT, DELETED, PENDING, VERIFIED, Checkpoint, Run, Shard, Vote,
                              utcnow)
from . import keys
from .runs import branches, last_good
from .commit import indexes
from .runs.fencing import GENERATION_GAP
from .events import add_event
from .sealing import ManifestKeys

log = logging.getLogger("lastgood.repair")


@dataclass
class Finding:
    kind: str  # lost_commit, missing_manifest, manifest_mismatch, missing_blob, orphan, unknown, id_conflict,
               # unsealed_manifest, forged_manifest
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


@dataclass
class Examined:
    """A lost manifest as read from the store: its checkpoint (`manifest`) or why not (`why`)."""
    parsed: keys.ParsedKey
    key: str
    body: bytes | None = None         # the stored bytes (None: too large to read)
    manifest: Manifest | None = None  # None: refused
    why: str | None = None
    unsealed: bool = False            # refused only for carrying no seal (an older store's, or planted)

    def refusal(self) -> dict:
        return {"checkpoint_id": self.parsed.checkpoint_id, "key": self.key, "why": self.why}


class Repair:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, manifest_keys: ManifestKeys,
                 clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.manifest_keys = manifest_keys  # what a manifest must be sealed by to count (domain/sealing.py)
        self.clock = clock

    # ---------------------------------------------------------------- looking
    def _rows(self, s: Session) -> dict[int, tuple[Checkpoint, str]]:
        return {ck.id: (ck, name) for ck, name in s.execute(
            select(Checkpoint, Run.name).join(Run, Run.id == Checkpoint.run_id))}

    def lost_manifests(self) -> list[keys.ParsedKey]:
        """Sealed manifests in the store of checkpoints the catalog does not hold as
        committed (or as corrupt or deleted since): rows it lost, or whose commit it lost."""
        return [e.parsed for e in self.examine_lost() if e.manifest is not None]

    def examine_lost(self, trust_unsealed: bool = False) -> list[Examined]:
        """Every manifest in the store the catalog does not account for, read and checked
        (seal, bounds, key), in id order. Start-up runs this after recovery, which rolls
        forward what it can by itself: the sealed ones close the gate, the rest are logged."""
        found = [(p, info.size) for info in self.blobs.list(keys.ROOT)
                 if (p := keys.parse(info.key)) and p.is_manifest]
        with self.sessions() as s, s.begin():
            rows = self._rows(s)
            lost = [(p, size) for p, size in found if not self._known(p, rows)]
        return [self._examine(p, size, trust_unsealed) for p, size in sorted(lost, key=lambda x: x[0].checkpoint_id)]

    def _examine(self, p: keys.ParsedKey, size: int, trust_unsealed: bool) -> Examined:
        key = keys.manifest_key(p.prefix)
        ex = Examined(p, key)
        if size > sealing.MAX_MANIFEST_BYTES:
            ex.why = f"{size} bytes, over the {sealing.MAX_MANIFEST_BYTES}-byte limit of a manifest: not read"
            return ex
        try:
            ex.body = self.blobs.read_all(key)
            unsealed, _key_id = self.manifest_keys.unseal(ex.body)
        except FileNotFoundError:
            ex.why = "deleted while being read"
            return ex
        except sealing.Unsealed as e:
            if not trust_unsealed:
                ex.why, ex.unsealed = f"{e}: written by a service older than seals, or planted", True
                return ex
            unsealed = ex.body  # the operator vouches for it (rebuild --trust-unsealed)
        except sealing.Unauthenticated as e:
            ex.why = str(e)
            return ex
        try:
            m = Manifest.from_bytes(unsealed)
        except ValueError as e:  # ManifestError: a sealed manifest out of bounds is a bug or a leaked key
            ex.why = f"sealed, but not a valid manifest: {e}"
            return ex
        if m.checkpoint_id != p.checkpoint_id or not keys.belongs_to(p, m.checkpoint_id, m.run, m.step, m.attempt):
            ex.why = f"{key} does not match its key"
            return ex
        ex.manifest = m
        return ex

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
        for ex in self.examine_lost():
            p = ex.parsed
            accounted.update(k for k in stored if k.startswith(p.prefix))
            if ex.manifest is None:
                report.add("unsealed_manifest" if ex.unsealed else "forged_manifest",
                           f"checkpoint {p.checkpoint_id}: a manifest in the store the catalog lacks, not "
                           f"restorable: {ex.why}", p.checkpoint_id, ex.key)
                continue
            row = rows.get(p.checkpoint_id)
            mine = row is not None and keys.belongs_to(p, row[0].id, row[1], row[0].step, row[0].attempt)
            kind = "id_conflict" if row is not None and not mine else "lost_commit"
            report.add(kind, f"checkpoint {p.checkpoint_id}: manifest in the store, not in the catalog"
                       + (" (its id now names another checkpoint)" if kind == "id_conflict" else ""),
                       p.checkpoint_id, ex.key)
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
    def rebuild(self, trust_unsealed: bool = False) -> dict:
        """Put every lost commit back into the catalog, from its sealed manifest; idempotent.
        Never ends half-done: a manifest that cannot be restored is skipped and reported (a
        forged one moved to quarantine/, an unsealed one left in place unless
        `trust_unsealed`), and every run that a restored or refused sealed manifest names
        has its generation advanced, whatever else failed."""
        restored, conflicts, corrupt, quarantined, unsealed = [], [], [], [], []
        stored = {info.key: info.size for info in self.blobs.list(keys.ROOT)}
        base = self.clock()
        fenced_from: dict[str, int] = {}  # run name -> the newest generation its sealed manifests name
        try:
            for i, ex in enumerate(self.examine_lost(trust_unsealed)):  # in id order: parents before children
                if ex.manifest is None:
                    if ex.unsealed:
                        unsealed.append(ex.refusal())
                    else:
                        quarantined.append(self._quarantine(ex))
                    continue
                m = ex.manifest
                fenced_from[m.run] = max(fenced_from.get(m.run, 0), m.generation)
                try:
                    outcome = self._restore(ex, base + dt.timedelta(microseconds=i), stored)
                except Exception as e:  # the catalog refused this one: the others still come back
                    log.exception("rebuild: checkpoint %s not restored", m.checkpoint_id)
                    outcome = f"not restored: {type(e).__name__}: {str(e)[:300]}"
                if outcome == COMMITTED:
                    restored.append(m.checkpoint_id)
                elif outcome == CORRUPT:
                    corrupt.append(m.checkpoint_id)
                else:
                    conflicts.append({"checkpoint_id": m.checkpoint_id, "why": outcome})
            self._advance_id_sequence()
        finally:
            self._advance_generations(fenced_from)
        log.warning("rebuild: %d commits restored, %d incomplete or damaged (CORRUPT), %d conflicts, "
                    "%d forged manifests quarantined, %d unsealed manifests left in place",
                    len(restored), len(corrupt), len(conflicts), len(quarantined), len(unsealed))
        for q in quarantined:
            log.error("rebuild: quarantined the manifest of checkpoint %s: %s", q["checkpoint_id"], q["why"])
        return {"restored": restored, "corrupt": corrupt, "conflicts": conflicts, "quarantined": quarantined,
                "unsealed": unsealed}

    def _quarantine(self, ex: Examined) -> dict:
        """Move a refused manifest out of ckpt/ (kept for inspection; moving it back and
        running rebuild again restores it if its key is listed again)."""
        out = {**ex.refusal(), "moved_to": None}
        if ex.body is not None:
            dest = keys.quarantine_key(ex.key)
            self.blobs.put_bytes(dest, ex.body)
            self.blobs.delete(ex.key)
            out["moved_to"] = dest
        return out

    @staticmethod
    def _shard_key(pfx: str, rank: int, digest: str, stored: dict[str, int]) -> str:
        """A shard under its name, or under an older store's (keys.shard_keys)."""
        return next((k for k in keys.shard_keys(pfx, rank, digest) if k in stored),
                    keys.shard_key(pfx, rank, digest))

    def _damage(self, pfx: str, m: Manifest, stored: dict[str, int]) -> str | None:
        """Why the checkpoint is not whole in the store, or None: every file and index
        object present at its size and re-hashed to the manifest's xxh3-128 (a sealed
        manifest vouches for the hashes, not for the bytes under them)."""
        for r, files in m.ranks.items():
            for f in files:
                blobs = [(self._shard_key(pfx, r, f.xxh3_128, stored), f.size, f.xxh3_128, f.name)]
                if f.index is not None:
                    blobs.append((keys.index_key(pfx, r, f.index["xxh3_128"]), f.index["size"],
                                  f.index["xxh3_128"], f"{f.name} (tensor index)"))
                for key, size, want, what in blobs:
                    if stored.get(key) != size:
                        return f"rank {r} {what}: missing or not {size} bytes"
                    h = StreamHasher()
                    try:
                        for chunk in self.blobs.get(key):
                            h.update(chunk)
                    except FileNotFoundError:
                        return f"rank {r} {what}: missing"
                    if h.size != size or h.hexdigest() != want:
                        return f"rank {r} {what}: the bytes hash to {h.hexdigest()}, not {want}"
        return None

    def _restore(self, ex: Examined, now: dt.datetime, stored: dict[str, int]) -> str:
        """One lost commit back into the catalog, in one transaction: COMMITTED, CORRUPT
        (incomplete or damaged) or why it conflicts."""
        p, m, key, body = ex.parsed, ex.manifest, ex.key, ex.body
        damage = self._damage(p.prefix, m, stored)
        with self.sessions() as s, s.begin():
            ck = s.get(Checkpoint, m.checkpoint_id)
            if ck is not None and not keys.belongs_to(p, ck.id, s.get(Run, ck.run_id).name, ck.step, ck.attempt):
                return "the catalog gave this id to another checkpoint"
            run = s.scalar(select(Run).where(Run.name == m.run))
            if run is None:
                run = Run(name=m.run, created_at=now)
                s.add(run)
                s.flush()
            parent = s.get(Checkpoint, m.parent_id) if m.parent_id else None
            if ck is None:
                ck = Checkpoint(id=m.checkpoint_id, run_id=run.id, step=m.step, attempt=m.attempt, created_at=now)
                s.add(ck)
            else:  # its begin survived, its commit did not: the manifest says what the votes were
                for table in (Shard, Vote):
                    for row in s.scalars(select(table).where(table.checkpoint_id == ck.id)):
                        s.delete(row)
                s.flush()
            ck.world_size, ck.parent_id = m.world_size, parent.id if parent else None
            ck.generation = m.generation
            ck.status, ck.bytes = (COMMITTED if damage is None else CORRUPT), m.total_bytes()
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
                                xxh3_128=f.xxh3_128, blob_key=self._shard_key(p.prefix, r, f.xxh3_128, stored),
                                status=VERIFIED, index_json=json.dumps(index) if index else None,
                                created_at=now))
                s.add(Vote(checkpoint_id=ck.id, rank=r, files_json=json.dumps(sorted(f.name for f in files)),
                           created_at=now))
            moved = damage is None and last_good.advance(s, ck)
            add_event(s, "rebuilt", run.id, ck.id, step=ck.step, status=ck.status, last_good=moved,
                      parent_missing=bool(m.parent_id) and parent is None,
                      **({"damage": damage} if damage else {}))
            return ck.status

    def _advance_generations(self, newest: dict[str, int]) -> None:
        """A lost catalog may have registered launches after its newest commit, and their
        zombies may still run. Each run that a sealed manifest names continues GENERATION_GAP
        generations past the newest one they name, so a relaunch never draws a generation an
        older launch holds, and every older launch is fenced. Generations are bounded by the
        wire (names.MAX_ID), so the sum fits the catalog's 64-bit integers."""
        with self.sessions() as s, s.begin():
            for name, gen in newest.items():
                run = s.scalar(select(Run).where(Run.name == name))
                if run is not None:  # None: its one checkpoint's restore failed before the run was made
                    run.generation = max(run.generation or 0, gen + GENERATION_GAP)

    def _advance_id_sequence(self) -> None:
        """PostgreSQL hands ids out from a sequence that rows inserted with explicit ids do
        not move; SQLite takes max(id) + 1 by itself."""
        with self.sessions() as s, s.begin():
            if s.bind.dialect.name == "postgresql":
                from sqlalchemy import text

                s.execute(text("SELECT setval(pg_get_serial_sequence('checkpoints', 'id'), "
                               "GREATEST((SELECT COALESCE(MAX(id), 0) FROM checkpoints), 1))"))
