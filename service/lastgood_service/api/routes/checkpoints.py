"""Checkpoints: one checkpoint with its manifest, the manifest's bytes, a file's tensor index, verification,
downloads of a rank's file (with HTTP Range), and the files the catalog holds."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import StreamingResponse

from lastgood.wire import names

from ...domain.errors import Damaged, InvalidArgument, OutOfRange
from ..contract import StrictJSONRoute, answers, error_response
from ..errors import lookup
from ..deps import CkptId, CommitsDep, FileName, QueriesDep

router = APIRouter(route_class=StrictJSONRoute, tags=["checkpoints"])

_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$", re.ASCII)  # 19 digits: any int64 offset


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One `bytes=a-b`, `bytes=a-` or `bytes=-n` range -> [start, end) within size."""
    m = _RANGE.match(header.strip())
    if not m or (m.group(1) == "" and m.group(2) == ""):
        raise InvalidArgument(f"unsupported Range header {header!r}: use one range, bytes=START-END")
    a, b = m.group(1), m.group(2)
    if a == "":
        n = int(b)
        if n == 0 or size == 0:
            raise OutOfRange(f"suffix range of {n} bytes of a {size}-byte file is empty")
        return max(0, size - n), size
    start = int(a)
    end = size if b == "" else int(b) + 1
    if b != "" and int(b) < start:
        raise InvalidArgument(f"Range end {b} is before start {a}")
    if start >= size:
        raise OutOfRange(f"range starts at byte {start} but the file has {size} bytes")
    return start, min(end, size)


@router.get("/api/v1/checkpoints/{checkpoint_id}", responses=answers(404, 409))
def get_checkpoint(checkpoint_id: CkptId, queries: QueriesDep, commits: CommitsDep):
    """A checkpoint: status, step, lineage, tags, files, and where a restore goes if it is unusable."""
    view = queries.get_checkpoint(checkpoint_id)
    # the full view, every tensor index fetched and checked: for tools, never the restore path
    if view["status"] == "COMMITTED":
        try:
            view["manifest"] = commits.full_manifest(checkpoint_id)
        except Damaged:  # found damaged just now and marked CORRUPT: show it as it now is
            view = {**queries.get_checkpoint(checkpoint_id), "manifest": None}
    else:
        view["manifest"] = None
    return view


@router.get("/api/v1/checkpoints/{checkpoint_id}/manifest", responses=answers(404, 409))
def get_manifest(checkpoint_id: CkptId, commits: CommitsDep):
    """A committed checkpoint's manifest, read from the store and checked."""
    return Response(commits.manifest_bytes(checkpoint_id), media_type="application/json")


@router.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/index/{file_name}", responses=answers(400, 404, 409))
def get_index(checkpoint_id: CkptId, rank: Annotated[int, Path(ge=0, le=names.MAX_RANK)], file_name: FileName,
              commits: CommitsDep):
    """One file's tensor index object (a manifest of format 2 names it by hash): the exact
    bytes, checked here against that hash; a damaged one marks the checkpoint CORRUPT."""
    try:
        names.check_file_name(file_name)
    except names.InvalidName as exc:
        raise InvalidArgument(str(exc)) from None
    return Response(commits.index_bytes(checkpoint_id, rank, file_name), media_type="application/json")


@router.post("/api/v1/checkpoints/{checkpoint_id}/verify", responses=answers(404, 409))
def verify(checkpoint_id: CkptId, commits: CommitsDep):
    """Re-hash every shard; a mismatch marks the checkpoint CORRUPT and moves last-good back."""
    return commits.verify(checkpoint_id)


@router.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}",
            responses=answers(400, 404, 409, 416))
def download(request: Request, checkpoint_id: CkptId, rank: Annotated[int, Path(ge=0, le=names.MAX_RANK)],
             file_name: FileName, commits: CommitsDep):
    """Download one of a rank's files (HTTP Range for a part of it); the xxh3-128 is in the headers."""
    try:
        names.check_file_name(file_name)
    except names.InvalidName as exc:
        raise InvalidArgument(str(exc)) from None
    sh = commits.shard_for_read(checkpoint_id, rank, file_name)
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{sh.xxh3_128}"', "X-Lastgood-Xxh3-128": sh.xxh3_128,
               "Content-Disposition": f'attachment; filename="{file_name}"'}
    rng = request.headers.get("range")
    if rng is None:
        body = commits.read_range(sh, 0, None)
        return StreamingResponse(body, media_type="application/octet-stream",
                                 headers={**headers, "Content-Length": str(sh.size)})
    try:
        start, end = parse_range(rng, sh.size)
    except OutOfRange as exc:
        status, _code, name = lookup(exc)
        return error_response(status, name, str(exc), {"Content-Range": f"bytes */{sh.size}"})
    body = commits.read_range(sh, start, end - start)
    return StreamingResponse(body, status_code=206, media_type="application/octet-stream",
                             headers={**headers, "Content-Length": str(end - start),
                                      "Content-Range": f"bytes {start}-{end - 1}/{sh.size}"})


@router.get("/api/v1/checkpoints/{checkpoint_id}/shards", responses=answers(404))
def shards(checkpoint_id: CkptId, queries: QueriesDep):
    """Per rank, the files the catalog holds (size, xxh3-128, state), whatever the checkpoint's status."""
    return queries.shards(checkpoint_id)
