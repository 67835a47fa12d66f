"""S3-compatible blob store (MinIO, AWS S3, ...) on the `minio` client, version 7.

URL: ``s3://bucket[/prefix]?endpoint=host:port&secure=false&region=us-east-1``. Credentials
never come from the URL or the code: the service passes LASTGOOD_S3_ACCESS_KEY and
LASTGOOD_S3_SECRET_KEY from its settings.

Writes stream: bytes arrive in pieces of unknown total, are buffered up to one part (5 MiB,
the S3 minimum for every part but the last) and uploaded as parts of a multipart upload
that starts with the first full part. `publish()` completes the upload, which is S3's
atomic "appear whole or not at all"; a blob smaller than one part is a single PUT at
publish, just as atomic. Any failure aborts the multipart upload, and so does `abort()`,
so no incomplete upload is left behind to be billed and forgotten.

S3 allows at most 10,000 parts, so the part size doubles after every 1,000 parts: 5 MiB
parts carry the first ~4.9 GiB, and the 256 GiB default shard limit is reached with
parts of at most 160 MiB. The buffer never holds more than one part.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from urllib.parse import parse_qs, urlparse

import certifi
import urllib3
from minio import Minio
from minio.datatypes import Part
from minio.error import S3Error

from lastgood.wire.s3parts import MAX_PARTS, MIN_PART_SIZE

from .base import READ_CHUNK, BlobInfo, BlobStore, BlobWriter, check_key
from .s3errors import not_found

log = logging.getLogger("lastgood.blobstore.s3")

MiB = 1024 * 1024
PARTS_PER_SIZE = 1000            # the part size doubles after this many parts
_TIMEOUT = urllib3.Timeout(connect=30, read=300)


class _Multipart:
    """One multipart upload, in the four S3 calls it takes.

    minio 7's public `put_object` uploads a whole stream itself: it pulls from a reader,
    in its own loop, and needs either the total length or a fixed part size. Our writer is
    pushed to (the service hands it gRPC chunks as they arrive) and must be able to abort
    on the service's say-so, so it drives the upload part by part with minio's low-level
    calls. Those are private in minio 7 (`_create_multipart_upload`, `_upload_part`,
    `_complete_multipart_upload`, `_abort_multipart_upload`); this class is the only place
    that touches them, and minio is pinned below 8 in pyproject.toml for that reason.
    """

    def __init__(self, client: Minio, bucket: str, name: str) -> None:
        self._client = client
        self.bucket = bucket
        self.name = name
        self.upload_id = client._create_multipart_upload(
            bucket_name=bucket, object_name=name, headers={"Content-Type": "application/octet-stream"})
        self.parts: list[Part] = []

    def upload(self, data: bytes) -> None:
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise ValueError(f"S3 allows at most {MAX_PARTS} parts per object")
        etag = self._client._upload_part(
            bucket_name=self.bucket, object_name=self.name, data=data, headers=None,
            upload_id=self.upload_id, part_number=number)
        self.parts.append(Part(part_number=number, etag=etag))

    def complete(self) -> None:
        self._client._complete_multipart_upload(
            bucket_name=self.bucket, object_name=self.name, upload_id=self.upload_id, parts=self.parts)

    def abort(self) -> None:
        self._client._abort_multipart_upload(
            bucket_name=self.bucket, object_name=self.name, upload_id=self.upload_id)


def part_size_for(part_number: int, base: int = MIN_PART_SIZE) -> int:
    """Size of part `part_number` (1-based): `base`, doubling after every 1,000 parts."""
    return base << ((part_number - 1) // PARTS_PER_SIZE)


class _S3Writer(BlobWriter):
    def __init__(self, store: "S3BlobStore", key: str) -> None:
        self._store = store
        self._name = store._name(key)
        self._buf = bytearray()
        self._upload: _Multipart | None = None
        self._done = False

    @property
    def buffered(self) -> int:
        """Bytes held in memory now (never more than one part plus the piece being added)."""
        return len(self._buf)

    @property
    def upload_id(self) -> str | None:
        return self._upload.upload_id if self._upload else None

    def _next_part_size(self) -> int:
        n = len(self._upload.parts) + 1 if self._upload else 1
        return part_size_for(n, self._store.part_size)

    def write(self, data) -> None:
        if self._done:
            raise ValueError("write after publish or abort")
        try:
            mv = memoryview(data).cast("B")
            while mv.nbytes:
                room = self._next_part_size() - len(self._buf)
                take = min(room, mv.nbytes)
                self._buf += mv[:take]
                mv = mv[take:]
                if len(self._buf) == self._next_part_size():
                    self._flush_part()
        except BaseException:
            self.abort()
            raise

    def _flush_part(self) -> None:
        if self._upload is None:
            self._upload = _Multipart(self._store.client, self._store.bucket, self._name)
        self._upload.upload(bytes(self._buf))
        self._buf = bytearray()

    def publish(self) -> None:
        if self._done:
            raise ValueError("publish after publish or abort")
        try:
            if self._upload is None:
                # smaller than one part: one PUT, atomic on its own
                self._store.client.put_object(
                    bucket_name=self._store.bucket, object_name=self._name, data=io.BytesIO(self._buf),
                    length=len(self._buf), content_type="application/octet-stream")
            else:
                if self._buf or not self._upload.parts:
                    self._upload.upload(bytes(self._buf))
                self._upload.complete()
        except BaseException:
            self.abort()
            raise
        self._buf = bytearray()
        self._done = True

    def abort(self) -> None:
        """Drop the buffer and abort the multipart upload. Never raises: it runs while
        another error propagates, and must not replace it. A failed abort is logged with
        the upload id (a bucket lifecycle rule that aborts incomplete uploads after a day
        is the backstop; see docs/operations.md)."""
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        if self._upload is not None:
            try:
                self._upload.abort()
            except Exception:
                log.exception("could not abort multipart upload %s of %s/%s", self._upload.upload_id,
                              self._upload.bucket, self._upload.name)


class S3BlobStore(BlobStore):
    def __init__(self, *, bucket: str, endpoint: str, access_key: str, secret_key: str,
                 secure: bool = True, region: str | None = None, prefix: str = "",
                 part_size: int = MIN_PART_SIZE, check_bucket: bool = True) -> None:
        """`part_size` is the first part size; S3 refuses parts under 5 MiB (but the last),
        so a smaller value only makes sense against a server that allows it."""
        if not bucket:
            raise ValueError("the S3 URL names no bucket: s3://bucket?endpoint=host:port")
        if part_size <= 0:
            raise ValueError("part_size must be > 0")
        self.bucket = bucket
        self.prefix = check_key(prefix.strip("/")) + "/" if prefix.strip("/") else ""
        self.part_size = part_size
        self.endpoint = endpoint
        # direct access (s3direct.py) signs URLs for trainers with these; never sent to them
        self.secure, self.region, self.access_key, self.secret_key = secure, region, access_key, secret_key
        # Our own pool: minio's default keeps 10 connections per host, and the service runs
        # up to grpc_workers uploads at once. Retries as minio's default (idempotent calls only).
        http = urllib3.PoolManager(
            timeout=_TIMEOUT, maxsize=64, cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]))
        self.client = Minio(endpoint=endpoint, access_key=access_key, secret_key=secret_key, secure=secure,
                            region=region, http_client=http)
        if check_bucket and not self.client.bucket_exists(bucket_name=bucket):
            raise RuntimeError(f"S3 bucket {bucket!r} does not exist at {endpoint}; create it first "
                               f"(docker-compose.yml has a one-shot job that does)")

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def open_writer(self, key: str) -> _S3Writer:
        return _S3Writer(self, key)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        name = self._name(key)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError("offset and length must be >= 0")
        if length == 0:  # minio reads length=0 as "to the end"; an empty range needs no body
            if self.stat(key) is None:
                raise FileNotFoundError(key)
            return iter(())
        try:  # the request is made now, so a missing key raises here, not at the first next()
            resp = self.client.get_object(bucket_name=self.bucket, object_name=name, offset=offset,
                                          length=length or 0)
        except S3Error as e:
            if not_found(e):
                raise FileNotFoundError(key) from None
            if e.code == "InvalidRange":  # offset at or past the end: an empty read, as a file gives
                if self.stat(key) is None:
                    raise FileNotFoundError(key) from None
                return iter(())
            raise
        return self._stream(resp)

    @staticmethod
    def _stream(resp) -> Iterator[bytes]:
        try:
            for chunk in resp.stream(READ_CHUNK):
                if chunk:
                    yield chunk
        finally:
            resp.close()
            resp.release_conn()

    def stat(self, key: str) -> BlobInfo | None:
        try:
            obj = self.client.stat_object(bucket_name=self.bucket, object_name=self._name(key))
        except S3Error as e:
            if not_found(e):
                return None
            raise
        return BlobInfo(key, obj.size)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        for obj in self.client.list_objects(bucket_name=self.bucket, prefix=self.prefix + prefix, recursive=True):
            yield BlobInfo(obj.object_name[len(self.prefix):], obj.size)

    def delete(self, key: str) -> None:
        # S3's DELETE of a missing key succeeds: idempotent as the interface asks
        self.client.remove_object(bucket_name=self.bucket, object_name=self._name(key))

    def direct(self, public_endpoint: str | None = None):
        """Presigned URLs and multipart calls for direct uploads (capabilities.GrantsDirectAccess)."""
        from .s3direct import S3Direct

        return S3Direct(self, public_endpoint)

    def incomplete_uploads(self, key_prefix: str = "", initiated: bool = False) -> list[tuple]:
        """(object name, upload id) of every multipart upload under this store's prefix (and
        `key_prefix` under it) not yet completed or aborted, and when it began if `initiated`
        (a datetime, None where the store does not say). For operators, tests and the
        direct uploads' sweep (domain/dataplane/grants.py): after publish or abort there is none."""
        out: list[tuple] = []
        key_marker = upload_marker = None
        while True:
            res = self.client._list_multipart_uploads(  # minio 7 has no public call for this
                bucket_name=self.bucket, prefix=self.prefix + key_prefix, key_marker=key_marker,
                upload_id_marker=upload_marker)
            out += [(u.object_name, u.upload_id, *((u.initiated_time,) if initiated else ())) for u in res.uploads]
            if not res.is_truncated:
                return out
            key_marker, upload_marker = res.next_key_marker, res.next_upload_id_marker


