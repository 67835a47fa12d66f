"""Reading a committed checkpoint from the service, verified: what `lastgood download`,
`lastgood export` and a restore share.

- `parse_ckpt` / `resolve`: a checkpoint named by id or RUN@TAG (RUN@last-good, RUN@best).
- `ReadLease`: a read lease, so GC cannot delete the checkpoint while it is read (I4),
  renewed by replacement every half period, so a killed reader holds GC off briefly.
- `read_manifest`: the exact manifest bytes the service committed, parsed and checked.
- `read_verified`: one file's bytes as they arrive over REST, hashed; the last step raises
  CorruptCheckpoint unless size and xxh3-128 match the manifest.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from lastgood.errors import CorruptCheckpoint, InvalidArgument, NotFound, ServiceError, ServiceUnreachable
from lastgood.wire import names
from lastgood.wire.hashing import StreamHasher
from lastgood.wire.names import LAST_GOOD_TAG as LAST_GOOD
from lastgood.wire.manifest import FileEntry, Manifest

log = logging.getLogger("lastgood")

CHUNK = 1024 * 1024
LEASE_SECONDS = 600.0          # renewed every half period while a download or export reads
RESTORE_LEASE_SECONDS = 3600.0  # not renewed: a restore holds its lease this long at most


@dataclass(frozen=True)
class CkptRef:
    id: int | None = None
    run: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return str(self.id) if self.id is not None else f"{self.run}@{self.tag}"


def parse_ckpt(text: str) -> CkptRef:
    """A checkpoint: its id, or RUN@TAG (RUN@last-good, RUN@best, ...). Run names cannot
    hold '@', so the first '@' splits; the tag may hold anything after it. ValueError says
    what is wrong with anything else."""
    if "@" in text:
        run, tag = text.split("@", 1)
        names.check_run_name(run)  # InvalidName is a ValueError
        if not tag:
            raise ValueError(f"{text!r} names no tag after '@' (e.g. {run}@{LAST_GOOD})")
        return CkptRef(run=run, tag=tag)
    try:
        cid = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a checkpoint id or RUN@TAG") from None
    if cid < 1:
        raise ValueError(f"checkpoint ids start at 1, got {cid}")
    return CkptRef(id=cid)


def lineage_all(rest, run: str, page: int = 10000) -> dict:
    """The whole lineage of a run, every page of it."""
    doc = rest.lineage(run, page, 0)
    nodes, edges = list(doc["nodes"]), list(doc["edges"])
    while len(nodes) < doc["total"] and doc["nodes"]:
        doc = rest.lineage(run, page, len(nodes))
        nodes += doc["nodes"]
        edges += doc["edges"]
    doc.update(nodes=nodes, edges=edges)
    doc.pop("limit", None)
    doc.pop("offset", None)
    return doc


def resolve(rest, ref: CkptRef) -> int:
    """The id of the checkpoint `ref` names. NotFound when no checkpoint has the tag;
    InvalidArgument when a plain tag names several."""
    if ref.id is not None:
        return ref.id
    run, tag = ref.run, ref.tag
    if tag == LAST_GOOD:
        return rest.last_good(run, required=True)["id"]
    hits = [n for n in lineage_all(rest, run)["nodes"] if any(t["name"] == tag for t in n["tags"])]
    if not hits:
        raise NotFound(f"run {run!r} has no checkpoint tagged {tag!r}")
    if len(hits) > 1:
        ids = ", ".join(f"#{n['id']}" for n in hits[:10]) + (", ..." if len(hits) > 10 else "")
        raise InvalidArgument(f"tag {tag!r} names {len(hits)} checkpoints of run {run!r} ({ids}); "
                              f"name one by id, or use an alias (tag --alias)")
    return hits[0]["id"]


class ReadLease:
    """A read lease on one checkpoint while it is read; `keep_alive()` renews it by
    replacement every half period. `release()` says whether the service let it go (it
    expires by itself otherwise)."""

    def __init__(self, rest, checkpoint_id: int, holder: str | None = None, seconds: float = LEASE_SECONDS,
                 what: str = "download") -> None:
        self.rest, self.checkpoint_id, self.seconds = rest, checkpoint_id, seconds
        self.holder = (holder or f"lastgood-cli {what} on {socket.gethostname()} pid {os.getpid()}")[:128]
        self.lease_id = rest.acquire_lease(checkpoint_id, self.holder, seconds)
        self.taken = time.monotonic()

    def keep_alive(self) -> None:
        if time.monotonic() - self.taken < self.seconds / 2:
            return
        old, self.lease_id = self.lease_id, self.rest.acquire_lease(self.checkpoint_id, self.holder, self.seconds)
        self.taken = time.monotonic()
        self._release(old)

    def release(self) -> bool:
        return self._release(self.lease_id)

    def _release(self, lease_id: int) -> bool:
        try:
            self.rest.release_lease(lease_id)
            return True
        except ServiceError as e:
            log.debug("lastgood: releasing read lease %s failed: %s", lease_id, e)
            return False

    def __enter__(self) -> "ReadLease":
        return self

    def __exit__(self, *exc) -> None:
        if not self.release():
            log.warning("lastgood: could not release read lease %s; it expires by itself", self.lease_id)


def read_manifest(rest, cid: int) -> tuple[bytes, Manifest]:
    """The checkpoint's manifest: the exact bytes the service committed, and parsed."""
    raw = rest.manifest_bytes(cid)
    try:
        manifest = Manifest.from_bytes(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {cid}: the manifest does not parse: {e}") from None
    if manifest.checkpoint_id != cid:
        raise CorruptCheckpoint(f"checkpoint {cid}: the service sent the manifest of checkpoint "
                                f"{manifest.checkpoint_id}")
    return raw, manifest


def read_verified(rest, cid: int, rank: int, entry: FileEntry, lease: ReadLease,
                  tail: str = "") -> Iterator[bytes]:
    """Yield one file's bytes as they arrive, hashing them; once the last byte is in, raise
    CorruptCheckpoint unless size and xxh3-128 match the manifest's. Nothing yielded is
    verified until the generator is exhausted without an error. `tail` ends each error
    message (what the caller did with the bytes)."""
    where = f"checkpoint {cid} rank {rank} file {entry.name}"
    hasher = StreamHasher()
    resp = rest.open_file(cid, rank, entry.name)
    with resp:
        while True:
            try:
                chunk = resp.read(CHUNK)
            except http.client.IncompleteRead as e:
                got = hasher.size + len(e.partial)
                raise CorruptCheckpoint(f"{where}: the service sent {got} of {entry.size} bytes (a truncated "
                                        f"blob, or the connection dropped){tail}") from None
            except OSError as e:
                raise ServiceUnreachable(f"{where}: the download broke off after {hasher.size} bytes: {e}") from None
            if not chunk:
                break
            if hasher.size + len(chunk) > entry.size:
                raise CorruptCheckpoint(f"{where}: the service sent more than the manifest's {entry.size} "
                                        f"bytes{tail}")
            hasher.update(chunk)
            yield chunk
            lease.keep_alive()
    if hasher.size != entry.size:
        raise CorruptCheckpoint(f"{where}: received {hasher.size} of {entry.size} bytes{tail}")
    got = hasher.hexdigest()
    if got != entry.xxh3_128:
        raise CorruptCheckpoint(f"{where}: the bytes received hash to xxh3-128 {got} but the manifest says "
                                f"{entry.xxh3_128}{tail}. `lastgood verify {cid}` re-hashes the checkpoint "
                                f"on the service (and marks it CORRUPT if it is)")
