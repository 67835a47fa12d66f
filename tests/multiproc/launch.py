"""Run scripts under real torchrun (gloo on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port

TRAIN = ROOT / "examples/gpt/train.py"


def torchrun(script: Path, args: list[str], nproc: int = 2, env: dict | None = None,
             timeout: float = 240, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`launcher` replaces the default --master-port (e.g. elastic rendezvous options)."""
    launch = launcher if launcher is not None else [f"--master-port={free_port()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *launch, str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def train(url: str, run: str | None, out: Path, *extra: str, kill: str | None = None, nproc: int = 2,
          launcher: list[str] | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**(env or {}), **({"LASTGOOD_EXAMPLE_KILL": kill} if kill else {})}
    named = ["--run-name", run] if run else []
    return torchrun(TRAIN, ["--url", url, *named, "--out", str(out), *extra], env=env, nproc=nproc,
                    launcher=launcher)


def why(res: subprocess.CompletedProcess) -> str:
    """What went wrong in a torchrun job: the ranks' own error lines first, then the tail."""
    lines = (res.stdout + res.stderr).splitlines()
    keys = ("Error", "error", "Abort", "abort", "terminate", "Traceback", "SIG", "what()")
    hits = [line for line in lines if any(k in line for k in keys)]
    return "\n".join(hits[-60:]) + "\n---- tail ----\n" + "\n".join(lines[-40:])
