"""Packed little-endian arrays on the wire: numpy <-> bytes, both directions.

Shared by the client and the daemon so that the two agree by construction.
"""

from __future__ import annotations

import numpy as np

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
U32 = np.dtype("<u4")


def pack(values, dtype: np.dtype) -> bytes:
    """Any sequence of integers -> packed bytes (raises ValueError/OverflowError on bad values)."""
    arr = np.asarray(values)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iub":
        raise TypeError(f"expected integers, got {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.min() < info.min or arr.max() > info.max:
        raise OverflowError(f"values out of range for {dtype}")
    return arr.astype(dtype, copy=False).tobytes()


def unpack(data: bytes, dtype: np.dtype, name: str = "field") -> np.ndarray:
    """Packed bytes -> a read-only numpy view (no copy)."""
    if len(data) % dtype.itemsize:
        raise ValueError(f"{name}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte items")
    return np.frombuffer(data, dtype)
