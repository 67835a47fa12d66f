"""A service that requires a bearer token: --token / LASTGOOD_TOKEN, and exit 4 without one."""

from __future__ import annotations

import pytest

from .conftest import error_line, lastgood_many

BOOT = "cli-test-bootstrap-admin-token"


@pytest.mark.slow
def test_token_from_option_or_environment(make_service):
    svc = make_service(LASTGOOD_AUTH_REQUIRED="true", LASTGOOD_ADMIN_TOKEN=BOOT)
    u = ["--url", svc.url]
    none, bad, opt, env_json = lastgood_many([
        (u + ["runs"], 4),
        (u + ["--token", "lg_1_not-a-real-secret", "runs"], 4),
        (u + ["--token", BOOT, "runs"], 0),
        (u + ["--json", "show", "123456"], 3, {"LASTGOOD_TOKEN": BOOT}),  # authenticated, then not found
    ])
    assert "requires a token" in error_line(none) and "--token or LASTGOOD_TOKEN" in none.err
    assert BOOT not in none.err and "not-a-real-secret" not in bad.err
    assert "no runs yet" in opt.out
    assert error_line(env_json) == "lastgood: error: checkpoint 123456 does not exist"
