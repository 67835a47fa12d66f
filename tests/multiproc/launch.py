"""Run scripts under real torchrun (gloo on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port

TRAIN = ROOT / "examples/gpt/train.py"


def torchrun(script: Path, args: list[str], nproc: int = 2, env: dict | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def train(url: str, run: str, out: Path, *extra: str, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {"LASTGOOD_EXAMPLE_KILL": kill} if kill else {}
    return torchrun(TRAIN, ["--url", url, "--run-name", run, "--out", str(out), *extra], env=env)
