"""A local store's publish fsyncs the blob's directory and every directory above it whose
entry is not known durable (blobstore/local.py, DurableDirs): a checkpoint's first blob fsyncs
its new folders up to blobs/, the next blobs in them only their own directory. A directory
removed (by the store, or by another process: a new inode) and made again is fsync'd up the
chain again, so its new entry is durable before the publish returns (I1)."""

from __future__ import annotations

import os
import shutil

from lastgood_service.blobstore import local
from lastgood_service.blobstore.local import LocalBlobStore


def test_publish_fsyncs_each_new_directory_entry_once(tmp_path, monkeypatch):
    synced = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda d: (synced.append(os.path.relpath(d, tmp_path / "s")), real(d)))
    store = LocalBlobStore(tmp_path / "s")

    def put(key: str) -> list[str]:
        synced.clear()
        store.put_bytes(key, b"x" * 100)
        return list(synced)

    # the first blob: its folder and each new one above it, up to blobs/
    assert put("ckpt/1-a/r0/shard") == ["blobs/ckpt/1-a/r0", "blobs/ckpt/1-a", "blobs/ckpt", "blobs"]
    assert put("ckpt/1-a/r0/shard.index") == ["blobs/ckpt/1-a/r0"]  # the rest is known durable
    assert put("ckpt/1-a/manifest.json") == ["blobs/ckpt/1-a"]
    assert put("ckpt/2-b/r0/shard") == ["blobs/ckpt/2-b/r0", "blobs/ckpt/2-b", "blobs/ckpt"]
    # controls: a folder the store removed, and one another process removed, are new when made again
    store.delete("ckpt/2-b/r0/shard")  # prunes r0/ and 2-b/
    assert put("ckpt/2-b/r0/shard") == ["blobs/ckpt/2-b/r0", "blobs/ckpt/2-b", "blobs/ckpt"]
    shutil.rmtree(tmp_path / "s" / "blobs" / "ckpt" / "1-a" / "r0")
    hold = tmp_path / "s" / "blobs" / "hold"  # keeps r0's old inode number from coming back at once
    hold.mkdir()
    assert put("ckpt/1-a/r0/shard") == ["blobs/ckpt/1-a/r0", "blobs/ckpt/1-a"]
    assert store.read_all("ckpt/1-a/r0/shard") == b"x" * 100
