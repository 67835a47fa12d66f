"""docs/install.md's compatibility table says what the packages declare and what the suite installs.

The table is a figure the docs quote, so a test keeps it current: each row's "declared" bound is
read from the packages' metadata (client/pyproject.toml, service/pyproject.toml), each "tested"
version from requirements-dev.txt's pins (Python from the Dockerfile's base image, the
interpreter the service image and CI use).
"""

from __future__ import annotations

import re
import tomllib

from tests.conftest import ROOT

DOC = ROOT / "docs" / "install.md"


def _table() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    section = text.split("## Compatibility", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _declared() -> dict[str, str]:
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    service = tomllib.loads((ROOT / "service" / "pyproject.toml").read_text())["project"]
    assert client["requires-python"] == service["requires-python"]
    out = {"Python": client["requires-python"]}
    for reqs in client["optional-dependencies"].values():
        for req in reqs:
            m = re.match(r"^([A-Za-z0-9_.-]+)(.*)$", req)
            out[m.group(1)] = m.group(2)
    return out


def test_the_compatibility_table_matches_the_metadata_and_the_pins():
    table, pins, declared = _table(), _pins(), _declared()
    assert "Python" in table and "torch" in table, table
    docker = re.search(r"^FROM python:(\d+\.\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    for name, (decl, tested) in table.items():
        assert decl == declared.get(name, "—"), (name, decl, declared.get(name))
        want = docker.group(1) if name == "Python" else pins.get(name.lower())
        assert tested == want, (name, tested, want)
    # every extra's package and every pinned framework the integrations are tested with has a row
    for name in declared:
        assert name in table, f"docs/install.md's table lacks {name}"
    for framework in ("lightning", "transformers", "accelerate", "torchtitan", "deepspeed"):
        assert framework in table, f"docs/install.md's table lacks {framework}"


def test_the_wheel_names_the_page_prints_carry_the_packages_versions():
    from lastgood import __version__ as client_version
    from lastgood_service import __version__ as service_version

    text = DOC.read_text()
    wheels = re.findall(r"dist/(lastgood(?:_service)?)-([0-9][^-]*)-py3-none-any\.whl", text)
    assert wheels, "the page names no wheel"
    for name, version in wheels:
        assert version == (service_version if name == "lastgood_service" else client_version), (name, version)
    assert f"lastgood {client_version}" in text
