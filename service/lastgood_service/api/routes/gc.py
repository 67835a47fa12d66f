"""Garbage collection: the plan (a dry run), a pass, and the retention policy in force."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...domain.errors import PermissionDenied
from ...domain.queries import gc_policy_view
from ..contract import StrictJSONRoute, answers
from ..deps import GCDep, SettingsDep, run_prefix

router = APIRouter(route_class=StrictJSONRoute, tags=["gc"])


@router.get("/api/v1/gc/plan", responses=answers())
def gc_plan(gc: GCDep, request: Request, full: bool = False):
    """A dry run: what GC would delete now, and the bytes it would free. It plans the runs
    where something changed since the last GC pass (the others have nothing to delete), and
    of those only the runs a scoped token may read. `full=true`: every run, and the blob
    store listed for orphans and unknown blobs (unscoped tokens only; seconds at thousands
    of runs)."""
    prefix = run_prefix(request)
    if full and prefix is not None:
        raise PermissionDenied(f"a full GC plan lists the whole store; this token is limited to runs starting "
                               f"with {prefix!r}: ask without full=true")
    return gc.plan(full=full, run_prefix=prefix).to_dict()


@router.post("/api/v1/gc", responses=answers())
def gc_run(gc: GCDep, dry_run: bool = False):
    """Run one GC pass now (`dry_run=true`: only say what it would delete)."""
    plan = gc.plan()
    out = {"plan": plan.to_dict(), "dry_run": dry_run}
    if not dry_run:
        out["result"] = gc.execute(plan)
    return out


@router.get("/api/v1/gc/policy", responses=answers(params=False))
def gc_policy(gc: GCDep, settings: SettingsDep):
    """The retention policy in force, the grace period and the GC interval."""
    return gc_policy_view(gc.retention, gc.grace.total_seconds(), settings.gc_interval)
