"""The memory tier's node agents (domain/memory/): registration and the placement list,
copy reports, the copies of a memory checkpoint, the segments an agent keeps. An agent's
own calls carry its key (lastgood.wire.tiers.AGENT_KEY_HEADER) besides the writer token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path
from pydantic import BaseModel, Field

from lastgood.wire import names, tiers

from ...domain.commit.tiering import MAX_MEMORY_FILES, MemoryFile
from ...domain.memory.agents import Agents
from ...domain.memory.copies import Copies
from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CommitsDep

router = APIRouter(route_class=StrictJSONRoute, tags=["agents"])

AgentId = Annotated[int, Path(ge=1, le=names.MAX_ID)]
AgentKey = Annotated[str | None, Header(alias=tiers.AGENT_KEY_HEADER, max_length=tiers.AGENT_KEY_HEX,
                                        description="the agent's key, as its registration answered it")]


class Place(BaseModel):
    host: str = Field(min_length=1, max_length=64, json_schema_extra=tiers.SCHEMA["label"])
    rack: str = Field("", max_length=64, json_schema_extra=tiers.SCHEMA["optional_label"])
    switch: str = Field("", max_length=64, json_schema_extra=tiers.SCHEMA["optional_label"])
    address: str = Field(min_length=3, max_length=tiers.MAX_ADDRESS, json_schema_extra=tiers.SCHEMA["address"],
                         description="host:port the agent serves on")


class HeldFile(BaseModel):
    name: str = Field(min_length=1, max_length=200, json_schema_extra=names.SCHEMA["file"])
    size: int = Field(ge=0, le=names.MAX_ID)
    xxh3_128: str = Field(pattern="^[0-9a-f]{32}$", description="the agent's own hash of the bytes it holds")


class CopyReport(BaseModel):
    agent_id: int = Field(ge=1, le=names.MAX_ID)
    rank: int = Field(ge=0, le=names.MAX_RANK)
    files: list[HeldFile] = Field(max_length=MAX_MEMORY_FILES)


def _agents(commits) -> Agents:
    return Agents(commits.sessions, commits.settings.agent_ttl_seconds, commits.clock)


@router.post("/api/v1/agents", responses=answers(400, 413))
def register_agent(body: Place, commits: CommitsDep):
    """Register a node agent: its id and key (shown once). A registration again of the same
    host and address retires the older one."""
    return _agents(commits).register(body.host, body.rack, body.switch, body.address)


@router.get("/api/v1/agents", responses=answers(params=False))
def list_agents(commits: CommitsDep):
    """The agents that count (not retired, heard from within LASTGOOD_AGENT_TTL_SECONDS): what
    placement (tiers.partners) is computed over."""
    return _agents(commits).list()


@router.get("/api/v1/agents/{agent_id}/live", responses=answers(403))
def live_segments(agent_id: AgentId, commits: CommitsDep, key: AgentKey = None):
    """The memory checkpoints this agent keeps segments of; it frees every other."""
    return Copies(commits).live(agent_id, key)


@router.post("/api/v1/checkpoints/{checkpoint_id}/copies", responses=answers(400, 403, 404, 409, 413))
def report_copies(checkpoint_id: CkptId, body: CopyReport, commits: CommitsDep, key: AgentKey = None):
    """An agent holds these files of one rank of a memory checkpoint, with these digests of
    its own: they count toward the commit; other bytes than the declared abort it."""
    files = [MemoryFile(f.name, f.size, f.xxh3_128) for f in body.files]
    return Copies(commits).report(checkpoint_id, body.agent_id, key, body.rank, files)


@router.get("/api/v1/checkpoints/{checkpoint_id}/copies", responses=answers(404, 409))
def memory_copies(checkpoint_id: CkptId, commits: CommitsDep):
    """The agents holding each file of a memory checkpoint (their digest matched)."""
    return Copies(commits).copies(checkpoint_id)
