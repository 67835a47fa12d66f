"""What a JSON value that lastgood stores may hold, and how other values are carried.

Python's json module reads and writes `NaN`, `Infinity`, `1e999` (read as infinity) and
lone surrogates (`"\\ud800"`), but JSON has no such values: the service answers with
`allow_nan=False` and UTF-8, so one such value stored in an event made every later read of
the run's events fail. The rules, owned here for the service and the client alike:

- the service refuses a request body that is not strict JSON: non-finite numbers, text that
  is not valid UTF-8 (lone surrogates included), nesting deeper than MAX_DEPTH (`loads`);
- a client that has a non-finite number to report sends it as the string "nan", "inf" or
  "-inf" (`carried`); SpikeGuard does so for the loss and gradient norm of a spike;
- reads repair rows stored before these rules: non-finite numbers become those strings,
  lone surrogates U+FFFD, anything nested deeper than MAX_DEPTH the string "(too deep)".
"""

from __future__ import annotations

import json
import math

MAX_DEPTH = 32
TOO_DEEP = "(too deep)"


class InvalidJSON(ValueError):
    pass


def _refuse_constant(name: str):
    raise InvalidJSON(f"{name} is not a JSON number: send a non-finite value as the string "
                      f"\"nan\", \"inf\" or \"-inf\"")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise InvalidJSON(f"number {text[:40]} is out of the range of a 64-bit float")
    return x


def loads(data: bytes | str):
    """Strict JSON: finite numbers, valid UTF-8, at most MAX_DEPTH levels; else InvalidJSON."""
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidJSON(f"the body is not UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except InvalidJSON:
        raise
    except RecursionError:
        raise InvalidJSON(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # not JSON, or an integer of more digits than Python converts
        raise InvalidJSON(str(e)[:200]) from None
    check(value)
    return value


def check(value, depth: int = 0) -> None:
    """InvalidJSON unless `value` holds only finite numbers, UTF-8 text and at most
    MAX_DEPTH levels of arrays and objects (`depth`: the levels around `value`)."""
    if isinstance(value, dict | list | tuple):
        depth += 1
        if depth > MAX_DEPTH:
            raise InvalidJSON(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidJSON(f"{value} is not a JSON number")
    if isinstance(value, str):
        _utf8(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8(k)
            check(v, depth)
    elif isinstance(value, list | tuple):
        for v in value:
            check(v, depth)


def _utf8(text) -> None:
    try:
        str(text).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidJSON(f"text with a lone surrogate at character {e.start} is not UTF-8") from None


def carry(x: float) -> float | str:
    """A float as JSON can carry it: itself if finite, else "nan", "inf" or "-inf"."""
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def carried(value, depth: int = 0):
    """`value` with every non-finite float carried, every lone surrogate replaced by U+FFFD
    and anything deeper than MAX_DEPTH replaced by TOO_DEEP: always valid strict JSON."""
    if isinstance(value, dict | list | tuple):
        depth += 1
        if depth > MAX_DEPTH:
            return TOO_DEEP
    if isinstance(value, float):
        return carry(value)
    if isinstance(value, str):
        return _repair(value)
    if isinstance(value, dict):
        return {_repair(str(k)): carried(v, depth) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [carried(v, depth) for v in value]
    return value


def _repair(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
