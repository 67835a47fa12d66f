"""The catalog gate: closed while the catalog is behind the blob store (domain/repair.py
finds that at start-up), so that nothing is written or handed out as last-good from a
catalog that lost acknowledged commits."""

from __future__ import annotations

from .errors import CatalogBehind

REBUILD_COMMAND = "lastgood-service rebuild"


class CatalogGate:
    """Whether the service may write: closed while the catalog is behind the store."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def close(self, lost_ids: list[int]) -> None:
        ids = sorted(lost_ids)
        shown = ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
        self.reason = (f"the catalog is behind the blob store: it lacks {len(ids)} committed checkpoint(s) "
                       f"({shown}); writes and last-good look-ups wait until an operator runs "
                       f"`{REBUILD_COMMAND}` (with the service's settings) and restarts the service")

    def check(self) -> None:
        if self.reason:
            raise CatalogBehind(self.reason)
