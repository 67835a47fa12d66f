"""deploy/kubernetes/, checked without a cluster: every resource validated against the
Kubernetes schema (kubernetes-validate, strict: an unknown field is an error), and the
service's environment held against its own Settings and URL parsers, as the compose file's
is (test_compose.py). A broken copy of a manifest is the control that the validator looks."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from sqlalchemy.engine import make_url

from lastgood_service import __version__
from lastgood_service.blobstore.s3 import s3_from_url
from lastgood_service.settings import Settings
from tests.conftest import ROOT

DIR = ROOT / "deploy" / "kubernetes"
K8S = "1.37.0"


def documents() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def by_kind(kind: str, name: str) -> dict:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_env(container: dict, secret: dict) -> dict[str, str]:
    """A container's environment as the kubelet builds it: secretKeyRefs resolved from the
    example Secret, $(VAR) expanded from the variables defined before."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"], e
            env[e["name"]] = secret["stringData"][ref["key"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


@pytest.mark.parametrize("name,doc", documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_resource_is_valid_kubernetes(name, doc):
    kubernetes_validate.validate(doc, K8S, strict=True)
    assert doc["metadata"].get("namespace", "lastgood") == "lastgood" or doc["kind"] == "Namespace"


def test_the_validator_refuses_a_broken_manifest():
    """Control: the same Deployment with a misspelt field and a port that is not a number."""
    doc = copy.deepcopy(by_kind("Deployment", "lastgood"))
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S, strict=True)
    doc = copy.deepcopy(by_kind("Deployment", "lastgood"))
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S, strict=True)


@pytest.fixture
def service_settings(monkeypatch):
    deploy = by_kind("Deployment", "lastgood")
    env = pod_env(deploy["spec"]["template"]["spec"]["containers"][0], by_kind("Secret", "lastgood-secrets"))
    for key in list(__import__("os").environ):
        if key.startswith("LASTGOOD_"):
            monkeypatch.delenv(key)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env, Settings()


def test_the_service_environment_is_settings_that_parse(service_settings):
    env, s = service_settings
    fields = {f"LASTGOOD_{n.upper()}" for n in Settings.model_fields}
    assert sorted(set(env) - fields - {"LASTGOOD_DB_PASSWORD"}) == [], "not Settings fields (ignored silently)"
    assert s.auto_migrate is False and s.host == "0.0.0.0" and s.grpc_host == "0.0.0.0"
    assert s.exposed_without_auth() == [], "listening beyond loopback needs tokens, or the service refuses to start"
    url = make_url(s.catalog_url)
    assert (url.host, url.port, url.database, url.password) == ("postgres", 5432, "lastgood", "change-me")
    store = s3_from_url(s.blob_url, access_key="x", secret_key="y", check_bucket=False)
    assert store is not None
    host, port = s.grpc_advertise.rsplit(":", 1)
    assert host.startswith("lastgood.lastgood.svc") and int(port) == s.grpc_port


def test_probes_ports_images_and_the_migration(service_settings):
    env, s = service_settings
    deploy = by_kind("Deployment", "lastgood")
    pod = deploy["spec"]["template"]["spec"]
    main, = pod["containers"]
    migrate, = pod["initContainers"]
    assert main["image"] == migrate["image"] == f"lastgood-service:{__version__}"
    assert main["readinessProbe"]["httpGet"]["path"] == main["startupProbe"]["httpGet"]["path"] == "/healthz"
    # a catalog outage must not restart the service: liveness does not read the catalog
    assert "tcpSocket" in main["livenessProbe"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": s.port, "grpc": s.grpc_port}
    svc = by_kind("Service", "lastgood")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == ports
    assert migrate["command"] == ["lastgood-service", "migrate"]
    assert pod_env(migrate, by_kind("Secret", "lastgood-secrets"))["LASTGOOD_CATALOG_URL"] == s.catalog_url
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
    assert "--uid 10001" in (ROOT / "Dockerfile").read_text()


def test_the_store_and_the_bucket(service_settings):
    env, s = service_settings
    bucket_job = by_kind("Job", "minio-bucket")
    args = " ".join(bucket_job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "store/lastgood" in args and s.blob_url.startswith("s3://lastgood?endpoint=minio:9000")
    minio = by_kind("Service", "minio")
    assert minio["spec"]["ports"][0]["port"] == 9000
