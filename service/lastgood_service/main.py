"""Process entry point: build settings, catalog, blob store and both transports, then serve.

Start-up order matters: migrate the catalog, recover pending checkpoints, start gRPC (so
its port is known), then serve REST, which announces the gRPC endpoint at /api/v1/info.
"""

from __future__ import annotations

import argparse
import logging
import threading

import uvicorn

from .api.grpc_server import Servicer, start_grpc_server
from .api.rest import AppContext, create_app
from .blobstore import open_blobstore
from .catalog.db import make_engine, make_sessionmaker, upgrade_head
from .domain.commit import CommitService
from .domain.curation import Curator
from .domain.gc import GarbageCollector
from .domain.retention import Retention
from .domain.queries import Queries
from .settings import Settings

log = logging.getLogger("lastgood")


class Service:
    """Everything one service process runs; `start()` then `stop()`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        url = settings.resolved_catalog_url()
        if settings.auto_migrate:
            upgrade_head(url, settings.migrations_dir)
        self.engine = make_engine(url)
        sessions = make_sessionmaker(self.engine)
        blobs = open_blobstore(settings.resolved_blob_url(), settings)
        self.commits = CommitService(settings, sessions, blobs)
        self.queries = Queries(sessions)
        self.curator = Curator(sessions)
        self.gc = GarbageCollector(sessions, blobs, Retention.parse(settings.retention), settings.gc_grace_seconds)
        self._stop = threading.Event()
        self.grpc_server = None
        self.grpc_port = None

    def start(self) -> None:
        rolled = self.commits.recover()
        if rolled:
            log.warning("rolled forward at start-up: %s", rolled)
        s = self.settings
        self.grpc_server, self.grpc_port = start_grpc_server(
            Servicer(self.commits, self.queries), s.grpc_host, s.grpc_port, s.grpc_workers, s.max_chunk_bytes)
        threading.Thread(target=self._reaper, name="lease-reaper", daemon=True).start()
        if s.gc_interval > 0:
            threading.Thread(target=self._gc_loop, name="gc", daemon=True).start()

    @property
    def grpc_target(self) -> str:
        return self.settings.grpc_advertise or f"{self.settings.grpc_host}:{self.grpc_port}"

    def _reaper(self) -> None:
        while not self._stop.wait(self.settings.reaper_interval):
            try:
                self.commits.expire_leases()
            except Exception:
                log.exception("lease reaper pass failed; will retry")

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.settings.gc_interval):
            try:
                self.gc.execute(self.gc.plan())
            except Exception:
                log.exception("scheduled GC pass failed; will retry")

    def app(self):
        return create_app(AppContext(self.commits, self.queries, self.grpc_target, self.curator, self.gc))

    def stop(self) -> None:
        self._stop.set()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2).wait()
        self.engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lastgood-service",
                                     description="Run the lastgood service (settings from LASTGOOD_* variables).")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--data-dir")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"host": args.host, "port": args.port, "grpc_port": args.grpc_port,
                                   "data_dir": args.data_dir}.items() if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    service = Service(settings)
    service.start()
    log.info("gRPC on %s; REST on http://%s:%s (catalog %s, blobs %s)", service.grpc_target, settings.host,
             settings.port, settings.resolved_catalog_url(), settings.resolved_blob_url())
    try:
        uvicorn.run(service.app(), host=settings.host, port=settings.port, log_level="warning")
    finally:
        service.stop()


if __name__ == "__main__":
    main()
