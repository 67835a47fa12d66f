"""Scale: a 1,024-rank checkpoint of tiny shards from a load generator, and the checkpoint
list of a run whose catalog holds 10,000 committed checkpoints."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.common import Service, median, percentile
from lastgood.wire.format import FORMAT_VERSION, META_FORMAT, TensorSpec, plan_layout
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc


def _tiny_shard(rank: int) -> bytes:
    """A valid safetensors shard of 16 data bytes, as a rank with almost no state writes."""
    layout = plan_layout([TensorSpec("w", "F32", (4,))], {META_FORMAT: FORMAT_VERSION, "rank": str(rank)})
    return layout.header + rank.to_bytes(4, "little") * 4


class LoadGenerator:
    """Plays `ranks` ranks against one service over one gRPC channel (threads for uploads)."""

    def __init__(self, svc: Service, ranks: int, threads: int = 8) -> None:
        self.svc, self.ranks, self.threads = svc, ranks, threads
        self.channel = grpc.insecure_channel(svc.info["grpc_target"])
        self.stub = pb_grpc.CheckpointsStub(self.channel)
        self.shards = [_tiny_shard(r) for r in range(ranks)]
        self.digests = [hash_bytes(s) for s in self.shards]

    def close(self) -> None:
        self.channel.close()

    def name(self, r: int) -> str:
        return f"rank{r:05d}.safetensors"

    def begin(self, run: str, step: int, attempt: str) -> int:
        return self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
            run=run, step=step, world_size=self.ranks, attempt=attempt, rank=0), timeout=60).checkpoint_id

    def put_all(self, cid: int) -> float:
        def put(r: int) -> None:
            data = self.shards[r]
            msgs = [pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=r, file_name=self.name(r),
                                                             size=len(data), xxh3_128=self.digests[r])),
                    pb.PutShardRequest(chunk=data)]
            self.stub.PutShard(iter(msgs), timeout=120)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(put, range(self.ranks)))
        return time.perf_counter() - t0

    def vote(self, cid: int, r: int, wait: float):
        return self.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=r, files=[self.name(r)],
                                                         wait_seconds=wait), timeout=wait + 120)

    def last_vote_to_commit(self, run: str, step: int, attempt: str) -> dict:
        """Every rank uploads; ranks 0..N-2 vote with wait_seconds=0; then the last rank's
        CommitRank is timed until it answers COMMITTED (the commit happens inside it)."""
        cid = self.begin(run, step, attempt)
        put_s = self.put_all(cid)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as ex:
            states = list(ex.map(lambda r: self.vote(cid, r, 0.0).status, range(self.ranks - 1)))
        votes_s = time.perf_counter() - t0
        assert all(s == "PENDING" for s in states), set(states)
        t0 = time.perf_counter()
        res = self.vote(cid, self.ranks - 1, 5.0)
        commit_s = time.perf_counter() - t0
        if res.status != "COMMITTED":
            raise RuntimeError(f"checkpoint {cid}: last vote answered {res.status}")
        return {"checkpoint_id": cid, "put_s": put_s, "votes_s": votes_s, "commit_s": commit_s}

    def all_vote_waiting(self, run: str, step: int, attempt: str, wait: float, limit: float = 300.0) -> dict:
        """As the Checkpointer votes: every rank at once calls CommitRank(wait_seconds=wait)
        and calls again until it hears COMMITTED. Returns first vote sent -> first COMMITTED
        reply, and -> every rank has heard it."""
        cid = self.begin(run, step, attempt)
        self.put_all(cid)
        done = threading.Event()
        lock = threading.Lock()
        heard: dict[int, float] = {}
        calls = [0]
        errors: list[BaseException] = []

        def issue(r: int) -> None:
            with lock:
                calls[0] += 1
            f = self.stub.CommitRank.future(pb.CommitRankRequest(
                checkpoint_id=cid, rank=r, files=[self.name(r)], wait_seconds=wait), timeout=wait + 120)
            f.add_done_callback(lambda fut, r=r: on_done(r, fut))

        def on_done(r: int, fut) -> None:
            try:
                res = fut.result()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                done.set()
                return
            if res.status == "COMMITTED":
                with lock:
                    heard[r] = time.perf_counter()
                    if len(heard) == self.ranks:
                        done.set()
            elif not done.is_set():
                issue(r)

        t0 = time.perf_counter()
        for r in range(self.ranks):
            issue(r)
        if not done.wait(limit):
            raise RuntimeError(f"{self.ranks} ranks voting with wait={wait}s: no commit within {limit}s")
        if errors:
            raise RuntimeError(f"CommitRank failed: {errors[0]}")
        return {"checkpoint_id": cid, "first_commit_s": min(heard.values()) - t0,
                "all_heard_s": max(heard.values()) - t0, "calls": calls[0]}


def commit_at_scale(work: Path, ranks: int, reps: int, waiting_reps: int, log) -> dict:
    svc = Service(work / "svc-scale", {"LASTGOOD_GC_INTERVAL": "0"}).start()
    gen = LoadGenerator(svc, ranks)
    try:
        runs = []
        for i in range(reps + 1):  # the first is a warm-up
            r = gen.last_vote_to_commit("bench-scale", i, "a1")
            log(f"  {ranks} ranks, rep {i}{' (warm-up)' if i == 0 else ''}: puts {r['put_s']:.2f} s, "
                f"{ranks - 1} votes {r['votes_s']:.2f} s, last vote -> COMMITTED {r['commit_s'] * 1e3:.1f} ms")
            if i:
                runs.append(r)
        waiting = []
        for i in range(waiting_reps):
            r = gen.all_vote_waiting("bench-scale-waiting", i, "a1", wait=2.0)
            log(f"  {ranks} ranks all voting with wait_seconds=2 (as the Checkpointer): first COMMITTED after "
                f"{r['first_commit_s']:.2f} s, all heard after {r['all_heard_s']:.2f} s, {r['calls']} calls")
            waiting.append(r)
    finally:
        gen.close()
        svc.stop()
    out = {"ranks": ranks, "grpc_workers": 64, "reps": runs,
           "last_vote_to_commit_s": median([r["commit_s"] for r in runs]),
           "puts_s": median([r["put_s"] for r in runs]), "votes_s": median([r["votes_s"] for r in runs])}
    if waiting:
        out["waiting_votes"] = {"wait_seconds": 2.0, "reps": waiting,
                                "first_vote_to_commit_s": median([r["first_commit_s"] for r in waiting]),
                                "first_vote_to_all_heard_s": median([r["all_heard_s"] for r in waiting])}
    return out


# ---------------------------------------------------------------------------- the catalog list
def seed_catalog(data_dir: Path, run: str, n: int) -> float:
    """n COMMITTED checkpoints of one run (a parent chain, a few tags), inserted straight
    into the service's SQLite catalog through its own models, before the service starts."""
    from sqlalchemy import insert, update

    from lastgood_service.catalog.db import make_engine, upgrade_head
    from lastgood_service.catalog.models import COMMITTED, SYSTEM, TAG, Checkpoint, Run, Tag
    from lastgood_service.settings import Settings

    t0 = time.perf_counter()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings(data_dir=data_dir)
    url = settings.resolved_catalog_url()
    upgrade_head(url, settings.migrations_dir)
    engine = make_engine(url)
    base = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    with engine.begin() as conn:
        if conn.exec_driver_sql("SELECT count(*) FROM checkpoints").scalar():
            raise RuntimeError(f"{data_dir}: the catalog is not empty")
        run_id = conn.execute(insert(Run).values(name=run, created_at=base)).inserted_primary_key[0]
        rows = []
        for i in range(n):  # a fresh catalog: ids 1..n, each the parent of the next
            t = base + dt.timedelta(seconds=60 * i)
            rows.append({"id": i + 1, "run_id": run_id, "step": 100 * i, "attempt": "a1", "world_size": 8,
                         "status": COMMITTED, "bytes": 8 * 2**30, "lease_expires_at": t, "created_at": t,
                         "committed_at": t + dt.timedelta(seconds=20), "parent_id": i or None,
                         "manifest_key": f"ckpt/{i + 1}/manifest.json", "manifest_hash": "0" * 32})
        conn.execute(insert(Checkpoint), rows)
        tags = [{"run_id": run_id, "checkpoint_id": cid, "name": "eval", "kind": TAG, "created_at": base}
                for cid in range(1, n + 1, 100)]
        tags.append({"run_id": run_id, "checkpoint_id": max(1, n - 5), "name": "rollback-target", "kind": SYSTEM,
                     "created_at": base})
        conn.execute(insert(Tag), tags)
        conn.execute(update(Run).where(Run.id == run_id).values(last_good_id=n))
    engine.dispose()
    return time.perf_counter() - t0


