"""The client's error model: every error code the service sends becomes one class, from REST
and from gRPC alike, and an answer without a code is classified by its status. Both sides
derive how a code travels from lastgood.wire.codes, read here with the service's table, so
a code added on either side cannot be forgotten on the other."""

from __future__ import annotations

import json

import pytest

import lastgood
from lastgood import errors
from lastgood.errors import from_grpc, from_http
from lastgood.wire import codes
from lastgood_service.api.errors import TABLE as SERVICE_TABLE
from lastgood_service.domain import errors as domain

SERVICE_CODES = {name: (status, code.name) for status, code, name in SERVICE_TABLE.values()}


def body(code: str | None, message: str = "the service's words") -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@pytest.mark.parametrize("name", sorted(SERVICE_CODES))
def test_every_service_error_code_has_one_client_class(name):
    status, grpc_code = SERVICE_CODES[name]
    assert name in errors.TABLE, f"the service sends {name!r}; add it to lastgood.errors.TABLE"
    cls = errors.TABLE[name]
    assert codes.CODES[name] == (status, grpc_code), "the service sends a code otherwise than the wire says"
    over_rest = from_http("GET", "/x", status, body(name))
    over_grpc = from_grpc("PutShard", grpc_code, "the service's words", ((errors.ERROR_METADATA, name),))
    for err in (over_rest, over_grpc):
        assert type(err) is cls and err.reason == name and err.coded
        assert err.detail == "the service's words"
    assert (over_rest.status, over_grpc.grpc_code) == (status, grpc_code)
    assert over_rest.retryable == over_grpc.retryable


def test_the_client_table_holds_no_code_the_service_does_not_send():
    rest_only = {codes.INVALID_REQUEST, codes.INTERNAL}  # the REST layer's own (api/rest.py), not the domain's
    assert set(errors.TABLE) - rest_only == set(SERVICE_CODES)
    assert set(errors.TABLE) == set(codes.CODES), "every code of the wire has one client class, and no other"


def test_the_classes_follow_the_services_hierarchy():
    """A client class is a subclass of another where the service's are, but for a catalog
    behind its store: Unavailable on the service (503), yet not retried by the client."""
    by_domain = {cls: errors.TABLE[name] for cls, (_s, _c, name) in SERVICE_TABLE.items()}
    for a, ca in by_domain.items():
        for b, cb in by_domain.items():
            if a is not b and issubclass(a, b) and (a, b) != (domain.CatalogBehind, domain.Unavailable):
                assert issubclass(ca, cb), f"{a.__name__} < {b.__name__}, but {ca.__name__} is not < {cb.__name__}"


def test_only_outages_and_a_busy_service_are_retried():
    retried = {name for name, cls in errors.TABLE.items() if cls.transient}
    # rate_limited: a run's launch registrations, which pass again once the window moved on
    assert retried == {"unavailable", "streams_busy", "internal", "rate_limited"}
    # an operator has to act on these: retrying only delays the error
    for name in (codes.CATALOG_BEHIND, codes.STORE_FULL):
        assert not from_http("POST", "/x", SERVICE_CODES[name][0], body(name)).retryable


@pytest.mark.parametrize("status,cls,retryable", [
    (400, errors.InvalidArgument, False), (401, errors.Unauthenticated, False),
    (403, errors.PermissionDenied, False), (404, errors.NotFound, False), (405, errors.ServiceError, False),
    (409, errors.Conflict, False), (413, errors.TooLarge, False), (416, errors.OutOfRange, False),
    (422, errors.InvalidArgument, False), (500, errors.Internal, True), (501, errors.ServiceError, False),
    (502, errors.Unavailable, True), (503, errors.Unavailable, True), (504, errors.Unavailable, True),
    (505, errors.ServiceError, False), (507, errors.StoreFull, False), (599, errors.Internal, True),
])
def test_an_answer_without_a_code_is_classified_by_its_status(status, cls, retryable):
    """A proxy's error page, an older service: the status decides, and nothing says a
    lastgood route answered (so last_good never reads a proxy's 404 as "no checkpoint")."""
    err = from_http("GET", "/api/v1/runs/x/last-good", status, b"<html>bad gateway</html>")
    assert type(err) is cls and err.retryable is retryable and not err.coded
    assert err.detail == "<html>bad gateway</html>" and f"HTTP {status}" in str(err)


