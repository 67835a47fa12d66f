"""Fixtures for the service tests (the service processes themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from ..conftest import FAST, ServiceProc
from .helpers import Client


@pytest.fixture
def client(service):
    """A gRPC client (generated stubs) on the session's shared service."""
    c = Client(service.grpc_target)
    yield c
    c.close()


@pytest.fixture(scope="module")
def svc(tmp_path_factory, request):
    """A service of the test module's own, with a long lease: no PENDING checkpoint expires
    between two snapshots of a test, which would turn a status change into a false alarm."""
    s = ServiceProc(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]),
                    {**FAST, "LASTGOOD_LEASE_SECONDS": "120"}).start()
    yield s
    s.stop()


@pytest.fixture
def cl(svc):
    """A gRPC client on the module's own service."""
    c = Client(svc.grpc_target)
    yield c
    c.close()


@pytest.fixture(scope="module")
def peer_svc(tmp_path_factory, request):
    """A service of the test module's own in `peer` verification mode (docs/dataplane.md),
    with a 60 s lease; a module's PEER_SETTINGS (a dict of settings, or a function of the
    fixture request that returns one) adds to or overrides these (test_peer_liveness: a
    shorter lease and grace; test_direct_s3_peer: a bucket on moto and direct uploads)."""
    extra = getattr(request.module, "PEER_SETTINGS", {})
    env = {**FAST, "LASTGOOD_LEASE_SECONDS": "60", "LASTGOOD_VERIFICATION": "peer",
           **(extra(request) if callable(extra) else extra)}
    s = ServiceProc(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), env).start()
    yield s
    s.stop()
