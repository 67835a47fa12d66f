"""Direct uploads to S3 (domain/dataplane/grants.py, lastgood/datapath/directs3.py, docs/direct-s3.md), against a
real service and LocalStack's S3, which verifies part checksums and presigned URLs
(tests/localstack.py); moto, which verifies neither, is the control that shows why the
`store` verification needs a checking store."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from torch import nn

import lastgood
from lastgood.datapath import directs3
from lastgood.wire import s3parts
from lastgood.errors import FailedPrecondition
from lastgood.datapath.transport import Transport
from lastgood_service.domain import keys

from .helpers import metric  # noqa: F401 - also imported from here by other tests

pytestmark = pytest.mark.slow  # a LocalStack of its own for the session, a service per test

MiB = 1024 * 1024
DIRECT = {"LASTGOOD_DIRECT_S3": "true", "LASTGOOD_VERIFICATION": "store", "LASTGOOD_DIRECT_S3_PART_SIZE": str(5 * MiB),
          "LASTGOOD_LEASE_SECONDS": "20"}


def direct_service(make_service, tmp_path, server, bucket, **env):
    return make_service(data_dir=tmp_path / "svc", **server.env(bucket), **{**DIRECT, **env})


def training(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))  # ~6 MiB of weights
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).square().mean().backward()
    opt.step()
    return model, opt


def round_trip(url: str, run: str):
    """Save a trained model and optimizer at step 3, restore them into another one, and
    check every tensor bitwise: (the saved pair, the restored pair)."""
    model, opt = training(0)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        ckpt.save(3, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
    model2, opt2 = training(1)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt2.state_dict()["state"][i][k]), (i, k)
    return (model, opt), (model2, opt2)


def shard(size: int, seed: int = 0) -> bytearray:
    return bytearray(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
                     .numpy().tobytes())


def begin(t: Transport, run: str, step: int = 1, world: int = 1) -> int:
    return t.begin(run, step, world, None, "a1", 0).checkpoint_id


def test_direct_save_and_restore_round_trip_bitwise(make_service, tmp_path, localstack, ls_bucket, run_name):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    assert svc.info["direct_s3"]["checksum"] == "crc32"
    round_trip(svc.url, run_name)

    # the bytes went to the store and came back from it, never through the service
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    entry = lg["manifest"]["ranks"][0]["files"][0]
    assert entry["size"] > 3 * 5 * MiB
    assert metric(svc, "lastgood_bytes_ingested_total") == 0
    assert metric(svc, "lastgood_bytes_served_total") == 0
    key = keys.shard_key(keys.prefix(lg["id"], run_name, 3, lg["attempt"]), 0, entry["xxh3_128"])
    stat = localstack.client().stat_object(bucket_name=ls_bucket, object_name=key)
    assert stat.size == entry["size"] and stat.etag.endswith(f"-{-(-entry['size'] // (5 * MiB))}")  # in parts
    kinds = [e["kind"] for e in svc.get(f"/api/v1/runs/{run_name}/events", params={"limit": 100}).json()["items"]]
    assert "direct_upload" in kinds
    assert localstack.uploads(ls_bucket) == []


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group: single rank" warning
def test_a_dcp_save_goes_direct_too(make_service, tmp_path, localstack, ls_bucket, run_name):
    """DCP's StorageWriter saves through the same session, so through the same data path."""
    from tests.client.test_dcp_session import assert_loads_back, save

    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    save(svc.url, run_name)
    assert_loads_back(svc.url, run_name)
    assert metric(svc, "lastgood_bytes_ingested_total") == metric(svc, "lastgood_bytes_served_total") == 0


def upload_corrupted(svc, run: str, corrupt: bool, world: int = 1):
    """Begin, checksum the file, then (if `corrupt`) change a byte of part 2 before uploading."""
    t = Transport(svc.url)
    cid = begin(t, run, world=world)
    data = shard(12 * MiB)
    prepared = directs3.prepare(data, 5 * MiB)
    if corrupt:
        data[7 * MiB] ^= 0xFF  # bytes changed after their checksum was computed
    return t, cid, data, prepared


