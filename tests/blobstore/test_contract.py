"""One contract for every BlobStore: local, memory and S3 (moto's S3 server over HTTP), and the
metering wrapper (over local) that the service puts in front of them.

Each backend also says what temporary state it can leave behind (`leftovers`): local's
tmp/ files, S3's incomplete multipart uploads, nothing for memory. Tests that check "abort
leaves nothing" first see that state while a write is open (the control: the probe can
see a leftover), then see it gone.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from lastgood.wire.hashing import hash_bytes
from lastgood_service.blobstore import BlobStore, LocalBlobStore, MemoryBlobStore
from lastgood_service.blobstore import capabilities
from lastgood_service.blobstore.base import READ_CHUNK
from lastgood_service.blobstore.capabilities import (AdoptsFiles, GrantsDirectAccess, LendsLocalPaths,
                                                       ReportsFreeSpace)
from lastgood_service.blobstore.metered import MeteredBlobStore
from lastgood_service.domain.dataplane.spool import Taken
from lastgood_service.metrics import Metrics

MiB = 1024 * 1024


@dataclass
class Backend:
    name: str
    store: BlobStore
    leftovers: Callable[[], list]
    has_temp_state: bool  # whether an open writer shows up in leftovers() (memory keeps it in the writer)


@pytest.fixture(params=["local", "memory", "s3", "metered"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        store = LocalBlobStore(tmp_path / "store")
        return Backend("local", store, lambda: sorted(p.name for p in store.tmp_dir.iterdir()), True)
    if request.param == "metered":
        inner = LocalBlobStore(tmp_path / "store")
        return Backend("metered", MeteredBlobStore(inner, Metrics()),
                       lambda: sorted(p.name for p in inner.tmp_dir.iterdir()), True)
    if request.param == "memory":
        return Backend("memory", MemoryBlobStore(), lambda: [], False)
    s3 = request.getfixturevalue("s3_server")
    store = s3.store(request.getfixturevalue("s3_bucket"))
    return Backend("s3", store, store.incomplete_uploads, True)


def payload(n: int, seed: int = 1) -> bytes:
    """n pseudo-random bytes: no repeating block can hide a misplaced range."""
    return random.Random(seed).randbytes(n)


def read(store: BlobStore, key: str, offset: int = 0, length: int | None = None) -> bytes:
    chunks = list(store.get(key, offset, length))
    assert all(0 < len(c) <= READ_CHUNK for c in chunks), [len(c) for c in chunks]
    return b"".join(chunks)


def test_put_get_stat_list_delete(backend):
    s = backend.store
    data = payload(100_000)
    s.put_bytes("ckpt/1/r0/aa", data)
    assert s.stat("ckpt/1/r0/aa").size == len(data)
    assert s.stat("ckpt/1/r0/aa").key == "ckpt/1/r0/aa"
    assert read(s, "ckpt/1/r0/aa") == data
    assert s.read_all("ckpt/1/r0/aa") == data
    assert [(i.key, i.size) for i in s.list()] == [("ckpt/1/r0/aa", len(data))]
    s.delete("ckpt/1/r0/aa")
    assert s.stat("ckpt/1/r0/aa") is None
    assert list(s.list()) == []
    assert backend.leftovers() == []


def test_list_by_prefix(backend):
    s = backend.store
    keys = {"ckpt/1/r0/aa": 3, "ckpt/1/r1/bb": 4, "ckpt/12/r0/cc": 5, "ckpt/2/manifest.json": 6, "other/x": 7}
    for k, n in keys.items():
        s.put_bytes(k, payload(n))
    assert sorted((i.key, i.size) for i in s.list()) == sorted(keys.items())
    assert sorted(i.key for i in s.list("ckpt/1/")) == ["ckpt/1/r0/aa", "ckpt/1/r1/bb"]
    assert sorted(i.key for i in s.list("ckpt/1")) == ["ckpt/1/r0/aa", "ckpt/1/r1/bb", "ckpt/12/r0/cc"]
    assert list(s.list("nothing/")) == []


@pytest.mark.parametrize("offset,length", [
    (0, None), (0, 1), (7, 10), (4095, 3), (99_990, None), (99_990, 10), (99_990, 1000),  # clipped at the end
    (99_999, 1), (100_000, None), (100_000, 5), (123_456, None), (50_000, 0), (0, 0), (0, 100_000),
])
def test_ranged_get(backend, offset, length):
    s = backend.store
    data = payload(100_000)
    s.put_bytes("ckpt/5/r0/range", data)
    want = data[offset:] if length is None else data[offset:offset + length]
    assert read(s, "ckpt/5/r0/range", offset, length) == want


def test_missing_key_raises_at_the_call(backend):
    s = backend.store
    with pytest.raises(FileNotFoundError):
        s.get("ckpt/9/r0/none")  # not iterated: the error must come from the call itself
    with pytest.raises(FileNotFoundError):
        s.get("ckpt/9/r0/none", 5, 0)
    assert s.stat("ckpt/9/r0/none") is None


def test_empty_blob(backend):
    s = backend.store
    s.put_bytes("ckpt/3/empty", b"")
    assert s.stat("ckpt/3/empty").size == 0
    assert read(s, "ckpt/3/empty") == b""
    assert backend.leftovers() == []


def test_nothing_visible_before_publish(backend):
    s = backend.store
    data = payload(6 * MiB + 123)  # more than one S3 part, so S3 has a multipart upload open
    w = s.open_writer("ckpt/4/r0/pub")
    w.write(data[:3 * MiB])
    w.write(data[3 * MiB:])
    assert s.stat("ckpt/4/r0/pub") is None
    assert list(s.list()) == []
    with pytest.raises(FileNotFoundError):
        s.get("ckpt/4/r0/pub")
    if backend.has_temp_state:  # control: the probe does see an open write
        assert len(backend.leftovers()) == 1
    w.publish()
    assert s.stat("ckpt/4/r0/pub").size == len(data)
    assert hash_bytes(read(s, "ckpt/4/r0/pub")) == hash_bytes(data)
    assert backend.leftovers() == []
    w.abort()  # after publish: does nothing
    assert s.stat("ckpt/4/r0/pub").size == len(data)


def test_abort_leaves_nothing(backend):
    s = backend.store
    w = s.open_writer("ckpt/4/r0/gone")
    w.write(payload(6 * MiB))
    if backend.has_temp_state:
        assert len(backend.leftovers()) == 1, "control: an open write must be visible to the probe"
    w.abort()
    w.abort()  # twice is harmless
    assert s.stat("ckpt/4/r0/gone") is None
    assert list(s.list()) == []
    assert backend.leftovers() == []


def test_leaving_the_with_block_by_an_exception_aborts(backend):
    s = backend.store
    with pytest.raises(RuntimeError, match="hash mismatch"):
        with s.open_writer("ckpt/4/r1/bad") as w:
            w.write(payload(5 * MiB + 1))
            if backend.has_temp_state:
                assert len(backend.leftovers()) == 1
            raise RuntimeError("hash mismatch")  # what the service does when the bytes are wrong
    assert s.stat("ckpt/4/r1/bad") is None
    assert list(s.list()) == []
    assert backend.leftovers() == []


def test_small_write_aborted_leaves_nothing(backend):
    s = backend.store
    w = s.open_writer("ckpt/4/r2/small")
    w.write(b"abc")
    w.abort()
    assert s.stat("ckpt/4/r2/small") is None
    assert backend.leftovers() == []


def test_publishing_the_same_bytes_twice_is_harmless(backend):
    s = backend.store
    data = payload(10_000)
    s.put_bytes("ckpt/6/r0/twice", data)
    s.put_bytes("ckpt/6/r0/twice", data)
    assert read(s, "ckpt/6/r0/twice") == data
    assert [i.key for i in s.list()] == ["ckpt/6/r0/twice"]


BAD_KEYS = ["", "/etc/passwd", "../escape", "ckpt/../../etc", "ckpt/./x", "a//b", "a/", "/", ".hidden",
            "ckpt/1/..", "Upper/case", "a\\b", "a\x00b", "sp ace", "ckpt/1/r0/x?y", "a/%2e%2e/b", "~root"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=[repr(k) for k in BAD_KEYS])
def test_keys_that_could_escape_are_refused(backend, key):
    s = backend.store
    s.put_bytes("ckpt/1/keep", b"x")
    for op in (lambda: s.open_writer(key), lambda: s.get(key), lambda: s.stat(key), lambda: s.delete(key),
               lambda: s.put_bytes(key, b"data")):
        with pytest.raises(ValueError):
            op()
    assert [i.key for i in s.list()] == ["ckpt/1/keep"]
    assert backend.leftovers() == []


def test_delete_is_idempotent(backend):
    s = backend.store
    s.delete("ckpt/7/never")
    s.put_bytes("ckpt/7/once", b"abc")
    s.delete("ckpt/7/once")
    s.delete("ckpt/7/once")
    assert s.stat("ckpt/7/once") is None
    with pytest.raises(FileNotFoundError):
        s.get("ckpt/7/once")


def uneven_pieces(data: bytes):
    sizes = [1, 4099, MiB - 1, 3 * MiB + 17, 7, 2 * MiB + 5, 65536, 5 * MiB + 1]
    off = i = 0
    while off < len(data):
        n = sizes[i % len(sizes)]
        yield data[off:off + n]
        off += n
        i += 1


def test_large_streamed_write_in_uneven_pieces(backend):
    s = backend.store
    data = payload(12 * MiB + 12345, seed=7)
    with s.open_writer("ckpt/8/r0/big") as w:
        for piece in uneven_pieces(data):
            w.write(piece)
        assert s.stat("ckpt/8/r0/big") is None
        w.publish()
    assert s.stat("ckpt/8/r0/big").size == len(data)
    got = read(s, "ckpt/8/r0/big")
    assert len(got) == len(data) and hash_bytes(got) == hash_bytes(data)
    for off, n in [(5 * MiB - 3, 10), (10 * MiB - 1, 2), (12 * MiB, 12345), (1, 11 * MiB)]:  # across part boundaries
        assert read(s, "ckpt/8/r0/big", off, n) == data[off:off + n]
    assert backend.leftovers() == []


# ---------------------------------------------------------------- optional capabilities
# (blobstore/capabilities.py): each store that has one passes its part; the others are
# asked nothing, and the helpers answer for them.

def needs(backend: Backend, capability: type) -> None:
    if not isinstance(backend.store, capability):
        pytest.skip(f"{backend.name} has no {capability.__name__}")


def test_free_bytes_is_a_count(backend):
    needs(backend, ReportsFreeSpace)
    free = backend.store.free_bytes()
    assert isinstance(free, int) and free > 0


def test_local_path_is_the_published_blob_only(backend):
    needs(backend, LendsLocalPaths)
    s = backend.store
    data = payload(10_000, seed=3)
    s.put_bytes("ckpt/9/r0/aa", data)
    assert s.local_path("ckpt/9/r0/aa").read_bytes() == data
    assert s.local_path("ckpt/9/r0/missing") is None
    with s.open_writer("ckpt/9/r0/bb") as w:
        w.write(data)
        assert s.local_path("ckpt/9/r0/bb") is None  # nothing visible before publish
        w.abort()


def _taken(directory, data: bytes) -> Taken:
    directory.mkdir(exist_ok=True)
    path = directory / f"{os.urandom(16).hex()}.part"
    path.write_bytes(data)
    return Taken(path, os.open(path, os.O_RDONLY), len(data))


def test_an_adopted_file_becomes_the_blob(backend, tmp_path):
    needs(backend, AdoptsFiles)
    s = backend.store
    data = payload(3 * MiB + 5, seed=4)
    taken = _taken(tmp_path / "spool", data)
    w = s.adopt_writer("ckpt/10/r0/aa", taken)
    assert w is not None, "a file on the store's own file system can be adopted"
    try:
        with w:
            for piece in taken.chunks(MiB):  # the caller hashes through the descriptor and passes it on
                w.write(piece)
            assert s.stat("ckpt/10/r0/aa") is None
            w.publish()
    finally:
        taken.close()
    assert read(s, "ckpt/10/r0/aa") == data
    assert not taken.path.exists()  # the file is the blob now, not a copy


def test_a_store_that_adopts_files_says_so_before_one_is_there(backend, tmp_path):
    """A followed hand-over (domain/dataplane/spool.Followed) is adopted only once its hash names the
    blob, so whether the spool's files can be adopted is asked of the directory first."""
    needs(backend, AdoptsFiles)
    (tmp_path / "spool").mkdir()
    assert backend.store.adopts_from(tmp_path / "spool")
    assert capabilities.adopts_from(backend.store, tmp_path / "spool")
    assert not capabilities.adopts_from(MemoryBlobStore(), tmp_path / "spool")  # no capability: no


