"""The streamed path against its peers, each in one run: a streamed restore against the bare
gRPC stream of the same stored files, and N ranks saving streamed at once against the raw
disk (bench/README.md, "The streamed path").

    python -m bench.stream restore --size 1G --reps 7   # → bench/results/stream-restore-1GiB.json
    python -m bench.stream ranks --rank-size 1G --reps 5  # → bench/results/stream-ranks-1GiB.json

`restore`: one service, one state saved once with LASTGOOD_USE_SPOOL=0, then rep by rep in
a Williams order (bench.common.order_of): lastgood's streamed restore (every byte hashed and
checked, copied into the model and optimizer in place), the bare gRPC stream of the very
files the restore reads (bench/pipe.py DownloadFile: a grpcio server reading them in 4 MiB
chunks, one stream per file at once, the client hashing each chunk and dropping it) and the
same from memory (bench/pipe.py Download). Every case reads its files warm (warm_files),
after the dirty backlog is written out. `ranks`: bench.run's RankProcs, streamed, each rep
a raw write + fsync of the same bytes right before the ranks' save, alternating which
goes first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import (GiB, MiB, ROOT, Service, build_state, machine, median, order_of, parse_size, settle,
                          size_label, spread, state_bytes, timed, warm_files)
from bench.one_size import SERVICE_ENV, Pipe, log, restored_blobs, spool_off
from bench.peers import raw_write


def restore_bench(size: int, reps: int, work: Path) -> dict:
    import lastgood

    model, opt = build_state(size)
    nbytes = state_bytes(model, opt)
    state = lastgood.TrainState(model=model, optimizer=opt)
    svc = Service(work / "svc", SERVICE_ENV).start()
    pipe = Pipe(work)
    run, attempt = f"bench-stream-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:12]
    try:
        with spool_off():
            ckpt = lastgood.Checkpointer(svc.url, run=run, attempt=attempt)
        ckpt.save(1, state)
        ckpt.wait()
        blobs = restored_blobs(svc, work / "svc", run)
        files = sorted(f for f in blobs.rglob("*") if f.is_file() and not f.name.endswith(".json"))
        stored = sum(f.stat().st_size for f in files)
        log(f"{size_label(size)}: {nbytes / MiB:.0f} MiB of state in {len(files)} stored files "
            f"({stored / MiB:.0f} MiB); load {os.getloadavg()[0]:.1f}")
        times: dict[str, list[float]] = {"lastgood_restore_stream": [], "grpc_file": [], "grpc_memory": []}
        cpu: dict[str, list[float]] = {"lastgood_restore_stream": []}

        def lg() -> None:
            got = []
            times["lastgood_restore_stream"].append(timed(lambda: got.append(ckpt.restore(state)),
                                                          cpu["lastgood_restore_stream"]))
            assert got == [1], got
            gc.collect()

        cases = [("lastgood streamed", lg),
                 ("gRPC file", lambda: times["grpc_file"].append(pipe.client.download_files(files))),
                 ("gRPC memory", lambda: times["grpc_memory"].append(pipe.client.download(stored)))]
        for _name, case in cases:  # one untimed pass: the staging buffer, first-call costs
            case()
        for v in (*times.values(), *cpu.values()):
            v.clear()
        loads = []
        for i in range(reps):
            order = order_of(cases, i)
            for _name, case in order:
                settle()
                warm_files(files)
                case()
            loads.append(os.getloadavg()[0])
            log(f"  rep {i + 1} (load {loads[-1]:.1f}) ({' > '.join(n for n, _ in order)}): lastgood streamed "
                f"{times['lastgood_restore_stream'][-1]:.3f} s, gRPC file {times['grpc_file'][-1]:.3f} s, "
                f"gRPC memory {times['grpc_memory'][-1]:.3f} s")
        ckpt.close()
    finally:
        pipe.close()
        svc.stop()
    lgt, ft, mt = times["lastgood_restore_stream"], times["grpc_file"], times["grpc_memory"]
    by_rep = [f / t for f, t in zip(ft, lgt)]
    out = {"bytes": nbytes, "stored_bytes": stored, "files": len(files), "reps": reps, "loadavg": loads,
           "seconds": times, "client_cpu_s": cpu,
           "median_s": {k: median(v) for k, v in times.items()},
           "spread": {k: spread(v) for k, v in times.items()},
           "gib_per_s": {k: stored / GiB / median(v) for k, v in times.items()},
           # throughput ratios: the peer's time over lastgood's
           "ratio_vs_grpc_file": median(ft) / median(lgt), "ratio_vs_grpc_file_by_rep": by_rep,
           "ratio_vs_grpc_memory": median(mt) / median(lgt),
           "target": 0.8}
    log(f"streamed restore / bare gRPC stream of the same files: {out['ratio_vs_grpc_file']:.2f}× "
        f"(rep by rep {min(by_rep):.2f}-{max(by_rep):.2f}; target ≥ 0.8); / from memory "
        f"{out['ratio_vs_grpc_memory']:.2f}×")
    return out


def ranks_bench(per_rank: int, ranks: int, reps: int, work: Path) -> dict:
    from bench.run import RankProcs

    procs = RankProcs(per_rank, ranks, work, spool=False).start()
    try:
        total = 0
        for p in procs.procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a rank process exited before it was ready")
            total += json.loads(line)["bytes"]
        step = [0]

        def save() -> float:
            step[0] += 1
            for p in procs.procs:
                p.stdin.write(f"save {step[0]}\n")
                p.stdin.flush()
            outs = [json.loads(p.stdout.readline()) for p in procs.procs]
            return max(o["t1"] for o in outs) - min(o["t0"] for o in outs)

        log(f"{ranks} ranks × {size_label(per_rank)} streamed: {total / MiB:.0f} MiB in all; load "
            f"{os.getloadavg()[0]:.1f}")
        warm = save()
        procs.svc.gc()
        (work / "files").mkdir(exist_ok=True)
        raw_path = work / "files" / "raw-ranks.bin"
        raw, agg, loads = [], [], []
        for i in range(reps):
            for which in (("raw", "ranks") if i % 2 == 0 else ("ranks", "raw")):
                settle()
                if which == "raw":
                    raw.append(raw_write(raw_path, total))
                else:
                    agg.append(save())
                    procs.svc.gc()
            loads.append(os.getloadavg()[0])
            log(f"  rep {i + 1} (load {loads[-1]:.1f}): raw write + fsync {raw[-1]:.2f} s, {ranks} ranks streamed "
                f"to commit {agg[-1]:.2f} s ({raw[-1] / agg[-1]:.2f}×)")
        raw_path.unlink(missing_ok=True)
    finally:
        procs.stop()
    by_rep = [r / a for r, a in zip(raw, agg)]
    out = {"ranks": ranks, "per_rank_bytes": per_rank, "bytes": total, "reps": reps, "loadavg": loads,
           "warmup_s": warm, "aggregate_s": agg, "raw_s": raw,
           "aggregate_gib_per_s": total / GiB / median(agg), "raw_gib_per_s": total / GiB / median(raw),
           "ratio": median(raw) / median(agg), "ratio_by_rep": by_rep, "target": 0.8}
    log(f"{ranks} ranks streamed / raw write + fsync: {out['ratio']:.2f}× (rep by rep "
        f"{min(by_rep):.2f}-{max(by_rep):.2f}; target ≥ 0.8)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("restore", help="a streamed restore against the bare gRPC stream of its files")
    r.add_argument("--size", default="256M")
    r.add_argument("--reps", type=int, default=7)
    k = sub.add_parser("ranks", help="N ranks saving streamed at once against the raw disk")
    k.add_argument("--rank-size", default="256M")
    k.add_argument("--ranks", type=int, default=4)
    k.add_argument("--reps", type=int, default=5)
    for p in (r, k):
        p.add_argument("--workdir", help="scratch folder on the disk under test (default: a new one under /tmp)")
        p.add_argument("--out", default=str(ROOT / "bench" / "results"))
        p.add_argument("--name", help="results file name (default stream-<what>-<size>.json)")
    args = ap.parse_args(argv)
    if args.reps < 3:
        ap.error("--reps must be at least 3")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lastgood-stream-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        if args.what == "restore":
            size = parse_size(args.size)
            result = restore_bench(size, args.reps, work)
        else:
            size = parse_size(args.rank_size)
            result = ranks_bench(size, args.ranks, args.reps, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    label = size_label(size).replace(" ", "")
    doc = {"command": "python -m bench.stream " + " ".join(argv if argv is not None else sys.argv[1:]),
           "started": started, "elapsed_s": time.perf_counter() - t0, "machine": machine(),
           "loadavg_end": os.getloadavg(), args.what: result}
    out = Path(args.out) / (args.name or f"stream-{args.what}-{label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
