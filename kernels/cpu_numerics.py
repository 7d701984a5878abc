"""Float32 arithmetic for the CPU attention kernel that LLVM's vectorizer can handle: float16 bits
to float32, ``exp`` and ``tanh`` as polynomials (Numba's ``np.exp`` is a scalar libm call here),
and the ``fastmath`` flags the kernel compiles with."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._numba_compat import numba

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

# exp(x) = 2^n * exp(r), x = n ln2 + r, |r| <= ln2/2 (Cephes expf)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.3)  # below: 2^n would be subnormal; the result is 0 (as good as)
_EXP_MAX = np.float32(88.0)  # above: clamped (callers pass x <= 0; masked lanes may hold anything)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_HALF, ONE, _TWO, ZERO = np.float32(0.5), np.float32(1.0), np.float32(2.0), np.float32(0.0)
# tanh (Cephes tanhf): odd polynomial below _TANH_SMALL; 1 in float32 from _TANH_SAT on
_TANH_SMALL, _TANH_SAT = np.float32(0.625), np.float32(10.0)
_T0, _T1, _T2 = np.float32(-5.70498872745e-3), np.float32(2.06390887954e-2), np.float32(-5.37397155531e-2)
_T3, _T4 = np.float32(1.33314422036e-1), np.float32(-3.33332819422e-1)
_TWO_M24 = np.float32(2.0**-24)  # float16's smallest subnormal


@intrinsic
def bits_to_f32(typingctx, x):
    """The float32 whose bit pattern is the low 32 bits of integer ``x`` (a register move)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """The bit pattern of float32 ``x`` as an int32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


@numba.njit(inline="always", fastmath=FASTMATH)
def f16_to_f32(h):
    """float16 bits → float32, exact for all 65536 patterns (subnormals, infinities, NaN payloads).

    Normal and special values by moving the exponent and mantissa bits (exponent bias
    15 → 127, all-ones stays all-ones), subnormals as ``mantissa * 2^-24`` (exact),
    then the sign bit; in integer and float arithmetic that vectorizes (a 65536-entry
    lookup table is a gather, which does not: benchmarks/NOTES-kernels.md).
    """
    em = np.int32(h & 0x7FFF)
    normal = bits_to_f32((em << 13) + (0x70000000 if em >= 0x7C00 else 0x38000000))
    v = np.float32(em) * _TWO_M24 if em < 0x400 else normal
    return bits_to_f32(f32_to_bits(v) | ((np.int32(h) & 0x8000) << 16))


@numba.njit(inline="always", fastmath=FASTMATH)
def fast_exp(x):
    """exp(x) in float32 (0 below ``_EXP_MIN``), in plain arithmetic so that loops over it vectorize."""
    xc = min(max(x, _EXP_MIN), _EXP_MAX)  # keeps the float → int conversion in range
    n = np.floor(xc * _LOG2E + _HALF)
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    y = p * r * r + r + ONE
    y = y * bits_to_f32((np.int32(n) + 127) << 23)
    return y if x > _EXP_MIN else ZERO


@numba.njit(inline="always", fastmath=FASTMATH)
def fast_tanh(x):
    """tanh(x) in float32 within a few ulp, in plain arithmetic so that loops over it vectorize.

    Cephes ``tanhf``: an odd polynomial below |x| = 0.625 (where ``1 - 2 / (e^2x + 1)``
    would cancel), that formula above; both are computed and one is selected, which
    keeps the loop free of branches.
    """
    a = min(abs(x), _TANH_SAT)
    big = ONE - _TWO / (fast_exp(a + a) + ONE)
    z = x * x
    small = ((((_T0 * z + _T1) * z + _T2) * z + _T3) * z + _T4) * z * a + a
    t = small if a < _TANH_SMALL else big
    return t if x >= ZERO else -t
