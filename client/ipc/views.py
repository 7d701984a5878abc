"""Turning a raw byte range into a typed torch tensor, shared by every arena (daemon and client side).

Every backend first makes a flat ``uint8`` tensor over its bytes and then
reinterprets it (``Tensor.view(dtype)``): that works for dtypes that have no
NumPy / CUDA-array-interface spelling (bfloat16, float8_e4m3fn) too.
"""

from __future__ import annotations

import math

from ..protocol.arena import DTYPE_ITEMSIZE


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    dt = getattr(torch, name, None)
    if dt is None:  # pragma: no cover - very old torch without float8
        raise ValueError(f"this torch ({torch.__version__}) has no dtype {name!r}")
    return dt


def check_range(dtype: str, shape, offset: int, nbytes_total: int) -> tuple[tuple[int, ...], int]:
    """Validate a view request; returns (shape, byte count)."""
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    itemsize = DTYPE_ITEMSIZE[dtype]
    count = math.prod(shape) * itemsize
    if count == 0:
        raise ValueError(f"shape {shape} is empty")
    if offset < 0 or offset % itemsize:
        raise ValueError(f"offset {offset} is negative or not a multiple of {dtype}'s size {itemsize}")
    if offset + count > nbytes_total:
        raise ValueError(
            f"view of {count} bytes at offset {offset} ({dtype}{list(shape)}) "
            f"does not fit in the arena's {nbytes_total} bytes"
        )
    return shape, count


def typed_view(flat_u8, dtype: str, shape: tuple[int, ...]):
    """Reinterpret a flat uint8 tensor as ``dtype`` with ``shape`` (no copy)."""
    return flat_u8.view(torch_dtype(dtype)).view(shape)
