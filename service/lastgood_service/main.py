"""Process entry point: build settings, catalog, blob store and both transports, then serve.

Start-up order matters: migrate the catalog, recover pending checkpoints, start gRPC (so
its port is known), then serve REST, which announces the gRPC endpoint at /api/v1/info.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import uvicorn

from . import alloc, pygc
from .api.grpc_server import Servicer, start_grpc_server
from .api.deps import AppContext
from .api.rest import create_app
from .blobstore import capabilities, open_blobstore
from .catalog import txtimer
from .catalog.db import inject_eio, make_engine, make_sessionmaker, read_sessionmaker, upgrade_head
from .domain.commit import CommitService
from .domain.commit.outcomes import OutcomeNotifier
from .domain.runs.curation import Curator
from .domain.faults import Ballast
from .domain.gate import CatalogGate
from .domain.gc import GarbageCollector
from .domain.dataplane.grants import DirectUploads
from .domain.health.heartbeats import Health
from .domain.repair import Repair
from .domain.sealing import ManifestKeyError, ManifestKeys
from .domain.errors import DomainError
from .domain.runs.retention import Retention
from .domain.dataplane.directfs import DirectFS
from .domain.dataplane.spool import Spool
from .domain.peer import verification_modes
from .domain.peer.peer_fallback import PeerFallback
from .domain.peer.verification_modes import PeerChecks
from .domain.tokens import TokenStore
from .api.connections import Limits, LimitedHttp, budget
from .api.contract import Nosniff
from .api.limits import BodyLimit
from .metrics import Metrics
from .reaper import Reaper
from .domain.queries import Queries
from .failpoints import Failpoint
from .settings import Settings

log = logging.getLogger("lastgood")


def _sqlite_dir(url: str) -> Path | None:
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return Path(u.database).resolve().parent if u.get_backend_name() == "sqlite" and u.database else None


class Service:
    """Everything one service process runs; `start()` then `stop()`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        url = settings.resolved_catalog_url()
        if settings.auto_migrate:
            upgrade_head(url, settings.migrations_dir)
        self.engine = make_engine(url)
        if settings.failpoint == Failpoint.CATALOG_EIO:  # testing only: a catalog file that answers EIO
            inject_eio(self.engine, settings.data_dir / f"{Failpoint.CATALOG_EIO}.on")
        sessions = make_sessionmaker(self.engine)
        blobs = open_blobstore(settings.resolved_blob_url(), settings)
        if settings.failpoint == Failpoint.BLOB_EIO:  # testing only: a device that fails every write
            from .blobstore.faulty import WriteEIO

            blobs = WriteEIO(blobs)
        self.gate = CatalogGate()  # closed at start while the catalog is behind the store
        self.manifest_keys = ManifestKeys.from_settings(settings)  # seal every manifest (domain/sealing.py)
        self.repair = Repair(sessions, blobs, self.manifest_keys)
        self.queries = Queries(read_sessionmaker(self.engine), self.gate)
        self.metrics = Metrics(pending=self.queries.pending_count)
        self.commits = CommitService(settings, sessions, blobs, metrics=self.metrics, gate=self.gate,
                                     manifest_keys=self.manifest_keys)
        self.outcomes = OutcomeNotifier(sessions, settings.outcome_poll_interval)  # one per process
        self.commits.listeners.append(self.outcomes.poke)
        if settings.direct_s3:  # an abort or a lease expiry aborts the direct uploads it left open
            self.commits.end_listeners.append(DirectUploads(self.commits).end)
        self.curator = Curator(sessions, gate=self.gate, max_tags=settings.max_tags_per_checkpoint)
        # heartbeats commit without an fsync each (catalog/db.py): their own small pool
        self.health_engine = make_engine(url, durable=False)
        self.health = Health.from_settings(make_sessionmaker(self.health_engine), settings, metrics=self.metrics,
                                           gate=self.gate)
        self.ballast = Ballast(_sqlite_dir(url) / ".lastgood-ballast" if _sqlite_dir(url) else None,
                               settings.ballast_bytes)
        self.ballast.ensure()
        self.gc = GarbageCollector(sessions, blobs, Retention.parse(settings.retention), settings.gc_grace_seconds,
                                   metrics=self.metrics, gate=self.gate, ballast=self.ballast,
                                   batch_size=settings.gc_batch_size, full_every=settings.gc_full_every,
                                   batch_seconds=settings.gc_batch_seconds,
                                   event_retention_seconds=settings.event_retention_seconds,
                                   read_sessions=self.queries.sessions,
                                   grant_seconds=settings.direct_s3_grant_seconds)
        self.metrics.watch_free_bytes(lambda: capabilities.free_bytes(blobs))
        self.metrics.watch_catalog(txtimer.of(sessions))  # the commit path's engine (heartbeats have their own)
        admin = settings.admin_token.get_secret_value() if settings.admin_token else None
        self.tokens = TokenStore(sessions, required=settings.auth_required, bootstrap_admin=admin)
        # direct-FS and the verification mode (docs/dataplane.md): a mode the store cannot provide stops the start
        verification_modes.check_available(settings.verification, blobs, settings.direct_s3)
        self.direct_fs = DirectFS.open(blobs, settings.direct_fs)
        # peer verification: one fallback hash per process, the reaper's sweep and the requests' checks share it
        self.peer_fallback = PeerFallback(self.commits)
        self.commits.confirm = self.peer_fallback.start  # `store` mode: each direct upload's xxh3-128 (grants.py)
        self.peer_checks = PeerChecks(self.commits, self.peer_fallback, self.direct_fs)
        self.spool = None
        if spool_dir := settings.resolved_spool_dir():
            try:
                # files handed over while they are written are adopted by rename (domain/dataplane/spool.Followed)
                self.spool = Spool(spool_dir, follow=lambda d: capabilities.adopts_from(blobs, d))
            except OSError as e:
                log.warning("no spool (same-host hand-over off; clients stream): %s", e)
        self._stop = threading.Event()
        self._gc_lock = threading.Lock()  # the scheduled and the memory tier's passes, one at a time
        self.grpc_server = None
        self.grpc_port = None

    def start(self) -> None:
        rolled = self.commits.recover()
        if rolled:
            log.warning("rolled forward at start-up: %s", rolled)
        if self.settings.startup_store_check:
            self._check_store()
        s = self.settings
        self.grpc_server, self.grpc_port = start_grpc_server(
            Servicer(self.commits, self.queries, self.tokens, self.spool, self.direct_fs), s.grpc_host, s.grpc_port, s.grpc_workers,
            s.max_chunk_bytes, s.grpc_stream_window)
        threading.Thread(target=Reaper(self).run, args=(self._stop,), name="lease-reaper", daemon=True).start()
        if s.gc_interval > 0:
            threading.Thread(target=self._gc_loop, name="gc", daemon=True).start()
        if s.memory_gc_seconds > 0 and s.gc_interval > 0:  # GC turned off is off for the memory tier too
            threading.Thread(target=self._memory_gc_loop, name="memory-gc", daemon=True).start()
        if s.health_interval > 0:
            threading.Thread(target=self._health_loop, name="health", daemon=True).start()

    def _check_store(self) -> None:
        """Close the gate while the store holds sealed manifests the catalog lacks; a
        manifest that is not sealed by the service's keys is logged, never obeyed: a file
        planted in the store alone does not stop writes (domain/repair.py)."""
        examined = self.repair.examine_lost()
        if lost := [e.parsed.checkpoint_id for e in examined if e.manifest is not None]:
            self.gate.close(lost)
            log.error("%s", self.gate.reason)
        for e in (e for e in examined if e.manifest is None):
            log.warning("ignored a manifest in the store the catalog lacks, %s: %s (`lastgood-service fsck` lists "
                        "them, `lastgood-service rebuild` quarantines forged ones)", e.key, e.why)

    @property
    def grpc_target(self) -> str:
        return self.settings.grpc_advertise or f"{self.settings.grpc_host}:{self.grpc_port}"

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.settings.gc_interval):
            try:
                with self._gc_lock:
                    self.gc.run_pass()
            except Exception:
                log.exception("scheduled GC pass failed; will retry")
            if self.settings.malloc_trim:  # the pass's peak back to the system (alloc.py)
                alloc.trim()

    def _memory_gc_loop(self) -> None:
        """GC's incremental pass within `memory_gc_seconds` of a memory commit (at most one
        pass per period, however many commits): the runs with something new are planned,
        and the memory checkpoints their retention no longer keeps are deleted, so the
        agents' live lists (domain/memory/copies.py) stop naming them and their segments are
        freed. A memory checkpoint every few seconds would otherwise fill node memory until
        the scheduled pass, or until each agent's budget forced it out."""
        period = self.settings.memory_gc_seconds
        while not self._stop.is_set():
            if not self.commits.memory_committed.wait(1.0):
                continue
            if self._stop.wait(period):  # the commits of the next period ride on this pass
                return
            self.commits.memory_committed.clear()
            try:
                with self._gc_lock:
                    self.gc.incremental_pass()
            except Exception:
                log.exception("memory GC pass failed; will retry in %s s", period)
                self.commits.memory_committed.set()

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.health_interval):
            try:
                self.health.sweep()
            except Exception:
                log.exception("health sweep failed; will retry")

    def app(self):
        return create_app(AppContext(self.commits, self.queries, self.grpc_target, self.curator, self.gc,
                                     self.tokens, self.metrics, self.spool,
                                     self.health, self.outcomes, self.direct_fs, self.peer_checks))

    def stop(self) -> None:
        self._stop.set()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2).wait()
        self.engine.dispose()
        self.health_engine.dispose()
        log.info("service stopped")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the run and checkpoint ids the domain attaches."""

    FIELDS = ("run", "checkpoint_id", "step", "rank")

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        out.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _logging(settings: Settings) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _token_command(args, settings: Settings) -> int:
    """`lastgood-service token create|list|revoke`: manage tokens straight in the catalog."""
    url = settings.resolved_catalog_url()
    if settings.auto_migrate:
        upgrade_head(url, settings.migrations_dir)
    engine = make_engine(url)
    store = TokenStore(make_sessionmaker(engine), required=True)
    try:
        if args.token_cmd == "create":
            out = store.create(args.name, args.role, args.scope)
            print(json.dumps(out))
            print("store this token now: only its hash is kept", file=sys.stderr)
        elif args.token_cmd == "revoke":
            print(json.dumps(store.revoke(args.id)))
        else:
            print(json.dumps(store.list(), indent=2))
        return 0
    except DomainError as e:
        print(f"lastgood-service: error: {e}", file=sys.stderr)
        return 4
    finally:
        engine.dispose()


def _repair_command(args, settings: Settings) -> int:
    """`lastgood-service fsck|rebuild`: the catalog against the blob store (domain/repair.py).
    Exit 0: consistent (fsck) or rebuilt; 1: fsck found disagreements; 4: rebuild skipped a
    manifest (a conflict, a forgery it quarantined, an unsealed one it left in place)."""
    url = settings.resolved_catalog_url()
    if settings.auto_migrate:
        upgrade_head(url, settings.migrations_dir)
    try:
        manifest_keys = ManifestKeys.from_settings(settings)
    except ManifestKeyError as e:
        print(f"lastgood-service: {e}", file=sys.stderr)
        return 2
    engine = make_engine(url)
    repair = Repair(make_sessionmaker(engine), open_blobstore(settings.resolved_blob_url(), settings), manifest_keys)
    try:
        if args.command == "fsck":
            report = repair.fsck(rehash=args.rehash)
            out = report.to_dict()
            if not args.json:
                for f in report.findings:
                    print(f"{f.kind:17} {f.detail}" + (f"  [{f.key}]" if f.key else ""))
                print(f"{report.checkpoints} checkpoints, {report.blobs} blobs: "
                      + (", ".join(f"{n} {k}" for k, n in out["counts"].items()) or "consistent"))
                if report.of("lost_commit"):
                    print("the catalog lacks committed checkpoints the store holds: run `lastgood-service rebuild`")
            else:
                print(json.dumps(out, indent=2))
            return 0 if report.ok else 1
        result = repair.rebuild(trust_unsealed=args.trust_unsealed)
        print(json.dumps(result, indent=2))
        return 4 if result["conflicts"] or result["quarantined"] or result["unsealed"] else 0
    finally:
        engine.dispose()


def _check_settings(settings: Settings) -> None:
    """What the settings cannot check themselves, because the rule is the domain's (the
    settings sit below it): a retention policy that does not parse stops every command
    at start, with the reason (domain/runs/retention.py)."""
    try:
        Retention.parse(settings.retention)
    except ValueError as e:
        sys.exit(f"lastgood-service: LASTGOOD_RETENTION={settings.retention!r} refused: {e}")


def _limit_malloc_arenas(n: int) -> None:
    """glibc gives each thread that allocates its own arena (up to 8 per core), and freed
    4 MiB chunks stay in them: with 2 the service's RSS while ingesting is lower and flat
    (bench.alloc). Before any thread starts; MALLOC_ARENA_MAX in the environment wins."""
    if n <= 0 or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


class _Server(uvicorn.Server):
    """uvicorn's server with its housekeeping tick (the Date header, the exit check) once a
    second instead of ten times: ten wakeups a second would be most of an idle service's
    CPU (3 ms a second here), paid by every save for as long as it takes (bench/README.md,
    "Data paths"). A signal still ends it at once: handle_exit wakes the loop."""

    async def main_loop(self) -> None:
        self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick does its once-a-second work when counter % 10 == 0
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except asyncio.TimeoutError:  # the builtin only from Python 3.11
                pass
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if (loop := getattr(self, "_loop", None)) is not None:
            loop.call_soon_threadsafe(self._wake.set)


def _raise_open_files() -> int:
    """The soft open-file limit raised to the hard one (REST's connection budget is sized
    from it, api/connections.py); the limit it is then."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("open-file limit stays %s (hard %s): %s", soft, hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _rest_limits(settings: Settings, nofile: int) -> Limits:
    total = budget(nofile, settings.rest_max_connections)
    per_client = settings.rest_max_connections_per_client or max(1, total // 2)
    log.info("open files at most %s: REST holds at most %s connections, %s per client address; "
             "a request's headers and body within %s s", nofile, total, per_client,
             settings.rest_read_timeout or "unbounded")
    if total > nofile:
        log.warning("LASTGOOD_REST_MAX_CONNECTIONS=%s is over the open-file limit (%s): a flood of "
                    "connections can take every file descriptor", total, nofile)
    return Limits(total, min(per_client, total), settings.rest_read_timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lastgood-service",
                                     description="Run the lastgood service (settings from LASTGOOD_* variables).")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--data-dir")
    sub = parser.add_subparsers(dest="command")
    tok = sub.add_parser("token", help="create, list or revoke API tokens (straight in the catalog)")
    tsub = tok.add_subparsers(dest="token_cmd", required=True)
    create = tsub.add_parser("create", help="print a new token once; only its hash is stored")
    create.add_argument("--name", required=True)
    create.add_argument("--role", required=True, choices=["reader", "writer", "admin"])
    create.add_argument("--scope", help="limit the token to runs whose names start with this prefix")
    revoke = tsub.add_parser("revoke")
    revoke.add_argument("id", type=int)
    tsub.add_parser("list")
    fsck = sub.add_parser("fsck", help="check the catalog against the blob store (exit 1 on disagreements)")
    fsck.add_argument("--rehash", action="store_true", help="also re-hash every committed shard (reads every byte)")
    fsck.add_argument("--json", action="store_true")
    rebuild = sub.add_parser("rebuild", help="restore the catalog's lost commits from the sealed manifests in "
                             "the blob store (forged ones are quarantined; exit 4 when any was skipped)")
    rebuild.add_argument("--trust-unsealed", action="store_true",
                         help="also restore manifests that carry no seal (written by a service older than seals); "
                              "only for a store nobody else could write to")
    sub.add_parser("migrate", help="bring the catalog's schema to this version's head (Alembic) and exit")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"host": args.host, "port": args.port, "grpc_port": args.grpc_port,
                                   "data_dir": args.data_dir}.items() if v is not None}
    settings = Settings(**overrides)
    _check_settings(settings)
    _logging(settings)
    if args.command == "token":
        sys.exit(_token_command(args, settings))
    if args.command in ("fsck", "rebuild"):
        sys.exit(_repair_command(args, settings))
    if args.command == "migrate":  # the one-shot job of a deploy (LASTGOOD_AUTO_MIGRATE=false on the service)
        upgrade_head(settings.resolved_catalog_url(), settings.migrations_dir)
        print(f"catalog at head: {settings.migrations_dir}")
        sys.exit(0)
    exposed = settings.exposed_without_auth()
    if exposed:
        sys.exit(f"lastgood-service: refusing to listen on {', '.join(exposed)} without authentication: "
                 f"anyone who can reach it could read and overwrite checkpoints. Set LASTGOOD_AUTH_REQUIRED=true "
                 f"(and create tokens with `lastgood-service token create`), or bind to 127.0.0.1.")
    _limit_malloc_arenas(settings.malloc_arena_max)
    limits = _rest_limits(settings, _raise_open_files())
    try:
        service = Service(settings)
    except (verification_modes.ModeUnavailable, ManifestKeyError) as e:
        sys.exit(f"lastgood-service: {e}")
    service.start()
    from sqlalchemy.engine import make_url

    catalog = make_url(settings.resolved_catalog_url()).render_as_string(hide_password=True)
    log.info("gRPC on %s; REST on http://%s:%s (catalog %s, blobs %s, auth %s)", service.grpc_target,
             settings.host, settings.port, catalog, settings.resolved_blob_url(),
             "required" if settings.auth_required else "off (loopback only)")
    app = Nosniff(BodyLimit(service.app(), settings.max_request_bytes))
    pygc.freeze_startup(settings)  # start-up is done: its objects are never walked by Python's GC again
    # uvicorn shuts HTTP down gracefully on SIGINT or SIGTERM, then raises the signal again
    # into the handler it found: SIGINT's raises KeyboardInterrupt, and SIGTERM's must not be
    # the default one, which would end the process before service.stop() (gRPC's grace for
    # the calls in flight, the catalog closed)
    try:
        signal.signal(signal.SIGTERM, _terminated)
        _Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                               http=LimitedHttp.protocol(limits), timeout_keep_alive=settings.rest_keep_alive_timeout,
                               backlog=min(2048, limits.max_connections))).run()
    except (KeyboardInterrupt, _Terminated):  # a clean exit, as uvicorn.run's
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the stop at once
        service.stop()


class _Terminated(Exception):
    """SIGTERM, raised again by uvicorn after its graceful shutdown (main())."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # once: a second SIGTERM ends the process at once
    raise _Terminated()


if __name__ == "__main__":
    main()
