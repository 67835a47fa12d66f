"""A shard's key does not name its declared digest (domain/keys.py: a peer checker that could read
it off a path or a presigned GET could report it unread), and a store whose shards are named by
the digest itself, as older stores are, is still rebuilt and read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lastgood.wire.hashing import hash_bytes
from lastgood_service.domain import keys

import pytest

from .helpers import Client, checkpoint, http, shard_blob, shard_name


def test_a_shard_key_is_stable_per_digest_and_does_not_contain_it():
    digest = hash_bytes(b"some bytes")
    key = keys.shard_key("ckpt/7-0123456789abcdef/", 0, digest)
    assert digest not in key and key == keys.shard_key("ckpt/7-0123456789abcdef/", 0, digest)
    assert key != keys.shard_key("ckpt/7-0123456789abcdef/", 0, hash_bytes(b"other bytes"))
    assert keys.legacy_shard_key("ckpt/7-0123456789abcdef/", 0, digest).endswith("/" + digest)  # the control
    assert keys.parse(key).prefix == "ckpt/7-0123456789abcdef/"


def test_a_saved_shard_s_blob_is_not_named_by_its_digest(svc, run_name):
    with Client(svc.grpc_target) as c:
        cid, shards = c.save(run_name, 1)
    assert shard_blob(svc, cid, 0).name != hash_bytes(shards[0])
    assert shard_blob(svc, cid, 0).name == keys.shard_name(hash_bytes(shards[0]))


@pytest.mark.slow
def test_a_store_with_digest_named_shards_is_rebuilt_and_read(make_service, run_name, tmp_path):
    svc = make_service(tmp_path / "svc")
    with Client(svc.grpc_target) as c:
        cid, shards = c.save(run_name, 1)
    svc.stop()
    blob = shard_blob(svc, cid, 0)
    blob.rename(blob.parent / hash_bytes(shards[0]))  # where an older store keeps it
    for f in (tmp_path / "svc").glob("catalog.db*"):
        f.unlink()
    env = {**os.environ, "LASTGOOD_DATA_DIR": str(tmp_path / "svc")}
    for cmd in (["migrate"], ["rebuild"]):
        done = subprocess.run([sys.executable, "-m", "lastgood_service.main", *cmd], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["restored"] == [cid]
    svc = make_service(tmp_path / "svc")
    assert checkpoint(svc, cid)["status"] == "COMMITTED"
    got = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}")
    assert got.status_code == 200 and got.content == shards[0]
    assert http(svc).post(f"/api/v1/checkpoints/{cid}/verify").json()["ok"]


def test_the_shard_name_example_in_the_format_spec():
    """docs/format.md §3 quotes this pair."""
    assert keys.shard_name("99aa06d3014798d86001c324468d497f") == "64b78499f92fe33644c8143065f167dd"
    assert hash_bytes(b"") == "99aa06d3014798d86001c324468d497f"
