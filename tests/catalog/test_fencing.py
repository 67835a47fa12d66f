"""Fencing on each catalog backend (SQLite and a real PostgreSQL server): launch
generations are monotone, writes of an older generation are refused, its pending
checkpoints are abandoned, its committed ones stay readable, and a commit racing a
relaunch's registration either lands before it or not at all (docs/fencing.md)."""

from __future__ import annotations

import json
import threading

import pytest
from sqlalchemy import select

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker
from lastgood_service.catalog.models import Checkpoint, Event, Run
from lastgood_service.domain.commit import CommitService
from lastgood_service.domain.runs.curation import Curator
from lastgood_service.domain.errors import FailedPrecondition, Fenced, InvalidArgument
from lastgood_service.settings import Settings
from tests.service.helpers import make_shard, shard_name

from .test_commit_backends import last_good, manifest_key, put, save, status


def events(sessions, run: str, kind: str) -> list[dict]:
    with sessions() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == run))
        return [json.loads(d) for d in s.scalars(select(Event.data_json).where(
            Event.run_id == run_id, Event.kind == kind).order_by(Event.id))]


def test_generations_are_monotone_and_idempotent_per_launch(commits):
    L = commits.launches
    a = L.register("run-g", "launch-a", 2)
    assert a["generation"] == 1 and not a["fenced"]
    assert L.register("run-g", "launch-a", 2)["generation"] == 1  # rank 1 of the same launch
    b = L.register("run-g", "launch-b", 2)
    assert b["generation"] == 2
    again = L.register("run-g", "launch-a", 2)  # a late rank of the old launch learns nothing new
    assert again["generation"] == 1 and again["fenced"] and again["current_generation"] == 2
    assert L.current("run-g")["attempt"] == "launch-b"
    assert L.register("other-run", "launch-a", 1)["generation"] == 1  # per run
    with pytest.raises(InvalidArgument):
        L.register("run-g", "bad attempt!", 1)


def test_older_generation_is_refused_and_its_pending_abandoned(commits, sessions):
    curator = Curator(sessions)
    old = commits.launches.register("run-f", "old", 1)["generation"]
    kept = save(commits, "run-f", 1, attempt="old", generation=old)
    pending = commits.begin("run-f", 2, 1, kept, "old", generation=old).id
    put(commits, pending, 0, make_shard(0, seed=2))
    new = commits.launches.register("run-f", "new", 1)["generation"]
    assert new == old + 1

    assert status(sessions, pending) == "ABANDONED"
    fenced = events(sessions, "run-f", "fenced")
    assert fenced == [{"generation": old, "attempt": "old", "by_generation": new, "by_attempt": "new",
                       "abandoned": [pending], "last_good_id": kept, "last_good_step": 1}]
    with pytest.raises(Fenced, match="launch 'new'"):
        commits.begin("run-f", 3, 1, kept, "old", generation=old)
    assert events(sessions, "run-f", "fenced_write")[0]["what"] == "begin"
    with pytest.raises(Fenced):
        put(commits, pending, 0, make_shard(0, seed=3), name="rank00000.extra")
    with pytest.raises(Fenced):
        commits.vote(pending, 0, [shard_name(0)])
    for write in (lambda g: curator.set_tag(kept, "best", generation=g),
                  lambda g: curator.pin(kept, True, generation=g),
                  lambda g: curator.rollback("run-f", kept, 5, {}, generation=g)):
        with pytest.raises(Fenced):
            write(old)
        write(new)  # the newest launch, and callers that are no launch at all, are not fenced
        write(None)
    assert last_good(sessions, "run-f") == kept

    # restores are not fenced: the old launch's committed checkpoint is readable
    assert json.loads(commits.manifest_bytes(kept))["step"] == 1
    assert commits.shard_for_read(kept, 0, shard_name(0)).size > 0
    # the new launch saves on, from the old launch's last commit
    assert save(commits, "run-f", 2, parent=kept, attempt="new", generation=new) == last_good(sessions, "run-f")
    # a generation the run never handed out is a client's mistake
    with pytest.raises(InvalidArgument):
        commits.begin("run-f", 9, 1, None, "forged", generation=new + 5)


def test_unregistered_clients_write_only_until_a_launch_registers(commits, sessions):
    """Generation 0 (a client that never registered) saves into a run no launch registered
    for; once one has, its begins and votes are fenced and its pending checkpoint is
    abandoned (#36: a zombie that drops its generation is not let back in)."""
    assert save(commits, "run-u", 1, attempt="legacy") == last_good(sessions, "run-u")  # control
    legacy = commits.begin("run-u", 2, 1, None, "legacy").id
    put(commits, legacy, 0, make_shard(0, seed=1))
    commits.launches.register("run-u", "registered", 1)
    assert status(sessions, legacy) == "ABANDONED"
    with pytest.raises(Fenced):
        commits.vote(legacy, 0, [shard_name(0)])
    with pytest.raises(Fenced):
        commits.begin("run-u", 3, 1, None, "zombie")


