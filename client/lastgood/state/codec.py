"""Typed JSON for non-tensor state, with tensors moved out to the safetensors section.

`state_dict()`s mix JSON values with tensors, tuples, int-keyed dicts and NumPy arrays.
We keep their exact types without pickle: tensors and arrays become references to named
entries of the shard's tensor section; other non-JSON types get a small tagged form:

  {"__tensor__": name, "device": "cuda:0"}   torch.Tensor
  {"__dtensor__": name, "shape": [...], "offset": [...]}
                                             a DTensor (FSDP2): this rank's local shard, its
                                             global shape and where the shard starts in it
  {"__ndarray__": name}                      numpy.ndarray
  {"__replica__": name, "rank": r}           a replicated tensor written once, in rank r's
                                             file (replicas.py; the Checkpointer writes it)
  {"__tuple__": [...]}                       tuple (RNG states are tuples)
  {"__dict__": [[key, value], ...]}          dict with non-string keys (optimizer state)
  {"__float__": "nan" | "inf" | "-inf"}      non-finite floats (strict JSON has none)
  {"__np__": dtype, "v": value}              NumPy scalar
  {"__bytes__": base64}, {"__dtype__": "float32"}, {"__device__": "cpu"}

Anything else is refused with the path of the offending value: lastgood never pickles.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lastgood.errors import LastgoodError
from lastgood.wire.format import REPLICA_REF, TENSOR_REFS

_TAGS = (*TENSOR_REFS, REPLICA_REF, "__tuple__", "__dict__", "__float__", "__np__", "__bytes__",
         "__dtype__", "__device__")


class UnsupportedValue(LastgoodError, TypeError):
    pass


class Encoder:
    """Encodes values; collects tensors and arrays under stable, human-readable names."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor | np.ndarray] = {}

    def _name(self, path: list[str]) -> str:
        base = ".".join(path) or "value"
        name, n = base, 1
        while name in self.tensors:
            n += 1
            name = f"{base}#{n}"
        return name

    def encode(self, value, path: list[str], rename: Callable[[list[str]], list[str]] | None = None):
        if rename is not None:
            path = rename(path)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if _is_dtensor(value):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            name = self._name(path)
            self.tensors[name] = value.to_local()
            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            return {"__dtensor__": name, "shape": list(value.shape), "offset": [int(o) for o in offset]}
        if isinstance(value, torch.Tensor):
            name = self._name(path)
            self.tensors[name] = value
            ref = {"__tensor__": name}
            if value.device.type != "cpu":
                ref["device"] = str(value.device)
            return ref
        if isinstance(value, np.ndarray):
            name = self._name(path)
            self.tensors[name] = value
            return {"__ndarray__": name}
        if isinstance(value, np.generic):
            return {"__np__": value.dtype.str, "v": self.encode(value.item(), path)}
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
        if isinstance(value, (tuple, torch.Size)):
            return {"__tuple__": [self.encode(v, path + [str(i)], rename) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, path + [str(i)], rename) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
                return {k: self.encode(v, path + [k], rename) for k, v in value.items()}
            return {"__dict__": [[self.encode(k, path + ["key"]), self.encode(v, path + [str(k)], rename)]
                                 for k, v in value.items()]}
        raise UnsupportedValue(
            f"cannot checkpoint a {type(value).__module__}.{type(value).__qualname__} at "
            f"'{'.'.join(path)}': lastgood stores tensors, arrays and JSON values, and never pickles")


@dataclass(frozen=True)
class ShardRef:
    """A stored DTensor shard: restore fills the live DTensor from every overlapping one."""

    name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def _is_dtensor(value) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def decode(value, tensor: Callable[[str, str | None], torch.Tensor], array: Callable[[str], np.ndarray]):
    """Inverse of Encoder.encode; `tensor(name, device)` and `array(name)` resolve references;
    a DTensor shard decodes to a ShardRef."""
    if isinstance(value, list):
        return [decode(v, tensor, array) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dtensor__" in value:
        return ShardRef(value["__dtensor__"], tuple(value["shape"]), tuple(value["offset"]))
    if "__tensor__" in value:
        return tensor(value["__tensor__"], value.get("device"))
    if REPLICA_REF in value:  # written once, in another rank's file: `tensor` finds it (replicas.py)
        return tensor(value[REPLICA_REF], value.get("device"))
    if "__ndarray__" in value:
        return array(value["__ndarray__"])
    if "__tuple__" in value:
        return tuple(decode(v, tensor, array) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, tensor, array): decode(v, tensor, array) for k, v in value["__dict__"]}
    if "__float__" in value:
        return float(value["__float__"])
    if "__np__" in value:
        return np.dtype(value["__np__"]).type(decode(value["v"], tensor, array))
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__dtype__" in value:
        dt = getattr(torch, value["__dtype__"], None)
        if not isinstance(dt, torch.dtype):
            raise LastgoodError(f"unknown torch dtype {value['__dtype__']!r} in checkpoint")
        return dt
    if "__device__" in value:
        return torch.device(value["__device__"])
    return {k: decode(v, tensor, array) for k, v in value.items()}
