"""CuPy plumbing for the GPU kernels: compile once per device, launch on torch's stream.

Imported only when a CUDA tensor reaches a public wrapper, so the CPU path
never imports CuPy. Kernels are launched on the caller's *current torch
stream*, which orders them after the caller's own work and lets them be
captured in a ``torch.cuda.CUDAGraph`` (compile and first launch happen
before capture, in a warm-up call, as with any lazily compiled kernel).

A launcher is anything with ``launch(module_key, name, device, grid, args,
smem)``; ``CupyLauncher`` is the real one, ``cuda_emulator.EmulatorLauncher``
runs the same CUDA source on the CPU for tests. Kernel arguments are NumPy
scalars whose dtype fixes their C type (pointers are ``np.uint64``).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from .cuda_source import SOURCE

THREADS = 128
SMEM_OPT_IN = 227 * 1024  # largest dynamic shared memory a CTA may use on sm_80 / sm_90
_OPTIONS = ("-std=c++17", "--use_fast_math")


def module_kernels(module_key: tuple) -> dict[str, str]:
    """Kernel short names → C++ name expressions of one compiled module."""
    if module_key[0] == "attention":
        _, dt, d, warps_kv, stages, keys = module_key
        return {
            "attention": f"paged_attention_kernel<{dt},{d},{warps_kv},{stages},{keys}>",
            "merge": f"merge_splits_kernel<{dt},{d}>",
        }
    if module_key[0] == "prefill":
        _, dt, d, mtiles, warps, stages = module_key
        return {"attention": f"prefill_kernel<{dt},{d},{mtiles},{warps},{stages}>"}
    if module_key[0] == "write_kv":
        return {"write_kv": "write_kv_kernel"}
    raise KeyError(module_key)


def block_threads(module_key: tuple) -> int:
    """Threads per CTA of a module's kernels: 128, or 32 per warp of a prefill key."""
    return 32 * module_key[4] if module_key[0] == "prefill" else THREADS


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (``None`` → null)."""
    return np.uint64(0 if t is None else t.data_ptr())


@functools.lru_cache(maxsize=None)
def _functions(device_index: int, module_key: tuple) -> dict:
    import cupy

    names = module_kernels(module_key)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE, options=_OPTIONS, name_expressions=list(names.values()))
        return {short: module.get_function(expr) for short, expr in names.items()}


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class CupyLauncher:
    """Launches the CUDA source's kernels through CuPy on torch's current stream."""

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        self._smem_set: set = set()
        self._streams: dict = {}

    def num_sms(self, device: torch.device) -> int:
        return num_sms(device.index)

    def launch(self, module_key: tuple, name: str, device: torch.device, grid, args, smem: int = 0) -> None:
        cupy = self._cupy
        fn = _functions(device.index, module_key)[name]
        if smem > 48 * 1024 and (device.index, module_key, name) not in self._smem_set:
            fn.max_dynamic_shared_size_bytes = SMEM_OPT_IN  # opt in above the 48 KiB default
            self._smem_set.add((device.index, module_key, name))
        with cupy.cuda.Device(device.index), self._stream(device):
            fn(tuple(grid), (block_threads(module_key), 1, 1), tuple(args), shared_mem=smem)

    def _stream(self, device: torch.device):
        """CuPy's handle on torch's current stream (cached: one object per stream)."""
        ptr = torch.cuda.current_stream(device).cuda_stream
        key = (device.index, ptr)
        stream = self._streams.get(key)
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._cupy.cuda.ExternalStream(ptr, device.index)
            self._streams[key] = stream
        return stream


@functools.lru_cache(maxsize=1)
def default_launcher() -> CupyLauncher:
    return CupyLauncher()
