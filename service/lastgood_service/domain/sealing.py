"""The keys that seal manifests (lastgood/wire/sealing.py owns the seal; this, the keys).

A manifest in the store counts as the service's own only if it is sealed by one of these
keys, which live outside the blob store: `rebuild` and the start-up check trust nothing else
(domain/repair.py). Where they come from, first match wins:

  LASTGOOD_MANIFEST_KEYS   "<id>:<hex>,<id>:<hex>,...": a deployment's secret (a Kubernetes
                           Secret or a compose secret exposed as the variable). The first
                           entry seals; every entry verifies.
  the key file             LASTGOOD_MANIFEST_KEY_FILE, default <data_dir>/manifest.keys, one
                           "<id>:<hex>" a line, the first seals. Generated (0600) on first
                           start when missing, so the embedded single-node service needs no
                           set-up; it must then be kept, and backed up, with the catalog.

Rotation: put a new entry first and keep the old ones listed for as long as checkpoints
sealed by them may need a rebuild (docs/security.md). A key is at least 32 random bytes.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from lastgood.wire import sealing

from ..settings import Settings

log = logging.getLogger("lastgood.sealing")


class ManifestKeyError(ValueError):
    """Manifest keys that cannot be used: the service refuses to start with them."""


def parse(text: str, source: str) -> list[tuple[str, bytes]]:
    """The "<id>:<hex>" entries of `text` (commas or new lines between them); ManifestKeyError with
    the reason, naming `source` but never a key."""
    out: list[tuple[str, bytes]] = []
    for n, entry in enumerate(e.strip() for e in text.replace("\n", ",").split(",")):
        if not entry or entry.startswith("#"):
            continue
        key_id, sep, hexkey = entry.partition(":")
        if not sep or not sealing.KEY_ID.fullmatch(key_id):
            raise ManifestKeyError(f"{source}: entry {n + 1} is not <id>:<hex> with an id of 1-32 characters "
                            f"from A-Z a-z 0-9 . _ -")
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            raise ManifestKeyError(f"{source}: key {key_id!r} is not hex") from None
        if len(key) < sealing.MIN_KEY_BYTES:
            raise ManifestKeyError(f"{source}: key {key_id!r} has {len(key)} bytes, fewer than {sealing.MIN_KEY_BYTES}")
        if any(key_id == k for k, _ in out):
            raise ManifestKeyError(f"{source}: key id {key_id!r} is listed twice")
        out.append((key_id, key))
    if not out:
        raise ManifestKeyError(f"{source}: no key")
    return out


def new_entry() -> str:
    """A fresh "<id>:<hex>" line: a random id, so that two generated keys never share one."""
    return f"k{secrets.token_hex(4)}:{secrets.token_hex(32)}"


@dataclass(frozen=True)
class ManifestKeys:
    entries: tuple[tuple[str, bytes], ...]  # the first seals
    source: str = "given"

    @property
    def sealing_id(self) -> str:
        return self.entries[0][0]

    @property
    def verifying(self) -> dict[str, bytes]:
        return dict(self.entries)

    def seal(self, unsealed: bytes) -> bytes:
        key_id, key = self.entries[0]
        return sealing.seal(unsealed, key_id, key)

    def unseal(self, body: bytes) -> tuple[bytes, str]:
        """(unsealed bytes, key id); sealing.Unsealed / Unauthenticated otherwise."""
        return sealing.unseal(body, self.verifying)

    @classmethod
    def generate(cls) -> "ManifestKeys":
        """A fresh key held in memory only (tests, tools)."""
        return cls.from_text(new_entry(), "generated")

    @classmethod
    def from_text(cls, text: str, source: str) -> "ManifestKeys":
        return cls(tuple(parse(text, source)), source)

    @classmethod
    def from_settings(cls, settings: Settings) -> "ManifestKeys":
        if settings.manifest_keys is not None:
            return cls.from_text(settings.manifest_keys.get_secret_value(), "LASTGOOD_MANIFEST_KEYS")
        path = settings.resolved_manifest_key_file()
        _outside_store(path, settings.resolved_blob_url())
        if not settings.resolved_catalog_url().startswith("sqlite"):
            log.warning("manifest keys from the key file %s with a shared catalog: every replica and every "
                        "`lastgood-service rebuild` needs the same keys; set LASTGOOD_MANIFEST_KEYS from a secret "
                        "(docs/security.md)", path)
        if not path.exists():
            _create(path)
        return cls.from_text(path.read_text(), str(path))


def _outside_store(path: Path, blob_url: str) -> None:
    """A key inside a local store's directory would be readable and writable by whoever can
    write the store (direct-FS writers): the one thing the seal must not depend on."""
    u = urlparse(blob_url)
    if u.scheme == "file":
        root = Path(u.path).resolve()
        if path == root or root in path.parents:
            raise ManifestKeyError(f"the manifest key file {path} lies inside the blob store ({root}); keep it "
                                   f"outside (LASTGOOD_MANIFEST_KEY_FILE) or set LASTGOOD_MANIFEST_KEYS")


def _create(path: Path) -> None:
    """Write the file whole under a temporary name, then link it into place: two services
    starting on one data directory both end up with the first one's key, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_entry() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
    finally:
        tmp.unlink(missing_ok=True)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    log.warning("generated a manifest key in %s: keep it (and back it up) with the catalog; without it "
                "`lastgood-service rebuild` cannot tell this store's manifests from planted ones", path)