_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def s3_from_url(url: str, *, access_key: str | None, secret_key: str | None, **kw) -> S3BlobStore:
    """``s3://bucket[/prefix]?endpoint=host:port&secure=false&region=...``"""
    p = urlparse(url)
    if p.username or p.password:
        raise ValueError("put no credentials in the S3 URL; set LASTGOOD_S3_ACCESS_KEY and LASTGOOD_S3_SECRET_KEY")
    query = parse_qs(p.query, keep_blank_values=True)
    unknown = set(query) - {"endpoint", "secure", "region"}
    if unknown:
        raise ValueError(f"unknown S3 URL parameter(s) {sorted(unknown)}; use endpoint, secure, region")
    one = {k: v[-1] for k, v in query.items()}
    secure = one.get("secure", "true").lower()
    if secure not in _BOOL:
        raise ValueError(f"secure= must be true or false, got {one['secure']!r}")
    if not access_key or not secret_key:
        raise ValueError("an s3:// blob URL needs LASTGOOD_S3_ACCESS_KEY and LASTGOOD_S3_SECRET_KEY")
    return S3BlobStore(bucket=p.hostname or "", endpoint=one.get("endpoint") or "s3.amazonaws.com",
                       access_key=access_key, secret_key=secret_key, secure=_BOOL[secure],
                       region=one.get("region") or None, prefix=p.path, **kw)
