"""Read leases: keep a checkpoint's blobs from GC while a restore or download reads them."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ...domain.runs.curation import MAX_LEASE_SECONDS
from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CuratorDep, Id

router = APIRouter(route_class=StrictJSONRoute, tags=["checkpoints"])


class LeaseBody(BaseModel):
    holder: str = Field("client", max_length=128)
    seconds: float = Field(600.0, ge=1, le=MAX_LEASE_SECONDS, description="how long the lease lasts, 1 s to 24 h")


@router.post("/api/v1/checkpoints/{checkpoint_id}/leases", responses=answers(400, 404, 409, 413))
def acquire_lease(checkpoint_id: CkptId, body: LeaseBody, curator: CuratorDep):
    """Keep the checkpoint's blobs from GC while a restore or download reads them."""
    return curator.acquire_lease(checkpoint_id, body.holder, body.seconds)


@router.delete("/api/v1/leases/{lease_id}", responses=answers(404))
def release_lease(lease_id: Id, curator: CuratorDep):
    """Release a read lease: GC may delete the checkpoint's blobs again."""
    return curator.release_lease(lease_id)
