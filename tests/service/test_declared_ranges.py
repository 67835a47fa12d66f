"""Range digests of files the service never reads (docs/resharding.md, "Who computes
them"; service domain/commit/declared_ranges.py): a direct S3 upload declares them with its
hand-over, the service checks their shape and writes them into the file's index object,
and a restore at another world size then reads that file by ranges (presigned ranged
GETs, counted at the transport) instead of whole. Hostile declarations are refused and
leave nothing behind. Against LocalStack's S3, which checks the parts' CRC32s (`store`)."""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time

import pytest
import torch
from safetensors.torch import save as st_save

import lastgood
from lastgood.datapath import directs3
from lastgood.restore import readplan
from lastgood.errors import FailedPrecondition, InvalidArgument
from lastgood.wire.ranges import RangeHasher
from lastgood.datapath.transport import Transport

from lastgood_service.domain.keys import shard_name as shard_name_of
from tests.service.test_direct_s3 import MiB, begin, direct_service, training

pytestmark = pytest.mark.slow  # LocalStack


def test_a_direct_upload_declares_its_range_digests_and_is_read_by_ranges(make_service, tmp_path, localstack,
                                                                          ls_bucket, run_name):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    cap = svc.info["range_block_bytes"]
    model, opt = training(0)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        ckpt.save(3, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
    cid = svc.get(f"/api/v1/runs/{run_name}/last-good").json()["id"]
    t = Transport(svc.url)
    entry = t.manifest(cid).files(0)[0]
    assert "chunks" in entry.index  # the root says where its shards lie, as for a service-verified file
    whole, digest = t.read_file(cid, 0, entry.name, entry.size)
    assert digest == entry.xxh3_128

    assert readplan._open(t, 0, entry, readplan.RangeReader(t, cid)) is not None, \
        "the index object of a directly uploaded file has no range digests (read whole at another world size)"
    entry = entry.with_index(0, t.index_bytes(cid, 0, entry.name))
    ranges = RangeHasher(entry.data_start, entry.tensors, cap)  # the service's rule over the stored bytes
    ranges.update(whole)
    assert entry.digests == ranges.digests()

    # one tensor's middle: ranged GETs of its covering segments, not the file
    name, t0 = max(entry.tensors.items(), key=lambda kv: kv[1]["offsets"][1] - kv[1]["offsets"][0])
    a = entry.data_start + t0["offsets"][0] + 1000
    b = a + 300 * 1024
    before, requests = t.shard_bytes, t.range_requests
    out = bytearray(b - a)
    readplan.RangeReader(t, cid).read(0, entry, readplan.RangeDigests(entry.data_start, entry.tensors, entry.digests),
                                      a, b, out)
    assert bytes(out) == bytes(whole[a:b])
    read = t.shard_bytes - before
    assert t.range_requests > requests and b - a <= read <= b - a + 2 * cap < entry.size // 4
    t.close()


def safetensors_file(size: int) -> bytes:
    g = torch.Generator().manual_seed(0)
    return st_save({"a": torch.randn(size // 8, generator=g), "b": torch.randn(size // 8, generator=g)})


def mangled(digests: dict, how: str) -> dict:
    d = {**digests, "tensors": {k: list(v) for k, v in digests["tensors"].items()}}
    if how == "too_many_blocks":
        d["tensors"]["a"] = d["tensors"]["a"] * 300  # ~0.5 MB: under the body limit
    elif how == "wrong_extents":
        d["tensors"]["a"] = d["tensors"]["a"][:-1]
        d["tensors"]["b"] = d["tensors"]["b"] + ["0" * 32]
    elif how == "unknown_tensor":
        d["tensors"]["c"] = ["0" * 32]
    elif how == "header_not_the_header":
        d["header"] = "0" * 32
    elif how == "not_hex":
        d["tensors"]["b"] = ["zz" * 16] * len(d["tensors"]["b"])
    return d


@pytest.mark.parametrize("how", ["too_many_blocks", "wrong_extents", "unknown_tensor", "header_not_the_header",
                                 "not_hex", "control"])
def test_hostile_declared_digests_are_refused_and_change_nothing(make_service, tmp_path, localstack, ls_bucket,
                                                                run_name, how):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t = Transport(svc.url)
    cid = begin(t, run_name)
    data = safetensors_file(6 * MiB)
    prepared = directs3.prepare(data, 5 * MiB, svc.info["range_block_bytes"])
    assert prepared.digests is not None
    if how != "control":
        prepared = directs3.Parts(prepared.size, prepared.xxh3_128, prepared.part_size, prepared.crc32,
                                  mangled(prepared.digests, how))
    handle = directs3.upload(t, cid, 0, "rank00000.safetensors", data, prepared)
    if how == "control":
        directs3.hand_over(t, cid, 0, "rank00000.safetensors", handle)
        assert [f["name"] for f in svc.get(f"/api/v1/checkpoints/{cid}/shards").json()["ranks"][0]["files"]] \
            == ["rank00000.safetensors"]
        return
    with pytest.raises(InvalidArgument, match="declared range digests refused"):  # posted as is, however large
        t.post_json(f"/api/v1/checkpoints/{cid}/ranks/0/direct-files",
                    {"file_name": "rank00000.safetensors", "size": prepared.size, "xxh3_128": prepared.xxh3_128,
                     "part_size": prepared.part_size, "upload_id": handle.upload_id, "parts": handle.parts,
                     "digests": prepared.digests})
    # nothing recorded, nothing left under the file's key, and the rank cannot vote with it
    assert svc.get(f"/api/v1/checkpoints/{cid}/shards").json()["ranks"] == []
    assert [o for o in localstack.client().list_objects(ls_bucket, prefix="ckpt/", recursive=True)
            if o.object_name.endswith(prepared.xxh3_128)] == []
    t.close()


def test_digests_that_would_overflow_the_hand_over_body_are_dropped_and_the_save_goes_on(
        make_service, tmp_path, localstack, ls_bucket, run_name):
    """The digests fit DECLARE_BYTES, the whole hand-over (parts list and all, as serialised)
    does not fit the service's body limit: before, the hand-over got 413 and the save failed
    (it worked before digests existed). Now the writer measures the body against the limit
    the service announces and declares no digests (the file is read whole at another world
    size, as before); and a writer that does not know the limit retries a 413 without them."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, LASTGOOD_RANGE_BLOCK_BYTES=str(64 * 1024),
                         LASTGOOD_MAX_REQUEST_BYTES="2048")
    assert svc.info["max_request_bytes"] == 2048
    t = Transport(svc.url)
    data = safetensors_file(6 * MiB)
    for name, knows_the_limit in (("rank00000.safetensors", True), ("other.safetensors", False)):
        cid = begin(t, f"{run_name}-{knows_the_limit}")
        prepared = directs3.prepare(data, 5 * MiB, svc.info["range_block_bytes"])
        assert prepared.digests is not None and len(json.dumps(prepared.digests)) > 2048
        if not knows_the_limit:
            t.info = dataclasses.replace(t.info, max_request_bytes=None)  # a service that announces no limit
        handle = directs3.upload(t, cid, 0, name, data, prepared)
        directs3.hand_over(t, cid, 0, name, handle)
        assert [f["name"] for f in svc.get(f"/api/v1/checkpoints/{cid}/shards").json()["ranks"][0]["files"]] == [name]
        assert t.commit_rank(cid, 0, [name], wait=5).status == "COMMITTED"
        entry = t.manifest(cid).files(0)[0]
        assert entry.with_index(0, t.index_bytes(cid, 0, name)).digests is None  # declared none: read whole
    t.close()


def test_a_refused_declaration_does_not_delete_the_object_another_file_was_recorded_on(
        make_service, tmp_path, localstack, ls_bucket, run_name):
    """Two files of a rank with the same bytes share one object (its key derives from the xxh3-128).
    One hand-over is held (the hold_declared_index failpoint) after completing the object,
    before its declared digests are checked; the other file is recorded on that object
    meanwhile; then the held one's digests are refused. Before, the refusal deleted the
    object under the recorded file, and (store mode) its checkpoint would commit with a
    missing blob; now the object stays while a row holds it."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, LASTGOOD_FAILPOINT="hold_declared_index")
    t = Transport(svc.url)
    cid = begin(t, run_name)
    data = safetensors_file(6 * MiB)
    good = directs3.prepare(data, 5 * MiB, svc.info["range_block_bytes"])
    bad = directs3.Parts(good.size, good.xxh3_128, good.part_size, good.crc32, mangled(good.digests, "not_hex"))
    held_up = directs3.upload(t, cid, 0, "held.safetensors", data, bad)
    other_up = directs3.upload(t, cid, 0, "rank00000.safetensors", data,
                               directs3.Parts(good.size, good.xxh3_128, good.part_size, good.crc32))  # declares none
    refused = []

    def held():
        try:
            directs3.hand_over(t, cid, 0, "held.safetensors", held_up)
        except InvalidArgument as e:
            refused.append(e)

    th = threading.Thread(target=held)
    th.start()
    deadline = time.monotonic() + 60
    while "failpoint hold_declared_index: holding" not in svc.log.read_text():  # the hand-over is held
        assert time.monotonic() < deadline and th.is_alive(), svc.log.read_text()[-2000:]
        time.sleep(0.05)
    directs3.hand_over(t, cid, 0, "rank00000.safetensors", other_up)  # completes and records the same key
    (tmp_path / "svc" / "hold_declared_index.release").touch()
    th.join(60)
    assert refused and "declared range digests refused" in str(refused[0])
    keys = [o.object_name for o in localstack.client().list_objects(ls_bucket, prefix="ckpt/", recursive=True)
            if o.object_name.endswith(shard_name_of(good.xxh3_128))]
    assert len(keys) == 1, "the object the recorded file points to was deleted with the refusal"
    assert t.commit_rank(cid, 0, ["rank00000.safetensors"], wait=5).status == "COMMITTED"
    _, digest = t.read_file(cid, 0, "rank00000.safetensors", len(data))
    assert digest == good.xxh3_128
    t.close()


@pytest.mark.parametrize("wrong", [True, False])
def test_store_mode_recomputes_declared_range_digests_before_the_commit(make_service, tmp_path, localstack,
                                                                        ls_bucket, run_name, wrong):
    """In `store` mode the service reads each direct upload back for its xxh3-128 before the
    commit (domain/dataplane/grants.py) and recomputes the declared range digests in the same
    read: digests of the right shape but of other bytes (here: of the file with its last byte
    changed) abandon the checkpoint, and last-good does not move. The control (the file's own
    digests) commits, and verify() finds it whole."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t = Transport(svc.url)
    cid = begin(t, run_name)
    data = safetensors_file(6 * MiB)
    prepared = directs3.prepare(data, 5 * MiB, svc.info["range_block_bytes"])
    if wrong:
        other = bytearray(data)
        other[-1] ^= 0xFF
        digests = directs3.prepare(bytes(other), 5 * MiB, svc.info["range_block_bytes"]).digests
        assert digests != prepared.digests
        prepared = directs3.Parts(prepared.size, prepared.xxh3_128, prepared.part_size, prepared.crc32, digests)
    handle = directs3.upload(t, cid, 0, "rank00000.safetensors", data, prepared)
    directs3.hand_over(t, cid, 0, "rank00000.safetensors", handle)
    if wrong:
        with pytest.raises(FailedPrecondition, match="ABANDONED"):
            t.commit_rank(cid, 0, ["rank00000.safetensors"], wait=10)
        mismatch = [e for e in svc.get(f"/api/v1/runs/{run_name}/events").json()["items"]
                    if e["kind"] == "hash_mismatch"]
        assert mismatch and "range digests" in str(mismatch[0]), mismatch
        assert svc.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    else:
        assert t.commit_rank(cid, 0, ["rank00000.safetensors"], wait=10).status == "COMMITTED"
        r = svc.post(f"/api/v1/checkpoints/{cid}/verify")
        assert r.status_code == 200 and r.json()["ok"], r.text
    t.close()
