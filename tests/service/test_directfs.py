"""Direct-FS and the verification modes (docs/dataplane.md): a trainer that mounts the store's
directory - here under another path, a symlink, as another host would - writes its file in
place and hands over only the name; the service renames that very file into the store.
In `peer` mode another rank's read-back is what lets the checkpoint commit: a file changed
after its digest was computed never commits (control: the same file, with the peer's read
skipped, does commit; and in `service` mode the service's own hash refuses it). A mode the
store cannot provide is refused at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lastgood
from lastgood.datapath import directfs, peer
from lastgood.wire import ranges
from lastgood.restore import readplan
from lastgood.datapath.directfs import DirectFS
from lastgood.wire.manifest import RANGE_DIGESTS
from lastgood.errors import SaveFailed
from lastgood.wire.hashing import StreamHasher
from lastgood.wire.format import shard_file_name as ckpt_file_name
from lastgood.datapath.choose import default_path
from lastgood.datapath.transport import Transport

from ..conftest import FAST, ServiceProc
from .helpers import (checkpoint, events, index_blob, last_good_id, lying_checker, make_shard, shard_blob, shard_name,
                      wait_status)


@pytest.fixture(scope="module")
def hashing_svc(tmp_path_factory):
    s = ServiceProc(tmp_path_factory.mktemp("service"), {**FAST, "LASTGOOD_LEASE_SECONDS": "60"}).start()
    yield s
    s.stop()


def mount_of(svc, tmp_path: Path) -> Path:
    """The store's directory under another path, as a trainer on another host mounts it."""
    mount = tmp_path / "mnt" / "lastgood"
    mount.parent.mkdir(parents=True, exist_ok=True)
    if not mount.exists():
        mount.symlink_to(svc.blob_root)
    return mount


def staging_files(svc) -> list[str]:
    return sorted(p.name for p in (svc.blob_root / "direct").iterdir() if not p.name.startswith("."))


def written(svc, tmp_path, data: bytes, *, change_after_hashing: bool = False):
    """A transport that does not see the spool, its DirectFS, the file written, its digest."""
    t = Transport(svc.url, spool=False)
    direct = DirectFS.find(t, str(mount_of(svc, tmp_path)))
    assert direct is not None and direct.staging["dir"].startswith(str(tmp_path))
    hasher = StreamHasher()
    handle = direct.write(data, hasher)
    assert handle is not None
    if change_after_hashing:  # a byte of the tensor data changes after the digest was computed
        path = Path(direct.staging["dir"]) / handle.name
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    return t, direct, handle, hasher.hexdigest()


def handed_over(svc, tmp_path, run: str, data: bytes, **kw):
    """Rank 0's file written in place, in a checkpoint of two ranks: rank 1 writes nothing and
    checks rank 0's file (`check_by_peer`); a job of one rank does not check itself."""
    t, direct, handle, digest = written(svc, tmp_path, data, **kw)
    cid = t.begin(run, 1, 2, None, "a1", 0).checkpoint_id
    return t, direct, handle, digest, cid


def check_by_peer(t, direct, cid: int, **kw) -> str:
    """Rank 1 of a handed_over checkpoint votes (no files of its own) and checks rank 0's file."""
    t.commit_rank(cid, 1, [], wait=0)
    return peer.check(t, direct, cid, 1, **kw)


