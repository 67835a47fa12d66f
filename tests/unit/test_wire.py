"""Hand-framed shard chunks (lastgood.wire.framing) are exactly protobuf's encoding, both ways."""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf.message import DecodeError

from lastgood.wire import framing
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood_service.api import grpc_server


@pytest.mark.parametrize("n", [1, 127, 128, 300, 16_383, 16_384, 4 << 20])
def test_frame_is_protobufs_encoding(n):
    data = os.urandom(n)
    put = framing.frame(framing.PUT_CHUNK, memoryview(data))
    get = framing.frame(framing.GET_CHUNK, data)
    assert put == pb.PutShardRequest(chunk=data).SerializeToString()
    assert get == pb.GetShardResponse(chunk=data).SerializeToString()
    assert pb.PutShardRequest.FromString(put).chunk == data
    # and back, without a copy: a view into the received message
    view = framing.unframe(get, framing.GET_CHUNK)
    assert isinstance(view, memoryview) and view.obj is get and bytes(view) == data
    assert bytes(framing.unframe(put, framing.PUT_CHUNK)) == data


def test_frame_of_an_empty_chunk_parses_as_one():
    assert pb.PutShardRequest.FromString(framing.frame(framing.PUT_CHUNK, b"")).WhichOneof("body") == "chunk"
    assert bytes(framing.unframe(framing.frame(framing.GET_CHUNK, b""), framing.GET_CHUNK)) == b""


def test_other_encodings_are_left_to_protobuf():
    """unframe() takes only the exact form frame() writes; everything else is None, and
    protobuf then gives it its meaning (or refuses it)."""
    data = b"abcdef"
    chunk = framing.frame(framing.PUT_CHUNK, data)
    header = pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=1, file_name="x")).SerializeToString()
    unknown_field = bytes((7 << 3 | 2, len(data))) + data  # no field 7 in PutShardRequest
    twice = framing.frame(framing.PUT_CHUNK, b"zz") + chunk  # the last one wins
    for raw, body in ((b"", None), (header, "header"), (unknown_field, None), (twice, "chunk")):
        assert framing.unframe(raw, framing.PUT_CHUNK) is None, raw
        assert pb.PutShardRequest.FromString(raw).WhichOneof("body") == body
    assert pb.PutShardRequest.FromString(twice).chunk == data
    # a length written as a longer varint than needed is valid protobuf, and read alike
    overlong = bytes((framing.PUT_CHUNK, 0x86, 0x80, 0x00)) + data
    assert bytes(framing.unframe(overlong, framing.PUT_CHUNK)) == data == pb.PutShardRequest.FromString(overlong).chunk
    # truncated or padded: the length disagrees with what follows
    for raw in (chunk[:-1], chunk + b"\x00", bytes((framing.PUT_CHUNK,)) + b"\xff" * 11):
        assert framing.unframe(raw, framing.PUT_CHUNK) is None
        with pytest.raises(DecodeError):
            pb.PutShardRequest.FromString(raw)
    with pytest.raises(ValueError):
        framing.varint(-1)


def test_the_servers_handlers_cover_every_method_of_the_proto():
    """The service registers its methods by hand (two of them take raw bytes): none may be
    missing, and each must stream the way the .proto says."""
    methods = pb.DESCRIPTOR.services_by_name["Checkpoints"].methods
    handlers = grpc_server.handlers(grpc_server.Servicer.__new__(grpc_server.Servicer))
    assert set(handlers) == {m.name for m in methods}
    for m in methods:
        h = handlers[m.name]
        assert isinstance(h, grpc.RpcMethodHandler)
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming, m.server_streaming), m.name
        raw_in, raw_out = m.name == "PutShard", m.name == "GetShard"
        assert (h.request_deserializer is None) == raw_in and (h.response_serializer is None) == raw_out
