"""What each REST route answers on success, as the OpenAPI document declares it.

The shapes are pydantic models used for the document only: the routes return the domain's
dicts unchanged (no response_model, so an answer is never filtered or re-validated on its
way out), and tests/service/test_openapi_answers.py and the REST fuzz (schemathesis's
response conformance) hold real answers of a real service against these schemas. Every model allows keys it does not name, so a field added to an
answer is compatible; what a model names, the answer has. `document(app)` puts the schemas
into the app's OpenAPI document; OK names each route's model by (method, path).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class Page(Answer):
    total: int = Field(description="how many there are in all")
    limit: int
    offset: int


# ------------------------------------------------------------------ service
class Healthz(Answer):
    status: str = Field(description="ok")


class InfoAnswer(Answer):
    service: str
    version: str
    grpc_target: str = Field(description="the gRPC address clients dial (LASTGOOD_GRPC_ADVERTISE)")
    max_chunk_bytes: int
    max_shard_bytes: int
    max_request_bytes: int
    inline_bytes: int = Field(description="the most bytes of small files one vote may carry (0: none)")
    lease_seconds: float
    verification: str = Field(description="service, store or peer (docs/dataplane.md)")
    range_block_bytes: int
    spool: dict | None = Field(description="the spool the service offers, or null")
    direct_fs: dict | None = Field(description="the direct-FS store, or null")
    direct_s3: dict | None = Field(description="direct S3 uploads, or null")


# ------------------------------------------------------------------ checkpoints
class TagRef(Answer):
    name: str
    kind: str = Field(description="tag, alias or system (last-good)")


class CheckpointView(Answer):
    id: int
    run: str
    step: int
    attempt: str
    generation: int
    world_size: int
    tier: str = Field(description="durable or memory (docs/memory-tier.md)")
    parent_id: int | None
    status: str = Field(description="PENDING, COMMITTED, ABANDONED, CORRUPT or DELETED")
    bytes: int
    created_at: str
    committed_at: str | None
    lease_expires_at: str | None
    last_good: bool
    tags: list[TagRef]


class Manifest(Answer):
    """docs/format.md: lastgood.manifest/1 or /2."""
    format: str
    checkpoint_id: int
    run: str
    step: int
    world_size: int
    ranks: list[dict]


class CheckpointWithManifest(CheckpointView):
    manifest: Manifest


class CheckpointPage(Page):
    items: list[CheckpointView]


class Ancestors(Answer):
    checkpoint_id: int
    fallback_id: int | None = Field(description="the newest committed ancestor a restore falls back to")
    items: list[CheckpointView]


class TensorIndex(Answer):
    """docs/format.md: lastgood.index/1, a file's tensors and their byte offsets."""
    format: str
    file: str
    rank: int
    data_start: int
    tensors: dict


class FileState(Answer):
    name: str
    size: int
    xxh3_128: str | None
    status: str = Field(description="VERIFIED or DECLARED")


class RankShards(Answer):
    rank: int
    voted: bool
    files: list[FileState]


class Shards(Answer):
    checkpoint_id: int
    run: str
    status: str
    world_size: int
    ranks: list[RankShards]


class Outcome(Answer):
    checkpoint_id: int
    status: str
    missing_ranks: list[int]


class Verified(Answer):
    checkpoint_id: int
    ok: bool
    files: int
    bad: list[dict] = Field(description="each damaged file: rank, file, expected and found digests")
    status: str


class TagSet(Answer):
    checkpoint_id: int
    name: str
    kind: str
    moved_from: int | None = Field(description="an alias's previous checkpoint")


class TagRemoved(Answer):
    checkpoint_id: int
    removed: str


class Pinned(Answer):
    checkpoint_id: int
    pinned: bool


class Lease(Answer):
    lease_id: int
    checkpoint_id: int
    expires_at: str


class Released(Answer):
    released: int


# ------------------------------------------------------------------ runs
class RunView(Answer):
    name: str
    created_at: str
    generation: int
    last_good: CheckpointView | None
    checkpoints: dict[str, int] = Field(description="how many checkpoints of each status")


