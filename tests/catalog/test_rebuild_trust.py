"""`rebuild` trusts only what the service sealed (#36): a manifest planted in the store, a
sealed one out of bounds and damaged bytes under a sealed one never come back as committed,
and the generation gap reaches every run however the manifests fail. On each backend."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import delete, select

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry, Manifest
from lastgood_service.catalog.models import Checkpoint, Event, Launch, Run, Shard, Vote
from lastgood_service.domain import keys
from lastgood_service.domain.errors import Fenced
from lastgood_service.domain.repair import Repair
from lastgood_service.domain.runs.fencing import GENERATION_GAP
from tests.catalog.test_commit_backends import last_good, prefix_of, save, status
from tests.service.helpers import make_shard, shard_name


def plant(blobs, cid: int, run: str, step: int, attempt: str, generation: int, parent: int,
          seal=None, mac: str | None = None) -> str:
    """What a writer of the store can do without the key: a shard blob and a manifest whose
    id, run, step and nonce it computed from public fields. `seal`: sealed with the real key
    (a leaked key, or a bug); `mac`: a made-up seal."""
    data = make_shard(0, seed=77)
    pfx = keys.prefix(cid, run, step, attempt)
    blobs.put_bytes(keys.shard_key(pfx, 0, hash_bytes(data)), data)
    m = Manifest(cid, run, step, attempt, 1, parent, {0: [FileEntry(shard_name(0), len(data), hash_bytes(data))]},
                 generation, version=2)
    body = m.to_bytes()
    if seal is not None:
        body = seal.seal(body)
    elif mac is not None:
        d = json.loads(body)
        d["auth"] = {"alg": "hmac-sha256", "key_id": mac, "mac": "0" * 64}
        body = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    blobs.put_bytes(keys.manifest_key(pfx), body)
    return keys.manifest_key(pfx)


def lose_everything(sessions) -> None:
    """The catalog forgets every checkpoint and launch (its runs stay, at generation 0)."""
    with sessions() as s, s.begin():
        for run in s.scalars(select(Run)):
            run.last_good_id, run.generation = None, 0
        s.flush()
        for table in (Event, Vote, Shard, Launch):
            s.execute(delete(table))
        s.execute(delete(Checkpoint).where(Checkpoint.parent_id.is_not(None)))
        s.execute(delete(Checkpoint))


def test_rebuild_restores_the_sealed_commits_and_quarantines_forgeries(commits, sessions, blobs):
    good: dict[str, list[int]] = {"run-a": [], "run-b": []}
    for run, cids in good.items():
        for step in range(1, 7):  # launch "first" commits steps 1-3, launch "second" 4-6
            attempt = "first" if step <= 3 else "second"
            gen = commits.launches.register(run, attempt, 1)["generation"]
            cids.append(save(commits, run, step, parent=cids[-1] if cids else None, attempt=attempt, generation=gen))
    damaged = save(commits, "run-b", 7, parent=good["run-b"][-1], attempt="second", generation=2)
    data = make_shard(0, seed=7)
    blobs.put_bytes(keys.shard_key(prefix_of(sessions, damaged), 0, hash_bytes(data)), bytes(len(data)))
    twelve = sorted(good["run-a"] + good["run-b"])
    lose_everything(sessions)
    sealed_by = commits.manifest_keys
    forged = plant(blobs, 5000, "run-a", 100, "second", 2, good["run-a"][-1], mac=sealed_by.sealing_id)
    huge = plant(blobs, 5001, "run-b", 100, "second", 2**63 - 1, good["run-b"][-1], seal=sealed_by)
    unsealed = plant(blobs, 5002, "run-a", 101, "second", 2, good["run-a"][-1])

    repair = Repair(sessions, blobs, sealed_by)
    # the start-up check counts only sealed manifests: the planted ones alone would not close the gate
    assert [p.checkpoint_id for p in repair.lost_manifests()] == twelve + [damaged]
    report = repair.fsck()
    assert {(f.kind, f.checkpoint_id) for f in report.findings if f.kind != "lost_commit"} == {
        ("forged_manifest", 5000), ("forged_manifest", 5001), ("unsealed_manifest", 5002)}

    result = repair.rebuild()
    assert result["restored"] == twelve and result["corrupt"] == [damaged] and result["conflicts"] == []
    assert [(q["checkpoint_id"], q["moved_to"]) for q in result["quarantined"]] == [
        (5000, keys.quarantine_key(forged)), (5001, keys.quarantine_key(huge))]
    assert "MAC does not match" in result["quarantined"][0]["why"]
    assert "generation" in result["quarantined"][1]["why"]
    assert [u["checkpoint_id"] for u in result["unsealed"]] == [5002]  # left in place: an older store's, or planted
    for key in (forged, huge):
        assert blobs.stat(key) is None and blobs.stat(keys.quarantine_key(key)) is not None
    assert blobs.stat(unsealed) is not None
    assert [status(sessions, cid) for cid in twelve] == ["COMMITTED"] * 12
    assert status(sessions, damaged) == "CORRUPT"  # the sizes match, the bytes do not: re-hashed
    with sessions() as s:
        assert s.scalar(select(Checkpoint).where(Checkpoint.id >= 5000)) is None
        # every run continues past the newest generation its sealed manifests name
        assert {r.name: r.generation for r in s.scalars(select(Run))} == {
            "run-a": 2 + GENERATION_GAP, "run-b": 2 + GENERATION_GAP}
    assert last_good(sessions, "run-a") == good["run-a"][-1] and last_good(sessions, "run-b") == good["run-b"][-1]

    assert repair.lost_manifests() == []  # a restarted service would accept writes
    with pytest.raises(Fenced):  # a zombie of the lost catalog's newest launch
        commits.begin("run-a", 200, 1, good["run-a"][-1], "second", generation=2)
    gen = commits.launches.register("run-a", "relaunch", 1)["generation"]
    assert gen == 2 + GENERATION_GAP + 1
    cid = save(commits, "run-a", 200, parent=good["run-a"][-1], attempt="relaunch", generation=gen)
    assert cid not in (5000, 5001, 5002) and last_good(sessions, "run-a") == cid
    again = repair.rebuild()  # idempotent: nothing left but the unsealed one, still reported
    assert (again["restored"], again["quarantined"], [u["checkpoint_id"] for u in again["unsealed"]]) == (
        [], [], [5002])
    # an operator who knows the store was written only by a service older than seals vouches for it
    trusted = repair.rebuild(trust_unsealed=True)
    assert (trusted["restored"], trusted["unsealed"], trusted["quarantined"]) == ([5002], [], [])
    assert status(sessions, 5002) == "COMMITTED"  # re-hashed like the sealed ones
