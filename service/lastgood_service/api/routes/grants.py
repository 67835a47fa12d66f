"""Direct uploads to an S3 store (domain/dataplane/grants.py, docs/direct-s3.md): a rank's grant of
presigned part URLs for one of its files, the hand-over of what it uploaded, and presigned
reads of committed files. Off (409) unless LASTGOOD_DIRECT_S3 and an s3:// store."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from lastgood.wire import names
from lastgood.wire.s3parts import MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE

from ...domain.commit.types import ShardHeader
from ...domain.errors import InvalidArgument
from ...domain.dataplane.grants import DirectUploads, UploadedPart
from ..contract import StrictJSONRoute, answers
from ..deps import CkptId, CommitsDep, FileName

router = APIRouter(route_class=StrictJSONRoute, tags=["direct uploads"])

Rank = Annotated[int, Path(ge=0, le=names.MAX_RANK)]
Crc32 = Annotated[str, Field(min_length=8, max_length=8)]


def _direct(commits: CommitsDep) -> DirectUploads:
    return DirectUploads(commits)


DirectDep = Annotated[DirectUploads, Depends(_direct)]


class FileBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file_name: str = Field(min_length=1, max_length=255, json_schema_extra=names.SCHEMA["file"])
    size: int = Field(ge=0, le=names.MAX_ID)
    xxh3_128: str = Field(min_length=32, max_length=32)
    part_size: int | None = Field(None, ge=MIN_PART_SIZE, le=MAX_PART_SIZE,
                                  description="the part size the rank checksummed with (default: the service's)")


class GrantBody(FileBody):
    crc32: list[Crc32] = Field(max_length=MAX_PARTS, description="each part's CRC32, base64 of 4 big-endian bytes")


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    number: int = Field(ge=1, le=MAX_PARTS)
    etag: str = Field(min_length=1, max_length=256)
    crc32: Crc32


class HandOverBody(FileBody):
    upload_id: str = Field(min_length=1, max_length=1024)
    parts: list[Part] = Field(min_length=1, max_length=MAX_PARTS)
    digests: dict | None = Field(None, description="the file's range digests, computed by the rank with the "
                                 "service's rule (lastgood/wire/ranges.py; checked for shape: "
                                 "domain/commit/declared_ranges.py)")


def _header(checkpoint_id: int, rank: int, body: FileBody) -> ShardHeader:
    return ShardHeader(checkpoint_id, rank, body.file_name, body.size, body.xxh3_128)


@router.post("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/grants", responses=answers(400, 404, 409, 413))
def grant(checkpoint_id: CkptId, rank: Rank, body: GrantBody, direct: DirectDep):
    """Start the upload of one of the rank's files: presigned UploadPart URLs, one a part."""
    return direct.grant(_header(checkpoint_id, rank, body), body.crc32, body.part_size)


@router.post("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/direct-files",
             responses=answers(400, 404, 409, 413, 422))
def hand_over(checkpoint_id: CkptId, rank: Rank, body: HandOverBody, direct: DirectDep):
    """The rank's file is uploaded: confirmed from the store's metadata, completed, recorded."""
    r = direct.hand_over(_header(checkpoint_id, rank, body), body.upload_id,
                         [UploadedPart(p.number, p.etag, p.crc32) for p in body.parts], body.part_size,
                         body.digests)
    return {"already_present": r.already_present, "size": r.size, "xxh3_128": r.xxh3_128}


@router.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/read-grants/{file_name}",
            responses=answers(400, 404, 409))
def read_grant(checkpoint_id: CkptId, rank: Rank, file_name: FileName, direct: DirectDep):
    """A presigned GET of a committed checkpoint's file; the reader re-hashes what it reads."""
    try:
        names.check_file_name(file_name)
    except names.InvalidName as exc:
        raise InvalidArgument(str(exc)) from None
    return direct.read_url(checkpoint_id, rank, file_name)
