"""What a REST handler is given: the service's parts as typed FastAPI dependencies, and the
path, query and header parameters several routes share.

`create_app` puts the `AppContext` on `app.state`; a handler names the part it needs
(`commits: CommitsDep`), so a router is a plain module with nothing captured in a closure,
and a test can build an app on any context. None of these parameters reaches the OpenAPI
document: they are read from the request, not from the caller's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Path, Query, Request

from lastgood.wire import names
from lastgood.wire.codes import GENERATION_HEADER

from ..domain.commit import CommitService
from ..domain.runs.curation import Curator
from ..domain.errors import Unavailable
from ..domain.gc import GarbageCollector
from ..domain.health.heartbeats import Health
from ..domain.commit.outcomes import OutcomeNotifier
from ..domain.queries import MAX_PAGE, Queries
from ..domain.dataplane.directfs import DirectFS
from ..domain.dataplane.spool import Spool
from ..domain.tokens import TokenStore
from ..domain.peer.verification_modes import PeerChecks
from ..metrics import Metrics
from ..settings import Settings


@dataclass
class AppContext:
    commits: CommitService
    queries: Queries
    grpc_target: str
    curator: Curator
    gc: GarbageCollector
    tokens: TokenStore
    metrics: Metrics | None = None
    spool: Spool | None = None
    health: Health | None = None
    outcomes: OutcomeNotifier | None = None  # GET .../outcome (routes/outcomes.py); one per process
    # the direct-FS data path (domain/dataplane/directfs.py), announced at /api/v1/info
    direct_fs: DirectFS | None = None
    peer_checks: PeerChecks | None = None  # peer verification (domain/peer/verification_modes.py); one per process


# The lookups below are `async def` although they await nothing: FastAPI runs a plain `def`
# dependency in its thread pool, a thread hop per dependency per request, which at 1,024
# ranks asking for their outcome at once costs the event loop more than the answers do
# (docs/control-plane.md). An attribute read needs no thread.
async def context(request: Request) -> AppContext:
    return request.app.state.ctx


Ctx = Annotated[AppContext, Depends(context)]


async def _commits(ctx: Ctx) -> CommitService:
    return ctx.commits


async def _queries(ctx: Ctx) -> Queries:
    return ctx.queries


async def _curator(ctx: Ctx) -> Curator:
    return ctx.curator


async def _gc(ctx: Ctx) -> GarbageCollector:
    return ctx.gc


async def _tokens(ctx: Ctx) -> TokenStore:
    return ctx.tokens


async def _health(ctx: Ctx) -> Health:
    if ctx.health is None:  # an app built without it (a test's context): the routes exist, the part does not
        raise Unavailable("run health is not served by this app")
    return ctx.health


async def outcomes_of(ctx: AppContext) -> OutcomeNotifier:
    """The process's one notifier (main.Service); an app built without one (a test's
    context) gets its own, told of the commits made through its CommitService. On the event
    loop: no race creating it. Called by the outcome route itself, not as a dependency:
    every rank of a job asks there at once, and each dependency is one more solve per
    request on the event loop (docs/control-plane.md)."""
    if ctx.outcomes is None:
        ctx.outcomes = OutcomeNotifier(ctx.commits.sessions, ctx.commits.settings.outcome_poll_interval)
        ctx.commits.listeners.append(ctx.outcomes.poke)
    return ctx.outcomes


async def _settings(ctx: Ctx) -> Settings:
    return ctx.commits.settings


CommitsDep = Annotated[CommitService, Depends(_commits)]
QueriesDep = Annotated[Queries, Depends(_queries)]
CuratorDep = Annotated[Curator, Depends(_curator)]
GCDep = Annotated[GarbageCollector, Depends(_gc)]
TokensDep = Annotated[TokenStore, Depends(_tokens)]
SettingsDep = Annotated[Settings, Depends(_settings)]
HealthDep = Annotated[Health, Depends(_health)]

Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
Offset = Annotated[int, Query(ge=0, le=names.MAX_ID)]
Id = Annotated[int, Path(ge=1, le=names.MAX_ID)]  # checkpoint, lease and token ids
CkptId = Id
# the name rules (lastgood.wire.names) in the OpenAPI document: a name built from the schema is
# accepted; the handlers' checks still refuse any other (400)
RunName = Annotated[str, Path(description="a run name", json_schema_extra=names.SCHEMA["run"])]
FileName = Annotated[str, Path(description="a shard file name", json_schema_extra=names.SCHEMA["file"])]
# the caller's launch generation on the curation routes: an older one than the run's newest is refused
# (int, not int | None: the header is absent or an integer, and the schema says so; a "null"
# alternative would have clients send the text "null")
Generation = Annotated[int, Header(alias=GENERATION_HEADER, ge=0, le=names.MAX_ID)]


def run_prefix(request: Request) -> str | None:
    """The caller's token scope on a listing route (api/auth.py put the principal there)."""
    principal = getattr(request.state, "principal", None)
    return getattr(principal, "run_prefix", None)
