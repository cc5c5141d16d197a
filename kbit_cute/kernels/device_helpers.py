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


# ----------------------------------------------------------------------------- SWAR indices
#
# Extracting one index costs k shifts/ands/ors per element. Instead the k plane words of a
# block are merged pairwise, SWAR style: merging two words of w-bit fields gives two words of
# 2w-bit fields with one shift and one and-or (LOP3) each. After log2 stages every element's
# index sits in one field of one word. A lookup is then a shift and a shuffle: shfl reads
# only bits [4:0] of the lane operand, and lanes hold codebook[lane % 2^k], so bits of the
# next field above the index do not matter.

_FIELD_MASK = {1: 0x55555555, 2: 0x33333333, 4: 0x0F0F0F0F}


def field_bits(k: int) -> int:
    """Width of the index fields ``planes_to_fields`` produces (k rounded up to 2, 4 or 8)."""
    return 2 if k <= 2 else 4 if k <= 4 else 8


def planes_to_fields(planes: list, k: int) -> list[tuple]:
    """k plane words of a block -> [(word, elements)]: ``elements[f]`` is the element whose
    index occupies field f (bits f*W .. f*W+k-1, W = ``field_bits(k)``) of ``word``.

    Works on traced Uint32 values (in a kernel) and on Python ints (host tests) alike;
    the element bookkeeping is plain Python, fixed at trace time.
    """
    padded = list(planes[:k]) + [None] * (field_bits(k) - k)  # zero planes up to W
    return _merge_fields(padded)


def _merge_fields(planes: list) -> list[tuple]:
    if len(planes) == 1:
        return [(planes[0], list(range(32)))]
    half = len(planes) // 2
    low, high = _merge_fields(planes[:half]), _merge_fields(planes[half:])
    out = []
    for (x, elems), (y, _) in zip(low, high, strict=True):
        lo, hi = _merge_pair(x, y, half)
        out += [(lo, elems[0::2]), (hi, elems[1::2])]
    return out


def _merge_pair(x, y, w: int):
    """Two words of w-bit fields -> (even fields, odd fields) as 2w-bit fields, x low."""
    mask = _FIELD_MASK[w]
    if x is None:
        return None, None
    if y is None:
        return x & mask, (x >> w) & mask
    inv = ~mask & 0xFFFFFFFF
    return (x & mask) | ((y << w) & inv), ((x >> w) & mask) | (y & inv)
