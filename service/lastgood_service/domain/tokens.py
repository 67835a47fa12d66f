"""API tokens: roles, run-prefix scopes, hashed secrets, and who may do what.

A token reads `lg_<id>_<secret>`: the id finds the row, and the SHA-256 of the 32-byte
random secret is compared in constant time (a high-entropy secret needs no slow hash).
Only the hash is stored; the token is shown once, at creation. Roles are ordered:
reader (list, lineage, download, UI) < writer (trainers: begin, put, commit, restore,
rollback) < admin (tags, GC, deletion, tokens). A scope limits a token to the runs whose
names start with its prefix.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from lastgood.wire import names

from ..catalog.models import Token, utcnow
from .errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated

READER, WRITER, ADMIN = "reader", "writer", "admin"
ROLES = (READER, WRITER, ADMIN)
_RANK = {READER: 0, WRITER: 1, ADMIN: 2}
CACHE_SECONDS = 2.0  # a revocation takes effect on every replica within this


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    run_prefix: str | None = None

    def can(self, role: str) -> bool:
        return _RANK[self.role] >= _RANK[role]

    def may_access(self, run: str) -> bool:
        return self.run_prefix is None or run.startswith(self.run_prefix)


ANONYMOUS_ADMIN = Principal("anonymous (auth off)", ADMIN)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    def __init__(self, sessions: sessionmaker[Session], required: bool, bootstrap_admin: str | None = None) -> None:
        self.sessions = sessions
        self.required = required
        self._bootstrap = _hash(bootstrap_admin) if bootstrap_admin else None
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- authentication
    def authenticate(self, header: str | None) -> Principal:
        """The principal behind an `Authorization` header value (or raise Unauthenticated)."""
        if not self.required and not header:
            return ANONYMOUS_ADMIN
        if not header:
            raise Unauthenticated("this service requires a token: send 'Authorization: Bearer <token>'")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <token>'")
        token = token.strip()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token)
        if hit is not None and now - hit[0] < CACHE_SECONDS:
            principal = hit[1]
        else:
            principal = self._lookup(token)
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[token] = (now, principal)
        if principal is None:
            raise Unauthenticated("unknown or revoked token")
        return principal

    def _lookup(self, token: str) -> Principal | None:
        if self._bootstrap and hmac.compare_digest(_hash(token), self._bootstrap):
            return Principal("bootstrap admin", ADMIN)
        parts = token.split("_")
        if len(parts) != 3 or parts[0] != "lg" or not parts[1].isdigit() or len(parts[1]) > 18:
            return None
        with self.sessions() as s, s.begin():
            row = s.get(Token, int(parts[1]))
            if row is None or row.revoked_at is not None or not hmac.compare_digest(_hash(parts[2]), row.secret_hash):
                return None
            return Principal(row.name, row.role, row.run_prefix)

    @staticmethod
    def require(principal: Principal, role: str, run: str | None = None) -> None:
        if not principal.can(role):
            raise PermissionDenied(f"token {principal.name!r} is a {principal.role}; this needs {role}")
        if run is not None and not principal.may_access(run):
            raise PermissionDenied(f"token {principal.name!r} is limited to runs starting with "
                                   f"{principal.run_prefix!r}")

    # ---------------------------------------------------------------- management
    def create(self, name: str, role: str, run_prefix: str | None = None) -> dict:
        if role not in ROLES:
            raise InvalidArgument(f"role must be one of {', '.join(ROLES)}")
        if not 1 <= len(name) <= 128:
            raise InvalidArgument("a token name is 1-128 characters")
        if run_prefix is not None:
            try:
                names.check_run_name(run_prefix)
            except names.InvalidName as e:
                raise InvalidArgument(f"scope: {e}") from None
        secret = secrets.token_urlsafe(32).replace("_", "-")
        with self.sessions() as s, s.begin():
            row = Token(name=name, role=role, run_prefix=run_prefix, secret_hash=_hash(secret), created_at=utcnow())
            s.add(row)
            s.flush()
            return {"id": row.id, "name": name, "role": role, "run_prefix": run_prefix,
                    "token": f"lg_{row.id}_{secret}"}

    def revoke(self, token_id: int) -> dict:
        with self.sessions() as s, s.begin():
            row = s.get(Token, token_id)
            if row is None:
                raise NotFound(f"token {token_id} does not exist")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
        with self._lock:
            self._cache.clear()  # this replica forgets at once; others within CACHE_SECONDS
        return {"id": token_id, "revoked": True}

    def list(self) -> list[dict]:
        with self.sessions() as s, s.begin():
            return [{"id": t.id, "name": t.name, "role": t.role, "run_prefix": t.run_prefix,
                     "created_at": t.created_at.isoformat(),
                     "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None}
                    for t in s.scalars(select(Token).order_by(Token.id))]
