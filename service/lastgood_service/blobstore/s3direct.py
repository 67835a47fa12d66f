"""Direct access to an S3 store for trainers that hold no credentials: presigned URLs, and
the multipart calls the service makes around them (domain/dataplane/grants.py uses them).

Why our own SigV4 presigning (about thirty lines) instead of minio's `get_presigned_url`:
minio signs the host alone. A grant for one part signs the part's CRC32 too
(`x-amz-checksum-crc32` in SignedHeaders), so the URL admits exactly one content: a
request without that header, or with another value, fails the signature, and bytes that do
not match it fail the store's own check (BadDigest). The URL also signs the object key,
the upload id and the part number, and lasts `expires` seconds: it cannot be used for
another key, another upload or after its time (docs/direct-s3.md).

Path-style URLs (`http(s)://endpoint/bucket/key`), which AWS S3, MinIO, Ceph RGW and
LocalStack all serve. `public_endpoint` is the endpoint the trainers reach the store at when
it differs from the service's (LASTGOOD_S3_PUBLIC_ENDPOINT): the signature covers the host,
so the URL is signed for the host the trainer will send.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass
from urllib.parse import quote, urlparse

from minio.error import S3Error

from lastgood.wire.s3parts import CHECKSUM_HEADER

from .s3errors import not_found

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
MAX_EXPIRES = 7 * 24 * 3600  # SigV4's limit on a presigned URL


def parse_endpoint(value: str, secure: bool = True) -> tuple[str, str]:
    """(scheme, host[:port]) of an endpoint written `scheme://host[:port]` or `host[:port]`
    (then https unless `secure` is false). Settings check LASTGOOD_S3_PUBLIC_ENDPOINT with it.
    The scheme's default port (https 443, http 80) is dropped: HTTP clients leave it out of
    the Host header they send, and the signature covers that header, so a URL signed for
    `host:443` would fail the store's check (SignatureDoesNotMatch)."""
    ep = value if "://" in value else f"{'https' if secure else 'http'}://{value}"
    p = urlparse(ep)
    try:
        port = p.port
    except ValueError:
        port = -1
    if (p.scheme not in ("http", "https") or not p.hostname or p.path not in ("", "/") or p.query or p.username
            or port == -1):
        raise ValueError(f"an S3 endpoint is scheme://host[:port], got {value!r}")
    netloc = p.netloc
    if port == {"http": 80, "https": 443}[p.scheme]:
        netloc = netloc[:netloc.rfind(":")]
    return p.scheme, netloc


@dataclass(frozen=True)
class StoredPart:
    number: int
    size: int
    etag: str
    crc32: str | None  # what the store computed and kept; None: it keeps none


def composite(etags: list[str], crc32s: list[str]) -> tuple[str, str]:
    """The ETag and CRC32 S3 gives the object a multipart upload of these parts completes
    into: MD5 of the parts' binary MD5s, CRC32 of their binary CRC32s, each with `-<parts>`."""
    n = len(crc32s)
    etag = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in etags)).hexdigest()
    crc = zlib.crc32(b"".join(base64.b64decode(c) for c in crc32s))
    return f"{etag}-{n}", f"{base64.b64encode(crc.to_bytes(4, 'big')).decode()}-{n}"


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _q(s: str) -> str:
    return quote(s, safe="-_.~")


