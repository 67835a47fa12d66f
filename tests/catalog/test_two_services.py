"""Two real service processes on one PostgreSQL catalog (and one shared blob store), as two
replicas behind a load balancer would run. Ranks of one job talk to different replicas.

Checked after every scenario, through both replicas' REST APIs: every checkpoint is
COMMITTED exactly once (one commit event), its manifest and shards read back identical
from either replica, and last-good is the newest step.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import FAST, ServiceProc
from tests.service.helpers import (Client, checkpoint, events, http, last_good_id, make_shard,
                                   shard_name)

HANG_GUARD = 60.0


@pytest.fixture
def replicas(pg_url, tmp_path):
    """Two service processes, started at the same moment on an empty database (they
    migrate in turn), sharing the catalog and a blob directory."""
    env = {**FAST, "LASTGOOD_CATALOG_URL": pg_url, "LASTGOOD_BLOB_URL": f"file://{tmp_path / 'shared-blobs'}",
           # generous: nothing here tests expiry, and the machine is small and busy
           "LASTGOOD_LEASE_SECONDS": "120", "LASTGOOD_COMMIT_WAIT_MAX": "10"}
    procs = [ServiceProc(tmp_path / f"replica{i}", dict(env)) for i in range(2)]
    errors: list[BaseException] = []

    def start(p: ServiceProc) -> None:
        try:
            p.start(timeout=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert not errors, errors
        yield procs
    finally:
        for p in procs:
            p.stop()


def vote_until_committed(c: Client, cid: int, rank: int) -> str:
    res = c.vote(cid, rank, [shard_name(rank)], wait=10)
    deadline = time.monotonic() + HANG_GUARD
    while res.status == "PENDING" and time.monotonic() < deadline:
        res = c.vote(cid, rank, [shard_name(rank)], wait=10)
    return res.status


def run_threads(targets) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def go():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return go

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD * 4)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors


def check_run(replicas, run: str, expected: dict[int, dict[int, bytes]]) -> None:
    """expected: checkpoint id -> {rank: shard bytes}, in step order."""
    ids = list(expected)
    for svc in replicas:
        assert last_good_id(svc, run) == ids[-1]
        commits = [e["checkpoint_id"] for e in events(svc, run) if e["kind"] == "commit"]
        assert sorted(commits) == sorted(ids), f"each checkpoint commits exactly once: {commits}"
        for cid, shards in expected.items():
            assert checkpoint(svc, cid)["status"] == "COMMITTED"
            for rank, data in shards.items():
                got = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/{rank}/files/{shard_name(rank)}")
                assert got.status_code == 200 and got.content == data
    a, b = replicas
    for cid in ids:
        assert http(a).get(f"/api/v1/checkpoints/{cid}/manifest").content == \
            http(b).get(f"/api/v1/checkpoints/{cid}/manifest").content


def test_ranks_of_one_checkpoint_on_two_replicas_commit_once(replicas, run_name):
    """world size 2, rank 0 through replica A and rank 1 through replica B; both begin, put
    and vote at the same moment, step after step."""
    clients = [Client(svc.grpc_target) for svc in replicas]
    steps = 8
    expected: dict[int, dict[int, bytes]] = {}
    heard: dict[int, list[tuple[int, str]]] = {0: [], 1: []}
    barrier = threading.Barrier(2)
    ids: dict[int, list[int]] = {0: [], 1: []}

    def rank_loop(rank: int) -> None:
        c = clients[rank]
        parent = 0
        for step in range(1, steps + 1):
            barrier.wait(HANG_GUARD)
            cid = c.begin(run_name, step=step, world_size=2, parent_id=parent, rank=rank).checkpoint_id
            data = make_shard(rank, seed=step)
            c.put(cid, rank, shard_name(rank), data, chunk=4096)
            barrier.wait(HANG_GUARD)
            heard[rank].append((cid, vote_until_committed(c, cid, rank)))
            expected.setdefault(cid, {})[rank] = data
            ids[rank].append(cid)
            parent = cid

    try:
        run_threads([lambda: rank_loop(0), lambda: rank_loop(1)])
    finally:
        for c in clients:
            c.close()
    assert ids[0] == ids[1] and len(set(ids[0])) == steps  # both replicas handed out the same checkpoints
    assert heard[0] == heard[1] == [(cid, "COMMITTED") for cid in ids[0]]
    check_run(replicas, run_name, {cid: expected[cid] for cid in ids[0]})


def test_different_runs_on_two_replicas_at_once(replicas, run_name):
    """4 runs x 3 steps, world size 2, all at once; each run's rank 0 on replica A and rank
    1 on replica B."""
    runs = [f"{run_name}-{i}" for i in range(4)]
    clients = [Client(svc.grpc_target) for svc in replicas]
    steps = 3
    expected: dict[str, dict[int, dict[int, bytes]]] = {r: {} for r in runs}
    lock = threading.Lock()

    def rank_loop(run: str, rank: int) -> None:
        c = clients[rank]
        parent = 0
        for step in range(1, steps + 1):
            cid = c.begin(run, step=step, world_size=2, parent_id=parent, rank=rank).checkpoint_id
            data = make_shard(rank, seed=step)
            c.put(cid, rank, shard_name(rank), data, chunk=4096)
            assert vote_until_committed(c, cid, rank) == "COMMITTED"
            with lock:
                expected[run].setdefault(cid, {})[rank] = data
            parent = cid

    try:
        run_threads([(lambda run=run, rank=rank: rank_loop(run, rank)) for run in runs for rank in (0, 1)])
    finally:
        for c in clients:
            c.close()
    for run in runs:
        check_run(replicas, run, dict(sorted(expected[run].items())))


def test_two_steps_of_one_run_commit_at_once_on_two_replicas(replicas, run_name):
    """Steps 2k (replica A) and 2k+1 (replica B) of one run commit at the same moment: the
    newer step must end up last-good whichever transaction commits last (I3)."""
    clients = [Client(svc.grpc_target) for svc in replicas]
    try:
        base, _ = clients[0].save(run_name, step=0)
        expected = {base: {0: make_shard(0, seed=0)}}
        for k in range(1, 7):
            steps = (2 * k, 2 * k + 1)
            cids, datas = [], []
            for c, step in zip(clients, steps):
                cid = c.begin(run_name, step=step, world_size=1, parent_id=base).checkpoint_id
                data = make_shard(0, seed=step)
                c.put(cid, 0, shard_name(0), data)
                cids.append(cid)
                datas.append(data)
            barrier = threading.Barrier(2)

            def vote(i: int) -> None:
                barrier.wait(HANG_GUARD)
                assert vote_until_committed(clients[i], cids[i], 0) == "COMMITTED"

            run_threads([lambda: vote(0), lambda: vote(1)])
            for svc in replicas:
                assert last_good_id(svc, run_name) == cids[1], f"round {k}: last-good is not step {steps[1]}"
            expected.update({cids[0]: {0: datas[0]}, cids[1]: {0: datas[1]}})
    finally:
        for c in clients:
            c.close()
    check_run(replicas, run_name, expected)


def test_begin_of_a_new_run_on_both_replicas_at_once(replicas, run_name):
    clients = [Client(svc.grpc_target) for svc in replicas]
    got: list[int] = []
    barrier = threading.Barrier(2)

    def begin(i: int) -> None:
        barrier.wait(HANG_GUARD)
        got.append(clients[i].begin(run_name, step=1, world_size=2, rank=i).checkpoint_id)

    try:
        run_threads([lambda: begin(0), lambda: begin(1)])
    finally:
        for c in clients:
            c.close()
    assert len(got) == 2 and got[0] == got[1]
    for svc in replicas:
        assert [e["kind"] for e in events(svc, run_name)] == ["begin"]


def _crash_during_commit(svc, run: str, step: int) -> int:
    c = Client(svc.grpc_target)
    try:
        cid = c.begin(run, step=step).checkpoint_id
        c.put(cid, 0, shard_name(0), make_shard(0, seed=step))
        with pytest.raises(Exception):
            c.vote(cid, 0, [shard_name(0)], wait=2)
    finally:
        c.close()
    assert svc.wait_exit(30) == 77
    return cid


@pytest.mark.parametrize("failpoint,rolled", [("crash_after_manifest", True), ("crash_before_manifest", False)])
def test_recovery_on_postgres(make_service, pg_url, tmp_path, run_name, failpoint, rolled):
    """A replica dies inside a commit; the restarted one rolls the checkpoint forward only
    if the manifest was written (crash_before_manifest is the control: it stays PENDING)."""
    env = {"LASTGOOD_CATALOG_URL": pg_url, "LASTGOOD_BLOB_URL": f"file://{tmp_path / 'blobs'}",
           "LASTGOOD_LEASE_SECONDS": "120"}
    crashing = make_service(LASTGOOD_FAILPOINT=failpoint, **env)
    cid = _crash_during_commit(crashing, run_name, step=1)
    svc = make_service(**env)
    view = checkpoint(svc, cid)
    assert view["status"] == ("COMMITTED" if rolled else "PENDING")
    assert last_good_id(svc, run_name) == (cid if rolled else None)
    commits = [e for e in events(svc, run_name) if e["kind"] == "commit"]
    assert len(commits) == (1 if rolled else 0)
    if rolled:
        assert commits[0]["data"]["recovered"] is True
