"""Garbage collection: the plan (a dry run), a pass, and the retention policy in force."""

from __future__ import annotations

from fastapi import APIRouter

from ...domain.queries import gc_policy_view
from ..contract import StrictJSONRoute, answers
from ..deps import GCDep, SettingsDep

router = APIRouter(route_class=StrictJSONRoute, tags=["gc"])


@router.get("/api/v1/gc/plan", responses=answers(params=False))
def gc_plan(gc: GCDep):
    """A dry run: what GC would delete now, and the bytes it would free."""
    return gc.plan().to_dict()


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
