"""lastgood.wire.jsonvalues: the strict-JSON rule for stored values, and how others are carried."""

from __future__ import annotations

import json
import math

import pytest

from lastgood.wire import jsonvalues


@pytest.mark.parametrize("text", ['{"x": NaN}', '[Infinity]', '[-Infinity]', '[1e999]', '["\\ud800"]',
                                  '{"\\udfff": 1}', b'["\xff"]', "[" * 33 + "]" * 33, "[" * 5000, "1" * 5000, "{"])
def test_loads_refuses_what_json_cannot_carry(text):
    with pytest.raises(jsonvalues.InvalidJSON):
        jsonvalues.loads(text)


def test_loads_accepts_strict_json():
    assert jsonvalues.loads(b'{"loss": "nan", "x": [1.5e300, -2, "\\u00e9"], "d": ' + b"[" * 31 + b"]" * 31 + b"}") \
        == {"loss": "nan", "x": [1.5e300, -2, "é"], "d": json.loads("[" * 31 + "]" * 31)}


def test_carried_is_always_strict_json():
    value = {"a": math.nan, "b": [math.inf, -math.inf, 1.0], "s": "x\ud800", "\udfff": 1,
             "deep": json.loads("[" * 40 + "]" * 40)}
    out = jsonvalues.carried(value)
    assert out["a"] == "nan" and out["b"] == ["inf", "-inf", 1.0] and out["s"].startswith("x")
    text = json.dumps(out, allow_nan=False, ensure_ascii=False)
    text.encode("utf-8")  # no lone surrogate left
    assert jsonvalues.loads(text)["a"] == "nan" and jsonvalues.TOO_DEEP in text
