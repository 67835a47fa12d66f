"""A run's own retention policy (domain/runs/run_retention.py): read it, set it, clear it."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ...domain.runs.retention import MAX_SPEC
from ...domain.runs.run_retention import RunRetention
from ..contract import StrictJSONRoute, answers
from ..deps import GCDep, RunName

router = APIRouter(route_class=StrictJSONRoute, tags=["runs"])


class RetentionBody(BaseModel):
    retention: str | None = Field(max_length=MAX_SPEC, description="the run's policy in LASTGOOD_RETENTION's "
                                  "syntax, e.g. latest:5,every:1000,tagged,last-good,branch-heads; null or \"\": "
                                  "the service default")


def _policies(gc: GCDep) -> RunRetention:
    return RunRetention(gc.sessions, gc.retention, gate=gc.gate, clock=gc.clock)  # GC's sessions: they write


@router.get("/api/v1/runs/{run}/retention", responses=answers(400, 404))
def get_retention(run: RunName, gc: GCDep):
    """The retention GC applies to the run: its own, else the service default."""
    return _policies(gc).get(run)


@router.put("/api/v1/runs/{run}/retention", responses=answers(400, 413))
def set_retention(run: RunName, body: RetentionBody, gc: GCDep):
    """Give the run its own retention (validated as the service default is), or clear it.
    A run with no checkpoint yet is created with it: the policy holds from its first save."""
    return _policies(gc).set(run, body.retention)
