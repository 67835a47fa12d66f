"""Storage faults reach the trainer by name, and a full disk can be freed by lastgood's own GC.

A small tmpfs stands in for a full volume (mounting one needs root: the test is skipped
with the reason elsewhere); EIO comes from the testing-only `blob_eio` failpoint, a store
wrapper whose writes fail as a dying device's do."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import grpc
import numpy as np
import pytest

from .helpers import Client, http, json_error, rpc_error, shard_name

MiB = 1024 * 1024

pytestmark = pytest.mark.slow  # service restarts / a mounted volume


@pytest.fixture
def small_volume(tmp_path):
    mnt = tmp_path / "vol"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def big_shard(seed: int) -> bytes:
    """A valid safetensors shard of about 3 MiB (random, so nothing compresses it away)."""
    from lastgood.wire.format import TensorSpec, plan_layout

    arr = np.random.default_rng(seed).random(3 * MiB // 4, dtype=np.float32)
    layout = plan_layout([TensorSpec("model.w", "F32", arr.shape)], {"lastgood.format": "1"})
    buf = bytearray(layout.size)
    buf[:layout.data_start] = layout.header
    a, b = layout.offsets["model.w"]
    buf[a:b] = arr.tobytes()
    return bytes(buf)


def save(c: Client, run: str, step: int, parent: int) -> int:
    cid = c.begin(run, step, 1, parent, "a1").checkpoint_id
    c.put(cid, 0, shard_name(0), big_shard(step), chunk=MiB)
    assert c.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    return cid


@pytest.mark.parametrize("ballast", [4 * MiB, 0], ids=["ballast", "control-no-ballast"])
def test_a_full_volume_refuses_saves_by_name_and_gc_frees_it(make_service, small_volume, ballast):
    svc = make_service(small_volume / "data", LASTGOOD_RETENTION="latest:1,last-good,branch-heads",
                       LASTGOOD_GC_INTERVAL="0", LASTGOOD_GC_GRACE_SECONDS="0",
                       LASTGOOD_STORE_RESERVE_BYTES=str(4 * MiB), LASTGOOD_BALLAST_BYTES=str(ballast))
    run = f"full-{uuid.uuid4().hex[:6]}"
    ids, parent = [], 0
    with Client(svc.grpc_target) as c:
        for step in range(1, 40):
            try:
                parent = save(c, run, step, parent)
                ids.append(parent)
            except grpc.RpcError as e:
                # refused before a byte was written, with the free space: not INTERNAL
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "store full" in e.details() and "bytes free" in e.details()
                break
        else:
            pytest.fail("the volume never filled")
    assert len(ids) >= 3
    metrics = http(svc).get("/metrics").text
    assert "lastgood_store_free_bytes" in metrics

    # something else takes the last byte of the volume
    filler = small_volume / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    assert os.statvfs(small_volume).f_bavail == 0

    gc = http(svc).post("/api/v1/gc")
    if not ballast:  # control: the catalog cannot record a deletion at 0 bytes free; said by name, as JSON
        assert gc.status_code == 507 and gc.json()["error"]["code"] == "store_full", gc.text
        filler.unlink()
        return
    assert gc.status_code == 200, gc.text  # the ballast gave GC the room to record its deletions
    result = gc.json()["result"]
    assert sorted(result["deleted"]) == sorted(ids[:-1]) and result["bytes_freed"] > 0
    filler.unlink()
    with Client(svc.grpc_target) as c:
        save(c, run, 100, ids[-1])  # saves go on
    assert (small_volume / "data" / ".lastgood-ballast").stat().st_size == 4 * MiB  # held again


def test_an_io_error_reaches_the_trainer_as_unavailable(make_service, run_name):
    svc = make_service(LASTGOOD_FAILPOINT="blob_eio")
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name, 1).checkpoint_id
        e = rpc_error(grpc.StatusCode.UNAVAILABLE, c.put, cid, 0, shard_name(0), big_shard(1), chunk=MiB)
        assert "I/O error on ckpt/" in e.details()


def test_a_save_that_cannot_fit_is_refused_at_begin(make_service, small_volume, run_name):
    """A rank declares at begin what it is about to upload: a store without room for it
    refuses the begin, so no rank uploads a byte and no checkpoint is left pending.
    Control: a size that fits begins as before."""
    from lastgood.wire.v1 import lastgood_pb2 as pb

    svc = make_service(small_volume / "data", LASTGOOD_STORE_RESERVE_BYTES=str(4 * MiB))
    free = os.statvfs(small_volume).f_bavail * os.statvfs(small_volume).f_frsize
    with Client(svc.grpc_target) as c:
        def begin(step: int, expected: int):
            return c.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
                run=run_name, step=step, world_size=1, attempt="a1", expected_bytes=expected), timeout=20)

        e = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, begin, 1, free)
        assert "store full" in e.details() and "bytes free" in e.details()
        json_error(http(svc).get(f"/api/v1/runs/{run_name}/checkpoints"), 404)  # nothing was begun
        assert begin(2, MiB).status == "PENDING"  # control
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, begin, 3, -1)
