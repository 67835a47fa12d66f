"""Typed JSON round trip: every value type that state_dict()s contain comes back with
its exact type and value; anything else is refused (nothing is ever pickled)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from lastgood.state.codec import Encoder, UnsupportedValue, decode


def roundtrip(value):
    enc = Encoder()
    doc = json.loads(json.dumps(enc.encode(value, ["x"]), allow_nan=False))  # strict JSON
    return decode(doc, lambda n, d: enc.tensors[n], lambda n: enc.tensors[n]), enc


def test_types_survive_exactly():
    value = {
        "int_keys": {0: "a", 7: {"nested": (1, 2.5, None)}},
        "tuple": (3, [4, (5,)]), "nan": float("nan"), "inf": float("-inf"),
        "np_scalar": np.float32(1.5), "np_int": np.int64(2**40), "bytes": b"\x00\xff",
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "big": 2**62, "bool": True,
        "tensor": torch.arange(3), "array": np.arange(4, dtype=np.uint32),
        "python_rng": random.Random(3).getstate(), "numpy_rng": np.random.RandomState(1).get_state(),
    }
    out, enc = roundtrip(value)
    assert out["int_keys"] == {0: "a", 7: {"nested": (1, 2.5, None)}}
    assert out["tuple"] == (3, [4, (5,)]) and isinstance(out["tuple"][1][1], tuple)
    assert math.isnan(out["nan"]) and out["inf"] == float("-inf")
    assert type(out["np_scalar"]) is np.float32 and out["np_scalar"] == np.float32(1.5)
    assert type(out["np_int"]) is np.int64 and out["np_int"] == 2**40
    assert out["bytes"] == b"\x00\xff" and out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert out["big"] == 2**62 and out["bool"] is True
    assert out["python_rng"] == value["python_rng"]
    r = np.random.RandomState()
    r.set_state(out["numpy_rng"])
    ref = np.random.RandomState(1)
    assert r.rand() == ref.rand()
    assert set(enc.tensors) == {"x.tensor", "x.array", "x.numpy_rng.1"}


def test_tensor_names_are_readable_paths_and_unique():
    enc = Encoder()
    enc.encode({"a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)}, ["comp"])
    assert set(enc.tensors) == {"comp.a.b", "comp.a.b#2"}


def test_dicts_that_look_like_tags_are_not_confused():
    out, _ = roundtrip({"__tuple__": [1, 2]})
    assert out == {"__tuple__": [1, 2]}


class Opaque:
    pass


@pytest.mark.parametrize("bad", [Opaque(), {1, 2}, lambda: 0, complex(1, 2)])
def test_unsupported_values_are_refused_with_their_path(bad):
    with pytest.raises(UnsupportedValue, match=r"x\.field"):
        Encoder().encode({"field": bad}, ["x"])


def test_the_dcp_writer_pickles_without_its_connection():
    """DCP's process-based async_save pickles the storage writer: it must carry no channel."""
    import pickle

    from lastgood import dcp as lgdcp

    w = lgdcp.StorageWriter("http://127.0.0.1:1", run="r", step=3)
    w._transport = object()  # stands in for an open connection
    clone = pickle.loads(pickle.dumps(w))
    assert clone._transport is None and clone.url == w.url and clone.run == "r" and clone.step == 3