class RunPage(Page):
    items: list[RunView]


class Event(Answer):
    id: int
    kind: str
    at: str
    checkpoint_id: int | None
    data: dict


class EventPage(Page):
    items: list[Event]


class Recorded(Answer):
    recorded: str = Field(description="the kind of the event recorded")


class RunSummary(Answer):
    name: str
    created_at: str
    last_good: dict | None = Field(description="id and step")
    checkpoints: dict[str, int]
    total_checkpoints: int
    bytes_stored: int
    pending: int
    recent_failures: int


class Overview(Page):
    items: list[RunSummary]
    failure_window_seconds: float


class LineageNode(Answer):
    id: int
    step: int
    status: str
    tier: str = Field(description="durable or memory (docs/memory-tier.md)")
    parent_id: int | None
    branch: int
    tags: list[Any]
    last_good: bool


class Lineage(Page):
    run: str
    last_good_id: int | None
    nodes: list[LineageNode]
    edges: list[dict] = Field(description="{from, to} checkpoint ids")
    branches: int


class RolledBack(Answer):
    target_id: int
    target_step: int
    suspect: list[int] = Field(description="the checkpoints the rollback marks suspect")
    last_good_id: int | None


class LaunchView(Answer):
    run: str
    attempt: str
    generation: int
    world_size: int
    registered_at: str
    current_generation: int
    fenced: bool


class RankHealth(Answer):
    rank: int
    state: str = Field(description="ok, hung, straggler, lost or missing")


class Health(Answer):
    run: str
    ranks: list[RankHealth]
    hung: list[int]
    stragglers: list[int]
    lost: list[int]
    missing: list[int]
    checked_at: str


class RetentionView(Answer):
    run: str
    retention: str = Field(description="the policy GC applies to the run")
    own: str | None = Field(description="the run's own policy; null: the service default")
    default: str


# ------------------------------------------------------------------ gc, tokens
class GCPlan(Answer):
    policy: str
    checkpoints: list[dict] = Field(description="what would be deleted, with the reason")
    orphans: list[Any]
    unknown: list[Any]
    bytes_freed: int
    runs: list[dict]


class GCResult(Answer):
    deleted: list[int]
    skipped: list[Any]
    orphans_deleted: int
    bytes_freed: int


class GCRun(Answer):
    plan: GCPlan
    dry_run: bool
    result: GCResult | None = Field(None, description="what was deleted (absent with dry_run)")


class GCPolicy(Answer):
    retention: str
    policies: list[dict]
    grace_seconds: float
    interval_seconds: float


class TokenView(Answer):
    id: int
    name: str
    role: str
    run_prefix: str | None


class TokenList(Answer):
    items: list[TokenView]


class TokenCreated(TokenView):
    token: str = Field(description="the secret: shown once, only its hash is stored")


class Revoked(Answer):
    id: int
    revoked: bool


# ------------------------------------------------------------------ data paths
class UploadGrant(Answer):
    already_present: bool = Field(description="the store holds these bytes already: nothing to upload")
    part_size: int
    parts: list[dict] = Field(description="each part's number and presigned URL")
    upload_id: str | None = Field(None, description="the multipart upload (absent when already present)")


class HandedOver(Answer):
    already_present: bool
    size: int
    xxh3_128: str


class ReadGrant(Answer):
    url: str = Field(description="a presigned GET of the file")
    size: int
    expires_in: float


class PeerAssignment(Answer):
    verification: str
    status: str = Field(description="the checkpoint's status; files only while PENDING")
    peer_rank: int
    peer_voted: bool
    files: list[dict] = Field(description="each file to read back: its name, size and where to read it")


class PeerReported(Answer):
    status: str
    verified: list[str]
    mismatched: list[str]


# ------------------------------------------------------------------ the memory tier (docs/memory-tier.md)
class AgentView(Answer):
    agent_id: int
    host: str
    rack: str
    switch: str
    address: str


class AgentRegistered(Answer):
    agent_id: int
    key: str = Field(description="the agent's key (64 hex digits), shown once; every later call sends it")