@pytest.mark.parametrize("mode", ["service", "peer"])
def test_a_direct_fs_save_restores_bitwise_and_its_blob_is_the_file_written(mode, peer_svc, hashing_svc, run_name,
                                                                            tmp_path, monkeypatch):
    svc = peer_svc if mode == "peer" else hashing_svc
    monkeypatch.setenv("LASTGOOD_USE_SPOOL", "0")  # not the same-host spool: direct-FS, as from another host
    monkeypatch.setenv("LASTGOOD_DIRECT_FS_MOUNT", str(mount_of(svc, tmp_path)))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    inodes = []
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        direct = directfs.of(ckpt.transport)  # the data path the save session chooses (datapath/paths.py)
        assert direct is not None and ckpt.transport.spool is None
        assert isinstance(default_path(ckpt.transport), directfs.DirectFSPath)
        write = direct.write

        def observed(data, hasher=None):  # the real write; remember the inode it made
            handle = write(data, hasher)
            inodes.append((Path(direct.staging["dir"]) / handle.name).stat().st_ino)
            return handle

        direct.write = observed
        ckpt.save(5, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    assert checkpoint(svc, cid)["status"] == "COMMITTED"
    assert shard_blob(svc, cid, 0).stat().st_ino == inodes[0]  # renamed into the store, not copied
    assert staging_files(svc) == []
    checked = [e for e in events(svc, run_name) if e["kind"] == "peer_verified"]
    assert checked == [], checked  # one rank: in peer mode the service hashed it, the rank did not check itself
    # range digests in both modes: the service's own read, or (peer mode, where it reads only
    # the header) the writer's, declared with the name and recomputed by the peer - the same
    # digests, so such a file is read by ranges at another world size, not whole
    index = svc.get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{ckpt_file_name(0)}").json()
    blob = shard_blob(svc, cid, 0).read_bytes()
    mine = ranges.RangeHasher(index["data_start"], index["tensors"], svc.info["range_block_bytes"])
    mine.update(blob)
    assert index.get(RANGE_DIGESTS) == mine.digests(), sorted(index)
    root = svc.get(f"/api/v1/checkpoints/{cid}/manifest").json()
    assert "chunks" in root["ranks"][0]["files"][0]["index"]  # where its shards lie, as for a hashed file

    model2 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt2 = torch.optim.AdamW(model2.parameters())
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2)) == 5
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_peer_mode_a_file_changed_after_its_digest_never_commits(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=11)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)  # the service does not read it
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"  # voted; not checked yet
        with pytest.raises(SaveFailed, match="peer check: rank 0's .* in the store has xxh3-128 .*, its writer declared"):
            check_by_peer(t, direct, cid, deadline=float("inf"))
    finally:
        t.close()
    ck = checkpoint(peer_svc, cid)
    assert ck["status"] == "ABANDONED"
    kinds = [e["kind"] for e in events(peer_svc, run_name)]
    assert "hash_mismatch" in kinds and "commit" not in kinds
    assert last_good_id(peer_svc, run_name) is None


def test_control_without_the_peer_read_the_changed_file_would_commit(peer_svc, run_name, tmp_path):
    """The same changed file, with the peer's read replaced by a check that reports the declared
    digest unread: the service commits it - the read-back is what stopped it above."""
    data = make_shard(0, seed=11)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        assert check_by_peer(t, direct, cid, deadline=float("inf"), read=lying_checker({shard_name(0): digest})) in ("PENDING", "COMMITTED")
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()
    assert shard_blob(peer_svc, cid, 0).read_bytes() != data  # the bad bytes committed


def test_service_mode_refuses_the_changed_file_and_stores_the_declared_bytes(hashing_svc, run_name, tmp_path):
    """In `service` mode the service hashes the handed-over file: it refuses the changed one,
    and the client streams the bytes it declared instead (Transport.put_shard's fallback)."""
    data = make_shard(0, seed=11)
    t, direct, handle, digest, cid = handed_over(hashing_svc, tmp_path, run_name, data, change_after_hashing=True)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 1, [], wait=0)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()
    assert shard_blob(hashing_svc, cid, 0).read_bytes() == data  # the declared bytes, not the changed file
    assert "hash_mismatch" in [e["kind"] for e in events(hashing_svc, run_name)]
    assert staging_files(hashing_svc) == []


def test_a_peer_report_for_the_wrong_rank_is_refused_and_changes_nothing(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=2)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        r = peer_svc.post(f"/api/v1/checkpoints/{cid}/ranks/1/peer-check",
                          json={"peer_rank": 3, "files": [{"name": shard_name(0), "xxh3_128": digest}]})
        assert r.status_code == 400 and "checks the files of rank 0" in r.text, r.text
        assert checkpoint(peer_svc, cid)["status"] == "PENDING"
        assert check_by_peer(t, direct, cid, deadline=float("inf")) in ("PENDING", "COMMITTED")  # the real check
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()