def test_an_aborted_adoption_leaves_the_file_to_its_owner(backend, tmp_path):
    needs(backend, AdoptsFiles)
    s = backend.store
    taken = _taken(tmp_path / "spool", b"x" * 100)
    try:
        with pytest.raises(RuntimeError), s.adopt_writer("ckpt/11/r0/aa", taken) as w:
            w.write(b"x" * 100)
            raise RuntimeError("the hash did not match")
        assert taken.path.read_bytes() == b"x" * 100 and s.stat("ckpt/11/r0/aa") is None
    finally:
        taken.close()
    assert backend.leftovers() == []


def test_a_store_without_a_capability_is_asked_nothing():
    store = MemoryBlobStore()
    assert not isinstance(store, (AdoptsFiles, LendsLocalPaths, ReportsFreeSpace))
    store.put_bytes("ckpt/12/r0/aa", b"abc")
    assert capabilities.local_path(store, "ckpt/12/r0/aa") is None
    assert capabilities.free_bytes(store) is None
    assert capabilities.adopt_writer(store, "ckpt/12/r0/bb", object()) is None


def test_direct_access_uploads_and_reads_through_presigned_urls(backend):
    """GrantsDirectAccess (s3direct.py): what a trainer does with the URLs, with no
    credentials, and what the service's calls see of it. Checksums are checked only by a
    store that checks them: that part is tested against LocalStack (tests/service/test_direct_s3.py)."""
    needs(backend, GrantsDirectAccess)
    import urllib.request

    from lastgood.datapath import directs3
    from lastgood.remote.retry import NO_RETRY

    class NoRetry:
        retry = NO_RETRY

    d = backend.store.direct()
    data = bytearray(payload(5 * MiB + 7, seed=5))
    prepared = directs3.prepare(data, 5 * MiB)
    key = "ckpt/12/r0/" + prepared.xxh3_128
    upload_id = d.create_upload(key)
    other = d.create_upload(key)
    assert sorted(u for k, u in d.uploads("ckpt/12/") if k == key) == sorted([upload_id, other])
    etags = [directs3._put_part(NoRetry, d.presign_part(key, upload_id, n, crc, 60), "x-amz-checksum-crc32", crc,
                                memoryview(data)[(n - 1) * 5 * MiB:n * 5 * MiB], n)
             for n, crc in enumerate(prepared.crc32, 1)]
    assert backend.store.stat(key) is None  # nothing visible before completion
    parts = d.list_parts(key, upload_id)
    assert [(p.number, p.size, p.etag) for p in parts] == [(1, 5 * MiB, etags[0]), (2, 7, etags[1])]
    d.complete(key, upload_id, parts)
    d.abort_upload(key, other)
    d.abort_upload(key, other)  # one already gone counts as aborted
    assert backend.leftovers() == [] and d.uploads("ckpt/12/") == []
    assert read(backend.store, key) == bytes(data)
    with urllib.request.urlopen(d.presign_get(key, 60), timeout=30) as r:
        assert r.read() == bytes(data)