@pytest.mark.parametrize("corrupt", [True, False], ids=["corrupted", "control"])
def test_a_corrupted_part_is_refused_by_the_store_and_never_commits(make_service, tmp_path, localstack, ls_bucket,
                                                                    run_name, corrupt):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t, cid, data, prepared = upload_corrupted(svc, run_name, corrupt)
    if corrupt:
        with pytest.raises(directs3.StoreRefused) as e:
            directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)
        assert e.value.store_code == "BadDigest"
        with pytest.raises(FailedPrecondition, match="not verified"):  # nothing to vote with
            t.commit_rank(cid, 0, ["rank00000.bin"], wait=0)
        t.abort(cid, "corrupted part", 0)
        assert svc.get(f"/api/v1/checkpoints/{cid}").json()["status"] == "ABANDONED"
        assert svc.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
        assert localstack.uploads(ls_bucket) == []  # the abort ended the checkpoint's upload
    else:
        handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)
        assert [p["number"] for p in handle.parts] == [1, 2, 3]
        directs3.hand_over(t, cid, 0, "rank00000.bin", handle)
        assert t.commit_rank(cid, 0, ["rank00000.bin"], wait=5).status == "COMMITTED"
        view, digest = t.read_file(cid, 0, "rank00000.bin", len(data))  # a presigned GET
        assert bytes(view) == bytes(data) and digest == prepared.xxh3_128
    t.close()


def test_a_checkpointer_whose_bytes_change_after_checksumming_fails_the_save(make_service, tmp_path, localstack,
                                                                            ls_bucket, run_name, monkeypatch):
    """The same fault through the Checkpointer: its save fails, it aborts the checkpoint, the
    abort aborts the upload, and last-good stays where it was (the control is the round trip)."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    real = directs3.prepare

    def prepare_then_corrupt(data, part_size, *rest):  # rest: the range digests' cap
        prepared = real(data, part_size, *rest)
        data[len(data) // 2] ^= 0xFF  # the staging buffer changes after its checksums were computed
        return prepared

    monkeypatch.setattr(directs3, "prepare", prepare_then_corrupt)
    model, opt = training(0)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        with pytest.raises(lastgood.SaveFailed, match="BadDigest"):
            ckpt.wait()
    statuses = [c["status"] for c in svc.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]]
    assert statuses == ["ABANDONED"]
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    assert localstack.uploads(ls_bucket) == []


def test_a_hand_over_that_disagrees_with_the_store_is_refused(make_service, tmp_path, localstack, ls_bucket,
                                                              run_name):
    """The service believes the store's listing, not the rank: a part it names with another
    CRC32 (or a part missing) refuses the file, and the checkpoint cannot commit."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t, cid, data, prepared = upload_corrupted(svc, run_name, corrupt=False)
    handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)
    handle.parts[1]["crc32"] = handle.parts[0]["crc32"]
    r = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/direct-files",
                 json={"file_name": "rank00000.bin", "size": len(data), "xxh3_128": prepared.xxh3_128,
                       "upload_id": handle.upload_id, "parts": handle.parts})
    assert r.status_code == 422 and "part 2's CRC32" in r.json()["error"]["message"], r.text
    with pytest.raises(FailedPrecondition, match="not verified"):
        t.commit_rank(cid, 0, ["rank00000.bin"], wait=0)
    assert localstack.uploads(ls_bucket) == []  # the refused upload is aborted at once
    t.close()


def test_moto_does_not_catch_the_corrupted_part(make_service, tmp_path, s3_server, s3_bucket, run_name):
    """Control: the same corrupted upload on moto is accepted by the store, so there the
    `store` verification would vouch for bytes nobody checked."""
    svc = direct_service(make_service, tmp_path, s3_server, s3_bucket)
    t, cid, data, prepared = upload_corrupted(svc, run_name, corrupt=True)
    handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)  # no BadDigest
    assert [p["number"] for p in handle.parts] == [1, 2, 3]
    t.close()


def test_an_expired_grant_and_a_grant_used_for_another_key_are_refused_by_the_store(
        make_service, tmp_path, localstack, ls_bucket, run_name):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, LASTGOOD_DIRECT_S3_GRANT_SECONDS="2")
    t = Transport(svc.url)
    cid = begin(t, run_name)
    data = shard(1000)
    prepared = directs3.prepare(data, 5 * MiB)
    body = {"file_name": "rank00000.bin", "size": len(data), "xxh3_128": prepared.xxh3_128,
            "crc32": prepared.crc32}
    g = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/grants", json=body).json()
    url, crc = g["parts"][0]["url"], g["parts"][0]["crc32"]
    piece = memoryview(data)

    def put(u, header=crc):
        return directs3._put_part(t, u, g["checksum_header"], header, piece, 1)

    name = keys.shard_name(prepared.xxh3_128)
    assert f"/r0/{name}" in url and prepared.xxh3_128 not in url  # the key names no digest (domain/keys.py)
    other = url.replace(f"/r0/{name}", f"/r0/{'0' * 32}")  # another key of the same checkpoint
    with pytest.raises(directs3.StoreRefused) as e:
        put(other)
    assert e.value.status == 403, e.value
    with pytest.raises(directs3.StoreRefused) as e:  # another checksum than the one granted
        put(url, s3parts.crc32_b64(0))
    assert e.value.status == 403, e.value
    time.sleep(3)
    with pytest.raises(directs3.StoreRefused) as e:
        put(url)
    assert e.value.status == 403 and "expired" in str(e.value).lower(), e.value
    # control: a fresh grant for the same part is accepted
    g2 = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/grants", json=body).json()
    assert put(g2["parts"][0]["url"])
    t.close()


