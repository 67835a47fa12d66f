"""Helpers for the command-line tests: the real `lastgood` console script, run as a
subprocess against real service processes (tests/conftest.py starts them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service.helpers import Client

_SCRIPT = Path(sys.executable).parent / "lastgood"
# the installed console script; `python -m lastgood.cli` where the client is not reinstalled yet
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "lastgood.cli"]

# no LASTGOOD_URL from the developer's shell; a fixed width so text output is predictable
ENV = {k: v for k, v in os.environ.items() if k not in ("LASTGOOD_URL", "LASTGOOD_TOKEN", "COLUMNS", "LASTGOOD_DEBUG")}


@dataclass
class Result:
    code: int
    out: str
    err: str
    argv: list[str]

    def json(self):
        return json.loads(self.out)


def _check(proc: subprocess.CompletedProcess, argv: list[str], code: int | None) -> Result:
    res = Result(proc.returncode, proc.stdout, proc.stderr, argv)
    if code is not None:
        assert res.code == code, f"lastgood {' '.join(argv)} exited {res.code}, wanted {code}\n" \
                                 f"stdout:\n{res.out[-3000:]}\nstderr:\n{res.err[-3000:]}"
    return res


def lastgood(*argv: str, url: str | None = None, code: int | None = 0, env: dict | None = None,
             timeout: float = 60) -> Result:
    """Run the console script; by default it must exit 0."""
    args = (["--url", url] if url else []) + list(argv)
    proc = subprocess.run(COMMAND + args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**ENV, **(env or {})})
    return _check(proc, args, code)


def lastgood_many(calls: list[tuple], parallel: int = 4) -> list[Result]:
    """Independent invocations, (argv, wanted exit code[, extra env]) each, a few at a time:
    each is a fresh Python process, and their start-up would otherwise be most of a test."""
    results: list[Result] = []
    for i in range(0, len(calls), parallel):
        batch = []
        for argv, code, *env in calls[i:i + parallel]:
            p = subprocess.Popen(COMMAND + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 stdin=subprocess.DEVNULL,
                                 env={**ENV, **(env[0] if env else {})})
            batch.append((argv, code, p))
        for argv, code, p in batch:
            stdout, stderr = p.communicate(timeout=60)
            results.append(_check(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr), argv, code))
    return results


def error_line(res: Result) -> str:
    """The one stderr line every failing command prints."""
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, f"wanted one error line, got:\n{res.err}"
    assert lines[0].startswith("lastgood: error: "), lines[0]
    return lines[0]


def unique_run(stem: str) -> str:
    return f"cli-{stem}-{uuid.uuid4().hex[:6]}"


@dataclass
class Tree:
    """A seeded run: a 2-rank chain, an abandoned save, a retry, and a second branch.

        a (step 0, 2 ranks) ─ b (100, 2 ranks) ─ p (200, ABANDONED)
          │                   └ d (200)
          └ e (150) ─ f (250)   <- branch 1, last-good
    """
    run: str
    a: int
    b: int
    p: int
    d: int
    e: int
    f: int
    shards: dict[int, dict[int, bytes]]


def seed_tree(svc, run: str) -> Tree:
    c = Client(svc.grpc_target)
    try:
        a, sa = c.save(run, 0, world_size=2)
        b, sb = c.save(run, 100, world_size=2, parent_id=a)
        p = c.begin(run, 200, world_size=1, parent_id=b, attempt="crashed").checkpoint_id
        c.abort(p, "the job died")
        d, sd = c.save(run, 200, world_size=1, parent_id=b)
        e, se = c.save(run, 150, world_size=1, parent_id=a, attempt="relaunch")
        f, sf = c.save(run, 250, world_size=1, parent_id=e, attempt="relaunch")
    finally:
        c.close()
    return Tree(run, a, b, p, d, e, f, {a: sa, b: sb, d: sd, e: se, f: sf})


@pytest.fixture(scope="session")
def tree(service) -> Tree:
    """One seeded run for the whole folder: tests that tag it remove their tags again, and
    nothing here corrupts or deletes it (those tests seed their own run)."""
    return seed_tree(service, unique_run("tree"))