class S3Direct:
    """The direct-access calls on one S3BlobStore (its client, bucket, prefix and keys)."""

    def __init__(self, store, public_endpoint: str | None = None) -> None:
        self.store = store
        self.scheme, self.host = parse_endpoint(public_endpoint or store.endpoint, store.secure)
        self.region = store.region or "us-east-1"

    # ------------------------------------------------------------ presigned URLs
    def presign(self, method: str, key: str, expires: int, query: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, now: dt.datetime | None = None) -> str:
        """A SigV4 query-signed URL for `method` on `key`, signing `headers` (lowercase
        names) besides the host: the caller must send them with exactly these values."""
        if not 1 <= expires <= MAX_EXPIRES:
            raise ValueError(f"a presigned URL lasts 1..{MAX_EXPIRES} s, not {expires}")
        now = now or dt.datetime.now(dt.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        scope = f"{day}/{self.region}/s3/aws4_request"
        signed = {"host": self.host, **{k.lower(): v.strip() for k, v in (headers or {}).items()}}
        names = ";".join(sorted(signed))
        params = {**(query or {}), "X-Amz-Algorithm": "AWS4-HMAC-SHA256",
                  "X-Amz-Credential": f"{self.store.access_key}/{scope}", "X-Amz-Date": amz_date,
                  "X-Amz-Expires": str(int(expires)), "X-Amz-SignedHeaders": names}
        path = "/" + quote(f"{self.store.bucket}/{self.store._name(key)}", safe="/-_.~")
        canonical_query = "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(params.items()))
        canonical_headers = "".join(f"{k}:{signed[k]}\n" for k in sorted(signed))
        request = "\n".join([method, path, canonical_query, canonical_headers, names, "UNSIGNED-PAYLOAD"])
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
        k = _sign(("AWS4" + self.store.secret_key).encode(), day)
        for part in (self.region, "s3", "aws4_request"):
            k = _sign(k, part)
        signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        return f"{self.scheme}://{self.host}{path}?{canonical_query}&X-Amz-Signature={signature}"

    def presign_part(self, key: str, upload_id: str, number: int, crc32: str, expires: int) -> str:
        return self.presign("PUT", key, expires, {"partNumber": str(number), "uploadId": upload_id},
                            {CHECKSUM_HEADER: crc32})

    def presign_get(self, key: str, expires: int) -> str:
        return self.presign("GET", key, expires)

    # ------------------------------------------------------------ multipart, with the service's credentials
    def _call(self, method: str, key: str, query: dict, body: bytes | None = None, headers: dict | None = None):
        return self.store.client._execute(method, self.store.bucket, self.store._name(key), body=body,
                                          headers=headers, query_params=query)

    def create_upload(self, key: str) -> str:
        """A multipart upload whose parts each carry a CRC32 the store checks and keeps."""
        return self.store.client._create_multipart_upload(
            bucket_name=self.store.bucket, object_name=self.store._name(key),
            headers={"Content-Type": "application/octet-stream", "x-amz-checksum-algorithm": "CRC32"})

    def list_parts(self, key: str, upload_id: str) -> list[StoredPart]:
        """The parts the store holds, as the store describes them (no byte is read)."""
        out: list[StoredPart] = []
        marker = None
        while True:
            q = {"uploadId": upload_id, "max-parts": "1000", **({"part-number-marker": marker} if marker else {})}
            root = ET.fromstring(self._call("GET", key, q).data)
            for p in root.iter(f"{_NS}Part"):
                out.append(StoredPart(int(p.findtext(f"{_NS}PartNumber")), int(p.findtext(f"{_NS}Size")),
                                      (p.findtext(f"{_NS}ETag") or "").strip('"'),
                                      p.findtext(f"{_NS}ChecksumCRC32")))
            if (root.findtext(f"{_NS}IsTruncated") or "false").lower() != "true":
                return out
            marker = root.findtext(f"{_NS}NextPartNumberMarker")

    def complete(self, key: str, upload_id: str, parts: list[StoredPart]) -> None:
        root = ET.Element("CompleteMultipartUpload", xmlns=_NS.strip("{}"))
        for p in parts:
            e = ET.SubElement(root, "Part")
            ET.SubElement(e, "PartNumber").text = str(p.number)
            ET.SubElement(e, "ETag").text = f'"{p.etag}"'
            if p.crc32:
                ET.SubElement(e, "ChecksumCRC32").text = p.crc32
        body = ET.tostring(root)
        md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
        resp = self._call("POST", key, {"uploadId": upload_id}, body,
                          {"Content-Type": "application/xml", "Content-MD5": md5})
        # S3 may answer 200 with an error document when the completion fails late
        root = ET.fromstring(resp.data) if resp.data else None
        if root is not None and root.tag in ("Error", f"{_NS}Error"):
            raise RuntimeError(f"completing the upload of {key} failed: {root.findtext('Code')} "
                               f"{root.findtext('Message')}")

    def completed(self, key: str) -> tuple[int, str, str | None] | None:
        """(size, ETag, CRC32) of the object at `key` as the store reports them (HEAD, no
        byte read), or None when there is none. A multipart object's ETag and CRC32 are
        composite (`...-N`): of its parts' ETags and CRC32s, which `composite` recomputes."""
        try:
            r = self._call("HEAD", key, {}, headers={"x-amz-checksum-mode": "ENABLED"})
        except S3Error as e:
            if not_found(e) or e.code == "ResourceNotFound":
                return None
            raise
        return (int(r.headers.get("Content-Length", -1)), (r.headers.get("ETag") or "").strip('"'),
                r.headers.get(CHECKSUM_HEADER))

    def abort_upload(self, key_or_name: str, upload_id: str, *, named: bool = False) -> None:
        """Abort one upload; one already gone counts as aborted."""
        name = key_or_name if named else self.store._name(key_or_name)
        try:
            self.store.client._abort_multipart_upload(bucket_name=self.store.bucket, object_name=name,
                                                      upload_id=upload_id)
        except S3Error as e:
            if e.code != "NoSuchUpload":
                raise

    def uploads(self, key_prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of the uploads not completed or aborted under `key_prefix`."""
        n = len(self.store.prefix)
        return [(name[n:], uid) for name, uid in self.store.incomplete_uploads(key_prefix)]

    def uploads_since(self, key_prefix: str) -> list[tuple[str, str, dt.datetime | None]]:
        """(key, upload id, when it began) of the same uploads."""
        n = len(self.store.prefix)
        return [(name[n:], uid, t) for name, uid, t in self.store.incomplete_uploads(key_prefix, initiated=True)]