KILLED_RANK = """
import os, signal, sys
from lastgood.datapath import directs3
from lastgood.wire import s3parts
from lastgood.datapath.transport import Transport
t = Transport(sys.argv[1])
cid = t.begin(sys.argv[2], 1, 1, None, "a1", 0).checkpoint_id
data = bytearray(os.urandom(12 * 1024 * 1024))
prepared = directs3.prepare(data, 5 * 1024 * 1024)
g = t.post_json(f"/api/v1/checkpoints/{cid}/ranks/0/grants", {"file_name": "rank00000.bin", "size": len(data),
                "xxh3_128": prepared.xxh3_128, "crc32": prepared.crc32})
p = g["parts"][0]
directs3._put_part(t, p["url"], g["checksum_header"], p["crc32"], memoryview(data)[:5 * 1024 * 1024], 1)
print(cid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # killed mid-upload: one part of three sent, no hand-over, no abort
"""


def test_a_rank_killed_mid_upload_leaves_an_abandoned_checkpoint_and_no_upload(
        make_service, tmp_path, localstack, ls_bucket, run_name):
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, LASTGOOD_LEASE_SECONDS="3")
    proc = subprocess.run([sys.executable, "-c", KILLED_RANK, svc.url, run_name], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    cid = int(proc.stdout.split()[0])
    assert len(localstack.uploads(ls_bucket)) == 1  # the open upload the rank left
    deadline = time.monotonic() + 60
    while svc.get(f"/api/v1/checkpoints/{cid}").json()["status"] != "ABANDONED":
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while localstack.uploads(ls_bucket):  # the expiry aborts it
        assert time.monotonic() < deadline, localstack.uploads(ls_bucket)
        time.sleep(0.2)

    # GC's sweep: an upload the expiry did not see (a service that died in between) is aborted too
    ck = svc.get(f"/api/v1/checkpoints/{cid}").json()
    key = keys.shard_key(keys.prefix(cid, run_name, 1, ck["attempt"]), 0, "f" * 32)
    localstack.store(ls_bucket).direct().create_upload(key)
    assert len(localstack.uploads(ls_bucket)) == 1
    assert svc.post("/api/v1/gc").status_code == 200
    assert localstack.uploads(ls_bucket) == []


def test_direct_uploads_are_off_by_default(make_service, tmp_path, localstack, ls_bucket, run_name):
    svc = make_service(data_dir=tmp_path / "svc", **localstack.env(ls_bucket))
    assert svc.info["direct_s3"] is None
    t = Transport(svc.url)
    cid = begin(t, run_name)
    r = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/grants",
                 json={"file_name": "rank00000.bin", "size": 1, "xxh3_128": "0" * 32, "crc32": ["AAAAAA=="]})
    assert r.status_code == 409 and "direct uploads are off" in r.json()["error"]["message"]
    t.close()


