"""Run scripts under real torchrun (gloo on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, free_port

TRAIN = ROOT / "examples/gpt/train.py"


def inherited_env() -> dict[str, str]:
    """This process's environment for ranks, less PYTHONUNBUFFERED: unbuffered, print() writes
    its text and its newline in separate syscalls, so two ranks' lines (or a rank's line and a
    log record from its own background thread) interleave mid-line and a test parsing lines
    misses them (seen in CI: "RESULTRESULT {..}{..}"); buffered, a flush=True print reaches
    the output in one write."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def _command(script: Path, args: list[str], nproc: int, env: dict | None,
             launcher: list[str] | None) -> tuple[list[str], dict]:
    launch = launcher if launcher is not None else [f"--master-port={free_port()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *launch, str(script), *args]
    # faulthandler: a rank that aborts in native code (a rare SIGABRT, "terminate called
    # without an active exception", seen twice in the FSDP 4-rank save) prints every
    # thread's Python stack into the output that why() shows
    full_env = {**inherited_env(), "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    return cmd, full_env


def one_rank(script: Path, args: list[str], env: dict | None = None) -> tuple[list[str], dict]:
    """One rank without the launcher: the env:// variables torchrun would set, in a plain
    process (no second Python importing torch to watch it)."""
    cmd, full_env = _command(script, args, 1, env, None)
    ranks = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [sys.executable, str(script), *args], {**full_env, **ranks, **(env or {})}


def torchrun(script: Path, args: list[str], nproc: int = 2, env: dict | None = None,
             timeout: float = 240, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`launcher` replaces the default --master-port (e.g. elastic rendezvous options)."""
    cmd, full_env = _command(script, args, nproc, env, launcher)
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _train_args(url: str, run: str | None, out: Path, extra) -> list[str]:
    named = ["--run-name", run] if run else []
    return ["--url", url, *named, "--out", str(out), *extra]


def train(url: str, run: str | None, out: Path, *extra: str, kill: str | None = None, nproc: int = 2,
          launcher: list[str] | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**(env or {}), **({"LASTGOOD_EXAMPLE_KILL": kill} if kill else {})}
    return torchrun(TRAIN, _train_args(url, run, out, extra), env=env, nproc=nproc, launcher=launcher)


class Background:
    """train.py under torchrun in the background, its output in a file, for tests that act
    on the service while the job runs."""

    def __init__(self, url: str, run: str | None, out: Path, *extra: str, env: dict | None = None,
                 nproc: int = 2) -> None:
        cmd, full_env = _command(TRAIN, _train_args(url, run, out, extra), nproc, env, None)
        out.mkdir(parents=True, exist_ok=True)
        self.log = out.parent / f"{out.name}-torchrun.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, predicate, what: str, timeout: float = 180) -> None:
        """Poll until predicate() holds; fail with the job's output if it ends or times out first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended (rc {self.proc.returncode}) before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 240) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.output(), "")


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
