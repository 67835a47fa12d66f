"""Shared pieces of the benchmark: the state, a real service process, timing and RSS helpers."""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from lastgood.common import durable
from lastgood.common.sizes import parse_size  # noqa: F401 - the one size rule, bench API
from lastgood_service.launcher import ServiceProcess, free_port  # noqa: F401 - free_port is bench API

MiB = 1024 * 1024
GiB = 1024 * MiB
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- the state
def _dims(target: int) -> tuple[int, int, int]:
    """(vocab, d_model, context) of a GPT-style model whose weights + Adam moments ~ target."""
    if target < 32 * MiB:
        return 4096, 128, 128
    if target < 512 * MiB:
        return 32000, 384, 1024
    if target < 2 * GiB:
        return 32000, 768, 1024
    return 32000, 1024, 1024


def build_state(target: int, seed: int = 0):
    """A GPT-style model (token and position embeddings, pre-LN blocks with fused QKV, 4x
    MLP, biases and LayerNorms) sized so that its fp32 weights plus AdamW's exp_avg and
    exp_avg_sq come to about `target` bytes, with random values (no compressible zeros),
    and an AdamW optimizer whose state is filled as after a real step."""
    import torch
    from torch import nn

    vocab, d, ctx = _dims(target)
    params = target / 12  # fp32 weights + two fp32 moments
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((params - (vocab + ctx) * d - 2 * d) / per_layer))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d, device="meta")
            self.qkv = nn.Linear(d, 3 * d, device="meta")
            self.proj = nn.Linear(d, d, device="meta")
            self.ln2 = nn.LayerNorm(d, device="meta")
            self.fc = nn.Linear(d, 4 * d, device="meta")
            self.fc_out = nn.Linear(4 * d, d, device="meta")

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d, device="meta")
            self.pos = nn.Embedding(ctx, d, device="meta")
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d, device="meta")

    g = torch.Generator().manual_seed(seed)
    model = GPT().to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for p in model.parameters():
        avg = torch.empty_like(p).normal_(0, 1e-3, generator=g)
        sq = torch.empty_like(p).uniform_(0, 1e-6, generator=g)
        opt.state[p] = {"step": torch.tensor(1000.0), "exp_avg": avg, "exp_avg_sq": sq}
    return model, opt


def state_tensors(model, opt) -> list:
    ts = list(model.state_dict().values())
    for st in opt.state.values():
        ts.extend(v for v in st.values() if hasattr(v, "nbytes"))
    return ts


def state_bytes(model, opt) -> int:
    return sum(t.nbytes for t in state_tensors(model, opt))


