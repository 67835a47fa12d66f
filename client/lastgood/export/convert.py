"""Dtype conversion for the export, in NumPy: the command line stays torch-free.

Conversions round to nearest, ties to even, exactly as `torch.Tensor.to` does on the CPU:
F64 goes through F32 first (torch's CPU casts to F16 and BF16 take a float), BF16 is
widened to F32 by a shift (exact), and a NaN becomes BF16's canonical quiet NaN (0x7FC0),
as in c10::BFloat16. Only the four float formats convert; integers, bools and FP8 are
written as stored (an FP8 tensor's scale factors are part of a scheme we cannot know).
tests/unit/test_export_convert.py checks every case against torch bit for bit.
"""

from __future__ import annotations

import numpy as np

FLOATS = ("F64", "F32", "F16", "BF16")
# --dtype names -> safetensors dtype names
DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# little-endian, as safetensors stores them; BF16 as its raw 16 bits
_NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def target(stored: str, wanted: str | None) -> str:
    """The dtype a stored tensor is written in: `wanted` for floats, else as stored."""
    return wanted if wanted is not None and stored in FLOATS else stored


def _to_f32(raw, src: str) -> np.ndarray:
    a = np.frombuffer(raw, dtype=_NP[src])
    if src == "BF16":
        return (a.astype("<u4") << 16).view("<f4")
    return a.astype("<f4", copy=False)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view("<u4")
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF).astype("<u4")) >> 16).astype("<u2")
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype("<u2", copy=False)


def convert(raw, src: str, dst: str):
    """The bytes of a run of `src` elements (a buffer whose length is a multiple of the
    element size) as `dst` elements: a buffer of the same number of elements."""
    if src == dst:
        return raw
    if src not in FLOATS or dst not in FLOATS:
        raise ValueError(f"cannot convert {src} to {dst}")
    if src == "F64" or dst == "F64":
        if dst == "F64":
            return _to_f32(raw, src).astype("<f8")
        with np.errstate(over="ignore", invalid="ignore"):
            x = np.frombuffer(raw, dtype="<f8").astype("<f4")
    else:
        x = _to_f32(raw, src)
    if dst == "F32":
        return x
    if dst == "F16":
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the rounding rule
            return x.astype("<f2")
    return _f32_to_bf16(x)
