"""The shard format is plain safetensors: our writer's files open with safetensors'
own reader, and our header parser rejects what safetensors would reject."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from lastgood.errors import FormatError
from lastgood.wire.format import MAX_STATE_DEPTH, META_STATE, TensorSpec, parse_header, parse_state, plan_layout
from lastgood.state.staging import StagingPool, snapshot


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(3, 5, generator=g),
        "model.half": torch.randn(7, generator=g).half(),
        "model.bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "model.i64": torch.arange(5),
        "flags": torch.tensor([True, False, True]),
        "bytes": torch.arange(11, dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(20.0).view(4, 5).t(),  # non-contiguous source
    }


def test_snapshot_is_a_safetensors_file_readable_by_safetensors(tmp_path):
    ts = _tensors()
    snap = snapshot(1, {"hello": "world"}, ts, StagingPool(slots=1, pin=False))
    path = tmp_path / "x.safetensors"
    path.write_bytes(snap.view())
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(ts)
        for k, v in ts.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
        assert json.loads(f.metadata()["lastgood.state"]) == {"hello": "world"}
    assert set(st_load(path.read_bytes())) == set(ts)


def test_layout_aligns_every_tensor_to_its_element_size():
    specs = [TensorSpec("a", "U8", (3,)), TensorSpec("b", "F64", (2,)), TensorSpec("c", "F16", (5,)),
             TensorSpec("d", "F32", (1,))]
    layout = plan_layout(specs, {})
    assert layout.data_start % 8 == 0
    sizes = {"U8": 1, "F64": 8, "F16": 2, "F32": 4}
    for s in specs:
        assert layout.offsets[s.name][0] % sizes[s.dtype] == 0


def test_numpy_arrays_go_to_the_tensor_section(tmp_path):
    arr = np.arange(624, dtype=np.uint32)
    snap = snapshot(0, {}, {"rng.numpy": arr}, StagingPool(slots=1, pin=False))
    tensors, _ = parse_header(snap.view(), file_size=snap.layout.size)
    assert tensors["rng.numpy"]["dtype"] == "U32" and tensors["rng.numpy"]["shape"] == [624]


def _file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header,data,msg", [
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "do not fit"),
    ({"t": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "hole"),
    ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "bad shape"),
    ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6, "cover"),
    ({"__metadata__": {"a": 1}}, b"", "strings"),
])
def test_parse_header_rejects_malformed_files(header, data, msg):
    blob = _file(header, data)
    with pytest.raises(FormatError, match=msg):
        parse_header(blob, file_size=len(blob))


def test_parse_header_rejects_absurd_header_length_and_bad_json():
    with pytest.raises(FormatError, match="exceeds"):
        parse_header(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_header(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(FormatError, match="shorter"):
        parse_header(b"\x01\x02")


# ---------------------------------------------------------------- the state document
def _one_tensor():
    return {"model.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def test_parse_state_reads_a_well_formed_state():
    state = {"version": 1, "components": {"model": {"kind": "module", "state": {"w": {"__tensor__": "model.w"}}}}}
    assert parse_state({META_STATE: json.dumps(state)}, _one_tensor()) == state


@pytest.mark.parametrize("text, says", [
    ('{"a": ', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),      # beyond the JSON parser's own limit
    ('{"a": ' + "[" * MAX_STATE_DEPTH + "]" * MAX_STATE_DEPTH + "}", "nested more than"),
    ("[1, 2]", "not a JSON object"),
    ('{"w": {"__tensor__": "model.gone"}}', "'model.gone'"),
    ('{"w": {"__ndarray__": 5}}', "refers to tensor '5'"),
    (None, "no lastgood.state"),
])
def test_parse_state_refuses_what_restore_could_not_apply(text, says):
    with pytest.raises(FormatError, match=says):
        parse_state({} if text is None else {META_STATE: text}, _one_tensor())


def test_parse_state_takes_the_deepest_state_it_allows():
    deep = '{"a": ' + "[" * (MAX_STATE_DEPTH - 2) + "]" * (MAX_STATE_DEPTH - 2) + "}"
    assert parse_state({META_STATE: deep}, _one_tensor())["a"]
