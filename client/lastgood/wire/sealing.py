"""The manifest's MAC: what makes a manifest in the store the service's own.

The blob store is not trusted to say which checkpoints committed: anyone who can write to it
(a direct-FS writer under a local store's root, a leaked bucket credential) could plant a
manifest whose id, run, step and nonce are computed from public fields. So the service seals
every manifest it writes with a key it holds outside the store, and `rebuild` and the
start-up check accept only sealed ones (docs/format.md §6, docs/security.md).

A sealed manifest is the unsealed one (Manifest.to_bytes(), canonical JSON) with one more
member, `auth`:

    {"alg": "hmac-sha256", "key_id": "<id>", "mac": "<64 hex>"}

where mac = HMAC-SHA256(key, "lastgood.manifest-mac/1" NUL key_id NUL unsealed bytes). The
MAC covers the canonical bytes of every other member, so a reader that drops `auth` and
re-encodes canonically gets back exactly what was sealed; the key id is inside the MAC, so a
seal cannot be moved to another key. Readers that do not check seals ignore `auth` (unknown
members are ignored, §11). HMAC from the standard library: nothing to install, constant-time
comparison included.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping

from lastgood.wire import jsonvalues

AUTH = "auth"
MAC_ALG = "hmac-sha256"
_DOMAIN = b"lastgood.manifest-mac/1"
# a manifest is O(ranks): ~150 bytes per file; a blob claiming to be one that is larger is
# not read (65,536 ranks x 16 files fit many times over)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")
MIN_KEY_BYTES = 32


class Unauthenticated(ValueError):
    """A manifest the service cannot prove it wrote: no seal, an unknown key, a wrong MAC."""


class Unsealed(Unauthenticated):
    """A manifest with no seal at all: written by a service older than seals, or planted."""


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def mac(key_id: str, key: bytes, unsealed: bytes) -> str:
    return hmac.new(key, _DOMAIN + b"\0" + key_id.encode() + b"\0" + unsealed, hashlib.sha256).hexdigest()


def seal(unsealed: bytes, key_id: str, key: bytes) -> bytes:
    """The bytes the service stores for a manifest (`unsealed`: Manifest.to_bytes())."""
    d = json.loads(unsealed)
    if AUTH in d:
        raise ValueError("the manifest is sealed already")
    d[AUTH] = {"alg": MAC_ALG, "key_id": key_id, "mac": mac(key_id, key, unsealed)}
    return _canonical(d)


def content(body: bytes) -> bytes | None:
    """What `body` says without its seal, checked by nothing (None if it is no JSON object):
    for a writer comparing what it finds with what it would write, never for trust."""
    try:
        d = jsonvalues.loads(body) if len(body) <= MAX_MANIFEST_BYTES else None
    except jsonvalues.InvalidJSON:
        return None
    if not isinstance(d, dict):
        return None
    d.pop(AUTH, None)
    return _canonical(d)


def unseal(body: bytes, keys: Mapping[str, bytes]) -> tuple[bytes, str]:
    """(the unsealed bytes, the key id) of a manifest sealed by one of `keys` (id -> key);
    Unsealed if it carries no seal, Unauthenticated for any other failure. Bounded: a body
    over MAX_MANIFEST_BYTES, or JSON nested deeper than the wire allows, is refused unread."""
    if len(body) > MAX_MANIFEST_BYTES:
        raise Unauthenticated(f"{len(body)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit of a manifest")
    try:
        d = jsonvalues.loads(body)
    except jsonvalues.InvalidJSON as e:
        raise Unauthenticated(f"not a manifest: {e}") from None
    if not isinstance(d, dict):
        raise Unauthenticated("not a manifest: not a JSON object")
    auth = d.pop(AUTH, None)
    if auth is None:
        raise Unsealed("the manifest carries no seal")
    if (not isinstance(auth, dict) or auth.get("alg") != MAC_ALG or not isinstance(auth.get("key_id"), str)
            or not isinstance(auth.get("mac"), str)):
        raise Unauthenticated(f"the manifest's seal is not {MAC_ALG} {{key_id, mac}}")
    key_id = auth["key_id"]
    key = keys.get(key_id)
    if key is None:
        raise Unauthenticated(f"sealed with key {key_id[:40]!r}, which is not among the service's manifest keys")
    unsealed = _canonical(d)
    if not hmac.compare_digest(mac(key_id, key, unsealed), auth["mac"]):
        raise Unauthenticated(f"the manifest's MAC does not match key {key_id!r}: altered, or forged")
    return unsealed, key_id
