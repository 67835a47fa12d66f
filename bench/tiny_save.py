"""The fixed cost of a save: a tiny state through lastgood and through DCP, interleaved.

    python -m bench.tiny_save --reps 30          # make bench-tiny
    python -m bench.tiny_save --reps 3 --out /tmp/x   # tests/bench/test_tiny_save_smoke.py

One 64x64 Linear with its AdamW state (~50 KiB), saved A B C A B C ... `--reps` times
(each rep in another order: bench.common.order_of), on the same disk, in one process:

  checkpointer   lastgood.Checkpointer: save(step, state); wait() (hashed, fsync'd, committed); its
                 files travel with its vote (CommitRank.inline_files): begin and vote, two calls
  checkpointer_handed_over  the same, its files handed over by its data path first (PutShard
                 through the spool), as against a service with LASTGOOD_INLINE_BYTES=0: the
                 call the vote saves, measured in the same run
  checkpointer_every_beat  the same as checkpointer, its heartbeat thread beating at every phase
                 change (PHASE_BEAT_GAP 0, as before the gap): what the coalesced beats save
  lastgood_dcp   dcp.save(state, storage_writer=lastgood.dcp.StorageWriter(...)) (the same commit)
  dcp            dcp.save(state, storage_writer=FileSystemWriter(dir, sync_files=True))
  floor          what durability alone costs on this disk: FLOOR_FILES small files written and
                 fsync'd, their directory fsync'd, and one SQLite commit (WAL, synchronous=FULL,
                 as the service's catalog), nothing else
  floor_lastgood the syncs a one-rank lastgood save makes, alone: LASTGOOD_BLOBS files (shard,
                 tensor index, manifest) each fsync'd with the directories blobstore/local.py
                 fsyncs for it (3, 1, 1), and LASTGOOD_COMMITS SQLite commits

Where the time goes: every service call each lastgood case makes is timed (`calls`: per
save, how many of each and the median milliseconds of one; the rest of a save is the
client's own work: snapshot, hashing, the upload thread's hand-off).

Prints medians and the rep-by-rep ratios to DCP; writes bench/results/tiny_save.json. The
service runs as its own process on this host (bench.common.Service), so its spool and blob
store are on the disk /tmp is on, as DCP's directory is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import ROOT, Service, machine, order_of, write_results
from bench.one_size import SERVICE_ENV

CASES = ("checkpointer", "checkpointer_handed_over", "checkpointer_every_beat", "lastgood_dcp", "dcp", "floor", "floor_lastgood")
FLOOR_FILES = 2  # the shard and the manifest (DCP writes two too: its data file and .metadata)


def build_state():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()  # AdamW's state exists (exp_avg, exp_avg_sq, step)
    return model, opt


LASTGOOD_BLOBS = 3    # the shard, its tensor index, the manifest
LASTGOOD_COMMITS = 4  # begin, the file's VERIFIED row, the vote, the commit


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Floor:
    """The fsyncs alone: FLOOR_FILES files of `size` bytes written and fsync'd, their
    directory fsync'd, one SQLite row committed with synchronous=FULL in WAL mode."""

    def __init__(self, work: Path, size: int, like_lastgood: bool = False) -> None:
        name = "floor_lastgood" if like_lastgood else "floor"
        self.dir, self.size, self.n, self.like_lastgood = work / name, size, 0, like_lastgood
        self.dir.mkdir(parents=True)
        self.db = sqlite3.connect(work / f"{name}.db", isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")

    def __call__(self) -> float:
        self.n += 1
        payload = os.urandom(self.size)
        if self.like_lastgood:
            return self._like_lastgood(payload)
        t0 = time.perf_counter()
        for i in range(FLOOR_FILES):
            fd = os.open(self.dir / f"{self.n}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.db.execute("BEGIN")
        self.db.execute("INSERT INTO t (v) VALUES (?)", (str(self.n),))
        self.db.execute("COMMIT")
        return time.perf_counter() - t0

    def _like_lastgood(self, payload: bytes) -> float:
        leaf = self.dir / "ckpt" / str(self.n) / "r0"  # blobs/ckpt/<checkpoint>/r<rank>/, as the store's keys
        t0 = time.perf_counter()
        leaf.mkdir(parents=True)
        for i in range(LASTGOOD_BLOBS):
            where = leaf if i < 2 else leaf.parent  # the manifest lies in the checkpoint's folder
            fd = os.open(where / f"b{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            # the directories blobstore/local.py fsyncs: the shard's new folders up to ckpt/, then
            # only the folder each later blob lies in (the others' entries are known durable)
            for d in ([leaf, leaf.parent, leaf.parent.parent] if i == 0 else [where]):
                fsync_dir(d)
        for _ in range(LASTGOOD_COMMITS):
            self.db.execute("BEGIN")
            self.db.execute("INSERT INTO t (v) VALUES (?)", (str(self.n),))
            self.db.execute("COMMIT")
        return time.perf_counter() - t0


CALLS = ("last_good", "begin", "spool_write", "put_followed", "put_shard", "commit_rank", "outcome", "checkpoint",
         "pending", "manifest")


class Calls:
    """Times every service call of one transport (its instance's methods, wrapped): per case,
    the calls of the reps measured (`on`), not of the warm-up."""

    def __init__(self) -> None:
        self.case: str | None = None
        self.seen: dict[str, dict[str, list[float]]] = {}

    def watch(self, transport, case: str) -> None:
        for name in CALLS:
            real = getattr(transport, name)

            def timed_call(*a, _real=real, _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    if self.case == case:
                        self.seen.setdefault(case, {}).setdefault(_name, []).append(time.perf_counter() - t0)
            setattr(transport, name, timed_call)

    def summary(self, case: str, saves: int) -> dict:
        return {name: {"per_save": len(xs) / saves, "median_ms": statistics.median(xs) * 1e3}
                for name, xs in sorted(self.seen.get(case, {}).items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tiny_save", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="tiny_save", help="the JSON's file name (without .json)")
    args = ap.parse_args(argv)
    import torch.distributed.checkpoint as dcp

    import lastgood
    import lastgood.dcp as lgdcp
    from lastgood.remote import heartbeat

    gap = heartbeat.PHASE_BEAT_GAP

    model, opt = build_state()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    work = Path(tempfile.mkdtemp(prefix="lastgood-tiny-", dir="/tmp"))
    svc = Service(work / "svc", SERVICE_ENV).start()
    run = f"tiny-{uuid.uuid4().hex[:6]}"
    state = lastgood.TrainState(model=model, optimizer=opt)
    ckpt = lastgood.Checkpointer(svc.url, run=run, attempt=uuid.uuid4().hex[:16])
    handed = lastgood.Checkpointer(svc.url, run=f"{run}-handed", attempt=uuid.uuid4().hex[:16])
    handed.transport.info = dataclasses.replace(handed.transport.info, inline_bytes=0)
    heartbeat.PHASE_BEAT_GAP = 0.0  # read once, as its beating thread starts
    beating = lastgood.Checkpointer(svc.url, run=f"{run}-beating", attempt=uuid.uuid4().hex[:16])
    time.sleep(0.2)
    heartbeat.PHASE_BEAT_GAP = gap
    dcp_run = f"{run}-dcp"
    writer = lgdcp.StorageWriter(svc.url, run=dcp_run)
    floor, floor_lastgood = Floor(work, nbytes), Floor(work, nbytes, like_lastgood=True)
    calls = Calls()
    calls.watch(ckpt.transport, "checkpointer")
    calls.watch(writer.transport, "lastgood_dcp")
    calls.watch(handed.transport, "checkpointer_handed_over")
    calls.watch(beating.transport, "checkpointer_every_beat")
    step = [0]

    def sd():
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def saving(c):
        """One save of the state through Checkpointer `c`, to its acknowledged commit."""
        def once() -> float:
            step[0] += 1
            t0 = time.perf_counter()
            c.save(step[0], state)
            c.wait()
            return time.perf_counter() - t0
        return once

    def lastgood_dcp() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        dcp.save(sd(), storage_writer=writer, checkpoint_id=str(step[0]), planner=lgdcp.SavePlanner(),
                 no_dist=True)
        return time.perf_counter() - t0

    def stock_dcp() -> float:
        step[0] += 1
        path = work / "dcp" / str(step[0])
        t0 = time.perf_counter()
        dcp.save(sd(), storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
        took = time.perf_counter() - t0
        shutil.rmtree(work / "dcp", ignore_errors=True)
        return took

    cases = {"checkpointer": saving(ckpt), "checkpointer_handed_over": saving(handed),
             "checkpointer_every_beat": saving(beating),
             "lastgood_dcp": lastgood_dcp, "dcp": stock_dcp, "floor": floor,
             "floor_lastgood": floor_lastgood}
    times: dict[str, list[float]] = {c: [] for c in CASES}
    try:
        for c in CASES:  # warm-up: connections, staging buffers, DCP's imports
            cases[c]()
        for i in range(args.reps):
            for c in order_of(list(CASES), i):
                calls.case = c
                times[c].append(cases[c]())
                calls.case = None
            if i % 10 == 9 or i == args.reps - 1:
                print(f"rep {i + 1}: " + ", ".join(f"{c} {times[c][-1] * 1e3:.1f} ms" for c in CASES), flush=True)
    finally:
        ckpt.close()
        handed.close()
        beating.close()
        if writer._transport is not None:
            writer.transport.close()
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_end = os.getloadavg()
    out = {"command": "python -m bench.tiny_save " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {**machine(), "loadavg_end": load_end}, "state_bytes": nbytes, "reps": args.reps,
           "floor_files": FLOOR_FILES, "lastgood_blobs": LASTGOOD_BLOBS, "lastgood_commits": LASTGOOD_COMMITS,
           "cases": {}}
    for c in CASES:
        xs = times[c]
        entry = {"ms": [x * 1e3 for x in xs], "median_ms": statistics.median(xs) * 1e3}
        if c != "dcp":
            entry["vs_dcp_reps"] = [x / d for x, d in zip(xs, times["dcp"])]
            entry["vs_dcp"] = statistics.median(xs) / statistics.median(times["dcp"])
            entry["vs_dcp_median_of_reps"] = statistics.median(entry["vs_dcp_reps"])
        if c == "checkpointer":  # the files with the vote against handed over first, rep by rep
            entry["vs_handed_over_reps"] = [x / h for x, h in zip(xs, times["checkpointer_handed_over"])]
            entry["vs_handed_over"] = statistics.median(entry["vs_handed_over_reps"])
            entry["vs_every_beat_reps"] = [x / h for x, h in zip(xs, times["checkpointer_every_beat"])]
            entry["vs_every_beat"] = statistics.median(entry["vs_every_beat_reps"])
        if c.startswith("checkpointer") or c == "lastgood_dcp":
            entry["calls"] = calls.summary(c, len(xs))
        if c != "floor":
            entry["vs_floor"] = statistics.median(xs) / statistics.median(times["floor"])
        if c.startswith("checkpointer") or c == "lastgood_dcp":
            entry["vs_floor_lastgood"] = statistics.median(xs) / statistics.median(times["floor_lastgood"])
        out["cases"][c] = entry
        print(f"{c:>24}: median {entry['median_ms']:.1f} ms"
              + (f", {entry['vs_dcp']:.2f}x DCP" if "vs_dcp" in entry else "")
              + (f", {entry['vs_floor']:.2f}x the floor" if "vs_floor" in entry else "")
              + (f", {entry['vs_handed_over']:.2f}x handed over, {entry['vs_every_beat']:.2f}x beating every change "
                 f"(medians of reps)" if "vs_handed_over" in entry else ""))
        for name, cl in entry.get("calls", {}).items():
            print(f"{'':>26}{name}: {cl['per_save']:.1f} a save, {cl['median_ms']:.1f} ms")
    write_results(args.out, args.name, out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LASTGOOD_LOG_LEVEL", "WARNING")
    sys.exit(main())
