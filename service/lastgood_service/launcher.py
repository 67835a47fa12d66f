"""Start a real lastgood service process on loopback and wait until it answers.

One piece for everything that needs a live service of its own: the test fixtures, the
benchmark and `make demo`. The process is the real entry point (`python -m
lastgood_service.main`) on a free REST port with gRPC on a free port too; its output goes
to a log file per start in the data directory. `restart()` starts it again on the same data
directory and the same REST and gRPC ports, as a supervisor restarting a crashed service
would, so that clients that were talking to it can reconnect.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


# the settings a launched service is placed by (settings.py reads them, prefix LASTGOOD_)
ENV_DATA_DIR, ENV_PORT, ENV_GRPC_PORT = "LASTGOOD_DATA_DIR", "LASTGOOD_PORT", "LASTGOOD_GRPC_PORT"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProcess:
    data_dir: Path
    env: dict = field(default_factory=dict)  # LASTGOOD_* settings on top of the embedded defaults
    port: int = 0
    grpc_port: int = 0  # 0: the service picks one; kept by restart()
    proc: subprocess.Popen | None = None
    log: Path | None = None
    info: dict = field(default_factory=dict)  # GET /api/v1/info once it is up
    nofile: int | tuple[int, int] | None = None  # the process's open-file limit: soft and hard, or (soft, hard)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return self.info["grpc_target"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 30.0, keep_ports: bool = False) -> "ServiceProcess":
        if not keep_ports:
            self.port, self.grpc_port = free_port(), 0
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.data_dir / f"service-{self.port}.log"
        env = {**os.environ, ENV_DATA_DIR: str(self.data_dir), ENV_PORT: str(self.port),
               ENV_GRPC_PORT: str(self.grpc_port), **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "lastgood_service.main"], env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=None if self.nofile is None else self._limits)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/api/v1/info", timeout=1) as r:
                    self.info = json.loads(r.read())
                self.grpc_port = int(self.info["grpc_target"].rsplit(":", 1)[1])
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"service did not come up:\n{self.log.read_text()[-3000:]}")

    def _limits(self) -> None:
        import resource  # in the child, before it runs the service

        soft, hard = self.nofile if isinstance(self.nofile, tuple) else (self.nofile, self.nofile)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = 30.0) -> "ServiceProcess":
        """Stop it if it runs, and start it again on the same data and the same ports."""
        self.stop()
        return self.start(timeout, keep_ports=True)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)
