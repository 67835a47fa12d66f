"""Runs: listings, one run, its checkpoints, its last-good, its events, the page's overview."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from lastgood.wire import names

from ..contract import StrictJSONRoute, answers
from ..deps import CommitsDep, CuratorDep, Limit, Offset, QueriesDep, run_prefix

router = APIRouter(route_class=StrictJSONRoute, tags=["runs"])


class EventBody(BaseModel):
    kind: str = Field(description="spike, restart or note")
    checkpoint_id: int | None = Field(None, ge=1, le=names.MAX_ID)
    data: dict = Field(default_factory=dict, description="strict JSON, at most 32 levels deep")


@router.get("/api/v1/runs", responses=answers(400))
def list_runs(request: Request, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0):
    """Runs, with each one's last-good and its checkpoint counts by status (a scoped token sees its own
    runs)."""
    return queries.list_runs(limit, offset, run_prefix(request))


@router.get("/api/v1/runs/{run}", responses=answers(400, 404))
def get_run(run: str, queries: QueriesDep):
    """One run: its generation, last-good and checkpoint counts by status."""
    return queries.get_run(run)


@router.get("/api/v1/runs/{run}/checkpoints", responses=answers(400, 404))
def list_checkpoints(run: str, queries: QueriesDep, status: str | None = None, limit: Limit = 100,
                     offset: Offset = 0):
    """The run's checkpoints, newest first; `status` filters by one status."""
    return queries.list_checkpoints(run, status, limit, offset)


@router.get("/api/v1/runs/{run}/last-good", responses=answers(400, 404, 409))
def last_good(run: str, queries: QueriesDep, commits: CommitsDep, manifest: bool = False):
    """The run's last-good, its manifest read and checked (included with `manifest=true`:
    a restore needs the id, not a document of O(ranks)); 404 `not_found`: no such run; 404
    `no_checkpoint`: the run never committed one; 409 `no_usable_checkpoint`: it did,
    but all are damaged (a refusal, not "start from scratch")."""
    view, body = queries.readable_last_good(run, commits.manifest_bytes)
    if manifest:
        view["manifest"] = json.loads(body)
    return view


@router.get("/api/v1/runs/{run}/events", responses=answers(400, 404))
def events(run: str, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0,
           kind: Annotated[str | None, Query(max_length=400, description="comma list of kinds")] = None):
    """The run's events, oldest first (begin, commit, abandon, launch, rollback, save_given_up, ...);
    `kind` filters by a comma list of kinds."""
    return queries.events(run, limit, offset, kind.split(",") if kind is not None else None)


@router.post("/api/v1/runs/{run}/events", responses=answers(400, 404, 413))
def record_event(run: str, body: EventBody, curator: CuratorDep):
    """Record an event of the run (spike, restart or note), optionally naming one of its checkpoints."""
    return curator.record_event(run, body.kind, body.checkpoint_id, body.data)


@router.get("/api/v1/overview", responses=answers(400))
def overview(request: Request, queries: QueriesDep, limit: Limit = 100, offset: Offset = 0):
    """Runs with bytes stored, last activity, pending saves and recent failures (the page's runs list)."""
    return queries.overview(limit, offset, run_prefix(request))
