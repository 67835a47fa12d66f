"""Prometheus metrics of one service process (its own registry: nothing at import time).

Counters and histograms are fed by the domain as things happen; the number of pending
checkpoints is read from the catalog at scrape time, so every replica reports the truth.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class _CatalogTransactions:
    def __init__(self, timer) -> None:
        self.timer = timer

    def collect(self):
        c = CounterMetricFamily("lastgood_catalog_transactions", "Catalog transactions ended (committed or rolled "
                                "back) by this process, by who ran them", labels=["label"])
        for label, n in sorted(dict(self.timer.counts).items()):
            c.add_metric([label or "other"], n)
        yield c


class Metrics:
    def __init__(self, pending: Callable[[], int] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.bytes_ingested = Counter("lastgood_bytes_ingested", "Shard bytes received and verified", registry=r)
        self.bytes_served = Counter("lastgood_bytes_served", "Shard bytes sent to readers", registry=r)
        self.hash_mismatches = Counter("lastgood_hash_mismatches", "Shards rejected for a wrong xxh3-128", registry=r)
        self.commits = Counter("lastgood_commits", "Checkpoints committed", registry=r)
        self.abandoned = Counter("lastgood_abandoned", "Checkpoints abandoned", ["why"], registry=r)
        self.gc_bytes_freed = Counter("lastgood_gc_bytes_freed", "Bytes deleted by GC", registry=r)
        self.gc_transaction_seconds = Histogram(
            "lastgood_gc_transaction_seconds", "How long each catalog transaction of a scheduled GC pass held on "
            "(on SQLite: the write lock commits wait for)", buckets=_SECONDS, registry=r)
        self.save_seconds = Histogram("lastgood_save_seconds", "Begin to commit of a checkpoint", buckets=_SECONDS,
                                      registry=r)
        self.commit_seconds = Histogram("lastgood_commit_seconds", "Last rank's vote to the commit transaction",
                                        buckets=_SECONDS, registry=r)
        self.restore_seconds = Histogram("lastgood_restore_seconds", "Time to stream one shard file to a reader",
                                         buckets=_SECONDS, registry=r)
        self.heartbeats = Counter("lastgood_heartbeats", "Heartbeats received", registry=r)
        self.verdicts = Counter("lastgood_health_verdicts", "Ranks found hung, straggler or lost (events recorded)",
                                ["verdict"], registry=r)
        self.ranks_by_verdict = Gauge("lastgood_ranks", "Ranks of recently beating runs by verdict, at the last "
                                      "health sweep", ["verdict"], registry=r)
        Gauge("lastgood_python_gc_frozen_objects", "Objects exempt from Python's cyclic garbage collector "
              "(frozen once start-up is done: pygc.py)", registry=r).set_function(gc.get_freeze_count)
        if pending is not None:
            Gauge("lastgood_pending_checkpoints", "Checkpoints begun and not yet committed or abandoned",
                  registry=r).set_function(pending)

    def watch_free_bytes(self, free: Callable[[], int | None]) -> None:
        """Room left in the blob store, read at scrape time (NaN where the store cannot tell)."""
        Gauge("lastgood_store_free_bytes", "Bytes free in the blob store (local stores)", registry=self.registry
              ).set_function(lambda: float("nan") if (n := free()) is None else n)

    def watch_catalog(self, timer) -> None:
        """Catalog transactions (read-only ones included) by who ran them (catalog/txtimer.py's
        labels: begin, put, vote, ...; "other" unlabelled), read from the engine's timer at
        scrape time: what a checkpoint costs the catalog, on SQLite as on PostgreSQL."""
        if timer is not None:
            self.registry.register(_CatalogTransactions(timer))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
