"""The peer-check credential (LASTGOOD_VERIFICATION=peer): what proves a peer check comes from
the rank assigned to it.

A rank's vote carries `commitment(secret)`, the SHA-256 of a secret only that rank holds
(CommitRankRequest.peer_key); its peer-check requests send the secret itself in the
`HEADER` header. The service accepts a check of rank r's assignment only with the secret
whose commitment rank r's vote carried, so no other rank of the job - all of them hold the
same token - can file rank r's report. The rule's one owner on both sides: the service
checks (domain/peer/verification_modes.py), the client draws (`rank_secret`) and sends
(the transports' commit_rank, peer_assignment and peer_report)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

HEADER = "X-Lastgood-Peer-Key"
SECRET_BYTES = 32
_SECRET = re.compile(r"^[0-9a-f]{64}$")
_COMMITMENT = _SECRET  # both 64 lowercase hex digits


def commitment(secret: str) -> str:
    """What a vote carries for `secret` (64 hex digits)."""
    return hashlib.sha256(bytes.fromhex(secret)).hexdigest()


def is_secret(value: str) -> bool:
    return bool(_SECRET.match(value))


def is_commitment(value: str) -> bool:
    return bool(_COMMITMENT.match(value))


def matches(secret: str | None, committed: str | None) -> bool:
    """Does `secret` open the commitment a vote carried (constant time)?"""
    if not secret or not committed or not is_secret(secret):
        return False
    return hmac.compare_digest(commitment(secret), committed)


# drawn once per process: a rank's secret for a checkpoint is the same however many transports
# (reconnects) its save uses, and no other process can compute it
_PROCESS_KEY = secrets.token_bytes(SECRET_BYTES)


def rank_secret(checkpoint_id: int, rank: int) -> str:
    """This process's peer-check secret for `rank` of the checkpoint (64 hex digits)."""
    return hmac.new(_PROCESS_KEY, f"{int(checkpoint_id)}:{int(rank)}".encode(), hashlib.sha256).hexdigest()
