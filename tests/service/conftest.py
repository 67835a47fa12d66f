"""Fixtures for the service tests (the service processes themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from .helpers import Client


@pytest.fixture
def client(service):
    """A gRPC client (generated stubs) on the session's shared service."""
    c = Client(service.grpc_target)
    yield c
    c.close()
