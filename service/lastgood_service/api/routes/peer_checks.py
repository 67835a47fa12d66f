"""Peer verification (domain/peer/verification_modes.py): a rank asks which of its peer's files
to read back from the store, and reports what it read. Writers only: the report decides
whether a checkpoint may commit."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path
from pydantic import BaseModel, Field

from lastgood.wire import names, peerkey

from ...domain.errors import Unavailable
from ...domain.peer.verification_modes import MAX_REPORT_FILES, PeerChecks
from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, Ctx

router = APIRouter(route_class=StrictJSONRoute, tags=["checkpoints"])

Rank = Annotated[int, Path(ge=0, le=names.MAX_RANK)]
# the checker's secret (lastgood/wire/peerkey.py): only the rank whose vote carried its commitment has it
PeerKey = Annotated[str | None, Header(alias=peerkey.HEADER, max_length=64,
                                       description="the rank's peer-check secret (64 hex digits); the SHA-256 of "
                                                   "it is the peer_key its vote carried")]


class ReadFile(BaseModel):
    name: str = Field(min_length=1, max_length=200, json_schema_extra=names.SCHEMA["file"])
    xxh3_128: str | None = Field(None, pattern="^[0-9a-f]{32}$",
                                 description="what the checker read; null: it could not read the file")
    ranges_xxh3_128: str | None = Field(None, pattern="^[0-9a-f]{32}$",
                                        description="lastgood.wire.ranges.fingerprint of the range digests the checker "
                                                    "recomputed by the file's rule (the assignment's `ranges`)")


class PeerReport(BaseModel):
    peer_rank: int = Field(ge=0, le=names.MAX_RANK)
    files: list[ReadFile] = Field(max_length=MAX_REPORT_FILES)


def _checks(ctx) -> PeerChecks:
    if ctx.peer_checks is None:  # an app built without them (a test's context)
        raise Unavailable("peer checks are not served by this app")
    return ctx.peer_checks


@router.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check", responses=answers(400, 404, 409))
def peer_assignment(checkpoint_id: CkptId, rank: Rank, ctx: Ctx, key: PeerKey = None):
    """The files this rank is to read back and check: its peer's (rank + 1 mod world) files
    not yet checked, with their size and where to read each (the declared digest stays here).
    Only for the rank itself, after its vote: the peer key header opens its vote's commitment."""
    return _checks(ctx).assignment(checkpoint_id, rank, key)


@router.post("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check", responses=answers(400, 404, 409, 413))
def peer_report(checkpoint_id: CkptId, rank: Rank, body: PeerReport, ctx: Ctx, key: PeerKey = None):
    """What this rank read: a match verifies the file; a mismatch aborts the checkpoint. Only
    from the rank itself (the peer key header, as for the assignment); a refused report is
    recorded (peer_report_refused)."""
    return _checks(ctx).report(checkpoint_id, rank, body.peer_rank, [f.model_dump() for f in body.files], key)
