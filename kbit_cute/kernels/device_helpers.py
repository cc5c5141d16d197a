"""Device-side helpers shared by every kbit kernel: E4M4, bit planes, codebook lookup.

Called while a kernel is traced. Every kernel dequantizes through these
functions; none keeps its own copy. The host reference of the same math is
``kbit_cute.format``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm

# 2^(127 - 11): moves an E4M4 code placed in fp32's exponent/mantissa bits to its value.
_E4M4_FP32_EXP_SHIFT = 116


@cute.jit
def bits_to_f32(bits: Int32) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value()))


@cute.jit
def decode_e4m4(code: Int32) -> Float32:
    """E4M4 byte (bias 11) -> fp32, branch-free and exact.

    Placing e|m in fp32's exponent/mantissa with the exponent rebased gives
    f = 2^(e-11) (1 + m/16) for every code. For e == 0 the format is subnormal,
    2^-10 m/16, which equals 2f - 2^-10 there; both steps are exact.
    """
    code = code & 0xFF  # a uint8 load may arrive sign-extended
    f = bits_to_f32((code << 19) + (_E4M4_FP32_EXP_SHIFT << 23))
    subnormal = Float32(code < 16)
    return f + subnormal * (f - Float32(2.0**-10))


@cute.jit
def load_codebook_lane(mCodebook: cute.Tensor, k: cutlass.Constexpr[int]) -> Float32:
    """Each lane holds codebook entry lane % 2^k, ready for ``codebook_lookup``."""
    lane = cute.arch.lane_idx()
    return Float32(mCodebook[lane % (1 << k)])


@cute.jit
def codebook_lookup(cb_lane: Float32, index: Int32) -> Float32:
    """Codebook value of ``index`` via a warp shuffle; every lane of the warp must call it."""
    return cute.arch.shuffle_sync(cb_lane, index)


@cute.jit
def plane_index(planes, j, k: cutlass.Constexpr[int]) -> Int32:
    """Index of element j of a block from its k bit-plane words (bit j of word i is bit i)."""
    idx = (Uint32(planes[0]) >> j) & Uint32(1)
    for i in cutlass.range_constexpr(1, k):
        idx = idx | (((Uint32(planes[i]) >> j) & Uint32(1)) << i)
    return Int32(idx)
