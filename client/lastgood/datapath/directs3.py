"""Direct uploads to an S3 store: a rank's file goes from the trainer straight to the store,
in parts, in parallel; the service only grants, checks the store's metadata and commits
(the service's domain/dataplane/grants.py; docs/direct-s3.md). torch-free.

    parts = prepare(data, part_size)          # one pass: xxh3-128 of the file, CRC32 of each part
    handle = upload(transport, cid, rank, name, data, parts)   # grant, then the parts, in parallel
    hand_over(transport, cid, rank, name, handle)              # the service completes and records it
    discard(handle)                                            # a save that failed in between

`DirectS3Path` is the same as a data path of the save session (datapath/paths.py), which
chooses it whenever the service offers direct uploads (GET /api/v1/info `direct_s3`).

Why CRC32 per part: the store checks it on arrival (`x-amz-checksum-crc32`, which AWS S3,
MinIO, Ceph RGW and LocalStack verify: BadDigest on a mismatch), and it costs one pass of
zlib.crc32, in the standard library, beside the xxh3-128 pass we make anyway. SHA-256 would
cost several times more per byte for no gain against accidental corruption, which is what
this guards; CRC32C or CRC64NVME would need a third-party module. The grant signs each
part's CRC32 into its URL, so the URL admits those bytes and nothing else.

The whole file's xxh3-128 is still computed here, named in the key and the manifest, and
checked end to end by every restore (`read_file`).

The part layout is a rule of the wire, the same on both sides: `part_layout` here, which
the service imports.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from lastgood.common import durable
from lastgood.wire import ranges
from lastgood.errors import CorruptCheckpoint, DirectOff, Refused, TooLarge, Unavailable
from lastgood.wire.hashing import StreamHasher
from lastgood.datapath.paths import Prepared, StreamPath
from lastgood.wire.info import DirectS3Offer
from lastgood.wire.s3parts import crc32_b64, part_layout

log = logging.getLogger("lastgood")

THREADS = 4              # parts in flight per file: enough to fill a link, few enough to share it
_PIECE = 8 * 1024 * 1024  # hashing granularity: each piece is hashed while it is in the CPU's cache
_TIMEOUT = 300.0


class StoreRefused(Refused):
    """The store refused a request (BadDigest: the bytes do not match their checksum;
    AccessDenied / SignatureDoesNotMatch: an expired grant, or one used for another key)."""
    reason = "store_refused"

    def __init__(self, message: str, status: int, store_code: str) -> None:
        super().__init__(message, status)
        self.store_code = store_code


class StoreUnavailable(Unavailable):
    """No answer from the store, or a 5xx: the retry policy tries again."""
    reason = "store_unavailable"


def offered(transport) -> DirectS3Offer | None:
    """The service's direct-upload terms (GET /api/v1/info), or None: it takes the bytes itself."""
    info = getattr(transport, "info", None)
    return info.direct_s3 if info is not None else None


@dataclass(frozen=True)
class Parts:
    size: int
    xxh3_128: str
    part_size: int
    crc32: list[str]
    digests: dict | None = None  # the file's range digests (ranges.py), declared at the hand-over


@dataclass
class Handle:
    """What was uploaded: what the hand-over tells the service."""
    prepared: Parts
    upload_id: str | None = None
    parts: list[dict] = field(default_factory=list)  # {"number", "etag", "crc32"}
    already_present: bool = False                    # the service had the file already (a retried save)


def prepare(data, part_size: int, range_block: int | None = None) -> Parts:
    """One pass over the file: its xxh3-128, each part's CRC32 and, when the service
    writes range digests (`range_block`: its cap, GET /api/v1/info) and the file is a
    safetensors file, its range digests (ranges.py): the service never reads these bytes,
    so they are declared with the hand-over, as trustworthy as the xxh3-128 of the same pass."""
    view = memoryview(data).cast("B")
    segments = ranges.hasher_of(view, range_block)
    part, n = part_layout(view.nbytes, part_size)
    hasher = StreamHasher()
    crcs = []
    for i in range(n):
        crc = 0
        for off in range(i * part, min((i + 1) * part, view.nbytes), _PIECE):
            piece = view[off:min(off + _PIECE, (i + 1) * part, view.nbytes)]
            hasher.update(piece)
            crc = zlib.crc32(piece, crc)
            if segments is not None:
                segments.update(piece)
        crcs.append(crc32_b64(crc))
    if view.nbytes == 0:
        hasher.update(b"")
    return Parts(view.nbytes, hasher.hexdigest(), part, crcs, segments.digests() if segments is not None else None)


