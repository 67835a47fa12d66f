"""`make demo`: a two-rank training run with a loss spike, a crash and a resume, bit-exact.

Trains the example GPT twice, with one corrupt sample in epoch 1 that spikes the loss on
rank 1 at step 9 and a SpikeGuard that rolls back to step 5 and goes on on a new branch:

1. `demo-reference`, uninterrupted;
2. `demo`, whose rank 1 is SIGKILLed right after save(11) returned (its upload in flight),
   then relaunched: every rank restores last-good and trains to the end.

The two runs are compared bit for bit. Where the service comes from (plan()):

- LASTGOOD_URL set: that service; the run names get a time suffix (`demo-20261204-101500`)
  so that a second demo on the same service starts fresh;
- else a service of the demo's own, on LASTGOOD_PORT / LASTGOOD_GRPC_PORT (free ports when
  unset) with its data in LASTGOOD_DATA_DIR, or ./demo-data/data (replaced on every `make
  demo`; `make clean` removes it). A data directory of the user's own is never wiped: the
  run names get the time suffix there too.

On a terminal the demo's own service keeps serving afterwards, for the page and the CLI,
until Ctrl-C; without one (CI, a pipe) it stops when the demo ends.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lastgood.remote.config import ENV_URL
from lastgood_service.launcher import ENV_DATA_DIR, ENV_GRPC_PORT, ENV_PORT, ServiceProcess, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEMO = ROOT / "demo-data"
sys.path.insert(0, str(HERE))
from compare import compare  # noqa: E402

# rank 1 meets sample 29 at step 9 of epoch 1; margin 2: the guard rolls back to step 5
SPIKE = ["--loader", "plain", "--poison", "1:29", "--spike-guard", "--spike-margin", "2"]


@dataclass(frozen=True)
class Plan:
    url: str | None  # a service to use (LASTGOOD_URL); None: the demo starts its own
    port: int  # the own service's REST port (0: a free one)
    grpc_port: int  # and its gRPC port (0: a free one)
    data: Path  # the own service's data directory
    wipe: bool  # the data directory is the demo's own default: replaced on every demo
    suffix: str  # appended to the run names ("" on a fresh data directory)
    out: Path = DEMO  # the runs' own outputs (losses, weights) for the comparison


def plan(env: dict, now: dt.datetime | None = None) -> Plan:
    stamp = "-" + (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    url = env.get(ENV_URL) or None
    own_dir = env.get(ENV_DATA_DIR)
    data = Path(own_dir) if own_dir else DEMO / "data"
    fresh = url is None and not own_dir
    return Plan(url=url.rstrip("/") if url else None, port=int(env.get(ENV_PORT) or 0),
                grpc_port=int(env.get(ENV_GRPC_PORT) or 0), data=data, wipe=fresh,
                suffix="" if fresh else stamp)


def train(url: str, run: str, out: Path, kill: str | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR"}
    if kill:
        env["LASTGOOD_EXAMPLE_KILL"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(HERE / "train.py"), "--url", url, "--run-name", run, "--out", str(out), *SPIKE]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in (res.stdout + res.stderr).splitlines():
        if line.startswith("[rank") or "lastgood: spike" in line:
            print("   ", line.split("WARNING:")[-1].strip() if "lastgood: spike" in line else line)
    return res.returncode


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}") as r:
        return json.load(r)


def demo(url: str, p: Plan) -> int:
    ref, run = "demo-reference" + p.suffix, "demo" + p.suffix
    for d in (p.out / "reference", p.out / "demo"):
        shutil.rmtree(d, ignore_errors=True)
    print("1/3 uninterrupted run: 2 ranks, 20 steps, a save after every 3rd step; a corrupt sample at step 9")
    if train(url, ref, p.out / "reference") != 0:
        raise SystemExit("the reference run failed")
    print("2/3 the same run; rank 1 is SIGKILLed right after save(11) returned, its upload in flight")
    rc = train(url, run, p.out / "demo", kill="1:11:after_save")
    lg = get(url, f"/api/v1/runs/{run}/last-good")
    print(f"    torchrun exited with {rc}; last-good is checkpoint {lg['id']} at step {lg['step']}")
    print("3/3 relaunch: every rank restores last-good and trains to the end")
    if train(url, run, p.out / "demo") != 0:
        raise SystemExit("the relaunched run failed")
    diffs = compare(p.out / "reference", p.out / "demo", world=2)
    if diffs:
        print("RESULT: the resumed run DIFFERS from the uninterrupted one:")
        print("\n".join("   " + d for d in diffs[:20]))
        return 1
    print("RESULT: bitwise identical: every loss and sample after the resume point, final weights, "
          "Adam moments, LR schedule and RNG states")
    print(f"\nLook at run `{run}` (the rollback branch, the killed save, the relaunch):\n"
          f"    {url}/#run={run}\n    {ENV_URL}={url} .venv/bin/lastgood lineage {run}")
    return 0


def main() -> int:
    p = plan(dict(os.environ))
    if p.url is not None:
        print(f"service at {p.url} ({ENV_URL}); runs demo{p.suffix} and demo-reference{p.suffix}")
        return demo(p.url, p)
    if p.wipe:
        shutil.rmtree(p.data, ignore_errors=True)
    svc = ServiceProcess(p.data, {"LASTGOOD_LEASE_SECONDS": "10", "LASTGOOD_LOG_LEVEL": "WARNING",
                                  "LASTGOOD_GC_INTERVAL": "0"}, port=p.port or free_port(), grpc_port=p.grpc_port)
    svc.start(keep_ports=True)
    try:
        print(f"service at {svc.url}, data in {p.data}")
        rc = demo(svc.url, p)
        if rc == 0 and sys.stdin.isatty():
            print("The service keeps serving for the page and the CLI; Ctrl-C stops it.")
            try:
                svc.proc.wait()
            except KeyboardInterrupt:
                pass
        return rc
    finally:
        svc.stop()


if __name__ == "__main__":
    sys.exit(main())
