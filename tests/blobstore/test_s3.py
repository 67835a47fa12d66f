"""What only the S3 store has: bounded part buffering, multipart clean-up on failure, the URL
and settings that select it, and prefixes. Against moto's S3 server over real HTTP."""

from __future__ import annotations

import random

import pytest
from minio.error import S3Error

from lastgood.wire.hashing import hash_bytes
from lastgood_service.blobstore import open_blobstore
from lastgood_service.blobstore.s3 import (MAX_PARTS, MIN_PART_SIZE, S3BlobStore, _Multipart, part_size_for,
                                           s3_from_url)
from lastgood_service.settings import Settings
from tests.s3 import ACCESS_KEY, SECRET_KEY

MiB = 1024 * 1024


def test_part_sizes_cover_the_largest_shard_within_the_s3_part_limit():
    assert part_size_for(1) == part_size_for(1000) == MIN_PART_SIZE == 5 * MiB
    assert part_size_for(1001) == 10 * MiB
    covered = sum(part_size_for(n) for n in range(1, MAX_PARTS + 1))
    assert covered >= 256 * 1024**3  # Settings.max_shard_bytes' default
    largest_for_256g, total, n = 0, 0, 0
    while total < 256 * 1024**3:
        n += 1
        largest_for_256g = part_size_for(n)
        total += largest_for_256g
    assert largest_for_256g <= 160 * MiB  # the most one writer ever buffers at the default limit


def test_writer_buffers_at_most_one_part_and_uploads_in_parts(s3_server, s3_bucket):
    store = s3_server.store(s3_bucket)
    data = random.Random(3).randbytes(17 * MiB + 5)
    w = store.open_writer("ckpt/1/r0/stream")
    most = 0
    for off in range(0, len(data), 3 * MiB + 1):
        w.write(data[off:off + 3 * MiB + 1])
        most = max(most, w.buffered)
    assert most < MIN_PART_SIZE
    assert w.upload_id is not None and [u for _, u in store.incomplete_uploads()] == [w.upload_id]
    w.publish()
    assert store.incomplete_uploads() == []
    stat = s3_server.client().stat_object(bucket_name=s3_bucket, object_name="ckpt/1/r0/stream")
    assert stat.etag.endswith("-4"), stat.etag  # 3 full parts of 5 MiB and the 2 MiB rest: a multipart object
    assert hash_bytes(store.read_all("ckpt/1/r0/stream")) == hash_bytes(data)


def test_a_failed_complete_aborts_the_upload(s3_server, s3_bucket):
    """S3 refuses to complete an upload whose non-last parts are under 5 MiB (EntityTooSmall).
    A store configured with 1 MiB parts meets that refusal for real."""
    client = s3_server.client()
    data = random.Random(4).randbytes(3 * MiB)

    # control: the same calls without the writer's safeguard leave an incomplete upload behind
    bare = _Multipart(client, s3_bucket, "ckpt/2/r0/bare")
    bare.upload(data[:MiB])
    bare.upload(data[MiB:])
    with pytest.raises(S3Error) as info:
        bare.complete()
    assert info.value.code == "EntityTooSmall"
    assert [u.upload_id for u in client._list_multipart_uploads(bucket_name=s3_bucket).uploads] == [bare.upload_id]
    bare.abort()

    store = s3_server.store(s3_bucket, part_size=MiB)
    w = store.open_writer("ckpt/2/r0/small-parts")
    w.write(data)
    assert len(store.incomplete_uploads()) == 1
    with pytest.raises(S3Error) as info:
        w.publish()
    assert info.value.code == "EntityTooSmall"
    assert store.incomplete_uploads() == []  # the safeguard: publish aborted the upload
    assert store.stat("ckpt/2/r0/small-parts") is None
    w.abort()  # the service's `with` block aborts again: harmless


