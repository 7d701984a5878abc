"""Compile the GPU kernels' CUDA source with NVRTC, as a GPU machine does at first use, on a
machine without a GPU: what NVRTC refuses and ``nvcc`` accepts shows here, before a GPU run.

    pip install --target /tmp/nvrtc "nvidia-cuda-nvrtc==13.0.*"
    LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib python3 scripts/check_cuda_source.py /tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13

Each module compiles with the options ``kvpool.kernels.cuda_runtime`` uses: its own plus what
CuPy adds (``--device-as-default-execution-space``, ``-ftz=true``, sm_90) for the
``attention`` and ``prefill`` modules, ``SM90A_OPTIONS`` for the warpgroup-MMA prefill. Prints one line per module and
exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

from kvpool.kernels import cuda_runtime

# (module key, arch): decode rings of 2 and 3 stages, float8 stages, prefill on the split-KV
# kernel, the dedicated prefill kernels and the warpgroup-MMA prefill.
MODULES = [
    (("attention", 2, 128, 0, 4, 3, 16, False), "sm_90"),
    (("attention", 2, 128, 0, 4, 2, 16, True), "sm_90"),
    (("attention", 2, 128, 1, 4, 2, 32, False), "sm_90"),
    (("attention", 1, 96, 0, 1, 3, 16, False), "sm_90"),
    (("attention", 0, 256, 0, 2, 3, 16, False), "sm_90"),
    (("prefill", 2, 128, 1, 4, 2), "sm_90"),
    (("prefill", 2, 128, 1, 8, 3), "sm_90"),
    (("prefill_wg", 2, 128, False), "sm_90a"),
    (("prefill_wg", 2, 128, True), "sm_90a"),
]


def compile_module(lib, source: str, names: list[str], options: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"paged_attention.cu", 0, None, None):
        return -1, "nvrtcCreateProgram failed"
    try:
        for name in names:
            lib.nvrtcAddNameExpression(prog, name.encode())
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libnvrtc", help="path of libnvrtc.so (its builtins library on LD_LIBRARY_PATH)")
    args = p.parse_args()
    try:
        lib = ctypes.CDLL(args.libnvrtc)
        lib.nvrtcCreateProgram  # noqa: B018 - an NVRTC library, not any shared object
    except (OSError, AttributeError) as e:
        print(f"check_cuda_source: cannot load NVRTC from {args.libnvrtc}: {e}", file=sys.stderr)
        return 2
    failed = 0
    for key, arch in MODULES:
        names = list(cuda_runtime.module_kernels(key).values())
        if arch == "sm_90a":
            source, options = cuda_runtime.SOURCE + cuda_runtime.SOURCE_SM90, list(cuda_runtime.SM90A_OPTIONS)
        else:  # what cupy.RawModule adds to the options it is given
            source = cuda_runtime.SOURCE
            options = [*cuda_runtime._OPTIONS, f"-arch={arch}", "--device-as-default-execution-space", "-ftz=true"]
        rc, log = compile_module(lib, source, names, options)
        errors = [line for line in log.splitlines() if "error" in line]
        print(f"{'ok' if rc == 0 else 'FAILED'} {key} {arch}" + (f": {errors[0][:200]}" if rc and errors else ""))
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
