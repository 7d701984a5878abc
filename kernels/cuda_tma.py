"""TMA tensor maps of the pool, for the Hopper prefill kernel's K/V loads.

A tensor map tells the copy engine (TMA) how to cut boxes out of a global
tensor. The kernel loads one pool block at a time: a box of 64 head dims x
``block_size`` rows, written to shared memory with the 128-byte swizzle its
MMA descriptors read. One layer's K (or V) view ``[num_blocks, num_kv_heads,
block_size, head_dim]`` is described as a 3-D tensor (head_dim, num_kv_heads x
block_size rows, num_blocks) with the view's own block stride, so a block is
addressed by (panel, kv_head x block_size, block id) and an id of
``num_blocks`` lies outside the map (the engine writes zeros).

Maps are encoded on the host by the driver (``cuTensorMapEncodeTiled``,
through ctypes: no extra dependency) and copied once to device memory, where
the kernel reads them; they are cached per (device, address, geometry), so a
pool's layers each cost one small copy, at their first call. That copy cannot
happen during CUDA-graph capture: ``maps_for`` then returns None and the
caller runs the ``mma.sync`` kernel instead. So it does where the driver
cannot make maps at all (no ``cuTensorMapEncodeTiled``: a driver older than
CUDA 12; said once, as a warning) or refuses one view's map (remembered per
view).
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from ._validate import CacheGeometry

_MAP_BYTES = 128
_DTYPE = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_BOX_DIMS = 64  # head dims per box: 128 bytes of 16-bit values, the swizzle's span

_MAPS: dict[tuple, torch.Tensor | None] = {}  # None: the driver refused this view's map
_MAX_MAPS = 4096
_UNAVAILABLE: list[str] = []  # why this process cannot make maps at all (empty: it can)


@functools.lru_cache(maxsize=1)
def _encode_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return fn


def encode(address: int, geo: CacheGeometry, block_stride: int) -> bytes:
    """The 128-byte tensor map of one K or V view (``block_stride`` in elements)."""
    es = 2
    dims = (ctypes.c_uint64 * 3)(geo.head_dim, geo.num_kv_heads * geo.block_size, geo.num_blocks)
    strides = (ctypes.c_uint64 * 2)(geo.head_dim * es, block_stride * es)
    box = (ctypes.c_uint32 * 3)(_BOX_DIMS, geo.block_size, 1)
    steps = (ctypes.c_uint32 * 3)(1, 1, 1)
    raw = ctypes.create_string_buffer(_MAP_BYTES + 64)
    aligned = (ctypes.addressof(raw) + 63) & ~63  # CUtensorMap is 64-byte aligned
    status = _encode_fn()(
        aligned, _DTYPE[geo.dtype], 3, address, dims, strides, box, steps, 0, _SWIZZLE_128B, _L2_PROMOTION_128B, 0
    )
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {geo}")
    return ctypes.string_at(aligned, _MAP_BYTES)


def usable(geo: CacheGeometry, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What the copy engine needs: 16-bit elements, 16-byte aligned bases and strides, a
    box of at most 256 rows, and at most 2^31 - 1 blocks (kernel coordinates are int)."""
    return (
        geo.dtype in _DTYPE
        and geo.block_size <= 256
        and geo.num_blocks < 2**31 - 1
        and all(t.data_ptr() % 16 == 0 for t in (k_cache, v_cache))
        and all(s * 2 % 16 == 0 for s in (geo.k_block_stride, geo.v_block_stride))
    )


def maps_for(geo: CacheGeometry, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Device copies of the K and V maps, or None where TMA cannot be used now: a layout the
    engine does not take, a driver that cannot make maps, or a map not yet made while a
    CUDA graph is being captured."""
    if _UNAVAILABLE or not usable(geo, k_cache, v_cache):
        return None
    out = []
    for t, stride in ((k_cache, geo.k_block_stride), (v_cache, geo.v_block_stride)):
        key = (t.device.index, t.data_ptr(), geo.num_blocks, geo.num_kv_heads, geo.block_size, geo.head_dim, stride, geo.dtype)
        if key in _MAPS:
            m = _MAPS[key]
        else:
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            m = _make(t, geo, stride)
            if _UNAVAILABLE:
                return None
            if len(_MAPS) >= _MAX_MAPS:  # pools come and go: forget the old ones wholesale
                _MAPS.clear()
            _MAPS[key] = m
        if m is None:
            return None
        out.append(m)
    return out[0], out[1]


def _make(t: torch.Tensor, geo: CacheGeometry, stride: int) -> torch.Tensor | None:
    """One view's map on its device; None if the driver refused it."""
    try:
        raw = encode(t.data_ptr(), geo, stride)
    except (AttributeError, OSError) as exc:  # no libcuda, or no cuTensorMapEncodeTiled in it
        _UNAVAILABLE.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            f"kvpool.kernels: the CUDA driver cannot make TMA tensor maps ({exc}); prefill runs the mma.sync kernel",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    except RuntimeError:
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(t.device)
