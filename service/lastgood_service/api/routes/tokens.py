"""API tokens: list, create, revoke (admin only; api/auth.py)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from lastgood.wire import names

from ..contract import StrictJSONRoute, answers
from ...domain.tokens import ROLES
from ..deps import Id, TokensDep

router = APIRouter(route_class=StrictJSONRoute, tags=["tokens"])


class TokenBody(BaseModel):
    name: str = Field(description="who or what holds it, e.g. 'trainer gpt-small'",
                      json_schema_extra={"minLength": 1, "maxLength": 128})
    role: str = Field(description="reader, writer or admin", json_schema_extra={"enum": list(ROLES)})
    run_prefix: str | None = Field(None, description="limit the token to runs whose names start with this",
                                   json_schema_extra=names.SCHEMA["run"])


@router.get("/api/v1/tokens", responses=answers(params=False))
def list_tokens(tokens: TokensDep):
    """Every token: id, name, role, run scope, when made and revoked (never the secret)."""
    return {"items": tokens.list()}


@router.post("/api/v1/tokens", responses=answers(400, 413))
def create_token(body: TokenBody, tokens: TokensDep):
    """The token is in the answer, once: only its hash is stored."""
    return tokens.create(body.name, body.role, body.run_prefix)


@router.delete("/api/v1/tokens/{token_id}", responses=answers(404))
def revoke_token(token_id: Id, tokens: TokensDep):
    """Revoke a token: it is refused from the next call on."""
    return tokens.revoke(token_id)
