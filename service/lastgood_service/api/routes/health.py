"""REST routes of run health: heartbeats in, verdicts and the checkpoint interval out
(domain/health/heartbeats.py; docs/health.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from lastgood.wire import names

from ...domain.health.heartbeats import MAX_SECONDS
from ..contract import StrictJSONRoute, answers
from ..deps import HealthDep, RunName

Seconds = Annotated[float | None, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False, strict=True)]


class HeartbeatBody(BaseModel):
    rank: int = Field(ge=0, le=names.MAX_RANK, strict=True)
    world_size: int = Field(ge=1, le=names.MAX_RANK, strict=True)
    step: int | None = Field(None, ge=0, le=names.MAX_ID, strict=True)
    step_seconds: Seconds = Field(None, description="seconds per step since the rank's previous beat")
    phase: Literal["train", "saving", "restoring", "idle"]
    attempt: str | None = Field(None, max_length=64, description="the launch's attempt id",
                                json_schema_extra=names.SCHEMA["attempt"])
    generation: int | None = Field(None, ge=0, le=names.MAX_ID, strict=True, description="the launch's generation")
    max_step_seconds: Seconds = Field(None, description="the longest step since the previous beat")
    period_s: Seconds = Field(None, description="seconds between this rank's beats")
    save_stall_s: Seconds = Field(None, description="the training thread's stall in the rank's last save")


router = APIRouter(route_class=StrictJSONRoute, tags=["health"])


@router.post("/api/v1/runs/{run}/heartbeats", status_code=204, responses=answers(400, 404, 409, 413))
def heartbeat(run: RunName, body: HeartbeatBody, health: HealthDep):
    """One rank's latest liveness and progress; the service keeps the newest per rank."""
    health.beat(run, body.model_dump())
    return Response(status_code=204)


@router.get("/api/v1/runs/{run}/health", responses=answers(400, 404))
def run_health(run: RunName, health: HealthDep,
               hang_timeout: Annotated[float | None, Query(gt=0, le=MAX_SECONDS, allow_inf_nan=False)] = None):
    """Per rank its latest beat and verdict (ok, hung, straggler, lost), the hung and
    straggling ranks, the hang timeout in force (`hang_timeout` fixes it for this
    answer), and the checkpoint interval (Young/Daly from cost and failures)."""
    # the answer is plain JSON already: skip FastAPI's encoder, slow on thousands of ranks
    return JSONResponse(health.view(run, hang_timeout))
