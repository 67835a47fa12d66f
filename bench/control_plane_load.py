"""What bench/control_plane.py runs beside the storms and how it sums them up: the CPU hog
(--hog), the service's CPU per thread (its event loop apart), the same-run summary of
quiet against hogged checkpoints, and the older code of --compare-with.

The hog is one process spinning in pure Python, pinned to the last CPU the bench may use
(the machine's "other core" on two cores), at the bench's own niceness: under the
documented `nice -n 10` it competes with the service and the simulated ranks as an equal
(a hog at niceness 0 beside a niced service measures the niceness: on a machine at load 9
it starved the service, 12-29 s to the last COMMITTED, 0.6-0.9 s without it). It spins only
during the begin and vote storms (SIGSTOP while the shards are put: not what is measured,
and it keeps the run short); `hog_cpu_s` is what it spun during each vote storm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.common import median
from bench.probes import CLK_TCK

SPIN = "while True:\n    pass\n"


class Hog:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SPIN])
        cpus = sorted(os.sched_getaffinity(0))
        self.cpu = cpus[-1] if len(cpus) > 1 else None
        if self.cpu is not None:
            os.sched_setaffinity(self.proc.pid, {self.cpu})
        self.pause()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def cpu_seconds(self) -> float:
        """What it has spun so far: the proof that it ran during the storms."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self) -> None:
        self.resume()
        self.proc.kill()
        self.proc.wait()


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the service process so far: its main thread (uvicorn's event loop:
    every REST request, the outcome long-polls) and all its other threads together (gRPC
    workers: begin, put, vote, the commit; the catalog's and the notifier's helpers)."""
    out = {"event_loop": 0.0, "other_threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        out["event_loop" if int(tid) == pid else "other_threads"] += cpu
    return out


def per_rank_us(before: dict[str, float], after: dict[str, float], ranks: int) -> dict[str, float]:
    """Service CPU per rank over one storm, in microseconds, by thread group."""
    d = {k: (after[k] - before[k]) * 1e6 / ranks for k in before}
    return {k: round(v) for k, v in {**d, "all": sum(d.values())}.items()}


def _stats(rows: list[dict], key) -> dict | None:
    xs = [key(r) for r in rows]
    xs = [x for x in xs if x is not None]
    return {"median": round(median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3), "n": len(xs)} \
        if xs else None


def summarize(checkpoints: list[dict]) -> dict:
    """Per rank count and catalog: quiet against hogged, the medians over the checkpoints
    and their ratio (same run, interleaved)."""
    out: dict = {}
    groups: dict[tuple, list[dict]] = {}
    for c in checkpoints:
        if "failed" not in c:
            groups.setdefault((c["catalog_kind"], c["ranks"], c.get("replicas", 1), c.get("hog", False)), []).append(c)
    for (catalog, ranks, replicas, hog), rows in sorted(groups.items()):
        name = f"{catalog}-{ranks}" + (f"-{replicas}replicas" if replicas > 1 else "")
        out.setdefault(name, {})["hog" if hog else "quiet"] = {
            "checkpoints": len(rows),
            "heard_max_after_last_vote_s": _stats(rows, lambda r: r["heard_after_last_vote_s"]["max"]),
            "heard_max_after_first_vote_s": _stats(rows, lambda r: r.get("heard_max_after_first_vote_s")),
            "decision_s": _stats(rows, lambda r: r["decision_s"]),
            "vote_storm_wall_s": _stats(rows, lambda r: r["vote_storm_wall_s"]),
            "service_cpu_per_rank_us": {k: _stats(rows, lambda r, k=k: (r.get("service_cpu_per_rank_us") or {}).get(k))
                                        for k in ("event_loop", "other_threads", "all")},
        }
    for name, g in out.items():
        if "quiet" in g and "hog" in g:
            q = g["quiet"]["heard_max_after_last_vote_s"]["median"]
            g["hog_over_quiet_heard_max"] = round(g["hog"]["heard_max_after_last_vote_s"]["median"] / q, 2) if q else None
    return out


def older_code(root: Path, ref: str, into: Path) -> str:
    """The service and client of commit `ref`, unpacked under `into`: the PYTHONPATH that makes
    a service process run them. httptools and uvloop, installed here, are hidden from it
    unless that commit's service depends on them (uvicorn uses them whenever it can import them)."""
    import io
    import tarfile

    into.mkdir(parents=True)
    # older commits keep the Alembic environment at the top (migrations/), newer ones in the service package
    top = subprocess.run(["git", "ls-tree", "--name-only", ref], cwd=root, check=True, capture_output=True,
                         text=True).stdout.split()
    paths = ["service", "client", *(["migrations"] if "migrations" in top else [])]
    tar = subprocess.run(["git", "archive", ref, *paths], cwd=root, check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(into, filter="data")
    path = [str(into / "service"), str(into / "client")]
    if "uvloop" not in (into / "service" / "pyproject.toml").read_text():
        (into / "hide").mkdir()
        for mod in ("uvloop", "httptools"):
            (into / "hide" / f"{mod}.py").write_text(f"raise ImportError('{mod}: hidden by bench.control_plane')\n")
        path.insert(0, str(into / "hide"))
    return os.pathsep.join(path)
