"""`make demo`: a two-rank training run with a loss spike, a crash and a resume, bit-exact,
left on a running service to look at.

Starts a lastgood service on embedded defaults with its data in ./demo-data (replaced on
every `make demo`; `make clean` removes it), then trains the example GPT twice, with one
corrupt sample in epoch 1 that spikes the loss on rank 1 at step 9 and a SpikeGuard that
rolls back to step 5 and goes on on a new branch:

1. `demo-reference`, uninterrupted;
2. `demo`, whose rank 1 is SIGKILLed right after save(11) returned (its upload in flight),
   then relaunched: every rank restores last-good and trains to the end.

The two runs are compared bit for bit. The service keeps running afterwards: the page shows
run `demo` with its rollback branch, the failed save and the relaunch. Its address and the
command that stops it are printed last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from lastgood_service.launcher import ServiceProcess, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEMO = ROOT / "demo-data"
PID = DEMO / "service.pid"
sys.path.insert(0, str(HERE))
from compare import compare  # noqa: E402

# rank 1 meets sample 29 at step 9 of epoch 1; margin 2: the guard rolls back to step 5
SPIKE = ["--loader", "plain", "--poison", "1:29", "--spike-guard", "--spike-margin", "2"]


def stop_previous() -> None:
    """The service an earlier `make demo` left running (its pid file), before its data goes."""
    try:
        pid = int(PID.read_text())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"lastgood_service.main" in cmdline:
        os.kill(pid, signal.SIGTERM)
        print(f"stopped the service of the previous demo (pid {pid})")


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


def main() -> int:
    stop_previous()
    shutil.rmtree(DEMO, ignore_errors=True)
    svc = ServiceProcess(DEMO / "data", {"LASTGOOD_LEASE_SECONDS": "10", "LASTGOOD_LOG_LEVEL": "WARNING",
                                        "LASTGOOD_GC_INTERVAL": "0"}).start()
    PID.write_text(str(svc.pid))
    url = svc.url
    ok = False
    try:
        print(f"service at {url}, data in {DEMO / 'data'}")
        print("1/3 uninterrupted run: 2 ranks, 20 steps, a save after every 3rd step; a corrupt sample at step 9")
        if train(url, "demo-reference", DEMO / "reference") != 0:
            raise SystemExit("the reference run failed")
        print("2/3 the same run; rank 1 is SIGKILLed right after save(11) returned, its upload in flight")
        rc = train(url, "demo", DEMO / "demo", kill="1:11:after_save")
        lg = get(url, "/api/v1/runs/demo/last-good")
        print(f"    torchrun exited with {rc}; last-good is checkpoint {lg['id']} at step {lg['step']}")
        print("3/3 relaunch: every rank restores last-good and trains to the end")
        if train(url, "demo", DEMO / "demo") != 0:
            raise SystemExit("the relaunched run failed")
        diffs = compare(DEMO / "reference", DEMO / "demo", world=2)
        if diffs:
            print("RESULT: the resumed run DIFFERS from the uninterrupted one:")
            print("\n".join("   " + d for d in diffs[:20]))
            return 1
        print("RESULT: bitwise identical: every loss and sample after the resume point, final weights, "
              "Adam moments, LR schedule and RNG states")
        ok = True
        return 0
    finally:
        if ok:
            print(f"\nThe service keeps running. Look at run `demo` (the rollback branch, the killed save, "
                  f"the relaunch):\n    {url}/#run=demo\n    LASTGOOD_URL={url} .venv/bin/lastgood lineage demo\n"
                  f"Stop it with: kill {svc.pid}  (the next `make demo` stops it too)")
        else:
            svc.stop()


if __name__ == "__main__":
    sys.exit(main())
