"""Numeric precision of the forward pass: `train.dtype` resolved for a device, and its autocast.

Parameters and optimizer state always stay float32; only the forward pass (matmuls, attention) runs
in the autocast dtype, and the loss is computed in float32 (tinylm.nn_utils.cross_entropy upcasts).

    dtype = resolve_dtype("auto", device)      # bfloat16 on a CUDA device that has it, else float32
    with autocast(device, dtype):
        logits = model(x)
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The autocast dtype for `train.dtype` = name on `device`.

    "auto" is bfloat16 on a CUDA device that supports it and float32 everywhere else (on the CPU
    bf16 autocast runs, but is slower than float32 for small models and changes the published
    figures of the default run). The explicit names are taken as they are.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"train.dtype: {name!r} is not one of {['auto', *DTYPES]}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16' or 'float16'."""
    return str(dtype).removeprefix("torch.")


def autocast(device: torch.device | str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device`'s type; no autocast at all for float32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