def test_a_failed_write_aborts_the_upload(s3_server, s3_bucket, monkeypatch):
    """A write that fails after parts went up (here S3's part-count limit, lowered to 2 so
    the test reaches it) aborts the multipart upload by itself."""
    import lastgood_service.blobstore.s3 as s3mod

    monkeypatch.setattr(s3mod, "MAX_PARTS", 2)
    store = s3_server.store(s3_bucket)
    w = store.open_writer("ckpt/3/r0/x")
    w.write(random.Random(5).randbytes(10 * MiB))
    assert len(store.incomplete_uploads()) == 1  # control: two parts are up, the upload is open
    with pytest.raises(ValueError, match="at most 2 parts"):
        w.write(random.Random(6).randbytes(5 * MiB))
    assert store.incomplete_uploads() == [] and store.stat("ckpt/3/r0/x") is None
    with pytest.raises(ValueError):
        w.write(b"more")  # the writer is finished
    w.abort()


def test_prefix_keeps_stores_apart(s3_server, s3_bucket):
    a = s3_server.store(s3_bucket, prefix="team-a")
    b = s3_server.store(s3_bucket, prefix="team-b/lastgood")
    a.put_bytes("ckpt/1/manifest.json", b"a")
    b.put_bytes("ckpt/1/manifest.json", b"bb")
    assert [(i.key, i.size) for i in a.list()] == [("ckpt/1/manifest.json", 1)]
    assert [(i.key, i.size) for i in b.list("ckpt/")] == [("ckpt/1/manifest.json", 2)]
    names = sorted(o.object_name for o in s3_server.client().list_objects(bucket_name=s3_bucket, recursive=True))
    assert names == ["team-a/ckpt/1/manifest.json", "team-b/lastgood/ckpt/1/manifest.json"]
    with pytest.raises(ValueError):
        s3_server.store(s3_bucket, prefix="../other")


def test_open_blobstore_takes_credentials_from_settings(s3_server, s3_bucket):
    settings = Settings(s3_access_key=ACCESS_KEY, s3_secret_key=SECRET_KEY)
    store = open_blobstore(s3_server.url(s3_bucket, prefix="p"), settings)
    assert isinstance(store, S3BlobStore) and store.bucket == s3_bucket and store.prefix == "p/"
    store.put_bytes("k", b"v")
    assert s3_server.client().stat_object(bucket_name=s3_bucket, object_name="p/k").size == 1
    assert "lastgood-test-secret-key" not in repr(settings)  # a SecretStr: never printed


def test_settings_read_s3_credentials_from_the_environment(monkeypatch):
    monkeypatch.setenv("LASTGOOD_S3_ACCESS_KEY", "ak")
    monkeypatch.setenv("LASTGOOD_S3_SECRET_KEY", "sk")
    s = Settings()
    assert s.s3_access_key == "ak" and s.s3_secret_key.get_secret_value() == "sk"


@pytest.mark.parametrize("url,creds,word", [
    ("s3://ak:sk@bucket?endpoint=127.0.0.1:1", True, "credentials"),
    ("s3://bucket?endpoint=127.0.0.1:1&secure=perhaps", True, "secure"),
    ("s3://bucket?endpoint=127.0.0.1:1&acl=public", True, "unknown"),
    ("s3://?endpoint=127.0.0.1:1", True, "bucket"),
    ("s3://bucket?endpoint=127.0.0.1:1", False, "LASTGOOD_S3_ACCESS_KEY"),
])
def test_bad_s3_urls_are_refused_with_the_reason(url, creds, word):
    settings = Settings(s3_access_key=ACCESS_KEY, s3_secret_key=SECRET_KEY) if creds else Settings()
    with pytest.raises(ValueError, match=word):
        open_blobstore(url, settings)


def test_a_missing_bucket_is_a_clear_error_at_start(s3_server):
    with pytest.raises(RuntimeError, match="does not exist"):
        s3_from_url(s3_server.url("no-such-bucket-here"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
