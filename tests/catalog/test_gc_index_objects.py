"""An incremental GC pass deletes what the catalog recorded of a checkpoint: its shards,
its manifest and its tensor index objects (domain/commit/indexes.py). Before the index
objects were counted there, an incremental pass left them behind until a full pass."""

from __future__ import annotations

from lastgood_service.domain.gc import GarbageCollector
from lastgood_service.domain.keys import INDEX_SUFFIX
from lastgood_service.domain.runs.retention import Retention

from .test_commit_backends import prefix_of, save


def test_an_incremental_pass_deletes_the_index_objects_too(sessions, commits, blobs, clock):
    parent = None
    ids = []
    for step in range(4):
        parent = save(commits, "gc-index", step, parent=parent)
        ids.append(parent)
    old = prefix_of(sessions, ids[0])
    assert [i.key for i in blobs.list(old) if i.key.endswith(INDEX_SUFFIX)]  # control: it has one
    gc = GarbageCollector(sessions, blobs, Retention.parse("latest:1,last-good,branch-heads"), 3600, clock=clock)
    result = gc.execute(gc.plan(full=False))
    assert ids[0] in result["deleted"]
    assert [i.key for i in blobs.list(old)] == []
