"""`lastgood-service token create|list|revoke` manage tokens straight in the catalog, and
what they create works (and stops working) against a service that requires auth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import FAST, ServiceProc


def token_cli(data_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lastgood_service.main", "--data-dir", str(data_dir), "token", *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "LASTGOOD_LOG_LEVEL": "WARNING"})


@pytest.mark.slow
def test_token_commands(tmp_path):
    made = token_cli(tmp_path, "create", "--name", "ci-reader", "--role", "reader", "--scope", "team-")
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)
    assert token["role"] == "reader" and token["run_prefix"] == "team-" and token["token"].startswith("lg_")
    assert "only its hash is kept" in made.stderr
    listed = json.loads(token_cli(tmp_path, "list").stdout)
    assert [t["name"] for t in listed] == ["ci-reader"] and "token" not in listed[0]
    bad = token_cli(tmp_path, "create", "--name", "x", "--role", "reader", "--scope", "../etc")
    assert bad.returncode == 4 and "scope" in bad.stderr

    svc = ServiceProc(tmp_path, {**FAST, "LASTGOOD_AUTH_REQUIRED": "true"}).start()
    try:
        auth = {"Authorization": f"Bearer {token['token']}"}
        assert httpx.get(f"{svc.url}/api/v1/runs", headers=auth).status_code == 200
        assert httpx.get(f"{svc.url}/api/v1/runs").status_code == 401  # control: no token
        assert token_cli(tmp_path, "revoke", str(token["id"])).returncode == 0
        deadline = time.monotonic() + 10  # a revocation reaches every replica within its cache time
        while httpx.get(f"{svc.url}/api/v1/runs", headers=auth).status_code != 401:
            assert time.monotonic() < deadline, "the revoked token still works"
            time.sleep(0.2)
    finally:
        svc.stop()