@pytest.mark.parametrize("tampered", [False, True], ids=["retried", "control-other-parts"])
def test_a_hand_over_retried_after_the_upload_was_completed(make_service, tmp_path, localstack, ls_bucket, run_name,
                                                            tampered):
    """The service dies after it completed the upload and before it recorded the file (the
    failpoint): the upload id is gone, yet the rank's retried hand-over is confirmed from the
    completed object and commits. The control: a retry naming other parts is refused."""
    lease = {"LASTGOOD_LEASE_SECONDS": "60"}  # a restart under load must not expire the checkpoint
    crashing = direct_service(make_service, tmp_path, localstack, ls_bucket,
                              LASTGOOD_FAILPOINT="crash_after_direct_complete", **lease)
    t, cid, data, prepared = upload_corrupted(crashing, run_name, corrupt=False)
    handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)
    body = {"file_name": "rank00000.bin", "size": len(data), "xxh3_128": prepared.xxh3_128,
            "upload_id": handle.upload_id, "parts": handle.parts}
    with pytest.raises(httpx.HTTPError):  # the process exits before it answers
        crashing.post(f"/api/v1/checkpoints/{cid}/ranks/0/direct-files", json=body)
    t.close()
    assert localstack.uploads(ls_bucket) == []  # completed: the upload id is gone

    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, **lease)
    if tampered:
        body["parts"] = [dict(p, crc32=handle.parts[0]["crc32"]) for p in handle.parts]
    r = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/direct-files", json=body)
    t = Transport(svc.url)
    if tampered:
        assert r.status_code == 422, r.text
        with pytest.raises(FailedPrecondition, match="not verified"):
            t.commit_rank(cid, 0, ["rank00000.bin"], wait=0)
    else:
        assert r.status_code == 200 and r.json()["already_present"] is False, r.text
        assert t.commit_rank(cid, 0, ["rank00000.bin"], wait=5).status == "COMMITTED"
        view, digest = t.read_file(cid, 0, "rank00000.bin", len(data))
        assert bytes(view) == bytes(data) and digest == prepared.xxh3_128
        # and once more: the file is recorded, so the hand-over is a no-op
        assert svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/direct-files", json=body).json()["already_present"]
    t.close()


