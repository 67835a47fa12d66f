"""`GET /api/v1/info`: what the service tells every client before its first save, typed.

The service builds one `Info` and sends `to_dict()`; the client reads the answer with
`Info.from_dict`, so each field's name, type and default is written here once. A field the
client does not know is kept in `extra` (a newer service); so is a verification mode it
does not know (the client then checks no peer's files, as for `service`). A data-path
offer (`spool`, `direct_fs`, `direct_s3`) it cannot read is dropped with a warning: the
client streams instead. Any other known field with a wrong type is refused
(`FormatError`), never guessed at.

The rules that follow from the terms live here too: `commit_timeout` (how long a rank
waits for its checkpoint's outcome) follows from the lease.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from lastgood.wire.errors import FormatError
from lastgood.wire.vocab import Verification

log = logging.getLogger("lastgood")
MiB = 1024 * 1024
DEFAULT_LEASE_SECONDS = 60.0   # a pending checkpoint with no rank activity for this long is abandoned
DEFAULT_CHUNK_BYTES = 4 * MiB  # largest chunk of one PutShard / GetShard message
# a rank waits for its checkpoint's outcome this long past two leases: the lease may run
# out once while the last rank is still sending, and the service decides within one more
COMMIT_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class SpoolOffer:
    """The service's same-host spool: its directory and id file's content; `follow`: it takes
    a file while it is written (a followed hand-over)."""
    dir: str
    id: str
    follow: bool = False


@dataclass(frozen=True)
class DirectFSOffer:
    """A local store that trainers may mount and write in place: its root as the service sees
    it, the staging directory under it, and the staging directory's id."""
    dir: str
    staging: str
    id: str


@dataclass(frozen=True)
class DirectS3Offer:
    """Direct uploads to an S3 store: the part size, the most parts, the part checksum, and
    how long a grant lasts."""
    part_size: int
    max_parts: int
    checksum: str
    grant_seconds: float


@dataclass(frozen=True)
class Info:
    grpc_target: str
    service: str = "lastgood"
    version: str = ""
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_shard_bytes: int | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    verification: Verification = Verification.SERVICE
    range_block_bytes: int | None = None    # writers that upload directly declare digests by it
    max_request_bytes: int | None = None    # a hand-over that would not fit drops its digests
    inline_bytes: int = 0                   # small files' bytes one vote may carry (0: none: stream them)
    spool: SpoolOffer | None = None
    direct_fs: DirectFSOffer | None = None
    direct_s3: DirectS3Offer | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # fields this client does not know

    @property
    def commit_timeout(self) -> float:
        """How long a rank waits for its checkpoint's outcome after its vote."""
        return 2 * float(self.lease_seconds) + COMMIT_GRACE_SECONDS

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        del out["extra"]
        out["verification"] = self.verification.value
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Info":
        if not isinstance(d, dict):
            raise FormatError(f"/api/v1/info: expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        args = {k: v for k, v in d.items() if k in known and v is not None}
        extra = {k: v for k, v in d.items() if k not in known}
        mode = _typed(args, "verification", str, cls.verification.value)
        if mode not in {m.value for m in Verification}:
            extra["verification"] = mode
            mode = cls.verification.value
        offers = {}
        for name, kind in (("spool", SpoolOffer), ("direct_fs", DirectFSOffer), ("direct_s3", DirectS3Offer)):
            try:
                offers[name] = _offer(kind, args.get(name))
            except FormatError as e:
                log.warning("lastgood: the %s offer: %s; that data path is not used", name, e)
                offers[name] = None
        return cls(
            grpc_target=_typed(args, "grpc_target", str, required=True),
            service=_typed(args, "service", str, cls.service),
            version=_typed(args, "version", str, cls.version),
            max_chunk_bytes=_typed(args, "max_chunk_bytes", int, cls.max_chunk_bytes),
            max_shard_bytes=_typed(args, "max_shard_bytes", int),
            lease_seconds=float(_typed(args, "lease_seconds", (int, float), cls.lease_seconds)),
            verification=Verification(mode),
            range_block_bytes=_typed(args, "range_block_bytes", int),
            max_request_bytes=_typed(args, "max_request_bytes", int),
            inline_bytes=_typed(args, "inline_bytes", int, cls.inline_bytes),
            **offers,
            extra=extra,
        )


_TYPES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def _typed(args: dict, name: str, kind, default=None, required: bool = False):
    if name not in args:
        if required:
            raise FormatError(f"/api/v1/info: {name} is missing")
        return default
    value = args[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise FormatError(f"/api/v1/info: {name} must be {getattr(kind, '__name__', 'a number')}, "
                          f"got {type(value).__name__}")
    return value


def _offer(cls, d: Any):
    """One of the optional sections, or None where the service offers none."""
    if d is None or d is False:
        return None
    if not isinstance(d, dict):
        raise FormatError(f"/api/v1/info: {cls.__name__} must be an object, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = {}
    for name, f in fields.items():
        kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
        default = f.default if f.default is not dataclasses.MISSING else None
        value = _typed(d, name, kind, default, required=f.default is dataclasses.MISSING)
        args[name] = float(value) if f.type == "float" else value
    return cls(**args)
