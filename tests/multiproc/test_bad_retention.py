"""A run's retention is set by rank 0 (Checkpointer(retention=...)); a policy the service
refuses must stop every rank at once with the reason, not rank 0 alone while the others
wait in the first collective until torchrun or a timeout tears the group down."""

from __future__ import annotations

from pathlib import Path

from .launch import torchrun

HERE = Path(__file__).parent


def test_a_refused_retention_stops_every_rank(service, run_name):
    p = torchrun(HERE / "bad_retention.py", [service.url, run_name, "latest:x"], nproc=2, timeout=180)
    out = p.stdout + p.stderr
    assert "rank 0 refused" in out and "retention" in out.split("rank 0 refused", 1)[1].splitlines()[0], out[-3000:]
    assert "rank 1 refused" in out, out[-3000:]  # told, not left waiting in a collective
    ok = torchrun(HERE / "bad_retention.py", [service.url, run_name, "latest:2,last-good,branch-heads"], nproc=2,
                  timeout=180)
    assert ok.returncode == 0 and "rank 0 ok" in ok.stdout and "rank 1 ok" in ok.stdout, ok.stdout + ok.stderr
