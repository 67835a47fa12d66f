"""torch / NumPy dtypes <-> safetensors dtype names."""

from __future__ import annotations

import numpy as np
import torch

from lastgood.errors import FormatError

TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}

NUMPY_TO_ST = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8", np.dtype("bool"): "BOOL", np.dtype("uint16"): "U16",
    np.dtype("uint32"): "U32", np.dtype("uint64"): "U64",
}
ST_TO_NUMPY = {v: k for k, v in NUMPY_TO_ST.items()}


def st_dtype(value) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout != torch.strided:
            raise FormatError(f"only dense tensors can be checkpointed, not {value.layout}")
        name = TORCH_TO_ST.get(value.dtype)
    else:
        name = NUMPY_TO_ST.get(value.dtype.newbyteorder("=") if value.dtype.byteorder == ">" else value.dtype)
    if name is None:
        raise FormatError(f"dtype {value.dtype} is not supported by the safetensors format")
    return name
