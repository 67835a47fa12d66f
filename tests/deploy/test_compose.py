"""docker-compose.yml and the Dockerfile, checked without Docker (none runs on the test
machines): parsed, interpolated the way `docker compose` does with no variables set (except
the one it requires), and held against the service's own Settings and URL parsers.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from sqlalchemy.engine import make_url

from lastgood_service.blobstore.s3 import s3_from_url
from lastgood_service.settings import Settings
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
REQUIRED = {"LASTGOOD_ADMIN_TOKEN": "compose-test-token"}  # the variables compose demands (${X:?...})

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: ${X}, ${X:-default}, ${X-default}, ${X:?err}, $X, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        have = env.get(name)
        if op in (":-", "-"):
            return have if (have if op == ":-" else have is not None) else arg
        if op in (":?", "?"):
            if not have:
                raise KeyError(f"compose requires {name}: {arg}")
            return have
        return have or ""

    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    return interpolate(raw, dict(REQUIRED))


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def builds_our_image(service: dict) -> bool:
    build = service.get("build")
    ctx = build if isinstance(build, str) else (build or {}).get("context")
    return ctx in (".", "./")


@pytest.fixture(scope="module")
def ours(compose) -> dict[str, dict]:
    found = {name: s for name, s in compose["services"].items() if builds_our_image(s)}
    assert set(found) == {"lastgood", "migrate"}, found
    return found


@pytest.fixture(scope="module")
def settings_of(ours, monkeypatch_module) -> Settings:
    for k, v in environment(ours["lastgood"]).items():
        monkeypatch_module.setenv(k, v)
    return Settings()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_every_variable_of_our_services_is_a_setting(ours):
    fields = {f"LASTGOOD_{name.upper()}" for name in Settings.model_fields}
    for name, service in ours.items():
        env = environment(service)
        assert env, f"{name} has no environment"
        unknown = sorted(set(env) - fields)
        assert not unknown, f"{name}: {unknown} are not Settings fields (Settings ignores unknown names silently)"


def test_the_service_settings_parse_and_do_not_migrate(settings_of, ours):
    s = settings_of
    assert s.auto_migrate is False, "the migrate job migrates; the service must not race it"
    assert s.host == "0.0.0.0" and s.grpc_host == "0.0.0.0"
    assert s.exposed_without_auth() == [], "listening beyond loopback needs auth, or the service refuses to start"
    assert s.admin_token is not None
    assert environment(ours["migrate"])["LASTGOOD_CATALOG_URL"] == s.catalog_url


def test_depends_on_targets_and_conditions(compose):
    services = compose["services"]
    one_shot = {"createbucket", "migrate"}
    for name, service in services.items():
        deps = service.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for target, spec in deps.items():
            assert target in services, f"{name} depends on a missing service {target}"
            want = "service_completed_successfully" if target in one_shot else "service_healthy"
            assert spec.get("condition") == want, (name, target, spec)
            if want == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck to wait for"
    for name in one_shot:
        assert services[name].get("restart") in (None, "no"), f"one-shot {name} must not restart"
    assert set(services["lastgood"]["depends_on"]) == {"postgres", "minio", "createbucket", "migrate"}
    assert set(services["migrate"]["depends_on"]) == {"postgres"}
    assert set(services["createbucket"]["depends_on"]) == {"minio"}


def test_images_are_pinned_and_healthchecks_are_the_documented_ones(compose):
    s = compose["services"]
    pg_image = s["postgres"]["image"]
    assert re.fullmatch(r"postgres:15\.\d+(-\w+)?", pg_image), pg_image
    assert re.fullmatch(r"quay\.io/minio/minio:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", s["minio"]["image"])
    assert re.fullmatch(r"quay\.io/minio/mc:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", s["createbucket"]["image"])
    assert s["minio"]["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]
    assert "pg_isready" in " ".join(s["postgres"]["healthcheck"]["test"])
    assert "/healthz" in " ".join(s["lastgood"]["healthcheck"]["test"])


def test_named_volumes_are_declared_and_used(raw, compose):
    declared = set(raw.get("volumes") or {})
    used = set()
    for name, service in compose["services"].items():
        for v in service.get("volumes") or []:
            source = v.split(":", 1)[0] if isinstance(v, str) else v.get("source")
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
                used.add(source)
    assert used == declared == {"pgdata", "miniodata"}
    mounts = {name: [v.split(":")[1] for v in s.get("volumes", [])] for name, s in compose["services"].items()}
    assert mounts["postgres"] == ["/var/lib/postgresql/data"]
    assert mounts["minio"] == [compose["services"]["minio"]["command"][1]]  # the directory `server` serves


def test_catalog_url_points_at_the_postgres_service(compose, settings_of):
    url = make_url(settings_of.catalog_url)
    pg = environment(compose["services"]["postgres"])
    assert url.drivername == "postgresql+psycopg"
    assert url.host == "postgres" and (url.port or 5432) == 5432
    assert (url.username, url.password, url.database) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    assert f"-U {url.username}" in " ".join(compose["services"]["postgres"]["healthcheck"]["test"])


def test_blob_url_points_at_the_minio_service_and_the_created_bucket(compose, settings_of):
    s = compose["services"]
    blob = urlparse(settings_of.blob_url)
    assert blob.scheme == "s3"
    endpoint = dict(p.split("=", 1) for p in blob.query.split("&"))["endpoint"]
    host, port = endpoint.split(":")
    assert host == "minio"
    address = s["minio"]["command"][s["minio"]["command"].index("--address") + 1]
    assert address == f":{port}"
    # the one-shot job creates exactly the service's bucket, on the same endpoint
    script = " ".join(s["createbucket"]["command"])
    words = shlex.split(script.replace("&&", " && "))
    alias_at = words.index("alias")
    alias, alias_url = words[alias_at + 2], words[alias_at + 3]
    assert urlparse(alias_url).netloc == endpoint
    mb = words[words.index("mb") + 1:]
    targets = [w for w in mb if not w.startswith("-")]
    assert targets[0] == f"{alias}/{blob.hostname}"
    # the service's S3 credentials are MinIO's root credentials (same variables, same defaults)
    minio = environment(s["minio"])
    assert settings_of.s3_access_key == minio["MINIO_ROOT_USER"]
    assert settings_of.s3_secret_key.get_secret_value() == minio["MINIO_ROOT_PASSWORD"]
    # and our own parser accepts the URL (no connection made)
    store = s3_from_url(settings_of.blob_url, access_key="x", secret_key="y", check_bucket=False)
    assert (store.bucket, store.endpoint) == (blob.hostname, endpoint)


def test_ports_match_the_settings(compose, settings_of):
    ports = {int(p.split(":")[1]): int(p.split(":")[0]) for p in compose["services"]["lastgood"]["ports"]}
    assert set(ports) == {settings_of.port, settings_of.grpc_port}
    advertised_port = int(settings_of.grpc_advertise.rsplit(":", 1)[1])
    assert advertised_port == ports[settings_of.grpc_port], "clients dial the advertised port: it must be published"


def test_the_migrate_job_runs_alembic_on_the_image_migrations(compose):
    cmd = compose["services"]["migrate"]["command"]
    assert cmd[:2] == ["alembic", "-c"] and cmd[-2:] == ["upgrade", "head"]
    ini = Path(cmd[2])
    assert ini.name == "alembic.ini" and (ROOT / "migrations" / "alembic.ini").exists()
    assert ini.parent.as_posix() == dockerfile_env()["LASTGOOD_MIGRATIONS_DIR"]


def dockerfile_lines() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def dockerfile_env() -> dict[str, str]:
    env = {}
    for line in dockerfile_lines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                k, _, v = word.partition("=")
                env[k] = v
    return env


def test_dockerfile_builds_the_service_without_torch():
    lines = dockerfile_lines()
    assert lines[0] == "FROM python:3.11-slim"
    copies = {}
    for line in lines:
        if line.startswith("COPY "):
            src, dest = shlex.split(line[5:])
            copies[src.rstrip("/")] = dest.rstrip("/")
    assert {"client", "service", "migrations"} <= set(copies), copies
    installs = " ".join(line for line in lines if line.startswith("RUN ") and "pip install" in line)
    assert copies["client"] in installs and copies["service"] in installs
    assert "torch" not in installs and "[torch" not in installs and "-e " not in installs
    env = dockerfile_env()
    assert env["LASTGOOD_MIGRATIONS_DIR"] == copies["migrations"]
    assert (ROOT / "migrations" / "env.py").exists()
    assert set(env) - {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PIP_NO_CACHE_DIR",
                       "PIP_DISABLE_PIP_VERSION_CHECK"} <= {f"LASTGOOD_{n.upper()}" for n in Settings.model_fields}
    assert lines[-1] == 'CMD ["lastgood-service"]'
    assert any(line.startswith("USER ") and line != "USER root" for line in lines), "run as a non-root user"


def test_dockerignore_keeps_what_the_image_needs():
    ignored = [line.strip().rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for needed in ("client", "service", "migrations"):
        assert needed not in ignored
    assert ".venv" in ignored and ".git" in ignored


def test_service_package_ships_its_static_files():
    """A non-editable install (the image's) carries the web page's files only if the
    package data says so."""
    import tomllib

    project = tomllib.loads((ROOT / "service" / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["lastgood_service"]
    assert any(p.startswith("static/") for p in patterns)


def test_interpolation_matches_compose_rules():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d}|${UNSET:-d}|${EMPTY:-d}|${EMPTY-d}|$$X|${SET}", env) == "v|d|d||$X|v"
    with pytest.raises(KeyError):
        interpolate("${UNSET:?needed}", env)