def _store_error(status: int, body: bytes, what: str) -> Exception:
    text = body[:2000].decode("utf-8", "replace")
    code = (re.search(r"<Code>([^<]{1,100})</Code>", text) or [None, f"HTTP {status}"])[1]
    msg = (re.search(r"<Message>([^<]{1,500})</Message>", text) or [None, ""])[1]
    if status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"):
        return StoreUnavailable(f"{what}: the store answered {status} {code} {msg}".strip(), status)
    return StoreRefused(f"{what}: the store refused it: {status} {code} {msg}".strip(), status, code)


def _request(method: str, url: str, body=None, headers: dict | None = None, what: str = ""):
    """One request to the store; (response, connection), the response unread."""
    u = urlsplit(url)
    conn_type = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(u.netloc, timeout=_TIMEOUT)
    try:
        conn.request(method, f"{u.path}?{u.query}", body=body, headers=headers or {})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise StoreUnavailable(f"{what}: no answer from the store at {u.netloc}: {e}") from None
    if resp.status >= 300:
        try:
            err = _store_error(resp.status, resp.read(), what)
        except (OSError, http.client.HTTPException) as e:
            err = StoreUnavailable(f"{what}: the store's answer was cut short: {e}")
        finally:
            conn.close()
        raise err
    return resp, conn


def _put_part(transport, url: str, header: str, crc: str, piece: memoryview, number: int) -> str:
    def once() -> str:
        resp, conn = _request("PUT", url, piece, {header: crc, "Content-Length": str(piece.nbytes)},
                              f"upload of part {number}")
        try:
            resp.read()
            return (resp.getheader("ETag") or "").strip('"')
        finally:
            conn.close()
    return transport.retry.call(once, f"upload of part {number}")


def upload(transport, checkpoint_id: int, rank: int, file_name: str, data, prepared: Parts,
           renew: Callable[[], None] | None = None, renew_every: float = 15.0, threads: int = THREADS) -> Handle:
    """Ask for a grant, then upload the parts in parallel to its presigned URLs. `renew` is
    called every `renew_every` seconds while parts are in flight: the service sees no byte
    of a direct upload, so the checkpoint's lease is kept alive by the uploader."""
    g = transport.upload_grant(checkpoint_id, rank, {"file_name": file_name, "size": prepared.size,
                                                     "xxh3_128": prepared.xxh3_128, "crc32": prepared.crc32,
                                                     "part_size": prepared.part_size})
    handle = Handle(prepared, g.get("upload_id"), already_present=bool(g["already_present"]))
    if handle.already_present:
        return handle
    view = memoryview(data).cast("B")
    part = g["part_size"]
    header = g["checksum_header"]
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(g["parts"]))),
                            thread_name_prefix="lastgood-direct") as pool:
        futures = {}
        for p in g["parts"]:
            n = p["number"]
            piece = view[(n - 1) * part:min(n * part, view.nbytes)]
            futures[pool.submit(_put_part, transport, p["url"], header, p["crc32"], piece, n)] = p
        pending = set(futures)
        last = time.monotonic()
        try:
            while pending:
                done, pending = wait(pending, timeout=max(renew_every, 0.1), return_when=FIRST_EXCEPTION)
                for f in done:
                    p = futures[f]
                    etag = f.result()  # a refused part raises here; the rest are cancelled below
                    with lock:
                        handle.parts.append({"number": p["number"], "etag": etag, "crc32": p["crc32"]})
                if pending and renew is not None and time.monotonic() - last >= renew_every:
                    renew()
                    last = time.monotonic()
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    handle.parts.sort(key=lambda d: d["number"])
    return handle


def hand_over(transport, checkpoint_id: int, rank: int, file_name: str, handle: Handle) -> dict:
    """Tell the service what was uploaded; it confirms it from the store's metadata and
    records the file (a refusal: HashMismatch / DataLoss, and the rank cannot vote with it)."""
    p = handle.prepared
    if handle.already_present:
        return {"already_present": True, "size": p.size, "xxh3_128": p.xxh3_128}
    body = {"file_name": file_name, "size": p.size, "xxh3_128": p.xxh3_128, "part_size": p.part_size,
            "upload_id": handle.upload_id, "parts": handle.parts}
    declared = {**body, "digests": p.digests} if ranges.declarable(p.digests) else None
    # the digests are optional, the file is not: a body over the service's limit (its parts
    # list counts too) goes without them, and so does the retry of a 413 from a service
    # that does not announce its limit (the file is then read whole at another world size)
    info = getattr(transport, "info", None)
    limit = info.max_request_bytes if info is not None else None
    if declared is not None and (limit is None or len(json.dumps(declared).encode()) <= limit):
        try:
            return transport.direct_file(checkpoint_id, rank, declared)
        except TooLarge:
            log.warning("lastgood: the hand-over of %s is over the service's body limit with its range digests: "
                        "sent without them", file_name)
    return transport.direct_file(checkpoint_id, rank, body)