def list_latency(work: Path, n: int, reps: int, requests: int, log) -> dict:
    data = work / "svc-catalog"
    run = "bench-catalog"
    seed_s = seed_catalog(data, run, n)
    log(f"  seeded {n} committed checkpoints in {seed_s:.1f} s")
    svc = Service(data, {"LASTGOOD_GC_INTERVAL": "0"}).start()
    out = {"checkpoints": n, "requests_per_rep": requests, "seed_s": seed_s}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=60)

        def timed(path: str) -> float:
            t0 = time.perf_counter()
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            t = time.perf_counter() - t0
            assert resp.status == 200, (resp.status, body[:300])
            return t, body

        _, body = timed(f"/api/v1/runs/{run}/checkpoints?limit=100")
        doc = json.loads(body)
        assert doc["total"] == n and len(doc["items"]) == 100, (doc["total"], len(doc["items"]))
        for label, path in (("list", f"/api/v1/runs/{run}/checkpoints?limit=100"),
                            ("list_committed", f"/api/v1/runs/{run}/checkpoints?status=COMMITTED&limit=100"),
                            ("list_last_page", f"/api/v1/runs/{run}/checkpoints?limit=100&offset={n - 100}")):
            for _ in range(10):  # warm-up
                timed(path)
            p50s, p99s = [], []
            for _ in range(reps):
                ts = [timed(path)[0] for _ in range(requests)]
                p50s.append(percentile(ts, 0.5) * 1e3)
                p99s.append(percentile(ts, 0.99) * 1e3)
            out[label] = {"path": path, "p50_ms_reps": p50s, "p99_ms_reps": p99s,
                          "p50_ms": median(p50s), "p99_ms": median(p99s)}
            log(f"  GET {path}: p50 {median(p50s):.1f} ms, p99 {median(p99s):.1f} ms")
        conn.close()
    finally:
        svc.stop()
    return out
