"""The control plane at 1,024+ ranks: begin storm, vote storm, how every rank hears COMMITTED.

    nice -n 10 python -m bench.control_plane [--ranks 1024,4096] [--catalogs sqlite,postgres]
        [--modes outcome] [--repeats N] [--heartbeats 1024] [--profile DIR]
    python -m bench.control_plane storm URL --ranks N --mode outcome   (one storm, JSON; tests use it)

--heartbeats N: N ranks of another run beat every 10 s throughout (class Beats), and each
checkpoint reports the beats answered during its begin storm and its vote storm.
--profile DIR: the service runs under yappi (bench/profiling/sitecustomize.py); each vote
storm's CPU time per function, the event loop's thread apart from the others, goes to DIR.

One process simulates every rank with asyncio: gRPC (grpc.aio, one channel per 64 ranks)
for begin, put and vote; httpx for the REST long-poll. Per checkpoint:

1. begin storm: every rank calls BeginCheckpoint at once (idempotent: all get one id);
2. every rank puts a tiny valid shard (32 at a time: not what is measured);
3. vote storm: every rank votes at once and waits for COMMITTED, in one of two ways:
   - `vote-wait` (main's path before docs/control-plane.md): CommitRank with wait_seconds=2,
     again after a jittered backoff when the service answered without waiting (the
     Checkpointer's loop as it was);
   - `outcome`: CommitRank with wait 0, then GET /api/v1/checkpoints/{id}/outcome?wait=10
     until decided (the Checkpointer's loop now).
   Measured: from the last vote (its catalog timestamp) to each rank hearing COMMITTED
   (time.time() here; one machine, one clock); the service's CPU seconds and its peak
   thread count over the storm.
4. catalog cost of the checkpoint: rows it added; the service's catalog transactions of
   each phase by label (/metrics, both catalogs); on PostgreSQL the database's own
   transaction, tuple and WAL counters; on SQLite the bytes the service wrote with write()
   less the blob bytes.

Both modes run in the same service process, alternating, so they share the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx

from bench.common import ROOT, Service, machine, median, percentile
from bench.control_plane_load import Hog, older_code, per_rank_us, summarize, thread_cpu
from bench.probes import Catalog, ThreadSampler, _delta, catalog_transactions, cpu_seconds, summary, wchar
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

MODES = ("vote-wait", "outcome")
RANKS_PER_CHANNEL = 64
PUTS_AT_ONCE = 16
RPC_TIMEOUT = 600.0  # at 4,096 ranks a vote queues for minutes behind the others (docs/control-plane.md)


def _shard(rank: int, step: int) -> bytes:
    from tests.service.helpers import make_shard  # the one valid-shard maker

    return make_shard(rank, seed=step, n=2)


def _file(rank: int) -> str:
    from tests.service.helpers import shard_name

    return shard_name(rank)


class Beats:
    """Heartbeats alongside the storms (--heartbeats N): N ranks of a run of their own, each
    beating every `period` s on bench/heartbeats.py's open-loop timetable (rank r at
    t0 + (r/N + k)·period), each beat on a fresh connection as the client sends it, from a
    pool of threads. `window(t0, t1)`: the beats answered between two monotonic times."""

    def __init__(self, svc: Service, ranks: int, period: float = 10.0, threads: int = 32) -> None:
        from bench.heartbeats import register

        self.svc, self.ranks, self.period = svc, ranks, period
        self.gen = register(svc, "bench-heartbeats", ranks)
        self.rows: list[tuple[float, float, float, int]] = []  # (scheduled, sent, answered, HTTP status)
        self._next, self._lock, self._stop = 0, threading.Lock(), threading.Event()
        self._t0 = time.monotonic() + 0.5
        self._pool = [threading.Thread(target=self._worker, daemon=True) for _ in range(threads)]
        for t in self._pool:
            t.start()

    def _worker(self) -> None:
        from bench.heartbeats import beat_body, post

        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next, self._next + 1
            rank, k = i % self.ranks, i // self.ranks
            sched = self._t0 + (rank / self.ranks + k) * self.period
            if self._stop.wait(max(0.0, sched - time.monotonic())):
                return
            sent = time.monotonic()
            try:
                status = post("127.0.0.1", self.svc.port, "/api/v1/runs/bench-heartbeats/heartbeats",
                              beat_body(rank, self.ranks, k, self.gen, self.period))
            except OSError:
                status = 0
            with self._lock:
                self.rows.append((sched, sent, time.monotonic(), status))

    def window(self, t0: float, t1: float) -> dict:
        with self._lock:
            rows = [r for r in self.rows if t0 <= r[2] <= t1]
        ok = [r for r in rows if r[3] == 204]
        lat = sorted((r[2] - r[1]) * 1000 for r in ok)
        late = sorted((r[2] - r[0]) * 1000 for r in ok)
        return {"ranks": self.ranks, "period_s": self.period, "beats": len(rows), "failed": len(rows) - len(ok),
                "beats_per_s": round(len(ok) / max(t1 - t0, 1e-9), 1),
                "latency_ms": {"p50": round(median(lat), 1), "p99": round(percentile(lat, 0.99), 1),
                               "max": round(lat[-1], 1)} if lat else None,
                "answered_after_schedule_ms_p99": round(percentile(late, 0.99), 1) if late else None}

    def stop(self) -> None:
        self._stop.set()
        for t in self._pool:
            t.join(60)


async def get_json(host: str, port: int, path: str) -> tuple[int, dict]:
    """GET on a fresh connection (as the client's urllib does), on asyncio streams alone:
    httpx costs this one process ~10x the CPU per request, which at 4,096 ranks on a busy
    2-core machine would measure the simulator, not the service."""
    r, w = await asyncio.open_connection(host, port)
    try:
        w.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await r.read()
    finally:
        w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError("the connection closed without an answer")
    return int(head.split()[1]), json.loads(body)


async def storm(url: str, run: str, step: int, ranks: int, mode: str, pid: int | None = None,
                profile: Path | None = None, hog: Hog | None = None) -> dict:
    """One checkpoint of `ranks` simulated ranks; see the module docstring. `profile`: the
    service runs under bench/profiling (--profile): its counts of the vote storm go there."""
    info = httpx.get(url + "/api/v1/info", timeout=30).json()
    chans = [grpc.aio.insecure_channel(info["grpc_target"], options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range((ranks + RANKS_PER_CHANNEL - 1) // RANKS_PER_CHANNEL)]
    stubs = [pb_grpc.CheckpointsStub(c) for c in chans]
    stub = lambda r: stubs[r // RANKS_PER_CHANNEL]  # noqa: E731
    attempt = f"bench-{os.getpid()}"
    out: dict = {"ranks": ranks, "mode": mode}
    try:
        # 1. begin storm
        lat, errors, ids, failed = [], [], set(), []

        async def begin(r: int, measured: bool = True) -> None:
            t = time.perf_counter()
            try:
                res = await stub(r).BeginCheckpoint(pb.BeginCheckpointRequest(
                    run=run, step=step, world_size=ranks, attempt=attempt, rank=r), timeout=RPC_TIMEOUT)
                ids.add(res.checkpoint_id)
            except grpc.aio.AioRpcError as e:
                if not measured:
                    raise
                errors.append(e.code().name)
                failed.append(r)
            if measured:
                lat.append(time.perf_counter() - t)

        tx0 = catalog_transactions(url)
        if hog:  # spinning during the storms only (bench/control_plane_load.py)
            hog.resume()
        t0 = time.perf_counter()
        out["windows"] = {"begin_storm": [time.monotonic()]}
        await asyncio.gather(*(begin(r) for r in range(ranks)))
        out["windows"]["begin_storm"].append(time.monotonic())
        tx_begun = catalog_transactions(url)
        out["begin"] = {"latency_s": summary(lat), "errors": len(errors), "error_codes": sorted(set(errors)),
                        "checkpoint_ids": len(ids), "wall_s": round(time.perf_counter() - t0, 3)}
        if hog:
            hog.pause()
        for r in failed:  # the client's retry policy would ask again: so do we, one at a time, unmeasured
            await begin(r, measured=False)
        if len(ids) != 1:
            raise RuntimeError(f"begin storm: {out['begin']}")
        cid = ids.pop()
        out["checkpoint_id"] = cid

        # 2. puts (not measured)
        gate = asyncio.Semaphore(PUTS_AT_ONCE)
        blob_bytes = 0

        async def put(r: int) -> None:
            nonlocal blob_bytes
            data = _shard(r, step)
            blob_bytes += len(data)
            hdr = pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=r, file_name=_file(r),
                                                           size=len(data), xxh3_128=hash_bytes(data)))
            async with gate:
                for tries in range(20):
                    try:
                        await stub(r).PutShard(iter([hdr, pb.PutShardRequest(chunk=data)]), timeout=RPC_TIMEOUT)
                        return
                    except grpc.aio.AioRpcError as e:  # too many streams at once: again shortly
                        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or tries == 19:
                            raise
                        await asyncio.sleep(0.05 * (tries + 1))

        t0 = time.perf_counter()
        await asyncio.gather(*(put(r) for r in range(ranks)))
        out["put_wall_s"] = round(time.perf_counter() - t0, 3)
        tx_put = catalog_transactions(url)

        # 3. vote storm
        heard: list[float | None] = [None] * ranks
        statuses: list[str] = [""] * ranks
        asks = [0] * ranks
        vote_answered: list[float] = [0.0] * ranks
        host, port = url.removeprefix("http://").rsplit(":", 1)
        dropped = 0

        async def vote(r: int, wait: float) -> pb.CommitRankResponse:
            asks[r] += 1
            return await stub(r).CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=r, files=[_file(r)],
                                                                 wait_seconds=wait), timeout=wait + RPC_TIMEOUT)

        async def rank_vote_wait(r: int) -> None:
            pause = 0.05
            while True:
                asked = time.monotonic()
                res = await vote(r, 2.0)
                if res.status != "PENDING":
                    statuses[r], heard[r] = res.status, time.time()
                    return
                if time.monotonic() - asked < 1.0:  # answered without waiting: back off
                    await asyncio.sleep(pause * (0.5 + random.random()))
                    pause = min(pause * 2, 2.0)

        async def rank_outcome(r: int) -> None:
            nonlocal dropped
            res = await vote(r, 0.0)
            vote_answered[r] = time.time()
            status = res.status
            while status == "PENDING":
                asks[r] += 1
                try:
                    code, body = await get_json(host, int(port), f"/api/v1/checkpoints/{cid}/outcome?wait=10")
                    if code != 200:
                        raise RuntimeError(f"outcome: HTTP {code}: {body}")
                    status = body["status"]
                except (OSError, ConnectionError):  # a connection that dropped or was refused: ask again
                    dropped += 1
                    await asyncio.sleep(0.05)
            statuses[r], heard[r] = status, time.time()

        body = rank_vote_wait if mode == "vote-wait" else rank_outcome
        if profile:  # count from here (bench/profiling/sitecustomize.py)
            Path(os.environ["LASTGOOD_BENCH_PROFILE_OUT"] + ".clear").touch()
            await asyncio.sleep(0.5)
        if hog:
            hog.resume()
            hog0 = hog.cpu_seconds()
        cpu0, threads0 = (cpu_seconds(pid), thread_cpu(pid)) if pid else (0.0, None)
        t0 = time.time()
        out["windows"]["vote_storm"] = [time.monotonic()]
        with ThreadSampler(pid) as sampler:
            await asyncio.gather(*(body(r) for r in range(ranks)))
        out["windows"]["vote_storm"].append(time.monotonic())
        out["vote_storm_wall_s"] = round(time.time() - t0, 3)
        if hog:
            hog.pause()
            out["hog_cpu_s"] = round(hog.cpu_seconds() - hog0, 2)  # over the vote storm
        out["service_cpu_per_rank_us"] = per_rank_us(threads0, thread_cpu(pid), ranks) if pid else None
        out["heard_max_after_first_vote_s"] = round(max(h for h in heard if h is not None) - t0, 4)
        if profile:
            dumped = Path(os.environ["LASTGOOD_BENCH_PROFILE_OUT"])
            dumped.unlink(missing_ok=True)
            Path(f"{dumped}.dump").touch()
            for _ in range(3000):
                await asyncio.sleep(0.1)
                if dumped.exists():
                    break
            dumped.rename(profile)
        # catalog transactions of each phase, by the label of the code that ran them (the
        # service's own count: SQLite and PostgreSQL alike; "vote" includes the commit)
        out["catalog_transactions"] = {"begin_storm": _delta(tx_begun, tx0), "puts": _delta(tx_put, tx_begun),
                                       "vote_storm": _delta(catalog_transactions(url), tx_put)}
        out["service_cpu_s"] = round(cpu_seconds(pid) - cpu0, 2) if pid else None
        out["service_threads_peak"] = sampler.peak if pid else None
        out["statuses"] = {s: statuses.count(s) for s in set(statuses)}
        out["requests_per_rank"] = {"mean": round(sum(asks) / ranks, 2), "max": max(asks)}
        out["dropped_connections_asked_again"] = dropped
        out["heard"] = heard
        out["blob_bytes"] = blob_bytes
    finally:
        for c in chans:
            await c.close()
    return out


# ---------------------------------------------------------------------------- catalog
def one_checkpoint(svc: Service, catalog: Catalog, run: str, step: int, ranks: int, mode: str,
                   profile: Path | None = None, beats: Beats | None = None, hog: Hog | None = None) -> dict:
    before, w0 = catalog.counters(), wchar(svc.pid)
    res = asyncio.run(storm(svc.url, run, step, ranks, mode, svc.pid, profile, hog))
    windows = res.pop("windows")
    if beats is not None:  # the heartbeats answered while the storms ran
        res["heartbeats"] = {name: beats.window(*w) for name, w in windows.items()}
    time.sleep(1.5)  # PostgreSQL publishes a backend's counters within a second of its transactions
    after, w1 = catalog.counters(), wchar(svc.pid)
    last_vote, committed = catalog.times(res["checkpoint_id"])
    heard = res.pop("heard")
    res["decision_s"] = round(committed - last_vote, 4)  # last vote -> COMMITTED in the catalog
    res["heard_after_last_vote_s"] = summary([h - last_vote for h in heard if h is not None])
    res["catalog"] = {"rows": catalog.rows(res["checkpoint_id"])}
    if before:
        res["catalog"].update({k: after[k] - before[k] for k in before})
    else:
        res["catalog"]["bytes_written_less_blobs"] = w1 - w0 - res["blob_bytes"]
    return res


def run_catalog(kind: str, rank_counts: list[int], repeats: int, work: Path, modes=MODES, on_result=None,
                profile: Path | None = None, heartbeats: int = 0, compare: tuple[str, str] | None = None,
                hog: bool = False) -> dict:
    pg = None
    env = {"LASTGOOD_REAPER_INTERVAL": "30", "LASTGOOD_LEASE_SECONDS": "600", "LASTGOOD_GC_INTERVAL": "0"}
    if profile:  # yappi in the service (bench/profiling/sitecustomize.py)
        profile.mkdir(parents=True, exist_ok=True)
        os.environ["LASTGOOD_BENCH_PROFILE_OUT"] = str(work / f"profile-{kind}.txt")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "profiling"), os.environ.get("PYTHONPATH", "")])
    if kind == "postgres":
        sys.path.insert(0, str(ROOT))
        from tests.pg import _as_postgres, PG_BIN, _start

        root = Path(tempfile.mkdtemp(prefix="lastgood-pg-bench-"))
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(root, pw.pw_uid, pw.pw_gid)
        pg = _start(root)
    codes = ["this"] + ([f"{compare[0]}"] if compare else [])
    svcs, catalogs = {}, {}
    for code in codes:  # one service (and catalog) per version of the code, side by side
        cenv = dict(env)
        if pg is not None:
            cenv["LASTGOOD_CATALOG_URL"] = pg.url(pg.create_database(f"bench{len(svcs)}"))
        if code != "this":
            cenv["PYTHONPATH"] = compare[1]
        svcs[code] = Service(work / kind / str(len(svcs)), cenv).start(timeout=120)
        catalogs[code] = Catalog(cenv.get("LASTGOOD_CATALOG_URL") or
                                 f"sqlite:///{work / kind / str(len(catalogs)) / 'catalog.db'}")
    results = []
    beats = Beats(svcs["this"], heartbeats) if heartbeats else None
    spinner = Hog() if hog else None
    # every (code, mode, hog) in turn, the order reversed every other repeat: A B B A, same load
    order = [(c, m, h) for c in codes for m in modes for h in ((False, True) if hog else (False,))]
    try:
        step = 0
        for ranks in rank_counts:
            for rep in range(repeats):
                for code, mode, hogged in (order if rep % 2 == 0 else order[::-1]):
                    step += 1
                    load = os.getloadavg()[0]
                    try:
                        r = one_checkpoint(svcs[code], catalogs[code], f"cp-{kind}", step, ranks, mode,
                                           profile and profile / f"{kind}-{ranks}-{mode}-{step}.txt", beats,
                                           spinner if hogged else None)
                    except Exception as e:  # noqa: BLE001 - a failed checkpoint is a result too
                        r = {"ranks": ranks, "mode": mode, "failed": f"{type(e).__name__}: {e}"[:2000]}
                    r["code"], r["loadavg_1m_before"], r["catalog_kind"], r["hog"] = code, round(load, 2), kind, hogged
                    print(json.dumps({k: v for k, v in r.items() if k != "catalog"}), flush=True)
                    results.append(r)
                    if on_result:
                        on_result({"catalog": kind, "checkpoints": results})
    finally:
        if spinner is not None:
            spinner.stop()
        if beats is not None:
            beats.stop()
        for code, svc in svcs.items():
            catalogs[code].close()
            svc.stop()
            log = Path(tempfile.gettempdir()) / f"control-plane-service-{kind}-{code}.log"
            log.write_bytes(svc.log.read_bytes())  # the service's own account of any failure
        if pg is not None:
            _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(pg.data_dir), "-m", "fast", "-w", "stop")
    return {"catalog": kind, "checkpoints": results}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "storm":
        p = argparse.ArgumentParser(prog="bench.control_plane storm")
        p.add_argument("cmd")
        p.add_argument("url")
        p.add_argument("--run", required=True)
        p.add_argument("--step", type=int, default=1)
        p.add_argument("--ranks", type=int, default=256)
        p.add_argument("--mode", choices=MODES, default="outcome")
        a = p.parse_args()
        res = asyncio.run(storm(a.url, a.run, a.step, a.ranks, a.mode))
        res["heard"] = sum(h is not None for h in res["heard"])
        print(json.dumps(res))
        return
    p = argparse.ArgumentParser(prog="bench.control_plane")
    p.add_argument("--ranks", default="1024,4096")
    p.add_argument("--catalogs", default="sqlite,postgres")
    p.add_argument("--repeats", type=int, default=1, help="pairs of (vote-wait, outcome) per rank count")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane.json"))
    p.add_argument("--profile", type=Path, help="profile the service's vote storms with yappi (CPU time per "
                   "function, the event loop's thread and all threads) into this folder; slows it")
    p.add_argument("--heartbeats", type=int, default=0, metavar="N",
                   help="N ranks of another run beating every 10 s throughout (bench/heartbeats.py's beat)")
    p.add_argument("--compare-with", metavar="GIT_REF", help="also run the service of this commit, its "
                   "checkpoints alternating with this code's (same run, same load): git archive of service/, "
                   "client/ and migrations/, without httptools and uvloop unless that commit pins them")
    p.add_argument("--hog", action="store_true", help="run every checkpoint twice, quiet and with a CPU hog "
                   "spinning on the last CPU during its storms (bench/control_plane_load.py), interleaved")
    a = p.parse_args()
    if a.compare_with and a.heartbeats:
        p.error("--heartbeats beats this code's service only: run the comparison without it")
    report = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "nice": os.nice(0), "command": "python -m bench.control_plane " + " ".join(sys.argv[1:]),
              "runs": []}
    with tempfile.TemporaryDirectory(prefix="lastgood-cp-") as work:
        os.chmod(work, 0o755)
        compare = (a.compare_with, older_code(ROOT, a.compare_with, Path(work) / "older")) if a.compare_with else None
        for kind in a.catalogs.split(","):
            def partial(run: dict) -> None:  # written after every checkpoint: a long run that fails keeps its figures
                Path(a.out).write_text(json.dumps({**report, "runs": report["runs"] + [run], "partial": True},
                                                  indent=1) + "\n")
            report["runs"].append(run_catalog(kind, [int(x) for x in a.ranks.split(",")], a.repeats, Path(work),
                                              tuple(a.modes.split(",")), partial, a.profile, a.heartbeats,
                                              compare, a.hog))
    report["summary"] = summarize([c for run in report["runs"] for c in run["checkpoints"]])
    report["loadavg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
