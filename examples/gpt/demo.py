"""`make demo`: watch a two-rank training run crash and resume bit-exactly.

Starts a lastgood service on embedded defaults in a temporary directory, trains the
example GPT once without interruption, then trains it again and SIGKILLs rank 1 right
after save(11) returned (its upload still in flight), relaunches the job, and compares
the two runs bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from lastgood_service.launcher import ServiceProcess, free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import compare  # noqa: E402


def start_service(data_dir: Path) -> ServiceProcess:
    return ServiceProcess(data_dir, {"LASTGOOD_LEASE_SECONDS": "10", "LASTGOOD_LOG_LEVEL": "WARNING"}).start()


def train(url: str, run: str, out: Path, kill: str | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR"}
    if kill:
        env["LASTGOOD_EXAMPLE_KILL"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(HERE / "train.py"), "--url", url, "--run-name", run, "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in res.stdout.splitlines():
        if line.startswith("[rank"):
            print("   ", line)
    return res.returncode


def last_good(url: str, run: str) -> str:
    import json
    with urllib.request.urlopen(f"{url}/api/v1/runs/{run}/last-good") as r:
        d = json.load(r)
    return f"checkpoint {d['id']} at step {d['step']}"


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="lastgood-demo-"))
    svc = start_service(work / "data")
    url = svc.url
    try:
        print(f"service at {url}, data in {work / 'data'}")
        print("1/3 uninterrupted run: 2 ranks, 20 steps, a save after every 3rd step")
        if train(url, "demo-reference", work / "reference") != 0:
            raise SystemExit("the reference run failed")
        print("2/3 the same run; rank 1 is SIGKILLed right after save(11) returned, its upload in flight")
        rc = train(url, "demo", work / "crashed", kill="1:11:after_save")
        print(f"    torchrun exited with {rc}; last-good is {last_good(url, 'demo')}")
        print("3/3 relaunch: every rank restores last-good and trains to the end")
        if train(url, "demo", work / "crashed") != 0:
            raise SystemExit("the relaunched run failed")
        diffs = compare(work / "reference", work / "crashed", world=2)
        if diffs:
            print("RESULT: the resumed run DIFFERS from the uninterrupted one:")
            print("\n".join("   " + d for d in diffs[:20]))
            return 1
        print("RESULT: bitwise identical: every loss and sample after the resume point, final weights, "
              "Adam moments, LR schedule and RNG states")
        return 0
    finally:
        svc.stop()


if __name__ == "__main__":
    sys.exit(main())
