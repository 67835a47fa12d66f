"""Runs: listings, one run, its checkpoints, its last-good, its events, the page's overview."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from lastgood.wire import names

from ...domain.queries import EVENT_KIND, STATUSES
from ...domain.runs.curation import CLIENT_EVENTS
from ..contract import StrictJSONRoute, answers
from ..deps import CommitsDep, CuratorDep, Limit, Offset, QueriesDep, RunName, run_prefix

router = APIRouter(route_class=StrictJSONRoute, tags=["runs"])
# the rules the domain checks, in the schema (the domain still refuses any other value: 400)
Status = Annotated[str, Query(description="only checkpoints in this status",
                              json_schema_extra={"enum": list(STATUSES)})]
Kinds = Annotated[str, Query(max_length=400, description="comma list of kinds",
                             json_schema_extra={"pattern": f"^{EVENT_KIND}(?:,{EVENT_KIND})*$"})]


class EventBody(BaseModel):
    kind: str = Field(description="spike, restart or note", json_schema_extra={"enum": sorted(CLIENT_EVENTS)})
    checkpoint_id: int | None = Field(None, ge=1, le=names.MAX_ID)
    data: dict = Field(default_factory=dict, description="strict JSON, at most 32 levels deep")


@router.get("/api/v1/runs", responses=answers(400))
def list_runs(request: Request, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0):
    """One page of runs, by name (within the token's run scope)."""
    return queries.list_runs(limit, offset, run_prefix(request))


@router.get("/api/v1/runs/{run}", responses=answers(400, 404))
def get_run(run: RunName, queries: QueriesDep):
    """A run: its generation, its last-good, and its checkpoints counted by status."""
    return queries.get_run(run)


@router.get("/api/v1/runs/{run}/checkpoints", responses=answers(400, 404))
def list_checkpoints(run: RunName, queries: QueriesDep, status: Status = None, limit: Limit = 100,
                     offset: Offset = 0):
    """One page of the run's checkpoints, highest step first, optionally of one status."""
    return queries.list_checkpoints(run, status, limit, offset)


@router.get("/api/v1/runs/{run}/last-good", responses=answers(400, 404, 409))
def last_good(run: RunName, queries: QueriesDep, commits: CommitsDep, manifest: bool = False):
    """The run's last-good, its manifest read and checked (included with `manifest=true`:
    a restore needs the id, not a document of O(ranks)); 404 `not_found`: no such run; 404
    `no_checkpoint`: the run never committed one; 409 `no_usable_checkpoint`: it did,
    but all are damaged (a refusal, not "start from scratch")."""
    view, body = queries.readable_last_good(run, commits.manifest_bytes)
    if manifest:
        view["manifest"] = json.loads(body)
    return view


@router.get("/api/v1/runs/{run}/events", responses=answers(400, 404))
def events(run: RunName, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0,
           kind: Kinds = None):
    """One page of the run's events, oldest first, optionally of some kinds only."""
    return queries.events(run, limit, offset, kind.split(",") if kind is not None else None)


@router.post("/api/v1/runs/{run}/events", responses=answers(400, 404, 413))
def record_event(run: RunName, body: EventBody, curator: CuratorDep):
    """Record a client event (a spike, a restart, a note, the supervisor's) on the run."""
    return curator.record_event(run, body.kind, body.checkpoint_id, body.data)


@router.get("/api/v1/overview", responses=answers(400))
def overview(request: Request, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0):
    """Runs with bytes stored, last activity, pending saves and recent failures (the page's runs list)."""
    return queries.overview(limit, offset, run_prefix(request))
