"""The data paths against each other (docs/dataplane.md): what a committed GiB costs the
service, and what direct-FS delivers with many ranks at once.

    .venv/bin/python -m bench.dataplane                 # 256 MiB files, 16 ranks
    .venv/bin/python -m bench.dataplane --size 64M      # smaller (a loaded 2-core machine)

1. Service CPU seconds per GiB committed, read from /proc/<service pid>/stat (utime +
   stime) around saves of `--saves` files of `--size` each, one rank, on this host:
   streamed (gRPC chunks, hashed and written by the service), spool (written by the client
   into the service's spool; the service re-reads and hashes it, renames it), direct-FS in
   `service` mode (the same from a mount of the store under another path), direct-FS in
   `peer` mode (the service reads the header only; the rank reads its file back: the
   client's read is the peer's cost, not the service's). The same number of saves of a
   4 KiB file gives what a save costs the service whatever its size (the control plane),
   and the difference what its bytes cost; the idle service's background CPU per second
   (reaper, notifier: 10 ms clock ticks) is taken out of both.
2. `--ranks` (16) processes, each saving `--size` (256 MiB) through direct-FS into one
   checkpoint of that world size (`peer` mode: write + fsync, hand over, vote, read back
   the next rank's file, commit), against the same processes' raw write + fsync of the
   same bytes to their own files in the same directory, alternating, `--reps` times in the
   same run. Each rank's bytes are made before a start barrier; the figure is the
   aggregate bytes over the time from the barrier to the last rank's COMMITTED (or its
   fsync returning). Target: direct-FS >= 0.8x raw.

Results: bench/results/dataplane.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import GiB, MiB, ROOT, ServiceProcess, parse_size, settle
from bench.probes import cpu_seconds

FILE = "shard.bin"  # not .safetensors: the service reads no header, the bytes are the whole cost
IDLE_S = 3.0  # seconds the idle service's background CPU is measured over
TINY = 4096  # bytes of the saves that measure what a save costs whatever its size


# ---------------------------------------------------------------------------- one rank's save
def save_one(url: str, run: str, step: int, data: bytes, path: str, *, mount: str | None = None,
             world: int = 1, rank: int = 0, attempt: str = "a1", transport=None) -> dict:
    """One rank's save of `data` through `path` (streamed, spool, direct), to COMMITTED; the
    time.time() at which each phase ended (written, voted, checked, committed)."""
    from lastgood.datapath import peer
    from lastgood.datapath.directfs import DirectFS
    from lastgood.wire.hashing import StreamHasher, hash_bytes
    from lastgood.datapath.transport import Transport

    t = transport or Transport(url, spool=(path == "spool"))
    phases = {"start": time.time()}
    try:
        hasher, handle, spooled, direct = StreamHasher(), None, None, None
        if path == "direct":
            direct = DirectFS.find(t, mount)
            assert direct is not None, f"{mount} is not the service's direct-FS store"
            handle = direct.write(data, hasher)
        elif path == "spool":
            assert t.spool is not None, "no spool on this host"
            spooled = t.spool_write(data, hasher)
        digest = hasher.hexdigest() if (handle or spooled) else hash_bytes(data)
        phases["written"] = time.time()
        # `peer` mode alone: a job of one rank does not check itself (the service would hash
        # it), so the save is a checkpoint of two ranks whose second writes nothing and checks
        # the first, as in any larger job; its read is the peer's cost, not the service's
        checker = t.info.verification == "peer" and world == 1
        cid = t.begin(run, step, 2 if checker else world, None, attempt, rank).checkpoint_id
        if direct is not None:
            direct.hand_over(cid, rank, FILE, data, digest, handle)
            assert direct.usable, "the service declined the direct-FS hand-over"
        else:
            t.put_shard(cid, rank, FILE, memoryview(data), digest, spooled=spooled)
        status = t.commit_rank(cid, rank, [FILE], wait=0).status
        if checker:
            status = t.commit_rank(cid, 1, [], wait=0).status
        phases["voted"] = time.time()
        if t.info.verification == "peer" and status == "PENDING":
            # as the client does (commit/session.py): a COMMITTED heard in the check needs no outcome call
            by = 1 if checker else rank
            status = "COMMITTED" if peer.check(t, direct, cid, by, time.monotonic() + 600) == "COMMITTED" else status
        phases["checked"] = time.time()
        deadline = time.monotonic() + 600
        while status == "PENDING" and time.monotonic() < deadline:
            status = t.outcome(cid, wait=10)["status"]
        assert status == "COMMITTED", f"checkpoint {cid} is {status}"
        phases["committed"] = time.time()
        return phases
    finally:
        if transport is None:
            t.close()


# ---------------------------------------------------------------------------- 1. CPU per GiB
def _drop_large_blobs(root: Path, size: int) -> None:
    """Delete the measured saves' shard files (nothing reads them again): the next path's
    saves then need room for their own bytes only (3 paths x 4 GiB did not fit on a shared
    disk with 11 GiB free). Outside any measured interval."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.lstat(path).st_size >= size:
                    os.unlink(path)
            except OSError:
                pass


