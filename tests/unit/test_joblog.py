"""Logs at scale (lastgood.common.joblog): an incident every rank meets is one line for the
job, on rank 0, with the job's rank count; the other ranks log theirs at debug level."""

from __future__ import annotations

import logging

import pytest

from lastgood.common import joblog


@pytest.fixture(autouse=True)
def one_rank_after():
    yield
    joblog.set_job(0, 1)


def lines(caplog, rank: int, world: int) -> list[tuple[int, str]]:
    caplog.clear()
    joblog.set_job(rank, world)
    with caplog.at_level(logging.DEBUG, logger="lastgood"):
        joblog.incident(logging.getLogger("lastgood"), logging.WARNING, "lastgood: restored %s step %s", "run", 8)
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_rank_0_says_it_once_for_the_job_and_the_others_at_debug(caplog):
    assert lines(caplog, 0, 8) == [(logging.WARNING, "lastgood: restored run step 8 [rank 0 of 8 ranks; the others "
                                                     "log theirs at debug level]")]
    assert lines(caplog, 5, 8) == [(logging.DEBUG, "lastgood: restored run step 8 [rank 5 of 8]")]
    # a job of one rank (the CLI, a script without torchrun): as asked
    assert lines(caplog, 0, 1) == [(logging.WARNING, "lastgood: restored run step 8")]
