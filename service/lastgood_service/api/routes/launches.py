"""Launches: each launch of a job registers, and its generation fences older launches (docs/fencing.md)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from lastgood.wire import names

from ..contract import StrictJSONRoute, answers
from ..deps import CommitsDep, RunName

router = APIRouter(route_class=StrictJSONRoute, tags=["runs"])


class LaunchBody(BaseModel):
    attempt: str = Field(description="the launch's attempt id; every rank of one launch sends the same",
                         json_schema_extra=names.SCHEMA["attempt"])
    world_size: int = Field(1, ge=1, le=names.MAX_RANK)


@router.post("/api/v1/runs/{run}/launches", responses=answers(400, 404, 409, 413))
def register_launch(run: RunName, body: LaunchBody, commits: CommitsDep):
    """Register a launch of the job; its generation fences every older launch's writes
    and abandons their pending checkpoints (docs/fencing.md). Idempotent on (run, attempt)."""
    return commits.launches.register(run, body.attempt, body.world_size)


@router.get("/api/v1/runs/{run}/launches/current", responses=answers(400, 404))
def current_launch(run: RunName, commits: CommitsDep):
    """The run's newest launch: the one whose writes the service accepts."""
    return commits.launches.current(run)