def test_a_file_the_checker_cannot_read_is_hashed_by_the_service(peer_svc, run_name, tmp_path):
    data = make_shard(0, seed=5)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        check_by_peer(t, None, cid, deadline=float("inf"))  # no mount on this rank: reported unread
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()


def test_a_peer_check_whose_report_commits_asks_nothing_more(peer_svc, run_name, tmp_path):
    """The report that commits says so (COMMITTED): the check ends there, without asking for
    its assignment again only to hear the same. A rank's save is one request shorter."""
    data = make_shard(0, seed=41)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    asked = []
    get_json = t.get_json
    t.get_json = lambda path, *a, **kw: asked.append(path) or get_json(path, *a, **kw)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=0).status == "PENDING"  # its own file is left
        assert check_by_peer(t, direct, cid, deadline=time.monotonic() + 60) == "COMMITTED"
        assert len(asked) == 1, asked  # the assignment; the report's answer said COMMITTED
        assert checkpoint(peer_svc, cid)["status"] == "COMMITTED"
    finally:
        t.close()


@pytest.mark.slow
def test_store_mode_is_refused_at_start_by_a_file_store(tmp_path):
    """`store` needs a store that verifies declared checksums (direct S3 uploads); the
    control that the same start succeeds with `peer` is the peer_svc fixture."""
    env = {**os.environ, "LASTGOOD_VERIFICATION": "store", "LASTGOOD_DATA_DIR": str(tmp_path / "d"),
           "LASTGOOD_PORT": "0", "LASTGOOD_GRPC_PORT": "0"}
    res = subprocess.run([sys.executable, "-m", "lastgood_service.main"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert "LASTGOOD_VERIFICATION=store: the blob store (LocalBlobStore) does not verify the checksums" in res.stderr


class _GrantsDirect:
    """What check_available asks of an S3 store (capabilities.GrantsDirectAccess), no more."""

    def direct(self, public_endpoint=None):
        raise AssertionError("check_available never signs")


def test_direct_s3_uploads_need_store_or_peer_verification():
    """The service reads none of a direct upload's bytes, so with LASTGOOD_DIRECT_S3 the
    verification is the store's (`store`) or the ranks' read-back (`peer`,
    tests/service/test_direct_s3_peer.py): `service` would claim a hash nobody makes and is
    refused at start, whatever the store. `store` is then checked against the store's
    capability; `peer` needs none (the control: it starts)."""
    from lastgood_service.domain.peer import verification_modes as vm

    with pytest.raises(vm.ModeUnavailable, match="LASTGOOD_DIRECT_S3=true needs LASTGOOD_VERIFICATION=store or peer"):
        vm.check_available("service", None, direct_s3=True)
    with pytest.raises(vm.ModeUnavailable, match="does not verify the checksums"):
        vm.check_available("store", None, direct_s3=True)  # past the rule: no store that verifies
    vm.check_available("peer", _GrantsDirect(), direct_s3=True)
    vm.check_available("service", None, direct_s3=False)  # the same mode without direct uploads starts


def test_direct_s3_uploads_on_a_store_that_grants_none_are_refused_at_start(tmp_path):
    """LASTGOOD_DIRECT_S3=true on a local store does nothing (only an S3 store grants direct
    access): refused at start, in `peer` mode too, rather than silently streaming. Control:
    the same store without the setting starts in `peer` mode."""
    from lastgood_service.blobstore import LocalBlobStore
    from lastgood_service.domain.peer import verification_modes as vm

    local = LocalBlobStore(tmp_path / "blobs")
    with pytest.raises(vm.ModeUnavailable, match=r"LASTGOOD_DIRECT_S3=true: the blob store \(LocalBlobStore\) grants"):
        vm.check_available("peer", local, direct_s3=True)
    vm.check_available("peer", local, direct_s3=False)


def _handed_over_ranks(t, direct, run: str, world: int, seed: int) -> int:
    """A checkpoint of `world` ranks begun, each rank's file written in place and handed
    over (no vote yet): its id."""
    cid = t.begin(run, 1, world, None, "a1", 0).checkpoint_id
    for r in range(world):
        data = make_shard(r, seed=seed)
        hasher = StreamHasher()
        handle = direct.write(data, hasher)
        direct.hand_over(cid, r, shard_name(r), memoryview(data), hasher.hexdigest(), handle)
    return cid


def _catalog_transactions(svc) -> int:
    """The service's catalog transactions so far, all labels (/metrics)."""
    return sum(int(float(line.split()[-1])) for line in svc.get("/metrics").text.splitlines()
               if line.startswith("lastgood_catalog_transactions_total{"))


def test_a_peer_report_that_leaves_files_to_check_attempts_no_commit(make_service, run_name, tmp_path):
    """The commit check reads every vote and file of the checkpoint: run on every report, a
    checkpoint's reports cost O(world²) (bench/cluster.py measured it). A report that leaves
    a file DECLARED is the report's own transaction alone: no commit attempt, and no second
    transaction to read back the status it already knows (PENDING); the control is the last
    report, whose commit attempt (and commit) costs more. The
    service's reaper is slowed so that only the calls made here touch the catalog."""
    peer_svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_LEASE_SECONDS="60", LASTGOOD_REAPER_INTERVAL="60")
    world = 3
    t = Transport(peer_svc.url, spool=False)
    direct = DirectFS.find(t, str(mount_of(peer_svc, tmp_path)))
    try:
        cid = _handed_over_ranks(t, direct, run_name, world, seed=31)
        for r in range(world):
            t.commit_rank(cid, r, [shard_name(r)], wait=0)
        costs = []
        for r in range(world):  # rank r checks rank r + 1: two files stay DECLARED, then one, then none
            a = t.peer_assignment(cid, r)
            files = [peer.report_entry(f["name"], peer.read_and_hash(direct, f)) for f in a["files"]]
            idle = _catalog_transactions(peer_svc)
            before = _catalog_transactions(peer_svc)  # less what a scrape of /metrics costs itself:
            scrape = before - idle
            res = t.peer_report(cid, r, {"peer_rank": a["peer_rank"], "files": files})
            costs.append(_catalog_transactions(peer_svc) - before - scrape)
    finally:
        t.close()
    assert res["status"] == "COMMITTED"
    assert costs[0] == costs[1] == 1, costs  # the report: no commit attempt, no status read
    assert costs[2] > costs[1], costs  # control: the last report attempts the commit, and commits


def test_a_peer_save_costs_seven_catalog_transactions(make_service, run_name, tmp_path):
    """What a direct-FS save in `peer` mode costs the catalog, call by call, for the rank whose
    report commits: begin (1), the hand-over by name (2: admitted, then recorded once the file
    is in the store), the vote (1), the assignment (1), and the report that verifies the last
    file (2: its own, which also reads what the commit writes while it holds the checkpoint's
    row lock, and the commit's); the other rank's report is one (13 for the two ranks). The
    commit's read was a transaction of its own after the report's: the service CPU of such a
    save is mostly its fixed control-plane cost (bench/dataplane.py). The reaper is slowed so
    that only these calls touch the catalog."""
    svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_LEASE_SECONDS="60", LASTGOOD_REAPER_INTERVAL="60")
    t = Transport(svc.url, spool=False)
    direct = DirectFS.find(t, str(mount_of(svc, tmp_path)))
    try:
        idle = _catalog_transactions(svc)
        before = _catalog_transactions(svc)  # less what a scrape of /metrics costs itself
        cid = _handed_over_ranks(t, direct, run_name, 2, seed=41)
        for r in range(2):
            assert t.commit_rank(cid, r, [shard_name(r)], wait=0).status == "PENDING"
        assert peer.check(t, direct, cid, 0, time.monotonic() + 60, wait_for_peer=False) == "PENDING"
        assert peer.check(t, direct, cid, 1, time.monotonic() + 60) == "COMMITTED"
        spent = _catalog_transactions(svc) - before - (before - idle)
    finally:
        t.close()
    assert checkpoint(svc, cid)["status"] == "COMMITTED"
    assert spent == 13, spent