class Relaunching(MemoryBlobStore):
    """A blob store that runs `hook` while a manifest is being written: the moment between
    a commit's decision and its transaction, when a relaunch may register."""

    hook = None

    def put_bytes(self, key, data):
        super().put_bytes(key, data)
        if self.hook is not None and key.endswith("manifest.json"):
            hook, self.hook = self.hook, None
            hook()


def test_registration_during_an_in_flight_commit_wins(sessions, clock):
    blobs = Relaunching()
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=2), sessions, blobs, clock=clock)
    old = commits.launches.register("run-r", "old", 1)["generation"]
    first = save(commits, "run-r", 1, attempt="old", generation=old)
    cid = commits.begin("run-r", 2, 1, first, "old", generation=old).id
    put(commits, cid, 0, make_shard(0, seed=2))
    blobs.hook = lambda: commits.launches.register("run-r", "new", 1)
    with pytest.raises(Fenced):  # the vote is answered: fenced, not committed
        commits.vote(cid, 0, [shard_name(0)], wait_seconds=1)
    assert blobs.hook is None, "the relaunch did not register during the commit"
    assert blobs.stat(manifest_key(sessions, cid)) is not None  # written, yet never made visible
    assert status(sessions, cid) == "ABANDONED" and last_good(sessions, "run-r") == first


def test_commit_before_registration_is_what_the_relaunch_restores(commits, sessions):
    old = commits.launches.register("run-c", "old", 1)["generation"]
    cid = save(commits, "run-c", 1, attempt="old", generation=old)
    commits.launches.register("run-c", "new", 1)
    assert status(sessions, cid) == "COMMITTED" and last_good(sessions, "run-c") == cid


@pytest.mark.parametrize("backend", ["postgresql"])
def test_replicas_race_commits_against_registrations(backend, pg_url, tmp_path):
    """Two service replicas over one PostgreSQL: one commits checkpoints of the running
    launch while the other registers relaunches, over and over. Every commit is ordered
    entirely before a registration or refused; generations are unique and gapless."""
    from lastgood_service.catalog.db import upgrade_head

    from .conftest import MIGRATIONS

    upgrade_head(pg_url, MIGRATIONS)
    engines = [make_engine(pg_url) for _ in range(2)]
    blobs = MemoryBlobStore()
    a, b = (CommitService(Settings(lease_seconds=60, commit_wait_max=2), make_sessionmaker(e), blobs)
            for e in engines)
    sessions = make_sessionmaker(engines[0])
    try:
        gen = a.launches.register("race", "launch-0", 2)["generation"]
        parent = None
        outcomes = []
        for i in range(1, 13):
            cid = a.begin("race", i, 2, parent, f"launch-{i - 1}", generation=gen).id
            for r in range(2):
                put(a, cid, r, make_shard(r, seed=i))
            a.vote(cid, 0, [shard_name(0)])
            box = {}

            def commit():
                try:
                    box["vote"] = a.vote(cid, 1, [shard_name(1)], wait_seconds=1).status
                except FailedPrecondition as e:
                    box["vote"] = type(e).__name__

            def relaunch():
                box["launch"] = b.launches.register("race", f"launch-{i}", 2)

            threads = [threading.Thread(target=commit), threading.Thread(target=relaunch)]
            for t in (threads if i % 2 else threads[::-1]):
                t.start()
            for t in threads:
                t.join(60)
            gen = box["launch"]["generation"]
            assert gen == i + 1  # unique, gapless, monotone
            st = status(sessions, cid)
            with sessions() as s:
                run_id = s.scalar(select(Run.id).where(Run.name == "race"))
                ev = {k: i_ for i_, k in s.execute(select(Event.id, Event.kind).where(
                    Event.run_id == run_id, Event.checkpoint_id.is_(None) | (Event.checkpoint_id == cid),
                    Event.kind.in_(("commit", "launch")), Event.id > (outcomes[-1][2] if outcomes else 0)))}
            if st == "COMMITTED":
                assert box["vote"] == "COMMITTED"
                assert ev["commit"] < ev["launch"]  # the whole commit came before the registration
                assert last_good(sessions, "race") == cid
                parent = cid
            else:
                assert st == "ABANDONED" and box["vote"] == "Fenced", box
                assert cid in events(sessions, "race", "fenced")[-1]["abandoned"]
                assert last_good(sessions, "race") == parent
            outcomes.append((i, st, max(ev.values())))
    finally:
        for e in engines:
            e.dispose()
