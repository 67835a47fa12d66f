"""Verification and corruption: re-hash a committed checkpoint, and mark one whose bytes
changed CORRUPT, moving last-good away from it (I2, I3 in docs/architecture.md)."""

from __future__ import annotations

import logging

from sqlalchemy import select

from lastgood.wire.errors import FormatError
from lastgood.wire.format import META_STATE, dangling_replicas, header_length, parse_header, parse_state
from lastgood.wire.hashing import StreamHasher, hash_bytes
from lastgood.wire.ranges import FileCheck, fingerprint

from ...catalog.models import COMMITTED, CORRUPT, Shard
from ..runs import last_good
from . import tiering
from ..errors import FailedPrecondition
from ..events import add_event
from . import indexes
from .core import CommitCore, key_prefix

log = logging.getLogger("lastgood.commit")


class CommitVerification(CommitCore):
    def verify(self, checkpoint_id: int) -> dict:
        """Re-hash every shard of a committed checkpoint, and read the state of every
        lastgood shard as a restore would (format.parse_state). A mismatch, a missing blob
        or a state that cannot be read marks it CORRUPT, records an event and moves
        last-good back to the newest good commit."""
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            if ck.status not in (COMMITTED, CORRUPT):
                raise FailedPrecondition(f"checkpoint {checkpoint_id} is {ck.status}; only committed ones are verified")
            tiering.refuse_blob(ck, "verified by the service")  # a memory checkpoint's bytes are its agents'
            shards = list(s.scalars(select(Shard).where(Shard.checkpoint_id == checkpoint_id)
                                    .order_by(Shard.rank, Shard.file_name)))
            pfx = key_prefix(s, ck)
            world = ck.world_size
        bad = []
        held: dict[int, set[str]] = {}  # rank -> the tensors of its files; states: their documents
        states: dict[int, dict] = {}
        try:
            got = hash_bytes(self.store.read_all(ck.manifest_key))
        except FileNotFoundError:
            got = "missing"
        if got != ck.manifest_hash:
            bad.append({"file": "manifest", "expected": ck.manifest_hash, "found": got})
        for sh in shards:
            declared = _declared(sh)  # range digests its writer declared: recomputed in the same pass
            h = StreamHasher() if declared is None else FileCheck(declared["rule"])
            head = _HeadReader(sh)
            try:
                for chunk in self.store.get(sh.blob_key):
                    h.update(chunk)
                    head.feed(chunk)
                got = h.hexdigest() if h.size == sh.size else f"size {h.size}"
            except FileNotFoundError:
                got = "missing"
            if got != sh.xxh3_128:
                bad.append({"rank": sh.rank, "file": sh.file_name, "expected": sh.xxh3_128, "found": got})
            elif declared is not None and (fp := fingerprint(h.digests())) != declared["fingerprint"]:
                bad.append({"rank": sh.rank, "file": f"{sh.file_name} (range digests)",
                            "expected": declared["fingerprint"], "found": fp})
            elif (problem := head.state_problem()) is not None:
                bad.append({"rank": sh.rank, "file": sh.file_name, "expected": "a readable lastgood.state",
                            "found": problem})
            else:  # for the replicated-tensor references below
                held.setdefault(sh.rank, set()).update(head.tensors)
                if head.state is not None:
                    states[sh.rank] = head.state
        for rank, what in dangling_replicas(states, held, world):  # DDP state written once (replicas.py)
            bad.append({"rank": rank, "file": "lastgood.state", "expected": "every __replica__ resolves",
                        "found": what})
        for sh in shards:  # the tensor index objects the manifest names (indexes.py)
            if (key := indexes.key_of(pfx, sh)) is not None and (got := indexes.found(self.store, key)) != \
                    (want := indexes.ref_of(sh)["xxh3_128"]):
                bad.append({"rank": sh.rank, "file": f"{sh.file_name} (tensor index)", "expected": want, "found": got})
        if bad:
            self.mark_corrupt(checkpoint_id, bad)
        return {"checkpoint_id": checkpoint_id, "ok": not bad, "files": len(shards), "bad": bad,
                "status": CORRUPT if bad else ck.status}

    def mark_corrupt(self, checkpoint_id: int, bad: list[dict]) -> None:
        self.gate.check()  # moving last-good back on a catalog behind the store would pick from what it lost
        log.error("checkpoint %s is CORRUPT: %s", checkpoint_id, bad, extra={"checkpoint_id": checkpoint_id})
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            first = ck.status != CORRUPT
            ck.status = CORRUPT
            now_last_good = last_good.retreat(s, ck)
            if first:
                add_event(s, "corrupt", ck.run_id, ck.id, bad=bad, last_good=now_last_good)
        self._notify()


def _declared(sh: Shard) -> dict | None:
    """{"rule", "fingerprint"} of the range digests the file's writer declared (the service
    never read its bytes, indexes.DECLARED_RANGES); None for digests the service computed,
    or none. Declared digests of other bytes would send every ranged read of the file to
    its fallback while the checkpoint stays last-good."""
    ref = indexes.ref_of(sh)
    return ref.get(indexes.DECLARED_RANGES) if ref else None


class _HeadReader:
    """Keeps the first bytes of a .safetensors shard while verify hashes it, up to the end
    of its header, to read the lastgood state there: the bytes may hash right and still
    not be a state a restore can apply (they were uploaded that way)."""

    def __init__(self, sh: Shard) -> None:
        self.size = sh.size
        self.want = sh.file_name.endswith(".safetensors")
        self.buf = bytearray()
        self.need = 8
        self.tensors: dict = {}            # after state_problem(): the header's tensors
        self.state: dict | None = None     # and its lastgood.state, if it has one

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while self.want and view.nbytes and len(self.buf) < self.need:
            take = self.need - len(self.buf)
            self.buf += view[:take]
            view = view[take:]
            if self.need == 8 and len(self.buf) == 8:
                try:
                    self.need = header_length(self.buf)
                except FormatError:  # state_problem() says so
                    return

    def state_problem(self) -> str | None:
        if not self.want:
            return None
        try:
            self.tensors, meta = parse_header(bytes(self.buf), file_size=self.size)
            if META_STATE in meta:  # a shard with lastgood's state: a restore must be able to read it
                self.state = parse_state(meta, self.tensors)
        except FormatError as e:
            return str(e)[:300]
        return None