class AgentList(Answer):
    agents: list[AgentView]


class CopyReported(Answer):
    status: str = Field(description="the checkpoint's status after the report")


class MemoryCopies(Answer):
    tier: str
    replicas: int
    copies: list[dict] = Field(description="each file: rank, file, and the agents holding its declared bytes")


class LiveSegments(Answer):
    live: list[dict] = Field(description="the memory checkpoints (run, checkpoint_id) the agent keeps")


OK: dict[tuple[str, str], type[Answer]] = {
    ("get", "/healthz"): Healthz,
    ("get", "/api/v1/info"): InfoAnswer,
    ("get", "/api/v1/runs"): RunPage,
    ("get", "/api/v1/runs/{run}"): RunView,
    ("get", "/api/v1/runs/{run}/checkpoints"): CheckpointPage,
    ("get", "/api/v1/runs/{run}/last-good"): CheckpointView,
    ("get", "/api/v1/runs/{run}/events"): EventPage,
    ("post", "/api/v1/runs/{run}/events"): Recorded,
    ("get", "/api/v1/overview"): Overview,
    ("get", "/api/v1/runs/{run}/lineage"): Lineage,
    ("post", "/api/v1/runs/{run}/rollback"): RolledBack,
    ("post", "/api/v1/runs/{run}/launches"): LaunchView,
    ("get", "/api/v1/runs/{run}/launches/current"): LaunchView,
    ("get", "/api/v1/runs/{run}/health"): Health,
    ("get", "/api/v1/runs/{run}/retention"): RetentionView,
    ("put", "/api/v1/runs/{run}/retention"): RetentionView,
    ("get", "/api/v1/checkpoints/{checkpoint_id}"): CheckpointWithManifest,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/manifest"): Manifest,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/ancestors"): Ancestors,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/outcome"): Outcome,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/shards"): Shards,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/index/{file_name}"): TensorIndex,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/verify"): Verified,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/tags"): TagSet,
    ("delete", "/api/v1/checkpoints/{checkpoint_id}/tags/{name}"): TagRemoved,
    ("put", "/api/v1/checkpoints/{checkpoint_id}/pin"): Pinned,
    ("delete", "/api/v1/checkpoints/{checkpoint_id}/pin"): Pinned,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/leases"): Lease,
    ("delete", "/api/v1/leases/{lease_id}"): Released,
    ("get", "/api/v1/gc/plan"): GCPlan,
    ("post", "/api/v1/gc"): GCRun,
    ("get", "/api/v1/gc/policy"): GCPolicy,
    ("get", "/api/v1/tokens"): TokenList,
    ("post", "/api/v1/tokens"): TokenCreated,
    ("delete", "/api/v1/tokens/{token_id}"): Revoked,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/grants"): UploadGrant,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/direct-files"): HandedOver,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/read-grants/{file_name}"): ReadGrant,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check"): PeerAssignment,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check"): PeerReported,
    ("post", "/api/v1/agents"): AgentRegistered,
    ("get", "/api/v1/agents"): AgentList,
    ("get", "/api/v1/agents/{agent_id}/live"): LiveSegments,
    ("post", "/api/v1/checkpoints/{checkpoint_id}/copies"): CopyReported,
    ("get", "/api/v1/checkpoints/{checkpoint_id}/copies"): MemoryCopies,
}

# answers that are not JSON: a file's bytes
BYTES = {("get", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}")}


def document(app: FastAPI) -> None:
    """Have the app's OpenAPI document declare each route's success answer (OK, BYTES)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, ops in doc["paths"].items():
                for method, op in ops.items():
                    ok = next((c for c in op["responses"] if c.startswith("2")), None)
                    if ok is None or ok == "204":
                        continue
                    if (method, path) in BYTES:
                        op["responses"][ok]["content"] = {"application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}}}
                        continue
                    model = OK.get((method, path))
                    if model is None:
                        continue
                    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    schemas.update(body.pop("$defs", {}))
                    schemas[model.__name__] = body
                    op["responses"][ok]["content"] = {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