@pytest.mark.parametrize("code,cls,retryable", [
    ("NOT_FOUND", errors.NotFound, False), ("FAILED_PRECONDITION", errors.FailedPrecondition, False),
    ("ALREADY_EXISTS", errors.Conflict, False), ("DATA_LOSS", errors.DataLoss, False),
    ("UNAVAILABLE", errors.Unavailable, True), ("DEADLINE_EXCEEDED", errors.Unavailable, True),
    ("RESOURCE_EXHAUSTED", errors.TooLarge, False),
    # gRPC says these for the client's own failures too: nothing to retry
    ("INTERNAL", errors.ServiceError, False), ("UNKNOWN", errors.ServiceError, False),
    ("CANCELLED", errors.ServiceError, False),
])
def test_a_grpc_status_without_a_code_is_classified_by_its_name(code, cls, retryable):
    err = from_grpc("BeginCheckpoint", code, "no metadata", ())
    assert type(err) is cls and err.retryable is retryable and err.grpc_code == code and err.status is None


def test_an_unknown_code_keeps_its_name_and_is_classified_by_status():
    """A newer service's code: the class comes from the status, the reason is kept."""
    err = from_http("POST", "/x", 409, body("quota_exceeded"))
    assert type(err) is errors.Conflict and err.reason == "quota_exceeded" and not err.coded
    err = from_grpc("PutShard", "FAILED_PRECONDITION", "x", ((errors.ERROR_METADATA, "quota_exceeded"),))
    assert type(err) is errors.FailedPrecondition and err.reason == "quota_exceeded"


def test_the_framework_s_own_errors_say_no_route():
    err = from_http("DELETE", "/api/v1/checkpoints/1/tags/a/b", 404, body(codes.HTTP_ERROR, "Not Found"))
    assert isinstance(err, errors.NotFound) and err.no_route and not err.coded
    assert not from_http("GET", "/x", 404, body("not_found")).no_route


def test_the_public_names_work():
    """The names outside code catches: lastgood.* and lastgood.errors.*."""
    from lastgood.errors import ServiceError, ServiceUnreachable

    fenced = from_grpc("CommitRank", "FAILED_PRECONDITION", "fenced", ((errors.ERROR_METADATA, codes.FENCED),))
    assert isinstance(fenced, lastgood.Fenced) and isinstance(fenced, lastgood.ServiceError)
    assert isinstance(fenced, lastgood.LastgoodError)
    assert isinstance(from_http("GET", "/x", 409, body("no_usable_checkpoint")), lastgood.NoUsableCheckpoint)
    assert isinstance(from_http("GET", "/x", 404, body("not_found")), ServiceError)
    assert issubclass(ServiceUnreachable, lastgood.Unavailable)
    for name in ("LastgoodError", "SaveFailed", "CorruptCheckpoint", "NoUsableCheckpoint", "ServiceError", "Fenced"):
        assert getattr(lastgood, name) is getattr(errors, name)


def test_every_domain_error_has_a_code():
    """Every domain error class the service raises has a row, its own or a base class's
    (lookup falls back to invalid_argument for one without, which would hide what it is)."""
    mixins = (domain.DomainError, domain.Damaged)  # raised only as DamagedMissing / DamagedMismatch
    missing = [cls.__name__ for cls in vars(domain).values()
               if isinstance(cls, type) and issubclass(cls, domain.DomainError) and cls not in mixins
               and not any(base in SERVICE_TABLE for base in cls.__mro__)]
    assert missing == []
