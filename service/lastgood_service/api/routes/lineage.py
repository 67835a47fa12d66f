"""Lineage: a run's checkpoint tree, a checkpoint's ancestors, and rollbacks after a loss spike."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from lastgood.wire import names

from ...domain.queries import LINEAGE_PAGE, MAX_LINEAGE
from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CuratorDep, Generation, Offset, QueriesDep, RunName

router = APIRouter(route_class=StrictJSONRoute, tags=["lineage"])


class RollbackBody(BaseModel):
    target_id: int = Field(ge=1, le=names.MAX_ID, description="the checkpoint training returns to")
    spike_step: int = Field(ge=0, le=names.MAX_ID, description="the step at which the spike was seen")
    data: dict = Field(default_factory=dict, description="the guard's numbers: loss, median, mad, threshold, ... "
                                                         "(strict JSON: a non-finite number is sent as \"nan\", "
                                                         "\"inf\" or \"-inf\")")


@router.get("/api/v1/runs/{run}/lineage", responses=answers(400, 404))
def run_lineage(run: RunName, queries: QueriesDep, limit: Annotated[int, Query(ge=1, le=MAX_LINEAGE)] = LINEAGE_PAGE,
                offset: Offset = 0):
    """One page of the run's checkpoint tree, oldest first: nodes (step, status, branch, tags,
    bytes, durations), parent edges, and `total` to page on with `offset`."""
    # the answer's JSON text, built from the rows (domain/runs/lineage.py): no dict a node for
    # FastAPI's encoder (it walked each of 1,000 again, ~30 ms) or Python's GC to walk
    return Response(queries.lineage_json(run, limit, offset), media_type="application/json")


@router.get("/api/v1/checkpoints/{checkpoint_id}/ancestors", responses=answers(404))
def ancestors(checkpoint_id: CkptId, queries: QueriesDep):
    """The checkpoint's ancestors along its lineage, and where a restore goes if it is unusable."""
    return queries.ancestors(checkpoint_id)


@router.post("/api/v1/runs/{run}/rollback", responses=answers(400, 404, 409, 413))
def rollback(run: RunName, body: RollbackBody, curator: CuratorDep, generation: Generation = None):
    """Mark what followed the target suspect, tag the target rollback-target, move last-good back."""
    return curator.rollback(run, body.target_id, body.spike_step, body.data, generation)
