"""The two-phase commit on each catalog backend: SQLite and a real PostgreSQL server.

The domain code is the same on both; what differs is the database under it (types,
constraints, transaction isolation, how a unique violation surfaces). These run
CommitService in process against each, and read the catalog back with SQL.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select, text

from lastgood.wire.hashing import hash_bytes
from lastgood_service.catalog.models import Checkpoint, Event, Run, Shard, Vote
from lastgood_service.domain import keys
from lastgood_service.domain.commit.core import key_prefix
from lastgood_service.domain.commit.types import ShardHeader
from lastgood_service.domain.errors import Conflict, FailedPrecondition, HashMismatch, InvalidArgument, NotFound
from tests.service.helpers import make_shard, shard_name

ATTEMPT = "attempt-1"


def prefix_of(sessions, cid: int) -> str:
    with sessions() as s:
        return key_prefix(s, s.get(Checkpoint, cid))


def manifest_key(sessions, cid: int) -> str:
    return keys.manifest_key(prefix_of(sessions, cid))


def put(commits, cid: int, rank: int, data: bytes, name: str | None = None, xxh3: str | None = None,
        piece: int = 100):
    header = ShardHeader(cid, rank, name or shard_name(rank), len(data), xxh3 or hash_bytes(data))
    return commits.put_shard(header, (data[i:i + piece] for i in range(0, len(data), piece)))


def save(commits, run: str, step: int, world: int = 1, parent: int | None = None, attempt: str = ATTEMPT,
         generation: int = 0) -> int:
    cid = commits.begin(run, step, world, parent, attempt, generation=generation).id
    for r in range(world):
        put(commits, cid, r, make_shard(r, seed=step % 200))
    for r in range(world):
        res = commits.vote(cid, r, [shard_name(r)])
    assert res.status == "COMMITTED", res
    return cid


def last_good(sessions, run: str) -> int | None:
    with sessions() as s:
        return s.scalar(select(Run.last_good_id).where(Run.name == run))


def status(sessions, cid: int) -> str:
    with sessions() as s:
        return s.get(Checkpoint, cid).status


def event_kinds(sessions, cid: int) -> list[str]:
    with sessions() as s:
        return list(s.scalars(select(Event.kind).where(Event.checkpoint_id == cid).order_by(Event.id)))


def test_begin_is_idempotent_and_checks_what_it_is_told(commits, sessions):
    a = commits.begin("run-a", 10, 2, None, ATTEMPT, rank=0)
    b = commits.begin("run-a", 10, 2, None, ATTEMPT, rank=1)
    assert a.id == b.id and a.status == "PENDING"
    with pytest.raises(Conflict):
        commits.begin("run-a", 10, 4, None, ATTEMPT)
    other = commits.begin("run-a", 10, 2, None, "attempt-2")
    assert other.id != a.id
    with pytest.raises(NotFound):
        commits.begin("run-a", 11, 1, 999_999, ATTEMPT)
    with pytest.raises(InvalidArgument):
        commits.begin("bad run name!", 1, 1, None, ATTEMPT)
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 1
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 2


def test_commit_only_after_every_rank_voted(commits, sessions, blobs):
    cid = commits.begin("run-b", 1, 2, None, ATTEMPT).id
    shards = {r: make_shard(r, seed=1) for r in range(2)}
    for r, data in shards.items():
        assert put(commits, cid, r, data).already_present is False
    res = commits.vote(cid, 0, [shard_name(0)])
    assert res.status == "PENDING" and res.missing_ranks == [1]
    assert blobs.stat(manifest_key(sessions, cid)) is None and last_good(sessions, "run-b") is None
    res = commits.vote(cid, 1, [shard_name(1)])
    assert res.status == "COMMITTED" and res.missing_ranks == []
    assert last_good(sessions, "run-b") == cid
    manifest = json.loads(blobs.read_all(manifest_key(sessions, cid)))
    assert (manifest["checkpoint_id"], manifest["run"], manifest["world_size"]) == (cid, "run-b", 2)
    with sessions() as s:
        ck = s.get(Checkpoint, cid)
        assert ck.committed_at is not None and ck.committed_at.tzinfo is not None  # UTC on both backends
        assert ck.bytes == sum(len(d) for d in shards.values())
        assert ck.manifest_hash == hash_bytes(blobs.read_all(ck.manifest_key))
        stored = {sh.rank: sh for sh in s.scalars(select(Shard).where(Shard.checkpoint_id == cid))}
        assert {r: (sh.size, sh.xxh3_128, sh.status) for r, sh in stored.items()} == \
            {r: (len(d), hash_bytes(d), "VERIFIED") for r, d in shards.items()}
        assert blobs.read_all(stored[1].blob_key) == shards[1]
    assert event_kinds(sessions, cid) == ["begin", "commit"]
    # a late duplicate vote is answered, not counted twice
    assert commits.vote(cid, 0, [shard_name(0)]).status == "COMMITTED"
    assert event_kinds(sessions, cid).count("commit") == 1


def test_identical_resend_is_a_no_op_and_different_bytes_conflict(commits, sessions):
    cid = commits.begin("run-c", 1, 1, None, ATTEMPT).id
    data = make_shard(0, seed=1)
    assert put(commits, cid, 0, data).already_present is False
    assert put(commits, cid, 0, data).already_present is True
    with pytest.raises(Conflict):
        put(commits, cid, 0, make_shard(0, seed=2))
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Shard).where(Shard.checkpoint_id == cid)) == 1


def test_hash_mismatch_records_nothing_and_never_commits(commits, sessions, blobs):
    before = save(commits, "run-d", 1)
    cid = commits.begin("run-d", 2, 1, before, ATTEMPT).id
    data = make_shard(0, seed=2)
    with pytest.raises(HashMismatch):
        put(commits, cid, 0, data, xxh3=hash_bytes(b"something else"))
    with pytest.raises(FailedPrecondition):
        commits.vote(cid, 0, [shard_name(0)])
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Shard).where(Shard.checkpoint_id == cid)) == 0
    assert [b.key for b in blobs.list(prefix_of(sessions, cid))] == []
    assert last_good(sessions, "run-d") == before
    assert "hash_mismatch" in event_kinds(sessions, cid)


def test_new_steps_move_last_good_and_an_abort_does_not(commits, sessions):
    one = save(commits, "run-e", 1)
    two = save(commits, "run-e", 2, parent=one)
    assert last_good(sessions, "run-e") == two
    three = commits.begin("run-e", 3, 1, two, ATTEMPT).id
    put(commits, three, 0, make_shard(0, seed=3))
    assert commits.abort(three, "test") == "ABANDONED"
    assert commits.abort(three, "again") == "ABANDONED"
    assert status(sessions, three) == "ABANDONED"
    with pytest.raises(FailedPrecondition):
        commits.vote(three, 0, [shard_name(0)])
    with pytest.raises(FailedPrecondition):
        commits.abort(two)
    assert last_good(sessions, "run-e") == two


def test_a_recorded_file_renews_the_lease_in_full(commits, sessions, clock):
    """A file the service records is rank activity: the lease runs a whole lease_seconds
    (60 here) from it, as settings.lease_seconds says, not from an earlier renewal."""
    cid = commits.begin("run-lease", 1, 2, None, ATTEMPT).id
    clock.advance(10)
    put(commits, cid, 0, make_shard(0, seed=3))
    clock.advance(55)  # 65 s after begin, 55 s after the file
    assert commits.expire_leases() == []
    assert status(sessions, cid) == "PENDING"
    clock.advance(10)  # control: 65 s after the file, nothing since
    assert commits.expire_leases() == [cid]


def test_lease_expiry_abandons_a_half_voted_checkpoint(commits, sessions, clock):
    good = save(commits, "run-f", 1)
    cid = commits.begin("run-f", 2, 2, good, ATTEMPT).id
    put(commits, cid, 0, make_shard(0, seed=2))
    commits.vote(cid, 0, [shard_name(0)])
    assert commits.expire_leases() == []          # control: not before the lease runs out
    clock.advance(61)
    assert commits.expire_leases() == [cid]
    assert commits.expire_leases() == []
    assert status(sessions, cid) == "ABANDONED"
    assert last_good(sessions, "run-f") == good
    with sessions() as s:
        ev = s.scalar(select(Event).where(Event.checkpoint_id == cid, Event.kind == "expired"))
        assert json.loads(ev.data_json)["voted_ranks"] == [0]
    with pytest.raises(FailedPrecondition):  # a rank that comes back late cannot revive it
        put(commits, cid, 1, make_shard(1, seed=2))


def test_recovery_rolls_forward_only_with_manifest_and_shards(commits, sessions, blobs):
    """A process that died between the manifest write and the commit transaction leaves a
    PENDING checkpoint with all votes and its manifest; recovery commits it. Without the
    manifest (control) recovery leaves it PENDING."""
    cids = []
    for step in (1, 2):
        cid = commits.begin("run-g", step, 1, None, ATTEMPT).id
        put(commits, cid, 0, make_shard(0, seed=step))
        with sessions() as s, s.begin():  # the vote row, as a vote that never reached its commit leaves it
            s.add(Vote(checkpoint_id=cid, rank=0, files_json=json.dumps([shard_name(0)]),
                       created_at=commits.clock()))
        cids.append(cid)
    with_manifest, without = cids
    # the manifest try_commit would have written: let try_commit write it, on a copy of the state
    assert commits.try_commit(with_manifest) is True
    body = blobs.read_all(manifest_key(sessions, with_manifest))
    with sessions() as s, s.begin():  # put it back to PENDING, as the crash left it
        ck = s.get(Checkpoint, with_manifest)
        ck.status, ck.committed_at, ck.manifest_key, ck.manifest_hash = "PENDING", None, None, None
        s.get(Run, ck.run_id).last_good_id = None
        for ev in s.scalars(select(Event).where(Event.checkpoint_id == with_manifest, Event.kind == "commit")):
            s.delete(ev)
    assert blobs.read_all(manifest_key(sessions, with_manifest)) == body
    assert commits.recover() == [with_manifest]
    assert status(sessions, with_manifest) == "COMMITTED"
    assert status(sessions, without) == "PENDING"
    assert last_good(sessions, "run-g") == with_manifest


def test_verify_marks_corrupt_and_moves_last_good_back(commits, sessions, blobs):
    one = save(commits, "run-h", 1)
    two = save(commits, "run-h", 2, parent=one)
    assert commits.verify(two)["ok"] is True
    with sessions() as s:
        key = s.scalar(select(Shard.blob_key).where(Shard.checkpoint_id == two))
    data = bytearray(blobs.read_all(key))
    data[-1] ^= 0xFF
    blobs.put_bytes(key, bytes(data))
    report = commits.verify(two)
    assert report["ok"] is False and report["status"] == "CORRUPT"
    assert status(sessions, two) == "CORRUPT"
    assert last_good(sessions, "run-h") == one


def test_large_step_numbers_and_long_names_fit_both_backends(commits, sessions):
    run = "r" * 128
    step = 2**62
    cid = save(commits, run, step)
    with sessions() as s:
        ck = s.get(Checkpoint, cid)
        assert ck.step == step and s.get(Run, ck.run_id).name == run


def test_a_reissued_id_never_writes_into_a_lost_checkpoints_blobs(commits, sessions, blobs):
    """A catalog that lost its newest rows hands their ids out again. The new checkpoint
    with a lost one's id must get blob keys of its own: the lost manifest stays readable
    (the store is the source of truth for `rebuild`), and GC of the new one leaves it."""
    from lastgood_service.domain.gc import GarbageCollector
    from lastgood_service.domain.runs.retention import Retention

    lost = save(commits, "run-lost", 7)
    lost_prefix = prefix_of(sessions, lost)
    lost_manifest = blobs.read_all(keys.manifest_key(lost_prefix))
    lost_keys = sorted(b.key for b in blobs.list(lost_prefix))
    with sessions() as s, s.begin():  # the catalog forgets it, as a destroyed WAL does
        for table in (Event, Vote, Shard):
            for row in s.scalars(select(table).where(table.checkpoint_id == lost)):
                s.delete(row)
        s.get(Run, s.get(Checkpoint, lost).run_id).last_good_id = None
        s.flush()
        s.delete(s.get(Checkpoint, lost))
        if s.bind.dialect.name == "postgresql":  # a restored backup resets the sequence too
            s.execute(text("SELECT setval(pg_get_serial_sequence('checkpoints', 'id'), :v, false)"), {"v": lost})
    again = save(commits, "run-lost", 3, attempt="relaunch")
    assert again == lost  # the id is handed out again (both backends reuse it here)
    assert blobs.read_all(keys.manifest_key(lost_prefix)) == lost_manifest
    with sessions() as s, s.begin():
        s.get(Checkpoint, again).status = "ABANDONED"
        s.get(Run, s.get(Checkpoint, again).run_id).last_good_id = None
    gc = GarbageCollector(sessions, blobs, Retention.parse("latest:1,last-good,branch-heads"), grace_seconds=0)
    plan = gc.plan()
    assert [d.checkpoint_id for d in plan.checkpoints] == [again]
    assert not set(plan.checkpoints[0].keys) & set(lost_keys)
    gc.execute(plan)
    assert sorted(b.key for b in blobs.list(lost_prefix)) == lost_keys


def test_rebuild_restores_lost_commits_on_each_backend(commits, sessions, blobs):
    """The catalog loses its newest commits (rows gone, the id sequence reset, as a restored
    backup leaves it); rebuild restores them from the manifests, with last-good, and new
    checkpoints get fresh ids afterwards (PostgreSQL: the sequence is moved past them)."""
    from lastgood_service.domain.repair import Repair

    kept = save(commits, "run-rb", 1)
    lost = [save(commits, "run-rb", 2, parent=kept), None]
    lost[1] = save(commits, "run-rb", 3, parent=lost[0])
    with sessions() as s, s.begin():
        s.get(Run, s.get(Checkpoint, kept).run_id).last_good_id = kept
        for cid in reversed(lost):
            for table in (Event, Vote, Shard):
                for row in s.scalars(select(table).where(table.checkpoint_id == cid)):
                    s.delete(row)
            s.flush()
            s.delete(s.get(Checkpoint, cid))
        s.flush()
        if s.bind.dialect.name == "postgresql":
            s.execute(text("SELECT setval(pg_get_serial_sequence('checkpoints', 'id'), :v)"), {"v": kept})
    repair = Repair(sessions, blobs, commits.manifest_keys)
    assert sorted(p.checkpoint_id for p in repair.lost_manifests()) == lost
    assert repair.rebuild() == {"restored": lost, "corrupt": [], "conflicts": [], "quarantined": [], "unsealed": []}
    assert repair.lost_manifests() == [] and repair.fsck().ok
    assert [status(sessions, cid) for cid in lost] == ["COMMITTED", "COMMITTED"]
    assert last_good(sessions, "run-rb") == lost[1]
    assert save(commits, "run-rb", 4, parent=lost[1]) > lost[1]
    assert repair.rebuild() == {"restored": [], "corrupt": [], "conflicts": [], "quarantined": [],
                                "unsealed": []}  # idempotent


def test_a_manifest_whose_commit_lost_the_race_is_not_a_lost_commit(commits, sessions, blobs):
    """The manifest is written just before the commit transaction; a registration that
    fenced the launch, an abort or lease expiry can abandon the checkpoint in between. Its
    manifest stays in the store until GC, but it was never visible: start-up must not call
    the catalog behind, and rebuild must not bring the abandoned checkpoint back."""
    from lastgood_service.domain.repair import Repair

    cid = save(commits, "run-race", 5)
    with sessions() as s, s.begin():  # as if abandoned between the manifest and the commit
        ck = s.get(Checkpoint, cid)
        ck.status, ck.committed_at = "ABANDONED", None
        s.get(Run, ck.run_id).last_good_id = None
    assert blobs.stat(manifest_key(sessions, cid)) is not None
    repair = Repair(sessions, blobs, commits.manifest_keys)
    assert repair.lost_manifests() == []
    assert repair.rebuild() == {"restored": [], "corrupt": [], "conflicts": [], "quarantined": [], "unsealed": []}
    assert status(sessions, cid) == "ABANDONED" and last_good(sessions, "run-race") is None