@pytest.mark.parametrize("mode", ["peer", "service"])
def test_a_completing_vote_with_files_left_to_check_attempts_no_commit(mode, make_service, run_name, tmp_path):
    """In `peer` mode the ranks vote before their peers check their files: the vote that
    completes the checkpoint found it uncommittable (files DECLARED) only in its commit
    attempt, two transactions more than a vote. It costs what any vote does, and the last
    report, serialised with it by the checkpoint's row lock, commits. Control (`service`
    mode, nothing left to check): the completing vote attempts the commit, and commits."""
    svc = make_service(LASTGOOD_VERIFICATION=mode, LASTGOOD_LEASE_SECONDS="60", LASTGOOD_REAPER_INTERVAL="60")
    world = 2
    t = Transport(svc.url, spool=False)
    direct = DirectFS.find(t, str(mount_of(svc, tmp_path)))
    try:
        cid = _handed_over_ranks(t, direct, run_name, world, seed=37)
        costs, statuses = [], []
        for r in range(world):
            idle = _catalog_transactions(svc)
            before = _catalog_transactions(svc)  # less what a scrape of /metrics costs itself
            statuses.append(t.commit_rank(cid, r, [shard_name(r)], wait=0).status)
            costs.append(_catalog_transactions(svc) - before - (before - idle))
        if mode == "peer":
            assert statuses == ["PENDING", "PENDING"]
            assert costs[1] == costs[0], costs  # the completing vote: its batch, no commit attempt
            for r in range(world):  # the checks; the last report commits
                assert peer.check(t, direct, cid, r, time.monotonic() + 60) in ("PENDING", "COMMITTED")
            wait_status(svc, cid, "COMMITTED")
        else:
            assert statuses == ["PENDING", "COMMITTED"]
            assert costs[1] > costs[0], costs  # control: the completing vote commits
    finally:
        t.close()


