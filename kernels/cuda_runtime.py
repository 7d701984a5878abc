"""CuPy plumbing for the GPU kernels: compile once per device, launch on torch's stream.

Imported only when a CUDA tensor reaches a public wrapper, so the CPU path
never imports CuPy. Kernels are launched on the caller's *current torch
stream*, which orders them after the caller's own work and lets them be
captured in a ``torch.cuda.CUDAGraph`` (compile and first launch happen
before capture, in a warm-up call, as with any lazily compiled kernel).

A launcher is anything with ``launch(module_key, name, device, grid, args,
smem)``; ``CupyLauncher`` is the real one; the tests' ``EmulatorLauncher``
(``tests/kernels/support/cuda_emulator.py``) runs the same CUDA source on the
CPU. Kernel arguments are NumPy scalars whose dtype fixes their C type
(pointers are ``np.uint64``). The source is package data (``cuda/*.cu``,
read by ``cuda_source``).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from . import cuda_source
from .cuda_source import WG_GROUPS

# The kernels' CUDA C++ (package data: cuda/*.cu), read once at import.
SOURCE = cuda_source.read_attention()
SOURCE_SM90 = cuda_source.read_sm90()

THREADS = 128
SMEM_OPT_IN = 227 * 1024  # largest dynamic shared memory a CTA may use on sm_80 / sm_90
_OPTIONS = ("-std=c++17", "--use_fast_math")
# The sm_90a module's NVRTC options. As in CuPy's own compiles: functions (and lambdas)
# without an execution space are device code.
SM90A_OPTIONS = (*_OPTIONS, "-arch=sm_90a", "--device-as-default-execution-space")


def module_kernels(module_key: tuple) -> dict[str, str]:
    """Kernel short names → C++ name expressions of one compiled module."""
    if module_key[0] == "attention":
        _, dt, d, kf, warps_kv, stages, keys, pair = module_key
        kernel = "paged_attention_pair_kernel" if pair else "paged_attention_kernel"
        return {
            "attention": f"{kernel}<{dt},{d},{kf},{warps_kv},{stages},{keys}>",
            "merge": f"merge_splits_kernel<{dt},{d},{kf}>",
        }
    if module_key[0] == "prefill":
        _, dt, d, mtiles, warps, stages = module_key
        return {"attention": f"prefill_kernel<{dt},{d},{mtiles},{warps},{stages}>"}
    if module_key[0] == "prefill_wg":
        _, dt, d, persistent = module_key
        return {"attention": f"prefill_wg_kernel<{dt},{d},{'true' if persistent else 'false'}>"}
    if module_key[0] == "write_kv":
        return {"write_kv": "write_kv_kernel"}
    raise KeyError(module_key)


def cluster_z(module_key: tuple, name: str) -> int:
    """CTAs per cluster (along the grid's z axis, the splits) that a module's kernel is
    compiled for: 2 for the pair decode kernel, else 1 (no cluster)."""
    return 2 if module_key[0] == "attention" and module_key[7] and name == "attention" else 1


def block_threads(module_key: tuple) -> int:
    """Threads per CTA of a module's kernels: 128, 32 per warp of a prefill key, or 128 per
    warpgroup of a warpgroup-MMA prefill key (its consumer warpgroups and the producer)."""
    if module_key[0] == "prefill":
        return 32 * module_key[4]
    if module_key[0] == "prefill_wg":
        return 128 * (WG_GROUPS + 1)
    return THREADS


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (``None`` → null)."""
    return np.uint64(0 if t is None else t.data_ptr())


@functools.lru_cache(maxsize=None)
def _functions(device_index: int, module_key: tuple) -> dict:
    import cupy

    names = module_kernels(module_key)
    with cupy.cuda.Device(device_index):
        if module_key[0] == "prefill_wg":
            return compile_sm90a(SOURCE + SOURCE_SM90, names)
        module = cupy.RawModule(code=SOURCE, options=_OPTIONS, name_expressions=list(names.values()))
        return {short: module.get_function(expr) for short, expr in names.items()}


class Sm90aKernel:
    """A kernel of a module compiled for sm_90a, called like a ``cupy.RawKernel``."""

    _MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def __init__(self, function) -> None:
        self._function = function

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver

        return driver.funcGetAttribute(self._MAX_DYNAMIC_SHARED, self._function.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self._function.ptr, self._MAX_DYNAMIC_SHARED, int(value))

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        self._function(tuple(grid), tuple(block), args, shared_mem=shared_mem)


def compile_sm90a(source: str, names: dict[str, str]) -> dict[str, Sm90aKernel]:
    """Compile ``source`` for sm_90a with NVRTC and load it on the current device.

    CuPy's own compile path derives ``-arch`` from the device (``sm_90``) and has no
    way to ask for the architecture-specific ``sm_90a`` that ``wgmma`` needs, so this
    drives NVRTC (CuPy's binding of it) directly; the module is cached per process
    by ``_functions``.
    """
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kvpool_sm90a.cu", (), ())  # #line directives name the files
    try:
        for expr in names.values():
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, SM90A_OPTIONS)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed to compile the sm_90a kernels: {nvrtc.getProgramLog(prog)}") from exc
        lowered = {short: nvrtc.getLoweredName(prog, expr) for short, expr in names.items()}
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    module = function.Module()
    module.load(cubin)
    return {short: Sm90aKernel(module.get_function(name)) for short, name in lowered.items()}


@functools.lru_cache(maxsize=None)
def has_wgmma(device_index: int) -> bool:
    """Whether the device runs sm_90a code (Hopper: compute capability 9.0)."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.lru_cache(maxsize=None)
def has_clusters(device_index: int) -> bool:
    """Whether the device runs thread block clusters (compute capability 9.0 and later)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


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

    def wgmma(self, device: torch.device) -> bool:
        return has_wgmma(device.index)

    def clusters(self, device: torch.device) -> bool:
        return has_clusters(device.index)

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
