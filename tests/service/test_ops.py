"""Observability and limits: Prometheus metrics, structured logs, oversize requests and
too many streams refused before memory is spent on them."""

from __future__ import annotations

import json
import re
import signal
import threading

import grpc
import pytest

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import Client, http, make_shard, shard_name


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


@pytest.mark.slow
def test_metrics_follow_what_happens(make_service, run_name):
    svc = make_service(LASTGOOD_GC_INTERVAL="0", LASTGOOD_GC_GRACE_SECONDS="0",
                       LASTGOOD_RETENTION="latest:1,last-good,branch-heads")
    h = http(svc)
    before = h.get("/metrics").text
    assert metric(before, "lastgood_commits_total") == 0 and metric(before, "lastgood_pending_checkpoints") == 0
    c = Client(svc.grpc_target)
    try:
        first, shards = c.save(run_name, 1)
        c.save(run_name, 2, parent_id=first)
        pending = c.begin(run_name, step=3).checkpoint_id
        data = make_shard(0)
        with pytest.raises(grpc.RpcError):
            c.put(pending, 0, shard_name(0), data, xxh3="0" * 32)
        c.read(first, 0, shard_name(0))
    finally:
        c.close()
    text = h.get("/metrics").text
    assert metric(text, "lastgood_commits_total") == 2
    assert metric(text, "lastgood_bytes_ingested_total") == 2 * len(shards[0])
    assert metric(text, "lastgood_hash_mismatches_total") == 1
    assert metric(text, "lastgood_pending_checkpoints") == 1
    assert metric(text, "lastgood_bytes_served_total") == len(shards[0])
    assert metric(text, "lastgood_save_seconds_count") == 2 and metric(text, "lastgood_commit_seconds_count") == 2
    assert metric(text, "lastgood_restore_seconds_count") == 1
    freed = h.post("/api/v1/gc").json()["result"]["bytes_freed"]
    assert freed > 0 and metric(h.get("/metrics").text, "lastgood_gc_bytes_freed_total") == freed


@pytest.mark.slow
def test_json_logs_carry_run_and_checkpoint_ids(make_service, run_name):
    svc = make_service(LASTGOOD_LOG_FORMAT="json")
    with Client(svc.grpc_target) as c:
        cid, _ = c.save(run_name, 7)
    lines = [json.loads(line) for line in svc.log.read_text().splitlines() if line.startswith("{")]
    assert lines, "no JSON log lines"
    commit = [x for x in lines if x.get("checkpoint_id") == cid and "committed" in x["message"]]
    assert commit and commit[0]["run"] == run_name and commit[0]["step"] == 7 and commit[0]["level"] == "INFO"


@pytest.mark.slow
def test_oversized_rest_body_is_refused_before_it_is_read(make_service, run_name):
    svc = make_service(LASTGOOD_MAX_REQUEST_BYTES="2048")
    with Client(svc.grpc_target) as c:
        cid, _ = c.save(run_name, 1)
    h = http(svc)
    r = h.post(f"/api/v1/runs/{run_name}/events", json={"kind": "note", "data": {"x": "a" * 4000}})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    chunked = h.post(f"/api/v1/runs/{run_name}/events", content=iter([b'{"kind": "note", "data": {"x": "',
                                                                       b"a" * 4000, b'"}}']),
                     headers={"content-type": "application/json"})
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    assert h.post(f"/api/v1/runs/{run_name}/events", json={"kind": "note", "data": {"x": "a"}}).status_code == 200


@pytest.mark.slow
def test_too_many_streams_from_one_client_are_refused(make_service, run_name):
    svc = make_service(LASTGOOD_MAX_STREAMS_PER_CLIENT="1")
    c = Client(svc.grpc_target)
    release = threading.Event()
    data = make_shard(0)
    try:
        first = c.begin(run_name, step=1, world_size=2).checkpoint_id

        def slow():  # header, one byte, then hold the stream open
            yield pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=first, rank=0, file_name=shard_name(0),
                                                           size=len(data), xxh3_128=hash_bytes(data)))
            yield pb.PutShardRequest(chunk=data[:1])
            release.wait(30)
            yield pb.PutShardRequest(chunk=data[1:])

        held = c.stub.PutShard.future(slow(), timeout=60)
        tmp = svc.blob_root / "tmp"
        for _ in range(200):  # the held stream is open on the service once its temp file exists
            if list(tmp.glob("*.part")):
                break
            threading.Event().wait(0.05)
        assert list(tmp.glob("*.part")), "the held stream never reached the service"
        other = c.begin(run_name, step=2).checkpoint_id
        with pytest.raises(grpc.RpcError) as info:
            c.put(other, 0, shard_name(0), data)
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams" in err.details()
        release.set()
        held.result()
        c.put(other, 0, shard_name(0), data)  # control: with the first stream done, accepted
    finally:
        release.set()
        c.close()


def test_startup_objects_are_frozen_out_of_pythons_gc(make_service):
    """A started service exempts its start-up objects from Python's cyclic GC (pygc.py), so
    a full collection does not walk ~110,000 objects inside some query or GC batch; the
    control, with the setting off, freezes nothing."""
    on = metric(http(make_service()).get("/metrics").text, "lastgood_python_gc_frozen_objects")
    off = metric(http(make_service(LASTGOOD_PYTHON_GC_FREEZE="false")).get("/metrics").text,
                 "lastgood_python_gc_frozen_objects")
    assert on > 10_000 and off == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_service_cleanly_and_at_once(make_service, sig):
    """SIGTERM (an orchestrator) and SIGINT (Ctrl+C) stop the service promptly, whatever its
    housekeeping tick (main.py's _Server wakes on a signal), and both exit cleanly, through
    the service's own stop (gRPC's grace for calls in flight, the catalog closed): uvicorn
    re-raises the signal after its graceful HTTP shutdown, which must end neither in a
    KeyboardInterrupt traceback and status 130 (a review finding: it did) nor, for
    SIGTERM, in the default handler's death before that stop (it did)."""
    svc = make_service()
    svc.proc.send_signal(sig)
    code = svc.wait_exit(timeout=15)
    log = svc.log.read_text()
    assert "Traceback" not in log, log[-2000:]
    assert code == 0, (code, log[-2000:])
    assert "service stopped" in log, log[-2000:]
    svc.proc = None
