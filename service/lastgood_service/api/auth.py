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

from ..domain.errors import PermissionDenied
from ..domain.tokens import ADMIN, READER, WRITER, Principal, TokenStore

PUBLIC = "public"
_CONVERTER = re.compile(r"\{(\w+):\w+\}")

POLICY: dict[tuple[str, str], str | tuple[str, str]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/api/v1/info"): PUBLIC,           # where the gRPC endpoint is; no data
    ("GET", "/"): PUBLIC,                      # the web page; its API calls carry tokens
    ("GET", "/metrics"): (READER, "global"),
    ("GET", "/api/v1/runs"): (READER, "list"),
    ("GET", "/api/v1/runs/{run}"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/checkpoints"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/last-good"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/events"): (READER, "run"),
    ("GET", "/api/v1/runs/{run}/lineage"): (READER, "run"),
    ("POST", "/api/v1/runs/{run}/rollback"): (WRITER, "run"),
    ("POST", "/api/v1/runs/{run}/events"): (WRITER, "run"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/manifest"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ancestors"): (READER, "checkpoint"),
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"): (READER, "checkpoint"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/verify"): (READER, "checkpoint"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/leases"): (READER, "checkpoint"),
    ("DELETE", "/api/v1/leases/{lease_id}"): (READER, "lease"),
    ("POST", "/api/v1/checkpoints/{checkpoint_id}/tags"): (ADMIN, "checkpoint"),
    ("DELETE", "/api/v1/checkpoints/{checkpoint_id}/tags/{name}"): (ADMIN, "checkpoint"),
    ("PUT", "/api/v1/checkpoints/{checkpoint_id}/pin"): (ADMIN, "checkpoint"),
    ("DELETE", "/api/v1/checkpoints/{checkpoint_id}/pin"): (ADMIN, "checkpoint"),
    ("GET", "/api/v1/overview"): (READER, "list"),     # every run's health, filtered to the token's scope
    ("GET", "/api/v1/checkpoints/{checkpoint_id}/shards"): (READER, "checkpoint"),
    ("GET", "/api/v1/gc/policy"): (READER, "global"),
    ("GET", "/api/v1/gc/plan"): (READER, "global"),
    ("POST", "/api/v1/gc"): (ADMIN, "global"),
    ("GET", "/api/v1/tokens"): (ADMIN, "global"),
    ("POST", "/api/v1/tokens"): (ADMIN, "global"),
    ("DELETE", "/api/v1/tokens/{token_id}"): (ADMIN, "global"),
}


def make_authorizer(tokens: TokenStore, run_of_checkpoint: Callable[[int], str],
                    run_of_lease: Callable[[int], str]):
    """The app-wide dependency: authenticate, then check role and scope from POLICY."""

    def authorize(request: Request) -> None:
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
        params = request.path_params
        run = None
        if scope == "run":
            run = params["run"]
        elif scope in ("checkpoint", "lease"):
            raw = params["checkpoint_id" if scope == "checkpoint" else "lease_id"]
            if not raw.isdigit() or len(raw) > 18:
                return  # not an id: the route's validation answers 422 and the handler never runs
            run = (run_of_checkpoint if scope == "checkpoint" else run_of_lease)(int(raw))
        elif scope == "global":
            raise PermissionDenied(f"token {principal.name!r} is limited to runs starting with "
                                   f"{principal.run_prefix!r}; this operation spans every run")
        tokens.require(principal, role, run)

    return authorize
