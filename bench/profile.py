"""Where lastgood's save and restore time goes: py-spy on the trainer and on the service.

    python -m bench.profile [--size 1G] [--reps 3] [--out bench/results/profile]

Starts a real service, then runs the client workload in its own process twice — `save`
(one warm-up, then --reps synchronous saves to the acknowledged commit) and `restore`
(--reps restores into the same model and optimizer) — each under `py-spy record`, with a
second py-spy on the service for the same window. Every sample is kept, idle ones too
(--idle: a thread blocked in write(), fsync() or a gRPC wait is time spent), so a
function's share of the samples is its share of wall-clock time on that thread.
Writes the raw collapsed stacks (for flame graphs, e.g. speedscope) and a summary per
process and thread: the top functions by self time (the leaf frame) and by inclusive time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Service, build_state, parse_size

PYSPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def client(url: str, run: str, size: int, reps: int, phase: str) -> None:
    import lastgood

    model, opt = build_state(size)
    state = lastgood.TrainState(model=model, optimizer=opt)
    ckpt = lastgood.Checkpointer(url, run=run)
    if phase == "save":
        ckpt.save(0, state)
        ckpt.wait()
        for i in range(reps):
            t0 = time.perf_counter()
            ckpt.save(i + 1, state)
            ckpt.wait()
            print(f"save {i + 1}: {time.perf_counter() - t0:.2f} s", flush=True)
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            ckpt.restore(state)
            print(f"restore {i + 1}: {time.perf_counter() - t0:.2f} s", flush=True)
    ckpt.close()


_FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:)]+)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    f = m.group("file")
    for marker in ("site-packages/", "lastgood/", "lastgood_service/", "bench/", "python3.11/"):
        if marker in f:
            f = f.split(marker, 1)[1] if marker.endswith("-packages/") or marker == "python3.11/" else marker + f.split(marker, 1)[1]
            break
    return f"{m.group('fn')} ({f})"


IDLE = {"Condition.wait", "_worker", "_serve", "Runner.run", "Event.wait", "select", "poll"}


def summarize(raw: Path, title: str, top: int = 12) -> str:
    """Per thread (py-spy names them, e.g. `grpc_0`, `lastgood-upload`, `MainThread`): the
    share of that thread's samples spent in each function. Threads that only waited
    (leaf frame a Condition.wait, an idle pool worker, ...) are left out."""
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        frames = [_short(f) for f in frames[1:]]
        totals[thread] += n
        if frames:
            leaf[thread][frames[-1]] += n
            if frames[-1].split(" ")[0] not in IDLE:
                busy[thread] += n
            for f in set(frames):
                incl[thread][f] += n
    out = [f"# {title}: {sum(totals.values())} samples; one row per thread that did work"]
    for thread, b in busy.most_common():
        total = totals[thread]
        if b < 0.02 * max(totals.values()):
            continue
        out.append(f"\n## thread {thread}: {total} samples, {100 * b / total:.0f}% not waiting")
        out.append("  self%  function (leaf Python frame; C calls count to their caller)")
        for f, n in leaf[thread].most_common(top):
            out.append(f"  {100 * n / total:5.1f}  {f}")
        out.append("  incl%  function (anywhere on the stack)")
        skip = ("Thread.", "_bootstrap", "_run_code", "_run_module_as_main", "<module>", "_worker (")
        rows = [(f, n) for f, n in incl[thread].most_common() if not f.startswith(skip)]
        for f, n in rows[:top + 4]:
            out.append(f"  {100 * n / total:5.1f}  {f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", type=int, default=97, help="py-spy samples per second")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile"))
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames too; slower)")
    ap.add_argument("client_args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_args:  # the client process
        url, run, size, reps, phase = args.client_args
        client(url, run, int(size), int(reps), phase)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="lastgood-profile-", dir="/tmp"))
    svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0"}).start()
    run = f"profile-{os.getpid()}"
    flags = ["--idle", "--threads", "--format", "raw", "--rate", str(args.rate), "--nonblocking"]
    if args.native:
        flags.append("--native")
    report = []
    try:
        for phase in ("save", "restore"):
            svc_raw, cli_raw = out / f"{phase}-service.collapsed", out / f"{phase}-client.collapsed"
            spy = subprocess.Popen([PYSPY, "record", *flags, "-o", str(svc_raw), "-p", str(svc.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            subprocess.run([PYSPY, "record", *flags, "-o", str(cli_raw), "--", sys.executable, "-m",
                            "bench.profile", "--", svc.url, run, str(size), str(args.reps), phase],
                           cwd=ROOT, check=True)
            spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            spy.wait(60)
            report.append(summarize(cli_raw, f"{phase}: trainer process ({args.size}, {args.reps} reps)"))
            report.append(summarize(svc_raw, f"{phase}: service process"))
    finally:
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = "\n\n".join(report)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
