"""A checksum-checking S3 server for the tests: LocalStack's S3, on 127.0.0.1, on a free port.

Why a second S3 server beside moto (tests/s3.py): moto accepts a part whose bytes do not
match its `x-amz-checksum-crc32` (and a wrong Content-MD5), so a test on moto cannot show a
store refusing bad bytes. LocalStack's S3 verifies them (BadDigest) and, with signature
validation on, refuses an expired presigned URL and one whose signature does not cover the
request (another key). It runs without Docker from its own virtual environment,
`.venv-localstack` (`make .venv-localstack/.installed`, which `make test` builds: it pins
packages that clash with the project's), once per test session, stopped at its end.
Registered from tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from .s3 import S3Server

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-localstack" / "bin" / "python"
ACCESS_KEY = "test"     # LocalStack checks signatures with the secret of its default account
SECRET_KEY = "test"


@dataclass(frozen=True)
class LocalStack(S3Server):
    """The same helpers as the moto server's, with LocalStack's credentials."""

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY

    def uploads(self, bucket: str) -> list[tuple[str, str]]:
        """(object name, upload id) of every multipart upload open in the bucket."""
        return [(u.object_name, u.upload_id)
                for u in self.client()._list_multipart_uploads(bucket_name=bucket).uploads]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(home: Path):
    """LocalStack's S3 on a free loopback port while the block runs (the fixture below;
    bench/direct_s3.py). Its files and log go under `home`."""
    port = _free_port()
    env = {**os.environ, "GATEWAY_LISTEN": f"127.0.0.1:{port}", "SERVICES": "s3",
           "S3_SKIP_SIGNATURE_VALIDATION": "0",  # check presigned URLs: expiry, key, signed headers
           "SKIP_SSL_CERT_DOWNLOAD": "1", "DISABLE_EVENTS": "1", "DNS_ADDRESS": "0",  # loopback only
           "LOCALSTACK_VOLUME_DIR": str(home / "volume"), "TMPDIR": str(home)}
    log = open(home / "localstack.log", "wb")
    proc = subprocess.Popen([str(PYTHON), "-m", "localstack.runtime.main"], env=env, cwd=home, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # about 20 s here; far longer on a loaded machine
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"LocalStack exited with {proc.returncode}: "
                                   f"{(home / 'localstack.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_localstack/health", timeout=2) as r:
                    health = r.read()
                if b'"s3": "running"' in health or b'"s3": "available"' in health:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("LocalStack did not start in 180 s")
            time.sleep(0.5)
        yield LocalStack(f"127.0.0.1:{port}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: LocalStack and whatever it started
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def localstack(tmp_path_factory):
    if not PYTHON.exists():  # pragma: no cover - depends on the machine
        msg = f"{PYTHON} is missing: run `make .venv-localstack/.installed`"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    with running(tmp_path_factory.mktemp("localstack")) as server:
        yield server


@pytest.fixture
def ls_bucket(localstack):
    """A fresh bucket on the session's LocalStack; emptied again afterwards."""
    bucket = localstack.make_bucket()
    yield bucket
    localstack.empty_bucket(bucket)
