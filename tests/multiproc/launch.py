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
    # faulthandler: a rank that aborts in native code (a rare SIGABRT, "terminate called
    # without an active exception", seen twice in the FSDP 4-rank save) prints every
    # thread's Python stack into the output that why() shows
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
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
    out = "\n".join(hits[-60:]) + "\n---- tail ----\n" + "\n".join(lines[-40:])
    # a rank that died in native code: faulthandler's dump of every thread's Python stack
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    for i in starts[:2]:
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(("W1", "E1", "I1"))), len(lines))
        out += "\n---- faulthandler ----\n" + "\n".join(lines[i:min(end, i + 80)])
    return out
