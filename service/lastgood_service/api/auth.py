"""Who may call which REST route: one table, checked before every handler.

Every route has an entry: PUBLIC, or (role, scope). The scope says which run the call
touches, so that a token limited to a run prefix can be checked: "run" (the {run} path
parameter), "checkpoint" (the run of {checkpoint_id}), "lease" (the run of the lease's
checkpoint), "list" (a listing, filtered to the token's prefix by the handler) and
"global" (whole-service operations: only unscoped tokens). A route missing from the table
is admin-only, and the auth test matrix fails until it is added here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from fastapi.dependencies.utils import request_params_to_args

from ..domain.errors import PermissionDenied
from ..domain.tokens import ADMIN, READER, WRITER, Principal, TokenStore

PUBLIC = "public"
_CONVERTER = re.compile(r"\{(\w+):\w+\}")

POLICY: dict[tuple[str, str], str | tuple[str, str]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/api/v1/info"): PUBLIC,           # where the gRPC endpoint is; no data
    ("GET", "/"): PUBLIC,                      # the web page (and /static/*); its API calls carry tokens
    ("GET", "/openapi.json"): PUBLIC,          # the API's shape, the same for every deployment; no data
    ("GET", "/metrics"): (READER, "global"),
    ("GET", "/api/v1/runs"): (READER, "list"),
    ("GET", "/api/v1/runs/{run}"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/checkpoints"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/last-good"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/events"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/lineage"): (READER, "run"),
    ("POST", "/api/v1/runs/{run}/rollback"): (WRITER, "run"),
    ("POST", "/api/v1/runs/{run}/events"): (WRITER, "run"),
    ("POST", "/api/v1/runs/{run}/launches"): (WRITER, "run"),
    ("GET", "/api/v1/runs/{run}/launches/current"): (READER, "run"),
    ("POST", "/api/v1/runs/{run}/heartbeats"): (WRITER, "run"),
    ("GET", "/api/v1/runs/{run}/health"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/retention"): (READER, "run"),
    ("PUT", "/api/v1/runs/{run}/retention"): (WRITER, "run"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/manifest"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/outcome"): (READER, "checkpoint"),  # a voted rank waits here
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ancestors"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check"): (WRITER, "checkpoint"),  # a saving rank
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/peer-check"): (WRITER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/index/{file_name}"): (READER, "checkpoint"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/verify"): (READER, "checkpoint"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/leases"): (READER, "checkpoint"),
    ("DELETE", "/api/v1/leases/{lease_id}"): (READER, "lease"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/tags"): (ADMIN, "checkpoint"),
    ("DELETE", "/api/v1/checkpoints/{checkpoint_id}/tags/{name}"): (ADMIN, "checkpoint"),
    ("PUT", "/api/v1/checkpoints/{checkpoint_id}/pin"): (ADMIN, "checkpoint"),
    ("DELETE", "/api/v1/checkpoints/{checkpoint_id}/pin"): (ADMIN, "checkpoint"),
    ("GET", "/api/v1/overview"): (READER, "list"),     # every run's health, filtered to the token's scope
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/shards"): (READER, "checkpoint"),
    # direct S3 uploads (api/routes/grants.py): a grant names keys of this checkpoint alone
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/grants"): (WRITER, "checkpoint"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/direct-files"): (WRITER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/read-grants/{file_name}"): (READER, "checkpoint"),
    # the memory tier's node agents (api/routes/agents.py): they serve every run of their node,
    # so only unscoped tokens register and list them; an agent's own calls carry its key too
    ("POST", "/api/v1/agents"): (WRITER, "global"),
    ("GET", "/api/v1/agents"): (READER, "global"),
    ("GET", "/api/v1/agents/{agent_id}/live"): (READER, "global"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/copies"): (WRITER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/copies"): (READER, "checkpoint"),
    ("GET", "/api/v1/gc/policy"): (READER, "global"),
    ("GET", "/api/v1/gc/plan"): (READER, "list"),      # the runs of the token's scope (full=true: unscoped)
    ("POST", "/api/v1/gc"): (ADMIN, "global"),
    ("GET", "/api/v1/tokens"): (ADMIN, "global"),
    ("POST", "/api/v1/tokens"): (ADMIN, "global"),
    ("DELETE", "/api/v1/tokens/{token_id}"): (ADMIN, "global"),
}


def parsed_path_params(request: Request) -> dict | None:
    """The path parameters exactly as the handler will receive them, or None if they do not
    validate. Scope checks must use these, never the raw segments: pydantic reads `+8`,
    `%208`, `8.0`, `0_8` and `8%0A` as checkpoint 8, and a check on the raw text that let
    those through reached other runs (issue 10). Parsing with the route's own fields keeps
    one definition of what an id is."""
    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is None:
        return None
    values, errors = request_params_to_args(dependant.path_params, request.path_params)
    return None if errors else values


def make_authorizer(tokens: TokenStore, run_of_checkpoint: Callable[[int], str],
                    run_of_lease: Callable[[int], str]):
    """The app-wide dependency: authenticate, then check role and scope from POLICY."""

    async def authorize(request: Request) -> None:
        # A caller without a token on a service that requires none is the anonymous admin:
        # checking it reads nothing, so it runs on the event loop. Anything else may read the
        # catalog (a token not cached, a scoped token's run) and runs in the thread pool:
        # a thread hop per request, which 1,024 ranks waiting for an outcome at once would feel.
        if not tokens.required and not request.headers.get("authorization"):
            return check(request)
        return await run_in_threadpool(check, request)

    def check(request: Request) -> None:
        route = request.scope.get("route")
        template = _CONVERTER.sub(r"{\1}", getattr(route, "path", ""))  # {name:path} -> {name}, as in OpenAPI
        policy = POLICY.get((request.method, template), (ADMIN, "global"))
        if policy == PUBLIC:
            return
        role, scope = policy
        principal: Principal = tokens.authenticate(request.headers.get("authorization"))
        request.state.principal = principal
        tokens.require(principal, role)  # no lookups for callers without the role
        if principal.run_prefix is None:
            return  # unscoped: every run
        run = None
        if scope in ("run", "checkpoint", "lease"):
            params = parsed_path_params(request)
            if params is None:  # fail closed: a scoped token never reaches a run it cannot name
                raise PermissionDenied(f"token {principal.name!r} is limited to runs starting with "
                                       f"{principal.run_prefix!r}, and this path names no valid run or id")
            if scope == "run":
                run = params["run"]
            else:
                lookup = run_of_checkpoint if scope == "checkpoint" else run_of_lease
                run = lookup(params["checkpoint_id" if scope == "checkpoint" else "lease_id"])
        elif scope == "global":
            raise PermissionDenied(f"token {principal.name!r} is limited to runs starting with "
                                   f"{principal.run_prefix!r}; this operation spans every run")
        tokens.require(principal, role, run)

    return authorize
