"""One typed settings object, built in `main` and passed down. Nothing connects at import.

The settings sit below the domain, which reads them, and above the catalog and the blob
stores, which know nothing of them (.importlinter, service-layers): a value whose rule
the domain owns (the retention policy) is checked by main.py at start, not here."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lastgood.wire.info import DEFAULT_CHUNK_BYTES, DEFAULT_LEASE_SECONDS
from lastgood.wire.vocab import Verification
from lastgood.wire.s3parts import MAX_PART_SIZE, MIN_PART_SIZE  # S3's bounds, one place

from .failpoints import Failpoint

MiB = 1024 * 1024
INLINE_BYTES = 1 * MiB  # a vote's files: the default of inline_bytes


def _default_migrations_dir() -> Path:
    # The Alembic environment ships inside the package (its package data), so an installed
    # service migrates its catalog with nothing else at hand.
    return Path(__file__).resolve().parent / "migrations"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LASTGOOD_", extra="ignore")

    data_dir: Path = Field(Path("data"), description="holds the embedded catalog and blob store")
    catalog_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///<data_dir>/catalog.db")
    blob_url: str | None = Field(None, description="blob store URL; default file://<data_dir>/blobs")
    s3_access_key: str | None = Field(None, description="access key of an s3:// blob store (never in the URL)")
    s3_secret_key: SecretStr | None = Field(None, description="secret key of an s3:// blob store (never in the URL)")

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(50051, description="0 picks a free port")
    grpc_advertise: str | None = Field(None, description="host:port clients dial; default grpc_host:bound port")
    grpc_workers: int = Field(64, ge=4, description="threads serving gRPC calls")
    grpc_stream_window: int = Field(8 * MiB, ge=0, description="bytes of one stream gRPC buffers ahead of the "
                                    "service (a fixed HTTP/2 window); 0: gRPC's own, grown by BDP probing")
    malloc_arena_max: int = Field(2, ge=0, description="glibc malloc arenas (mallopt M_ARENA_MAX, unless "
                                  "MALLOC_ARENA_MAX is set); 0: glibc's default")

    lease_seconds: float = Field(DEFAULT_LEASE_SECONDS, gt=0, description="a pending checkpoint with no rank activity for this long is ABANDONED")
    reaper_interval: float = Field(1.0, gt=0, description="the shortest time between two passes of the lease "
                                   "reaper, which looks for expired leases only once the earliest pending lease can "
                                   "have run out (reaper.py)")
    commit_wait_max: float = Field(5.0, ge=0, description="longest one CommitRank call waits for the other ranks")
    outcome_wait_max: float = Field(30.0, ge=0, le=3600, description="longest one GET .../outcome?wait= call waits "
                                    "for a checkpoint's outcome (a coroutine, no thread, per waiting rank)")
    outcome_poll_interval: float = Field(0.25, gt=0, description="how often the one outcome notifier per process "
                                         "reads the watched checkpoints' status (commits by another replica)")
    vote_batch_window: float = Field(0.002, ge=0, le=1.0, description="a vote that finds no batch being written "
                                     "waits this long for others to join its transaction (0: only the votes "
                                     "that arrived while the previous batch was written join)")

    max_shard_bytes: int = Field(256 * 1024**3, gt=0, description="largest shard file accepted")
    max_chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, gt=0, description="largest chunk in one PutShard message")
    inline_bytes: int | None = Field(None, ge=0, description="the most bytes of small files one vote may carry "
                                     "(CommitRank.inline_files: a small state's files sent with its vote, one round "
                                     "trip fewer than a PutShard each); at most max_chunk_bytes, the largest message "
                                     "taken; unset: 1 MiB or max_chunk_bytes if smaller; 0: none, every file is streamed")
    max_world_size: int = Field(65536, gt=0, le=2**31 - 1, description="largest world size a begin or a launch's "
                                "registration names; a heartbeat's rank is bounded by its launch's world size")
    max_tags_per_checkpoint: int = Field(64, ge=1, le=100_000, description="tags and aliases one checkpoint may "
                                         "carry (system tags apart); one more is refused (409)")
    launch_rate_max: int = Field(30, ge=1, description="new launches one run may register within "
                                 "launch_rate_window seconds; one more is refused (429 rate_limited, which the "
                                 "client retries until the window has moved on)")
    launch_rate_window: float = Field(60.0, gt=0, le=86400, description="the window of launch_rate_max")
    range_block_bytes: int = Field(1 * MiB, ge=0, le=64 * MiB, description="tensors are cut into blocks of at "
                                   "most this many bytes (each tensor's ~1/32 of it, at least 16 KiB), each hashed on upload, so a reader can verify a byte range "
                                   "without reading the whole file (lastgood/wire/ranges.py, docs/resharding.md); "
                                   "0: none (files are then read whole by a restore at another world size); "
                                   "at least 4 KiB otherwise (smaller blocks cost more in digests, kept in "
                                   "memory while a file streams in, than they save in reads)")

    migrations_dir: Path = Field(default_factory=_default_migrations_dir)
    auto_migrate: bool = Field(True, description="run `alembic upgrade head` at start")
    store_reserve_bytes: int = Field(64 * MiB, ge=0, description="a shard is refused (store full) unless this "
                                     "much room stays free on a local store after it")
    ballast_bytes: int = Field(32 * MiB, ge=0, description="space held in a file beside an SQLite catalog and given "
                               "up when the disk is full, so that GC can record its deletions; 0: none")
    startup_store_check: bool = Field(True, description="at start, list the store's manifests and refuse writes "
                                      "while the catalog lacks any (lost commits: run `lastgood-service rebuild`)")
    manifest_keys: SecretStr | None = Field(None, description="the keys that seal every manifest the service "
                                            "writes (domain/sealing.py, docs/security.md): comma-separated "
                                            "<id>:<hex> entries, at least 32 bytes each; the first seals, every "
                                            "listed one verifies (rotation). Unset: the key file")
    manifest_key_file: Path | None = Field(None, description="where the keys are kept when LASTGOOD_MANIFEST_KEYS "
                                           "is unset, one <id>:<hex> a line; generated on first start; default "
                                           "<data_dir>/manifest.keys")
    log_level: str = "INFO"
    auth_required: bool = Field(False, description="every API call needs a bearer token (required off loopback)")
    admin_token: SecretStr | None = Field(None, description="a bootstrap admin token (create real ones with it)")
    spool: bool = Field(True, description="clients on this host may hand shard files over through the spool "
                                          "directory instead of streaming them (see domain/dataplane/spool.py)")
    spool_dir: Path | None = Field(None, description="the spool directory; default <data_dir>/spool (put it on "
                                                     "the blob store's file system: files are adopted by rename)")
    spool_cache_bytes: int = Field(512 * MiB, ge=-1, description="of each file handed over while it is written "
                                   "(a followed spool file), the first this many bytes stay in the page cache; "
                                   "beyond them, what the service has hashed is dropped from it once on the disk "
                                   "(drop-behind: a large save does not take its size in page-cache pages; "
                                   "docs/performance.md). 0: drop everything behind; -1: never drop")
    # direct uploads to an S3 store (domain/dataplane/grants.py, docs/direct-s3.md): off until enabled
    direct_s3: bool = Field(False, description="trainers upload shard files straight to an s3:// blob store "
                            "through presigned multipart URLs (per-part CRC32 the store verifies) and read "
                            "them back through presigned GETs; the service only signs, checks metadata, commits")
    s3_public_endpoint: str | None = Field(None, description="scheme://host:port at which trainers reach the S3 "
                                           "store when it differs from the service's endpoint (presigned URLs "
                                           "are signed for this host)")
    direct_s3_grant_seconds: int = Field(3600, ge=1, le=7 * 24 * 3600, description="how long a presigned URL "
                                         "of a direct upload or read lasts")
    direct_s3_part_size: int = Field(64 * MiB, ge=MIN_PART_SIZE, le=MAX_PART_SIZE, description="part size of a direct "
                                     "upload (S3: 5 MiB to 5 GiB; grown for files that would need over 10,000 parts)")
    # data paths and verification (docs/dataplane.md; domain/peer/verification_modes.py owns the modes)
    verification: str = Field(Verification.SERVICE.value, pattern=f"^({'|'.join(Verification)})$", description="who hashes a file handed "
                              "over by name (direct-FS, direct S3): service (the service re-reads every byte; not "
                              "with direct S3), peer (another rank reads it back from the store before the commit), "
                              "store (the store verified the declared checksums: direct S3 uploads; refused at "
                              "start without them)")
    peer_check_grace_seconds: float | None = Field(None, ge=0, description="peer mode: once every rank has voted, "
                                                   "a file no rank reported checking within this long is hashed by the "
                                                   "service itself (domain/peer/peer_fallback.py); default half the "
                                                   "lease; at or past the lease: never (the lease then abandons it)")
    direct_fs: bool = Field(True, description="trainers that mount a local store's directory may write their files "
                            "in place (<blob root>/direct) and hand over only the name, from any host")
    max_request_bytes: int = Field(1024 * 1024, gt=0, description="largest REST request body")
    # REST connection limits (api/connections.py, docs/security.md "Connection limits")
    rest_max_connections: int = Field(0, ge=0, description="REST connections held at once; 0: from the open-file "
                                      "limit (half of what is left after 256, at least 64, at most 16,384). A "
                                      "connection over it closes the oldest one waiting for a request, or is refused")
    rest_max_connections_per_client: int = Field(0, ge=0, description="REST connections one client address may "
                                                 "hold; 0: half of rest_max_connections (behind a proxy every "
                                                 "client has its address: set it to rest_max_connections)")
    rest_read_timeout: float = Field(10.0, ge=0, description="seconds a REST request's headers and body may take "
                                     "to arrive, from the connection's start or the request's first byte; the "
                                     "connection is closed after it (408); 0: no bound (a proxy in front bounds it)")
    rest_keep_alive_timeout: float = Field(5.0, gt=0, description="an idle REST keep-alive connection is closed "
                                           "after this many seconds")
    max_streams_per_client: int = Field(16, gt=0, description="concurrent PutShard/GetShard streams per caller: per "
                                        "token, or per connection when tokens are off")
    grpc_max_streams: int = Field(0, ge=0, description="concurrent PutShard/GetShard streams in the whole service; "
                                  "0: half of grpc_workers. Streams beyond it are refused at once (RESOURCE_EXHAUSTED) "
                                  "so that unary RPCs always find a worker")
    grpc_idle_timeout: float = Field(60.0, gt=0, description="a PutShard/GetShard stream that neither sends nor "
                                     "receives a message for this many seconds is cancelled, freeing its worker")
    log_format: str = Field("text", pattern="^(text|json)$", description="text, or json: one object a line")
    retention: str = Field("latest:3,tagged,last-good,branch-heads",
                           description="what GC keeps: latest:N, every:N (steps), tagged, last-good, branch-heads "
                                       "(domain/runs/retention.py owns the syntax; main.py refuses a bad one at start)")
    gc_interval: float = Field(3600.0, ge=0, description="seconds between scheduled GC passes; 0 turns them off")
    memory_gc_seconds: float = Field(5.0, ge=0, description="after a memory checkpoint commits, GC's incremental "
                                     "pass runs within this many seconds, so memory checkpoints beyond the run's "
                                     "memory:latest:N leave the agents' live lists (their segments are freed) "
                                     "without waiting for the scheduled pass; 0 leaves them to it (as does gc_interval 0: no GC)")
    gc_grace_seconds: float = Field(3600.0, ge=0,
                                    description="ABANDONED and CORRUPT checkpoints are kept at least this long")
    # run health (domain/health/heartbeats.py, docs/health.md)
    health_interval: float = Field(5.0, ge=0, description="seconds between health sweeps, which record hung, "
                                   "straggler and lost ranks as events; 0 turns them off (GET .../health still judges)")
    hang_timeout: float | None = Field(None, gt=0, description="a fixed hang timeout in seconds instead of the "
                                       "computed one (a request's ?hang_timeout= wins)")
    hang_factor: float = Field(5.0, gt=1, description="computed hang timeout: this times the slowest recent step")
    agent_ttl_seconds: float = Field(30.0, gt=0, le=24 * 3600, description="a memory-tier node agent not heard "
                                     "from (registration, a copy report, its live list) for this long is left out "
                                     "of the placement list; its next call puts it back")
    hang_floor_seconds: float = Field(60.0, gt=0, description="the computed hang timeout is never shorter")
    hang_first_step_seconds: float = Field(600.0, gt=0, description="hang timeout of a rank with no step time yet "
                                           "(start-up, compilation, the first step after a restore)")
    hang_save_seconds: float = Field(600.0, gt=0, description="hang timeout of a rank that is saving or restoring")
    straggler_z: float = Field(3.5, gt=0, description="a straggler's robust z-score (median/MAD) exceeds this ...")
    straggler_ratio: float = Field(1.5, ge=1, description="... its step time is at least this times the median ...")
    straggler_window_seconds: float = Field(60.0, ge=0, description="... for at least this long")
    mtbf_prior_hours: float = Field(24.0, gt=0, description="a run's mean time between failures until it has failed "
                                    "(the auto checkpoint interval)")
    failure_merge_seconds: float = Field(300.0, ge=0, description="failure signals of a run this close together "
                                         "(a hang, its kill, the relaunch) count as one failure")
    gc_batch_size: int = Field(100, ge=1, le=10_000, description="checkpoints GC marks DELETED per transaction: "
                               "short transactions let commits run between GC's batches")
    gc_batch_seconds: float = Field(0.02, gt=0, le=10, description="how long one GC batch should hold the catalog: "
                                    "batch sizes adapt to it, between a tenth of gc_batch_size and gc_batch_size")
    gc_full_every: int = Field(24, ge=1, description="every Nth scheduled GC pass (and the first after a start) "
                               "plans every run and lists the whole blob store for orphans; the others plan only "
                               "runs where something changed")
    malloc_trim: bool = Field(True, description="after each scheduled GC pass, hand the C allocator's free "
                              "memory back to the system (glibc's malloc_trim; a no-op elsewhere)")
    python_gc_freeze: bool = Field(True, description="once started, exempt the service's start-up objects from "
                                   "Python's cyclic garbage collector (gc.freeze): its full collections then "
                                   "take a few ms, not 60-100 ms inside whichever call triggers one (pygc.py)")
    event_retention_seconds: float = Field(30 * 24 * 3600.0, ge=0, description="events of a checkpoint GC deleted "
                                           "this long ago are pruned (its gc_delete event stays); 0 keeps them all")
    failpoint: str | None = Field(None, description="testing only: the one failpoint to arm, a name of "
                                  "failpoints.Failpoint (a crash, a hold or a failure at one point of the code; "
                                  "failpoints.py says what each does); any other name is refused at start")

    @model_validator(mode="after")
    def _streams_leave_workers(self) -> "Settings":
        # streams and waiting votes (a quarter of the pool, api/grpc_server.py) together
        # must leave workers for every other RPC
        if not self.grpc_max_streams:
            self.grpc_max_streams = self.grpc_workers // 2
        if self.grpc_max_streams + self.grpc_workers // 4 >= self.grpc_workers:
            raise ValueError(f"grpc_max_streams={self.grpc_max_streams} with grpc_workers={self.grpc_workers} "
                             f"would leave no worker for unary RPCs; at most "
                             f"{self.grpc_workers - self.grpc_workers // 4 - 1}")
        return self

    @model_validator(mode="after")
    def _inline_fits_a_message(self) -> "Settings":
        if self.inline_bytes is None:
            self.inline_bytes = min(INLINE_BYTES, self.max_chunk_bytes)
        elif self.inline_bytes > self.max_chunk_bytes:  # a gRPC message is at most a chunk and its framing
            raise ValueError(f"inline_bytes={self.inline_bytes} exceeds max_chunk_bytes={self.max_chunk_bytes}, "
                             f"the largest message the service takes")
        return self

    @field_validator("failpoint")
    @classmethod
    def _known_failpoint(cls, value: str | None) -> str | None:
        if value is not None:
            Failpoint.parse(value)  # a misspelt failpoint would arm nothing: refused, with the valid names
        return value

    @field_validator("range_block_bytes")
    @classmethod
    def _range_block_floor(cls, value: int) -> int:
        from lastgood.wire.ranges import MIN_BLOCK

        if 0 < value < MIN_BLOCK:  # 36 B of digest per block: 1-byte blocks would hold 36x the file
            raise ValueError(f"range_block_bytes must be 0 (no range digests) or at least {MIN_BLOCK}, got {value}")
        return value

    @field_validator("s3_public_endpoint")
    @classmethod
    def _valid_public_endpoint(cls, value: str | None) -> str | None:
        if value:
            from .blobstore.s3direct import parse_endpoint

            parse_endpoint(value)  # a bad endpoint stops the service at start, not every grant
        return value

    def exposed_without_auth(self) -> list[str]:
        """Addresses this service would listen on beyond loopback with no token required."""
        if self.auth_required:
            return []
        import ipaddress

        out = []
        for host in (self.host, self.grpc_host):
            try:
                loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                loop = False
            if not loop:
                out.append(host)
        return out

    def resolved_catalog_url(self) -> str:
        return self.catalog_url or f"sqlite:///{(self.data_dir / 'catalog.db').resolve()}"

    def resolved_spool_dir(self) -> Path | None:
        return (self.spool_dir or self.data_dir / "spool").resolve() if self.spool else None

    def resolved_manifest_key_file(self) -> Path:
        return (self.manifest_key_file or self.data_dir / "manifest.keys").resolve()

    def resolved_blob_url(self) -> str:
        return self.blob_url or f"file://{(self.data_dir / 'blobs').resolve()}"