def cpu_per_gib(work: Path, size: int, saves: int) -> list[dict]:
    rows = []
    for mode, paths in (("service", ("streamed", "spool", "direct")), ("peer", ("direct",))):
        svc = ServiceProcess(work / f"cpu-{mode}", {"LASTGOOD_VERIFICATION": mode, "LASTGOOD_GC_INTERVAL": "0",
                                                     "LASTGOOD_HEALTH_INTERVAL": "0"}).start()
        mount = work / f"mnt-{mode}"
        mount.symlink_to(svc.data_dir / "blobs")  # the store under another path, as another host mounts it
        try:
            for path in paths:
                data = os.urandom(size)
                save_one(svc.url, f"warm-{path}", 0, data, path, mount=str(mount))  # connections, imports
                # the service's own background (reaper, notifier) per second of wall time,
                # and the same number of saves of a tiny file: what a save costs the service
                # whatever its size (begin, vote, commit, the checks' calls); both taken out below
                cpu0 = cpu_seconds(svc.pid)
                time.sleep(IDLE_S)
                idle = (cpu_seconds(svc.pid) - cpu0) / IDLE_S
                cpu0, t0 = cpu_seconds(svc.pid), time.perf_counter()
                for i in range(saves):
                    save_one(svc.url, f"fixed-{path}", i + 1, data[:TINY], path, mount=str(mount))
                fixed = cpu_seconds(svc.pid) - cpu0 - idle * (time.perf_counter() - t0)
                settle()
                cpu0, t0 = cpu_seconds(svc.pid), time.perf_counter()
                for i in range(saves):
                    save_one(svc.url, f"cpu-{path}", i + 1, data, path, mount=str(mount))
                wall, cpu = time.perf_counter() - t0, cpu_seconds(svc.pid) - cpu0
                _drop_large_blobs(svc.data_dir / "blobs", size)
                gib = saves * size / GiB
                label = path if path != "direct" else f"direct-FS ({mode} mode)"
                per_byte = max(cpu - idle * wall - fixed, 0.0) / gib
                rows.append({"path": label, "bytes": saves * size, "service_cpu_s": round(cpu, 3),
                             "service_cpu_s_per_gib": round(cpu / gib, 3),
                             "service_cpu_s_per_save_fixed": round(fixed / saves, 4),
                             "service_cpu_s_per_gib_bytes_only": round(per_byte, 3), "wall_s": round(wall, 3),
                             "service_idle_cpu_s_per_s": round(idle, 4)})
                print(f"  {label:26} service CPU {cpu / gib:7.3f} s/GiB (of which per save, any size: "
                      f"{fixed / saves * 1000:5.1f} ms; per byte: {per_byte:6.3f} s/GiB)   wall {wall:6.2f} s",
                      flush=True)
        finally:
            svc.stop()
    streamed = next(r for r in rows if r["path"] == "streamed")["service_cpu_s_per_gib"]
    streamed_bytes = next(r for r in rows if r["path"] == "streamed")["service_cpu_s_per_gib_bytes_only"]
    for r in rows:
        r["vs_streamed"] = round(r["service_cpu_s_per_gib"] / streamed, 4) if streamed else None
        r["bytes_only_vs_streamed"] = (round(r["service_cpu_s_per_gib_bytes_only"] / streamed_bytes, 4)
                                       if streamed_bytes else None)
    return rows


