"""The metering wrapper counts shard traffic and nothing else: bytes a writer published
(not those of a writer that aborted), bytes a reader took from `get`; not the whole-object
calls that carry the service's manifests. The /metrics names are the ones the service
always served."""

from __future__ import annotations

import pytest

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.blobstore.metered import MeteredBlobStore
from lastgood_service.metrics import Metrics


def value(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_published_bytes_are_ingested_aborted_ones_are_not():
    m = Metrics()
    store = MeteredBlobStore(MemoryBlobStore(), m)
    with store.open_writer("ckpt/1/r0/aa") as w:
        w.write(b"x" * 10)
        w.write(memoryview(b"y" * 5))
        w.publish()
    with pytest.raises(RuntimeError), store.open_writer("ckpt/1/r0/bb") as w:
        w.write(b"z" * 100)
        raise RuntimeError("hash mismatch")  # the caller leaves the block: the writer aborts
    assert store.stat("ckpt/1/r0/bb") is None
    assert value(m, "lastgood_bytes_ingested_total") == 15


def test_get_counts_served_bytes_and_one_restore_time_per_read():
    m = Metrics()
    inner = MemoryBlobStore()
    inner.put_bytes("ckpt/1/r0/aa", b"a" * 1000)
    store = MeteredBlobStore(inner, m)
    assert b"".join(store.get("ckpt/1/r0/aa", 100, 50)) == b"a" * 50
    assert value(m, "lastgood_bytes_served_total") == 50
    assert value(m, "lastgood_restore_seconds_count") == 1
    with pytest.raises(FileNotFoundError):  # raised by the call, as the contract says, and not counted
        store.get("ckpt/1/r0/missing")
    assert value(m, "lastgood_restore_seconds_count") == 1


def test_manifest_calls_pass_through_uncounted():
    m = Metrics()
    store = MeteredBlobStore(MemoryBlobStore(), m)
    store.put_bytes("ckpt/1/manifest.json", b"{}" * 50)
    assert store.read_all("ckpt/1/manifest.json") == b"{}" * 50
    assert value(m, "lastgood_bytes_ingested_total") == 0 and value(m, "lastgood_bytes_served_total") == 0
    control = Metrics()  # the same bytes through a writer and get are counted
    metered = MeteredBlobStore(MemoryBlobStore(), control)
    with metered.open_writer("ckpt/1/manifest.json") as w:
        w.write(b"{}" * 50)
        w.publish()
    b"".join(metered.get("ckpt/1/manifest.json"))
    assert value(control, "lastgood_bytes_ingested_total") == 100 and value(control, "lastgood_bytes_served_total") == 100
