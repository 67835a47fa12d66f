"""`make demo` (examples/gpt/demo.py) places itself by the settings the README names: the
service at LASTGOOD_URL, else its own on LASTGOOD_PORT / LASTGOOD_GRPC_PORT with its data in
LASTGOOD_DATA_DIR; only its own default data directory is ever wiped."""

from __future__ import annotations

import datetime as dt
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 12, 4, 10, 15, 0)


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("lastgood_demo", ROOT / "examples" / "gpt" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_no_settings_means_an_own_service_on_free_ports_and_a_fresh_default_directory(demo):
    p = demo.plan({}, NOW)
    assert p.url is None and p.port == 0 and p.grpc_port == 0
    assert p.data == ROOT / "demo-data" / "data" and p.wipe and p.suffix == ""


def test_lastgood_url_means_that_service_and_run_names_of_their_own(demo):
    p = demo.plan({"LASTGOOD_URL": "http://10.0.0.5:8100/", "LASTGOOD_PORT": "8123"}, NOW)
    assert p.url == "http://10.0.0.5:8100" and not p.wipe and p.suffix == "-20261204-101500"


def test_port_and_data_dir_place_the_own_service_and_a_users_directory_is_never_wiped(demo, tmp_path):
    p = demo.plan({"LASTGOOD_PORT": "8123", "LASTGOOD_GRPC_PORT": "50123", "LASTGOOD_DATA_DIR": str(tmp_path)}, NOW)
    assert p.url is None and (p.port, p.grpc_port) == (8123, 50123)
    assert p.data == tmp_path and not p.wipe and p.suffix == "-20261204-101500"


def test_the_port_alone_keeps_the_default_directory(demo):
    p = demo.plan({"LASTGOOD_PORT": "8123"}, NOW)
    assert p.port == 8123 and p.data == ROOT / "demo-data" / "data" and p.wipe and p.suffix == ""