def declared_hand_over(svc, tmp_path, run: str, *, wrong_digest: bool):
    """A direct-FS hand-over in peer mode that declares the file's range digests, one of
    them (a tensor's, well formed) not of the bytes when `wrong_digest`."""
    data = make_shard(0, seed=12, n=40_000)
    t, direct, handle, digest, cid = handed_over(svc, tmp_path, run, data)
    segments = ranges.hasher_of(data, svc.info["range_block_bytes"])
    segments.update(data)
    declared = segments.digests()
    if wrong_digest:
        name = next(iter(declared["tensors"]))
        declared["tensors"][name][0] = "0" * 32
    handle = directfs.Handle(handle.name, handle.size, json.dumps(declared))
    direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
    assert staging_files(svc) == []  # taken by name, not streamed
    t.commit_rank(cid, 0, [shard_name(0)], wait=0)
    return t, direct, cid


def test_peer_mode_a_declared_range_digest_not_of_the_bytes_never_commits(peer_svc, run_name, tmp_path):
    t, direct, cid = declared_hand_over(peer_svc, tmp_path, run_name, wrong_digest=True)
    try:
        with pytest.raises(SaveFailed, match="range digests .*not the declared"):
            check_by_peer(t, direct, cid, deadline=float("inf"))
    finally:
        t.close()
    assert checkpoint(peer_svc, cid)["status"] == "ABANDONED"
    assert last_good_id(peer_svc, run_name) is None