def turned_off(transport, e: DirectOff) -> None:
    """The service refused a direct upload or read because it offers none any more (it
    restarted with them off): learn its terms anew, so this file and every later save and
    read go through the service, as a refused spool hand-over falls back to the stream."""
    log.warning("lastgood: the service no longer offers direct uploads (%s); sending through it", e.detail)
    transport.info = transport.service_info()


def read_file(transport, checkpoint_id: int, rank: int, file_name: str, size: int,
              into=None) -> tuple[memoryview, str]:
    """The whole file through a presigned GET, into `into`, and the xxh3-128 of what arrived
    (the caller compares it with the manifest's, as for a streamed read). A committed file
    the store no longer holds (404), or holds with another size, raises CorruptCheckpoint:
    the restore treats the checkpoint as damaged and falls back to an ancestor."""
    view = memoryview(durable.new_buffer(size) if into is None else into).cast("B")
    if view.nbytes < size:
        raise ValueError(f"read_file: a buffer of {view.nbytes} bytes cannot hold {size}")
    view = view[:size]
    what = f"direct read of checkpoint {checkpoint_id} rank {rank} {file_name}"

    def once() -> str:  # a retry asks for a fresh URL and starts over
        g = transport.read_grant(checkpoint_id, rank, file_name)
        try:
            resp, conn = _request("GET", g["url"], what=what)
        except StoreRefused as e:
            if e.status == 404 or e.store_code == "NoSuchKey":  # a committed file gone from the store:
                raise CorruptCheckpoint(f"{what}: the store has no such object ({e.store_code})") from None
            raise                                            # damage, as a missing blob is when streamed
        try:
            return _hash_body(resp, size, what, view)
        finally:
            conn.close()

    return view, transport.retry.call(once, what)


def _hash_body(resp, size: int, what: str, into: memoryview | None = None, hasher=None) -> str:
    """The xxh3-128 of a GET's body, which must be `size` bytes (else CorruptCheckpoint),
    read into `into`, or through one piece-sized buffer when the bytes are not kept;
    `hasher` (a StreamHasher by default) is fed every byte."""
    hasher, pos = hasher or StreamHasher(), 0
    scratch = memoryview(bytearray(min(_PIECE, size))) if into is None else None
    try:
        while pos < size:
            end = min(pos + _PIECE, size)
            target = into[pos:end] if into is not None else scratch[:end - pos]
            n = resp.readinto(target)
            if not n:
                break
            hasher.update(target[:n])
            pos += n
        extra = resp.read(1)
    except (OSError, http.client.HTTPException) as e:
        raise StoreUnavailable(f"{what}: the store's answer was cut short: {e}") from None
    if pos != size or extra:
        raise CorruptCheckpoint(f"{what}: the stored file is {'longer' if extra else f'{pos} bytes'}, "
                                f"not the committed {size}")
    return hasher.hexdigest()


def hash_object(url: str, size: int, ranges_rule: dict | None = None) -> tuple[str, str | None] | None:
    """The xxh3-128 of the object behind a presigned GET (a peer check, peer.py), read
    through one buffer, and the fingerprint of its range digests recomputed in that read by
    `ranges_rule` (None without: ranges.FileCheck); None when it cannot be read whole (the
    service hashes it then)."""
    what = "peer check read"
    check = ranges.FileCheck(ranges_rule)
    try:
        resp, conn = _request("GET", url, what=what)
    except (StoreRefused, StoreUnavailable) as e:
        log.warning("lastgood: %s", e)
        return None
    try:
        return _hash_body(resp, size, what, hasher=check), ranges.fingerprint(check.digests())
    except (CorruptCheckpoint, StoreUnavailable) as e:
        log.warning("lastgood: %s", e)
        return None
    finally:
        conn.close()


