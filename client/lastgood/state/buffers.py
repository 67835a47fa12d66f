"""Stored tensors viewed in (or copied out of) the buffer a file was read into: torch tensors
for a restore, NumPy arrays for a state's non-tensor values."""

from __future__ import annotations

import numpy as np
import torch

from lastgood.errors import LastgoodError
from lastgood.state.dtypes import ST_TO_NUMPY, ST_TO_TORCH


def tensor_from_buffer(buf, spec: dict, data_start: int, device: str | None, copy: bool) -> torch.Tensor:
    dtype = ST_TO_TORCH[spec["dtype"]]
    a, b = spec["data_offsets"]
    shape = tuple(spec["shape"])
    if b == a:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=data_start + a).view(dtype).view(shape)
        if copy:
            t = t.clone()
    if device is not None and device != "cpu":
        dev = torch.device(device)
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise LastgoodError(f"checkpoint holds a tensor on {device}, which this process does not have")
        t = t.to(dev)
    return t


def array_from_buffer(buf, spec: dict, data_start: int) -> np.ndarray:
    dtype = ST_TO_NUMPY[spec["dtype"]]
    a, b = spec["data_offsets"]
    return np.frombuffer(buf, dtype=dtype, count=(b - a) // dtype.itemsize,
                         offset=data_start + a).reshape(spec["shape"]).copy()
