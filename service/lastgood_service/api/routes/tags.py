"""Tags, aliases and pins on checkpoints (admin curation)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CuratorDep, Generation

router = APIRouter(route_class=StrictJSONRoute, tags=["tags"])


class TagBody(BaseModel):
    name: str = Field(description="free text, 1-128 characters")
    alias: bool = Field(False, description="an alias names one checkpoint per run and moves when set again")


@router.post("/api/v1/checkpoints/{checkpoint_id}/tags", responses=answers(400, 404, 409, 413))
def set_tag(checkpoint_id: CkptId, body: TagBody, curator: CuratorDep, generation: Generation = None):
    """Tag a committed checkpoint; an alias (`alias: true`) names one checkpoint per run and moves from
    the one it named."""
    return curator.set_tag(checkpoint_id, body.name, body.alias, generation)


@router.delete("/api/v1/checkpoints/{checkpoint_id}/tags/{name:path}",  # tags may hold '/'
               responses=answers(400, 404, 409))
def remove_tag(checkpoint_id: CkptId, name: str, curator: CuratorDep, generation: Generation = None):
    """Remove a tag or alias from the checkpoint."""
    return curator.remove_tag(checkpoint_id, name, generation)


@router.put("/api/v1/checkpoints/{checkpoint_id}/pin", responses=answers(404, 409))
def pin(checkpoint_id: CkptId, curator: CuratorDep, generation: Generation = None):
    """Pin the checkpoint: GC keeps it whatever the retention policy says."""
    return curator.pin(checkpoint_id, True, generation)


@router.delete("/api/v1/checkpoints/{checkpoint_id}/pin", responses=answers(404, 409))
def unpin(checkpoint_id: CkptId, curator: CuratorDep, generation: Generation = None):
    """Unpin the checkpoint: the retention policy decides again."""
    return curator.pin(checkpoint_id, False, generation)
