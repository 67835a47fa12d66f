"""GET /api/v1/info, typed (lastgood.wire.info): what the service sends reads back the same,
a newer service's words are kept aside, and only a wrong type of a field the client needs
is refused."""

from __future__ import annotations

import logging

import pytest

from lastgood.wire.errors import FormatError
from lastgood.wire.info import DEFAULT_LEASE_SECONDS, DirectS3Offer, Info, SpoolOffer
from lastgood.wire.vocab import Verification

SENT = {"service": "lastgood", "version": "0.1.0", "grpc_target": "127.0.0.1:50051", "max_chunk_bytes": 4194304,
        "max_shard_bytes": 1 << 38, "lease_seconds": 60, "verification": "peer", "range_block_bytes": 1048576,
        "max_request_bytes": 1048576, "inline_bytes": 1048576, "spool": {"dir": "/d/spool", "id": "ab" * 16, "follow": True},
        "direct_fs": None, "direct_s3": {"part_size": 8 << 20, "max_parts": 10000, "checksum": "crc32",
                                         "grant_seconds": 3600}}


def test_what_the_service_sends_reads_back_the_same():
    info = Info.from_dict(SENT)
    assert info.verification is Verification.PEER and info.lease_seconds == 60.0
    assert info.spool == SpoolOffer("/d/spool", "ab" * 16, True) and isinstance(info.direct_s3, DirectS3Offer)
    assert info.to_dict() == {**SENT, "lease_seconds": 60.0, "direct_s3": {**SENT["direct_s3"], "grant_seconds": 3600.0}}
    assert info.commit_timeout == 2 * 60 + 60
    assert Info.from_dict({"grpc_target": "x"}).lease_seconds == DEFAULT_LEASE_SECONDS  # defaults fill the rest


def test_a_newer_services_words_are_kept_aside(caplog):
    info = Info.from_dict({**SENT, "verification": "quorum", "tiers": ["memory"]})
    assert info.verification is Verification.SERVICE  # checks no peer's files, as before it knew the word
    assert info.extra == {"verification": "quorum", "tiers": ["memory"]}
    with caplog.at_level(logging.WARNING, logger="lastgood"):
        broken = Info.from_dict({**SENT, "spool": {"dir": 1, "id": "x"}, "direct_s3": "yes"})
    assert broken.spool is None and broken.direct_s3 is None  # streamed instead
    assert "spool offer" in caplog.text and "direct_s3 offer" in caplog.text


@pytest.mark.parametrize("bad", [[], {"version": "1"}, {"grpc_target": 7}, {"grpc_target": "x", "lease_seconds": "60"},
                                 {"grpc_target": "x", "max_chunk_bytes": True}])
def test_a_wrong_type_of_a_field_the_client_needs_is_refused(bad):
    with pytest.raises(FormatError, match="/api/v1/info"):
        Info.from_dict(bad)