# ---------------------------------------------------------------------------- 2. many ranks
def _worker(args) -> None:
    """A rank process: make its bytes, say ready, wait for go, save (or raw-write), report."""
    data = os.urandom(args.size)
    work = Path(args.work)
    transport = None
    if args.case == "direct":  # a trainer's transport lives across saves: made before the barrier
        from lastgood.datapath.transport import Transport

        transport = Transport(args.url, spool=False)
        import grpc

        grpc.channel_ready_future(transport._channel).result(timeout=120)  # connected, as a running trainer is
    (work / f"ready-{args.rank}").touch()
    while not (work / "go").exists():
        time.sleep(0.001)
    phases = {"start": time.time()}
    if args.case == "raw":
        fd = os.open(work / "raw" / f"rank{args.rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view, off = memoryview(data), 0
        while off < len(data):
            off += os.write(fd, view[off:off + 8 * MiB])
        os.fsync(fd)
        os.close(fd)
        phases["written"] = time.time()
    else:
        phases = save_one(args.url, args.run, args.step, data, "direct", mount=args.mount, world=args.world,
                          rank=args.rank, attempt=args.attempt, transport=transport)
    phases["end"] = time.time()
    (work / f"done-{args.rank}").write_text(json.dumps(phases))
    if transport is not None:
        transport.close()


def _one_round(case: str, ranks: int, size: int, work: Path, url: str, mount: str, step: int) -> tuple[float, dict]:
    """Aggregate bytes/s of `ranks` processes doing `case` at once, from the barrier to the
    last; and the median seconds from the barrier to the end of each phase."""
    for p in work.glob("ready-*"):
        p.unlink()
    for p in work.glob("done-*"):
        p.unlink()
    (work / "go").unlink(missing_ok=True)
    shutil.rmtree(work / "raw", ignore_errors=True)
    (work / "raw").mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.dataplane", "--worker", case, "--rank", str(r),
                               "--world", str(ranks), "--size", str(size), "--work", str(work), "--url", url,
                               "--mount", mount, "--run", "ranks", "--step", str(step), "--attempt", f"s{step}"],
                              cwd=ROOT) for r in range(ranks)]
    while len(list(work.glob("ready-*"))) < ranks:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a rank process failed before the barrier")
        time.sleep(0.01)
    settle()
    t0 = time.time()
    (work / "go").touch()
    for p in procs:
        if p.wait(900) != 0:
            raise RuntimeError(f"a rank process of the {case} case failed")
    done = [json.loads((work / f"done-{r}").read_text()) for r in range(ranks)]
    end = max(d["end"] for d in done)
    shutil.rmtree(work / "raw", ignore_errors=True)
    phases = {k: round(statistics.median(d[k] - t0 for d in done), 3) for k in done[0] if k != "start"}
    return ranks * size / (end - t0), phases


def many_ranks(work: Path, ranks: int, size: int, reps: int) -> dict:
    svc = ServiceProcess(work / "ranks-svc", {"LASTGOOD_VERIFICATION": "peer", "LASTGOOD_GC_INTERVAL": "0",
                                              "LASTGOOD_HEALTH_INTERVAL": "0", "LASTGOOD_LEASE_SECONDS": "300"}).start()
    mount = work / "mnt-ranks"
    mount.symlink_to(svc.data_dir / "blobs")
    rounds = work / "rounds"
    rounds.mkdir()
    direct, raw, phases = [], [], []
    try:
        for rep in range(reps):
            raw.append(_one_round("raw", ranks, size, rounds, svc.url, str(mount), rep + 1)[0])
            rate, ph = _one_round("direct", ranks, size, rounds, svc.url, str(mount), rep + 1)
            direct.append(rate)
            phases.append(ph)
            print(f"  rep {rep + 1}: raw write+fsync {raw[-1] / MiB:8.1f} MiB/s   direct-FS save "
                  f"{direct[-1] / MiB:8.1f} MiB/s   ratio {direct[-1] / raw[-1]:.2f}   direct-FS phases, median s "
                  f"from the barrier: {ph}", flush=True)
    finally:
        svc.stop()
    ratios = [d / r for d, r in zip(direct, raw)]
    return {"ranks": ranks, "bytes_per_rank": size, "verification": "peer",
            "raw_mib_s": [round(x / MiB, 1) for x in raw], "direct_mib_s": [round(x / MiB, 1) for x in direct],
            "ratio_per_rep": [round(x, 3) for x in ratios], "direct_phases_per_rep": phases, "ratio_median": round(statistics.median(ratios), 3),
            "target": 0.8}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="bytes per file (256M, 64M, ...)")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--saves", type=int, default=8, help="saves per data path in the CPU comparison")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dataplane.json"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-many", action="store_true", help="only the CPU comparison")
    # a rank process (internal)
    ap.add_argument("--worker", choices=["raw", "direct"])
    for flag in ("--rank", "--world", "--step"):
        ap.add_argument(flag, type=int, default=0)
    for flag in ("--work", "--url", "--mount", "--run", "--attempt"):
        ap.add_argument(flag)
    args = ap.parse_args(argv)
    if args.worker:
        args.case, args.size = args.worker, parse_size(args.size)
        return _worker(args)
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="lastgood-dataplane-", dir=args.workdir))
    try:
        out = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
               "loadavg_start": os.getloadavg(), "size": size, "saves": args.saves}
        if not args.skip_cpu:
            print(f"service CPU per GiB committed ({args.saves} saves of {size / MiB:.0f} MiB each):", flush=True)
            out["cpu_per_gib"] = cpu_per_gib(work, size, args.saves)
        if not args.skip_many:
            print(f"{args.ranks} ranks x {size / MiB:.0f} MiB, direct-FS (peer mode) vs raw write + fsync:", flush=True)
            out["many_ranks"] = many_ranks(work, args.ranks, size, args.reps)
        out["loadavg_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