def test_control_peer_mode_declared_range_digests_of_the_bytes_commit(peer_svc, run_name, tmp_path):
    t, direct, cid = declared_hand_over(peer_svc, tmp_path, run_name, wrong_digest=False)
    try:
        assert check_by_peer(t, direct, cid, deadline=float("inf")) in ("PENDING", "COMMITTED")
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    finally:
        t.close()
    # a restore at another world size reads it by ranges: one tensor's range, verified,
    # costs its covering segments at the transport, not the file
    r = Transport(peer_svc.url, spool=False)
    try:
        entry = r.manifest(cid).files(0)[0]
        entry = entry.with_index(0, r.index_bytes(cid, 0, entry.name))
        assert entry.digests is not None
        name, t0 = max(entry.tensors.items(), key=lambda kv: kv[1]["offsets"][1] - kv[1]["offsets"][0])
        a, b = entry.data_start + t0["offsets"][0], entry.data_start + t0["offsets"][1]
        out = bytearray(b - a)
        readplan.RangeReader(r, cid).read(0, entry, ranges.RangeDigests(entry.data_start, entry.tensors,
                                                                         entry.digests), a, b, out)
        assert bytes(out) == shard_blob(peer_svc, cid, 0).read_bytes()[a:b]
        assert r.shard_bytes == b - a < entry.size and r.range_requests >= 1  # a whole tensor: its own bytes
    finally:
        r.close()


def test_peer_mode_the_service_s_own_read_checks_declared_range_digests_too(peer_svc, run_name, tmp_path):
    """A checker that cannot read the file (no mount): the service reads it itself, and
    recomputes the declared range digests as the peer would have."""
    t, direct, cid = declared_hand_over(peer_svc, tmp_path, run_name, wrong_digest=True)
    try:
        check_by_peer(t, direct, cid, deadline=float("inf"), read=lambda _d, _f: None)  # unread: the service reads it
    finally:
        t.close()
    wait_status(peer_svc, cid, "ABANDONED", timeout=60)
    mismatch = [e for e in events(peer_svc, run_name) if e["kind"] == "hash_mismatch"]
    assert mismatch and "range digests" in str(mismatch[0]), mismatch
    assert last_good_id(peer_svc, run_name) is None


def test_peer_mode_hostile_declared_digests_are_refused_and_the_file_streamed(peer_svc, run_name, tmp_path, caplog):
    """Too many blocks for a tensor: the service refuses the hand-over (nothing recorded),
    the client streams the same bytes, and the index object holds the service's own digests."""
    data = make_shard(0, seed=13, n=40_000)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    segments = ranges.hasher_of(data, peer_svc.info["range_block_bytes"])
    segments.update(data)
    good = segments.digests()
    bad = {**good, "tensors": {k: v * 40 for k, v in good["tensors"].items()}}
    try:
        with caplog.at_level("WARNING", logger="lastgood"):
            direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest,
                             directfs.Handle(handle.name, handle.size, json.dumps(bad)))
        assert "declared range digests refused" in caplog.text
        t.commit_rank(cid, 1, [], wait=0)
        assert t.commit_rank(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"  # streamed: hashed, VERIFIED
        index = peer_svc.get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").json()
        assert index.get(RANGE_DIGESTS) == good, index  # computed by the service from the stream, not the declaration
    finally:
        t.close()


def test_the_peer_check_reads_no_index_object_from_the_store(peer_svc, run_name, tmp_path):
    """The assignment (every poll) and the report (under the checkpoint's row lock) compare the
    declared range digests from the catalog's row, not from the file's index object: at 1,024
    ranks a store read per file there was 1,024 GETs serialised under the lock. The index
    object is made unreadable (a directory in its place) while the check runs; before, the
    assignment's read of it failed the check."""
    data = make_shard(0, seed=13)
    t, direct, handle, digest, cid = handed_over(peer_svc, tmp_path, run_name, data)
    try:
        direct.hand_over(cid, 0, shard_name(0), memoryview(data), digest, handle)
        t.commit_rank(cid, 0, [shard_name(0)], wait=0)
        index = index_blob(peer_svc, cid, 0)
        assert RANGE_DIGESTS not in json.loads(index.read_bytes())  # a file too small to have any: no read either
        body = index.read_bytes()
        index.unlink()
        index.mkdir()
        try:
            assert check_by_peer(t, direct, cid, deadline=float("inf")) in ("PENDING", "COMMITTED")
        finally:
            index.rmdir()
            index.write_bytes(body)
        assert checkpoint(peer_svc, cid)["status"] == "COMMITTED"  # (the view reads the index object)
        assert [e["kind"] for e in events(peer_svc, run_name)].count("peer_verified") == 1
    finally:
        t.close()