def size_label(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB:
        return f"{n // MiB} MiB" if n % MiB == 0 else f"{n / MiB:.1f} MiB"
    return f"{n // 1024} KiB"


# ---------------------------------------------------------------------------- statistics
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(xs, q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------------------- the service
def write_results(out_dir, stem: str, doc: dict) -> Path:
    """Write a bench's JSON as <out_dir>/<stem>.json and say where."""
    dest = Path(out_dir) / f"{stem}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1))
    print(f"results in {dest}")
    return dest


def http_json(url: str, method: str = "GET", timeout: float = 60.0):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Service(ServiceProcess):
    """The launcher's service process, quiet, with a longer start-up allowance and GC on demand."""

    def __init__(self, data_dir: Path, env: dict | None = None) -> None:
        super().__init__(data_dir, {"LASTGOOD_LOG_LEVEL": "WARNING", **(env or {})})

    def start(self, timeout: float = 60.0, keep_ports: bool = False) -> "Service":
        super().start(timeout, keep_ports)
        return self

    def stop(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        super().stop(sig, grace)

    def gc(self) -> dict:
        return http_json(self.url + "/api/v1/gc?dry_run=false", method="POST", timeout=300)


def proc_status(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in bytes (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class RssSampler:
    """Samples a process's VmRSS every `interval` seconds while in use; `.peak` in bytes."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.start_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, proc_status(self.pid, "VmRSS"))
            except (OSError, KeyError):
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self.start_rss = proc_status(self.pid, "VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = proc_meminfo("MemTotal")
    import platform

    import torch

    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": round(mem / GiB, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "loadavg_start": os.getloadavg()}


def proc_meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


VMSTAT_KEYS = ("pgfault", "pgmajfault", "pgmigrate_success", "compact_stall", "allocstall_normal",
               "allocstall_movable", "pgscan_direct", "pgsteal_kswapd")


def vmstat() -> dict:
    """The machine's /proc/vmstat counters that say what memory management did meanwhile
    (faults, page migration, compaction and reclaim stalls), VMSTAT_KEYS only."""
    out = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in VMSTAT_KEYS:
                    out[key] = int(value)
    except OSError:
        pass
    return out


def dirty_bytes() -> int:
    """Bytes the page cache still has to write back (Dirty + Writeback in /proc/meminfo)."""
    return proc_meminfo("Dirty") + proc_meminfo("Writeback")


def order_of(cases: list, i: int) -> list:
    """The order rep i runs the cases in: a row of a Williams design (a balanced Latin
    square: cases 0, 1, n-1, 2, n-2, ... shifted by i; for an odd count every other row
    reversed, shifted so that it too starts with case i). So rep i starts with case i mod n, and
    over the reps each case follows a different neighbour nearly every time: what a case
    leaves behind (its writeback; the memory it freed, which this VM hands back to its
    host and faults in again slowly) falls on every other case alike, where a plain
    rotation kept each case behind the same neighbour in every rep
    (tests/bench/test_bench_smoke.py)."""
    n = len(cases)
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    if n % 2 and i % 2:
        return [cases[(i - base[-1] + b) % n] for b in base][::-1]
    return [cases[(i + b) % n] for b in base]


def settle(limit: int = 32 * MiB, timeout: float = 120.0) -> float:
    """sync, then wait until the dirty backlog is under `limit` (or `timeout` passes):
    a case must not pay for the writeback of the one before it. Returns seconds waited."""
    t0 = time.perf_counter()
    os.sync()
    while dirty_bytes() > limit and time.perf_counter() - t0 < timeout:
        time.sleep(0.05)
    return time.perf_counter() - t0


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_clean_cache() -> bool:
    """Free the page cache's clean pages (after settle(): every page is clean then), so that
    each save case allocates its page cache from memory the kernel has just freed, as
    every other case does. Why: on a VM whose balloon takes freed memory back (free page
    reporting), a page freed a few seconds ago costs the host a fault to reuse and one
    freed a moment ago does not; writing 2 GiB into the page cache took 0.4 s or 3.5-5.7 s
    on this machine by that alone (bench/README.md). Root only; False when not allowed."""
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


WARM_CHUNK = 16 * MiB  # warm_files() reads this much at a time into one reused buffer


def warm_files(paths) -> dict:
    """Read every file of `paths` (files, or folders taken whole) through the page cache,
    untimed, right before a restore case (bench.run drops the clean page cache first), so
    that the case reads its own files warm whatever the cases before it pushed out: at
    4 GiB the restores' files, the state and their buffers outgrow this machine's memory,
    and which file the page cache lost depended on the order (lastgood's restore took
    0.61-1.92 s, warm or half cold; bench/README.md). Returns what it read and how much of
    it the page cache held afterwards (durable.cached_pieces, page by page; None where
    that cannot be asked, or nothing was read)."""
    files = [f for p in map(Path, paths) for f in (sorted(p.rglob("*")) if p.is_dir() else [p]) if f.is_file()]
    buf = bytearray(WARM_CHUNK)
    total = held = 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    known = True
    for f in files:  # after the last read: a later file may have pushed out an earlier one
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            pages = durable.cached_pieces(fd, 0, size, mmap.PAGESIZE) if size else []  # one bool a page
            if pages is None:  # cannot be asked here: unknown, not cold
                known = False
            else:
                held += min(size, sum(pages) * mmap.PAGESIZE)
        finally:
            os.close(fd)
    return {"files": len(files), "bytes": total, "seconds": seconds,
            "cached_after": held / total if total and known else None}


def free_page_reporting() -> bool:
    """Does this (virtual) machine hand freed memory back to its host (virtio-balloon free
    page reporting)? The noise drop_clean_cache() works against."""
    return os.path.isdir("/sys/module/page_reporting")


def spread(xs) -> float:
    """(max - min) / median of the repetitions: 0.1 means they lie within 10% of each other."""
    m = median(xs)
    return (max(xs) - min(xs)) / m if xs and m else 0.0


def iqr_spread(xs) -> float:
    """(third quartile - first quartile) / median: how far the middle half of the
    repetitions lies apart, which one rep the machine spoiled does not move (spread() does)."""
    import statistics

    if len(xs) < 3:
        return spread(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    m = median(xs)
    return (q3 - q1) / m if m else 0.0


def timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of fn(); `cpu` gets this process's CPU seconds (every thread) for it."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return t


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
