"""What heartbeats cost the service: 1,024 simulated ranks beating every 10 s.

    python -m bench.heartbeats [--ranks 1024] [--period 10] [--compress 1,10] [--duration 60]

A real service process (SQLite catalog, its health sweep every 5 s as by default) and one
registered launch of RANKS ranks. A load generator in this process sends each rank's beat
on an open-loop timetable -- rank r at t0 + (r/RANKS + k)·PERIOD/COMPRESS -- from a pool of
threads, each beat on a fresh HTTP connection with the same body the client sends
(lastgood.remote.heartbeat), as the client does (urllib, one connection per beat). COMPRESS 1 is the
real load (RANKS/PERIOD beats a second); COMPRESS 10 is ten times that, the same number of
beats in a tenth of the time. For each: the service's CPU time over the window (utime +
stime from /proc, after a warm-up) as a share of one core, the latency of every beat
(send to answer) and its lateness against the timetable (answer minus scheduled time: a
generator or service that falls behind shows here, not hidden by coordinated omission),
the beats that failed, and the time GET .../health takes to judge all the ranks.
Writes bench/results/heartbeats.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, Service, median, percentile

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def post(host: str, port: int, path: str, body: bytes) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def beat_body(rank: int, ranks: int, k: int, gen: int, period: float) -> bytes:
    """Rank `rank`'s k-th beat, as the client sends it (lastgood.remote.heartbeat)."""
    return json.dumps({"rank": rank, "world_size": ranks, "step": k, "step_seconds": 0.5 if k else None,
                       "phase": "train", "attempt": "bench", "generation": gen,
                       "max_step_seconds": 0.6 if k else None, "period_s": period, "save_stall_s": 2.0}).encode()


def register(svc: Service, run: str, ranks: int) -> int:
    """Register a launch of `ranks` ranks on `run`: its generation, which every beat carries."""
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=30)
    conn.request("POST", f"/api/v1/runs/{run}/launches", json.dumps(
        {"attempt": "bench", "world_size": ranks}), {"Content-Type": "application/json"})
    gen = json.loads(conn.getresponse().read())["generation"]
    conn.close()
    return gen


def phase(svc: Service, run: str, gen: int, ranks: int, period: float, compress: float, duration: float,
          warmup: float, threads: int) -> dict:
    every = period / compress  # one rank's beats, compressed
    total = int(duration / every * ranks)
    t0 = time.monotonic() + 1.0
    plan = [t0 + (i % ranks) * every / ranks + (i // ranks) * every for i in range(total)]
    path = f"/api/v1/runs/{run}/heartbeats"
    host, port = "127.0.0.1", svc.port
    lock = threading.Lock()
    nxt = [0]
    rows: list[tuple[float, float, float, int]] = []  # (scheduled, sent, answered, status)

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= total or time.monotonic() > t0 + duration:  # behind at the end: the rest is not sent
                return
            sched = plan[i]
            rank, k = i % ranks, i // ranks
            wait = sched - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            body = beat_body(rank, ranks, k, gen, period)
            sent = time.monotonic()
            try:
                status = post(host, port, path, body)
            except OSError:
                status = 0
            done = time.monotonic()
            with lock:
                rows.append((sched, sent, done, status))

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    # the measuring window: after the warm-up, until the timetable's end
    time.sleep(max(0.0, t0 + warmup - time.monotonic()))
    c0, w0 = cpu_seconds(svc.pid), time.monotonic()
    time.sleep(max(0.0, t0 + duration - time.monotonic()))
    c1, w1 = cpu_seconds(svc.pid), time.monotonic()
    for t in pool:
        t.join(120)
    # the beats answered within the window: what the service really did in it (a service that
    # falls behind answers the window's beats later, and their lateness shows it)
    window = [r for r in rows if w0 <= r[2] <= w1]
    ok = [r for r in window if r[3] == 204]
    lat = [(r[2] - r[1]) * 1000 for r in ok]
    late = [(r[2] - r[0]) * 1000 for r in ok]
    return {"compress": compress, "target_beats_per_s": round(ranks / every, 1),
            "achieved_beats_per_s": round(len(ok) / (w1 - w0), 1), "window_s": round(w1 - w0, 2),
            "kept_up": bool(late) and percentile(late, 0.99) < every * 1000,
            "beats": len(window), "failed": len(window) - len(ok),
            "service_cpu_s": round(c1 - c0, 3), "service_cpu_share_of_one_core": round((c1 - c0) / (w1 - w0), 3),
            "service_cpu_ms_per_beat": round((c1 - c0) * 1000 / max(1, len(ok)), 3),
            "latency_ms": {"p50": round(median(lat), 2), "p99": round(percentile(lat, 0.99), 2),
                           "max": round(max(lat), 2)} if lat else None,
            "answered_after_schedule_ms": {"p50": round(median(late), 2), "p99": round(percentile(late, 0.99), 2)}
            if late else None}


def health_read(svc: Service, run: str, n: int = 20) -> dict:
    times = []
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=60)
        t = time.monotonic()
        conn.request("GET", f"/api/v1/runs/{run}/health")
        doc = json.loads(conn.getresponse().read())
        times.append((time.monotonic() - t) * 1000)
        conn.close()
    return {"ranks": len(doc["ranks"]), "hung": len(doc["hung"]), "ms_p50": round(median(times), 2),
            "ms_max": round(max(times), 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.heartbeats", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between one rank's beats")
    ap.add_argument("--compress", default="1,10", help="comma list of load multipliers")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of each phase")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=64, help="load generator threads")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "heartbeats.json")
    args = ap.parse_args(argv)
    from bench.common import machine

    doc = {"bench": "heartbeats", "ranks": args.ranks, "period_s": args.period, "duration_s": args.duration,
           "machine": machine(), "phases": []}
    with tempfile.TemporaryDirectory(prefix="lastgood-heartbeats-") as work:
        svc = Service(Path(work) / "svc", {"LASTGOOD_GC_INTERVAL": "0"}).start()
        try:
            run = "bench-heartbeats"
            gen = register(svc, run, args.ranks)
            for c in (float(x) for x in args.compress.split(",")):
                res = phase(svc, run, gen, args.ranks, args.period, c, args.duration, args.warmup, args.threads)
                doc["phases"].append(res)
                print(json.dumps(res), flush=True)
            doc["health_read"] = health_read(svc, run)
            print(json.dumps({"health_read": doc["health_read"]}), flush=True)
        finally:
            svc.stop()
    doc["machine"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