def read_range(transport, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
    """Bytes [offset, offset + len(into)) of a committed file through a presigned GET with a
    Range header (a resharding restore's ranges, docs/resharding.md; the caller verifies
    them against the range digests). The store answering with other bytes than asked for,
    or none (404), raises CorruptCheckpoint, as read_file does."""
    view = memoryview(into).cast("B")
    length = view.nbytes
    what = f"direct ranged read of checkpoint {checkpoint_id} rank {rank} {file_name} [{offset}, +{length})"

    def once() -> None:
        g = transport.read_grant(checkpoint_id, rank, file_name)
        try:
            resp, conn = _request("GET", g["url"], headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                                  what=what)
        except StoreRefused as e:
            if e.status in (404, 416) or e.store_code in ("NoSuchKey", "InvalidRange"):
                raise CorruptCheckpoint(f"{what}: the store has no such bytes ({e.store_code})") from None
            raise
        pos = 0
        try:
            if resp.status != 206 and not (offset == 0 and int(resp.getheader("Content-Length") or -1) == length):
                raise CorruptCheckpoint(f"{what}: the store answered {resp.status}, not the range")
            while pos < length:
                n = resp.readinto(view[pos:min(pos + _PIECE, length)])
                if not n:
                    break
                pos += n
        except (OSError, http.client.HTTPException) as e:
            raise StoreUnavailable(f"{what}: the store's answer was cut short: {e}") from None
        finally:
            conn.close()
        if pos != length:
            raise CorruptCheckpoint(f"{what}: the stored file ends {pos} bytes after the offset")

    transport.retry.call(once, what)


class DirectS3Path(StreamPath):
    """The data path (paths.py) for direct uploads: `prepare` hashes and checksums before
    begin, `send` uploads and hands over; `discard` has nothing to undo (the service aborts
    the checkpoint's open uploads when the rank's abort or the lease's expiry ends it, and
    every GC pass sweeps what those missed; the trainer holds no credentials to abort with,
    by design). Reads are presigned GETs of the store.
    The part size the file was checksummed with travels with its grant and hand-over, so a
    service whose setting changed since still lays the parts out the same; a service that
    turned direct uploads off since gets the file streamed (`turned_off`)."""

    name = "direct-s3"

    def __init__(self, transport, terms: DirectS3Offer) -> None:
        super().__init__(transport)
        self.part_size = terms.part_size

    def prepare(self, name: str, data):
        data = memoryview(data).cast("B")
        parts = prepare(data, self.part_size, self.transport.info.range_block_bytes
                        if name.endswith(".safetensors") else None)
        return Prepared(name, data, parts.xxh3_128, expected_bytes=0, token=parts)  # the store's room, not ours

    def send(self, checkpoint_id: int, rank: int, handle) -> None:
        try:
            up = upload(self.transport, checkpoint_id, rank, handle.name, handle.data, handle.token,
                        renew=self._renewer(checkpoint_id, rank),
                        renew_every=self.transport.info.lease_seconds / 4)
            hand_over(self.transport, checkpoint_id, rank, handle.name, up)
        except DirectOff as e:  # the service turned them off since: this file goes through it
            turned_off(self.transport, e)  # (an upload left open is aborted by GC's sweep)
            self.transport.put_shard(checkpoint_id, rank, handle.name, handle.data, handle.digest)

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                  into=None) -> tuple[memoryview, str]:
        try:
            return read_file(self.transport, checkpoint_id, rank, file_name, size, into)
        except DirectOff as e:  # turned off since we connected: through the service
            turned_off(self.transport, e)
            return super().read_file(checkpoint_id, rank, file_name, size, into)

    def read_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
        view = memoryview(into).cast("B")
        try:
            read_range(self.transport, checkpoint_id, rank, file_name, offset, view)
        except DirectOff as e:  # turned off since we connected: through the service
            turned_off(self.transport, e)
            super().read_range(checkpoint_id, rank, file_name, offset, view)
            return
        self.transport.count(view.nbytes, requests=1)

    def _renewer(self, checkpoint_id: int, rank: int) -> Callable[[], None]:
        """Renew the checkpoint's lease while parts are in flight: a begin of the same
        checkpoint (idempotent) does, and the checkpoint's view says what to begin with."""
        def renew() -> None:
            ck = self.transport.checkpoint(checkpoint_id)
            self.transport.begin(ck["run"], ck["step"], ck["world_size"], ck["parent_id"], ck["attempt"], rank)
        return renew