def test_a_direct_restore_of_a_checkpoint_whose_object_is_gone_falls_back_to_its_parent(
        make_service, tmp_path, localstack, ls_bucket, run_name):
    """The store answers 404 for a committed file's object: that is damage, as a missing blob
    is on the streamed path, so the restore falls back to the parent (the round trip above is
    the control that restores the newest)."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    model, opt = training(0)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        for step in (1, 2):
            ckpt.save(step, lastgood.TrainState(model=model, optimizer=opt))
            ckpt.wait()
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["step"] == 2
    entry = lg["manifest"]["ranks"][0]["files"][0]
    key = keys.shard_key(keys.prefix(lg["id"], run_name, 2, lg["attempt"]), 0, entry["xxh3_128"])
    localstack.client().remove_object(bucket_name=ls_bucket, object_name=key)
    model2, opt2 = training(1)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 1
    assert svc.get(f"/api/v1/checkpoints/{lg['id']}").json()["status"] == "CORRUPT"


def test_a_service_restarted_with_direct_uploads_off_gets_the_stream(make_service, tmp_path, localstack, ls_bucket,
                                                                     run_name):
    """The client learned the direct terms when it connected; the service restarts with
    them off. The next save is refused its grant (direct_off), so the client refreshes the
    service's info and streams that save; a restore reads through the service too. The
    first save, direct, is the control."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    model, opt = training(0)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        assert metric(svc, "lastgood_bytes_ingested_total") == 0  # direct
        svc.env.update(LASTGOOD_DIRECT_S3="false", LASTGOOD_VERIFICATION="service")  # the service hashes again
        svc.restart()
        assert svc.info["direct_s3"] is None
        model.state_dict()["0.bias"].add_(1)
        ckpt.save(2, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        assert metric(svc, "lastgood_bytes_ingested_total") > 0  # streamed
        model2, opt2 = training(1)
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k


def test_a_rank_that_checksummed_with_another_part_size_is_still_granted(make_service, tmp_path, localstack,
                                                                         ls_bucket, run_name):
    """The service's part size changed since the rank learned its terms (5 MiB here, 6 MiB
    there: 3 parts against 2 for 12 MiB). The rank's part size travels with the grant and
    the hand-over, so the upload is laid out as the rank checksummed it and commits."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket,
                         LASTGOOD_DIRECT_S3_PART_SIZE=str(6 * MiB))
    t, cid, data, prepared = upload_corrupted(svc, run_name, corrupt=False)  # checksummed at 5 MiB
    handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)
    assert [p["number"] for p in handle.parts] == [1, 2, 3]
    directs3.hand_over(t, cid, 0, "rank00000.bin", handle)
    assert t.commit_rank(cid, 0, ["rank00000.bin"], wait=5).status == "COMMITTED"
    r = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/grants",  # out of S3's bounds: a clear 422
                 json={"file_name": "rank00001.bin", "size": 1, "xxh3_128": "0" * 32, "crc32": ["AAAAAA=="],
                       "part_size": MiB})
    assert r.status_code == 422 and "part_size" in r.text, r.text
    t.close()


@pytest.mark.parametrize("same_bytes", [False, True], ids=["other-bytes", "control-same-bytes"])
def test_a_file_claiming_another_files_hash_cannot_overwrite_its_object(make_service, tmp_path, localstack, ls_bucket,
                                                                      run_name, same_bytes):
    """Two files of one rank that claim one xxh3-128 share one key. The service cannot
    check the claim (it reads no byte), so a second file with other bytes is refused
    rather than completed over the first's object; the same bytes are recorded on it."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t, cid, data, prepared = upload_corrupted(svc, run_name, corrupt=False)
    directs3.hand_over(t, cid, 0, "a.bin", directs3.upload(t, cid, 0, "a.bin", data, prepared))
    other = data if same_bytes else shard(len(data), seed=1)
    claimed = directs3.Parts(len(other), prepared.xxh3_128, prepared.part_size,
                             directs3.prepare(other, 5 * MiB).crc32)  # the first file's hash, claimed
    body = {"file_name": "b.bin", "size": len(other), "xxh3_128": claimed.xxh3_128, "crc32": claimed.crc32}
    r = svc.post(f"/api/v1/checkpoints/{cid}/ranks/0/grants", json=body)
    if same_bytes:
        assert r.status_code == 200 and r.json()["already_present"], r.text
        assert t.commit_rank(cid, 0, ["a.bin", "b.bin"], wait=5).status == "COMMITTED"
    else:
        assert r.status_code == 409 and "'a.bin'" in r.json()["error"]["message"], r.text
        assert t.commit_rank(cid, 0, ["a.bin"], wait=5).status == "COMMITTED"
    view, digest = t.read_file(cid, 0, "a.bin", len(data))
    assert bytes(view) == bytes(data) and digest == prepared.xxh3_128
    t.close()


def test_gc_aborts_an_upload_whose_checkpoint_row_is_gone(make_service, tmp_path, localstack, ls_bucket, run_name):
    """An upload under a checkpoint this catalog has no row for (a row purged, a catalog
    rebuilt or restored from a backup) is aborted by GC once it is older than a grant can
    live; before, an unknown checkpoint counted as PENDING and its upload stayed forever."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket, LASTGOOD_DIRECT_S3_GRANT_SECONDS="1")
    key = keys.shard_key(keys.prefix(987654, run_name, 1, "a1"), 0, "f" * 32)
    localstack.store(ls_bucket).direct().create_upload(key)
    assert len(localstack.uploads(ls_bucket)) == 1
    time.sleep(2.5)  # older than the grant lifetime
    assert svc.post("/api/v1/gc").status_code == 200
    assert localstack.uploads(ls_bucket) == []


@pytest.mark.parametrize("lie", [True, False], ids=["xxh3-of-other-bytes", "control"])
def test_store_mode_confirms_the_declared_xxh3_against_the_stored_object(make_service, tmp_path, localstack,
                                                                          ls_bucket, run_name, lie):
    """The store checks the parts' CRC32s, which a rank computes from the bytes it uploads; the
    xxh3-128 it declares beside them the store never sees. A rank that sends correct CRC32s
    with the xxh3-128 of other bytes (a client that hashed another buffer than it uploaded):
    the store takes every part, the hand-over answers, and the service's read of the object
    finds the digest wrong - the checkpoint is abandoned, last-good does not move (before,
    it committed and only a later `verify` marked it CORRUPT). Control: the true digest commits."""
    svc = direct_service(make_service, tmp_path, localstack, ls_bucket)
    t = Transport(svc.url)
    try:
        cid = begin(t, run_name)
        data = shard(11 * MiB, seed=5)
        prepared = directs3.prepare(data, 5 * MiB)
        if lie:
            other = bytearray(data)
            other[3 * MiB] ^= 0xFF
            prepared = dataclasses.replace(prepared, xxh3_128=directs3.prepare(other, 5 * MiB).xxh3_128)
        handle = directs3.upload(t, cid, 0, "rank00000.bin", data, prepared)  # the store takes every part
        directs3.hand_over(t, cid, 0, "rank00000.bin", handle)
        if lie:
            with pytest.raises(FailedPrecondition, match="ABANDONED"):
                t.commit_rank(cid, 0, ["rank00000.bin"], wait=10)
        else:
            assert t.commit_rank(cid, 0, ["rank00000.bin"], wait=10).status == "COMMITTED"
    finally:
        t.close()
    kinds = [e["kind"] for e in svc.get(f"/api/v1/runs/{run_name}/events").json()["items"]]
    assert ("hash_mismatch" in kinds) == lie and ("commit" in kinds) != lie
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good")
    assert (lg.status_code == 404) == lie, lg.text
