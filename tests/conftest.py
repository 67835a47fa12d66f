"""Shared fixtures: real service processes on loopback, never mocks.

`service` is one service process for the whole session (tests use unique run names);
`make_service` starts extra ones a test owns (restarts, failpoints, short leases).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

pytest_plugins = ["tests.pg", "tests.s3"]  # real PostgreSQL and S3 (moto server) fixtures

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProc:
    data_dir: Path
    env: dict
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None
    info: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return self.info["grpc_target"]

    @property
    def blob_root(self) -> Path:
        return self.data_dir / "blobs"

    def start(self, timeout: float = 30.0) -> "ServiceProc":
        self.port = free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.data_dir / f"service-{self.port}.log"
        env = {**os.environ, "LASTGOOD_DATA_DIR": str(self.data_dir), "LASTGOOD_PORT": str(self.port),
               "LASTGOOD_GRPC_PORT": "0", **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "lastgood_service.main"], env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "/api/v1/info", timeout=1)
                if r.status_code == 200:
                    self.info = r.json()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"service did not come up:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kw)


FAST = {"LASTGOOD_LEASE_SECONDS": "3", "LASTGOOD_REAPER_INTERVAL": "0.2", "LASTGOOD_COMMIT_WAIT_MAX": "2"}


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    svc = ServiceProc(tmp_path_factory.mktemp("service"), dict(FAST)).start()
    yield svc
    svc.stop()


@pytest.fixture
def make_service(tmp_path):
    started: list[ServiceProc] = []

    def make(data_dir: Path | None = None, **env) -> ServiceProc:
        svc = ServiceProc(data_dir or tmp_path / f"svc{len(started)}", {**FAST, **env}).start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


@pytest.fixture
def run_name(request) -> str:
    return f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:6]}"
