"""GET /api/v1/checkpoints/{id}/outcome?wait=S: a rank that has voted waits here for the
checkpoint's outcome. The handler is a coroutine on the server's event loop, so a waiting
rank holds no thread; the one notifier per process (domain/commit/outcomes.py) wakes every waiter
of a checkpoint at once (docs/control-plane.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, outcomes_of

router = APIRouter(route_class=StrictJSONRoute, tags=["checkpoints"])


@router.get("/api/v1/checkpoints/{checkpoint_id}/outcome", responses=answers(404))
async def checkpoint_outcome(checkpoint_id: CkptId, request: Request,
                             wait: Annotated[float, Query(ge=0, le=3600, description=(
                                 "seconds to wait while the checkpoint is PENDING; at most the "
                                 "service's outcome_wait_max"))] = 0.0):
    """The checkpoint's status as soon as it is not PENDING (COMMITTED, ABANDONED, CORRUPT),
    or after `wait` seconds with the ranks that have not voted. Asking again is always
    safe: a rank whose connection dropped while waiting learns the outcome this way."""
    # the parts read here, not as dependencies: FastAPI solves each dependency per request,
    # and the notifier and the settings (each through the context) were 4 of the 6 solves
    # that made up most of the event loop's time per waiting rank (bench/control_plane.py --profile)
    ctx = request.app.state.ctx
    notifier = await outcomes_of(ctx)
    outcome = await notifier.wait(checkpoint_id, min(wait, ctx.commits.settings.outcome_wait_max))
    # the JSON made once per outcome (Outcome.body), not FastAPI's per-element encoder: a
    # PENDING answer lists up to world_size-1 ranks, and thousands of them on the event loop
    # delayed COMMITTED answers by seconds at 4,096 ranks (bench/control_plane.py)
    return Response(outcome.body, media_type="application/json")
