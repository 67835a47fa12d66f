"""Tags, aliases and pins on checkpoints (admin curation)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from lastgood.wire import names

from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CuratorDep, Generation

TagName = Annotated[str, Path(description="a tag", json_schema_extra=names.SCHEMA["tag"])]

router = APIRouter(route_class=StrictJSONRoute, tags=["tags"])


class TagBody(BaseModel):
    name: str = Field(description="free text, 1-128 characters, no leading or trailing space, no control or "
                      "format characters, not a system tag; the schema's pattern is its portable part "
                      "(printable ASCII)", json_schema_extra=names.SCHEMA["tag"])
    alias: bool = Field(False, description="an alias names one checkpoint per run and moves when set again")


@router.post("/api/v1/checkpoints/{checkpoint_id}/tags", responses=answers(400, 404, 409, 413))
def set_tag(checkpoint_id: CkptId, body: TagBody, curator: CuratorDep, generation: Generation = None):
    """Tag the checkpoint (an alias moves to it from the run's other checkpoints)."""
    return curator.set_tag(checkpoint_id, body.name, body.alias, generation)


@router.delete("/api/v1/checkpoints/{checkpoint_id}/tags/{name:path}",  # tags may hold '/'
               responses=answers(400, 404, 409))
def remove_tag(checkpoint_id: CkptId, name: TagName, curator: CuratorDep, generation: Generation = None):
    """Remove a tag or alias from the checkpoint (system tags are lastgood's own)."""
    return curator.remove_tag(checkpoint_id, name, generation)


@router.put("/api/v1/checkpoints/{checkpoint_id}/pin", responses=answers(400, 404, 409))
def pin(checkpoint_id: CkptId, curator: CuratorDep, generation: Generation = None):
    """Pin the checkpoint: GC keeps it whatever the retention says."""
    return curator.pin(checkpoint_id, True, generation)


@router.delete("/api/v1/checkpoints/{checkpoint_id}/pin", responses=answers(400, 404, 409))
def unpin(checkpoint_id: CkptId, curator: CuratorDep, generation: Generation = None):
    """Unpin the checkpoint: retention decides about it again."""
    return curator.pin(checkpoint_id, False, generation)
