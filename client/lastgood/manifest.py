"""The manifest: the one document that makes a checkpoint complete.

The service writes it (canonical JSON, so the same checkpoint always yields the same
bytes) before the commit transaction; clients read it to find and verify every file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

FORMAT = "lastgood.manifest/1"


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh3_128: str
    data_start: int | None = None           # safetensors data section start, when indexed
    tensors: dict[str, dict] | None = None  # name -> {dtype, shape, offsets}

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "size": self.size, "xxh3_128": self.xxh3_128}
        if self.tensors is not None:
            d["data_start"] = self.data_start
            d["tensors"] = self.tensors
        return d


@dataclass(frozen=True)
class Manifest:
    checkpoint_id: int
    run: str
    step: int
    attempt: str
    world_size: int
    parent_id: int | None
    ranks: dict[int, list[FileEntry]] = field(default_factory=dict)
    # the launch generation that committed it (0: a client that never registered). Written
    # only when set, so a manifest of an unfenced checkpoint keeps its bytes; a rebuild of the
    # catalog from the store reads it to fence the launches the lost catalog knew about.
    generation: int = 0

    def files(self, rank: int) -> list[FileEntry]:
        return self.ranks.get(rank, [])

    def total_bytes(self) -> int:
        return sum(f.size for fs in self.ranks.values() for f in fs)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "checkpoint_id": self.checkpoint_id,
            "run": self.run,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "parent_id": self.parent_id,
            **({"generation": self.generation} if self.generation else {}),
            "ranks": [
                {"rank": r, "files": [f.to_dict() for f in sorted(self.ranks[r], key=lambda f: f.name)]}
                for r in sorted(self.ranks)
            ],
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}")
        ranks = {
            int(r["rank"]): [
                FileEntry(f["name"], int(f["size"]), f["xxh3_128"], f.get("data_start"), f.get("tensors"))
                for f in r["files"]
            ]
            for r in d["ranks"]
        }
        return cls(int(d["checkpoint_id"]), d["run"], int(d["step"]), d["attempt"],
                   int(d["world_size"]), d.get("parent_id"), ranks, int(d.get("generation") or 0))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        return cls.from_dict(json.loads(data))
