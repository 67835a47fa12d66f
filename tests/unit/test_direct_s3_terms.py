"""The direct-upload rules that need no store: the part layout both sides share, and URLs
signed for the public endpoint (docs/direct-s3.md). The store's side is tested against
LocalStack in tests/service/test_direct_s3.py."""

from __future__ import annotations

import datetime as dt
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from lastgood.datapath.directs3 import prepare
from lastgood.wire.s3parts import MAX_PARTS, part_layout
from lastgood_service.blobstore.s3 import S3BlobStore
from lastgood_service.settings import Settings

MiB = 1024 * 1024


def test_part_layout():
    assert part_layout(0, 5 * MiB) == (5 * MiB, 1)
    assert part_layout(5 * MiB, 5 * MiB) == (5 * MiB, 1)
    assert part_layout(5 * MiB + 1, 5 * MiB) == (5 * MiB, 2)
    size, n = part_layout(10**12, 5 * MiB)  # a 1 TB file: parts grown to fit S3's 10,000
    assert n <= MAX_PARTS and size * n >= 10**12 and size * (n - 1) < 10**12
    p = prepare(bytearray(11 * MiB), 5 * MiB)
    assert p.size == 11 * MiB and len(p.crc32) == 3 and p.crc32[0] == p.crc32[1] != p.crc32[2]


def test_urls_are_signed_for_the_public_endpoint_with_the_part_checksum():
    store = S3BlobStore(bucket="b", endpoint="minio:9000", access_key="k", secret_key="s", secure=False,
                        region="us-east-1", check_bucket=False)
    inside = urlsplit(store.direct().presign_part("ckpt/1/r0/x", "u", 1, "AAAAAA==", 60))
    public = urlsplit(store.direct("https://s3.example.org:9443").presign_part("ckpt/1/r0/x", "u", 1, "AAAAAA==", 60))
    assert (inside.scheme, inside.netloc) == ("http", "minio:9000")
    assert (public.scheme, public.netloc) == ("https", "s3.example.org:9443")
    q = parse_qs(public.query)
    assert q["X-Amz-SignedHeaders"] == ["host;x-amz-checksum-crc32"] and q["X-Amz-Expires"] == ["60"]
    assert q["partNumber"] == ["1"] and q["uploadId"] == ["u"] and public.path == "/b/ckpt/1/r0/x"
    assert parse_qs(inside.query)["X-Amz-Signature"] != q["X-Amz-Signature"]


@pytest.mark.parametrize("bad", ["ftp://host", "http://host/path", "http://", "http://u:p@host"])
def test_a_bad_public_endpoint_stops_the_service_at_start(bad):
    with pytest.raises(ValidationError, match="scheme://host"):
        Settings(s3_public_endpoint=bad)


@pytest.mark.parametrize("endpoint,plain", [("https://s3.example.org:443", "https://s3.example.org"),
                                            ("http://s3.example.org:80", "http://s3.example.org"),
                                            ("http://[::1]:80", "http://[::1]")])
def test_a_default_port_is_not_signed(endpoint, plain):
    """http.client leaves the scheme's default port out of the Host header it sends, so a
    URL signed for `host:443` fails the store's signature check (SignatureDoesNotMatch):
    the default port is dropped before signing. The control: 9443 stays (above)."""
    store = S3BlobStore(bucket="b", endpoint="minio:9000", access_key="k", secret_key="s", secure=False,
                        region="us-east-1", check_bucket=False)
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    with_port = store.direct(endpoint).presign("GET", "ckpt/1/r0/x", 60, now=now)
    assert with_port == store.direct(plain).presign("GET", "ckpt/1/r0/x", 60, now=now)
    assert urlsplit(with_port).netloc == urlsplit(plain).netloc
