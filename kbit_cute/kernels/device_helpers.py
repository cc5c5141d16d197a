"""Device-side helpers shared by every kbit kernel: E4M4, bit planes, codebook lookup.

Called while a kernel is traced. Every kernel dequantizes through these
functions; none keeps its own copy. The host reference of the same math is
``kbit_cute.format``.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T


def target_arch_family() -> str:
    """sm_90 or sm_80: the compile target's family (``kbit_cute.compile.target_arch``)."""
    from ..compile import target_arch

    return "sm_90" if target_arch().startswith("sm_9") else "sm_80"


# Shared memory a kernel may use per SM (H100: 227 KB, A100: 163 KB), by target family.
SMEM_PER_SM = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}


def smem_per_sm() -> int:
    """Shared memory per SM of the compile target."""
    return SMEM_PER_SM[target_arch_family()]


# 2^(127 - 11): moves an E4M4 code placed in fp32's exponent/mantissa bits to its value.
_E4M4_FP32_EXP_SHIFT = 116


@cute.jit
def bits_to_f32(bits: Int32) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value()))


@cute.jit
def f32_to_bits(x: Float32) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value()))


_E4M4_FP32_SHIFT = 19  # an E4M4 code at these bits of an fp32 reads as its value x 2^-116


@cute.jit
def decode_e4m4_byte(word: Uint32, i: cutlass.Constexpr[int]) -> Float32:
    """E4M4 byte i of ``word`` -> fp32 (bias 11; ``format.decode_e4m4`` on the host), exact
    and branch-free in three instructions: a shift, a mask, a multiply.

    The code placed in fp32's low exponent and high mantissa bits reads as value x 2^-116,
    subnormal codes too: e == 0 makes an fp32 subnormal, m/16 x 2^-126. The product with
    2^116 is exact; it is ``mul.rn.f32`` written out, which never flushes subnormals."""
    shift = _E4M4_FP32_SHIFT - 8 * i
    placed = Uint32(word) << Uint32(shift) if shift >= 0 else Uint32(word) >> Uint32(-shift)
    bits = placed & Uint32(0xFF << _E4M4_FP32_SHIFT)
    return Float32(
        llvm.inline_asm(
            T.f32(), [Float32(bits_to_f32(Int32(bits))).ir_value()],
            f"mul.rn.f32 $0, $1, {_f32_hex(2.0**_E4M4_FP32_EXP_SHIFT)};", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


def _f32_hex(x: float) -> str:
    """An fp32 immediate as PTX writes it exactly: 0fXXXXXXXX."""
    return "0f" + struct.pack(">f", x).hex().upper()


@cute.jit
def load_codebook_lane(mCodebook: cute.Tensor, k: cutlass.Constexpr[int]) -> Float32:
    """Each lane holds codebook entry lane % 2^k, ready for ``codebook_lookup``."""
    lane = cute.arch.lane_idx()
    return Float32(mCodebook[lane % (1 << k)])


@cute.jit
def codebook_lookup(cb_lane: Float32, index: Int32) -> Float32:
    """Codebook value of ``index`` via a warp shuffle; every lane of the warp must call it."""
    return cute.arch.shuffle_sync(cb_lane, index)


# ----------------------------------------------------------------------------- SWAR indices
#
# Extracting one index costs k shifts/ands/ors per element. Instead the k plane words of a
# block are merged pairwise, SWAR style: merging two words of w-bit fields gives two words of
# 2w-bit fields with one shift and one and-or (LOP3) each. After log2 stages every element's
# index sits in one field of one word. A lookup is then a shift and a shuffle: shfl reads
# only bits [4:0] of the lane operand, and lanes hold codebook[lane % 2^k], so bits of the
# next field above the index do not matter.

_FIELD_MASK = {1: 0x55555555, 2: 0x33333333, 4: 0x0F0F0F0F}


def field_bits(k: int, min_width: int = 1) -> int:
    """Width of the index fields ``planes_to_fields`` produces: k rounded up to 2, 4 or 8,
    and to at least ``min_width`` (byte-select lookups want 4-bit fields even for k = 2)."""
    return max(min_width, 2 if k <= 2 else 4 if k <= 4 else 8)


def planes_to_fields(
    planes: list, k: int, min_width: int = 1, zero_fill: bool = True,
    select_widths: tuple = (1, 2, 4),
) -> list[tuple]:  # fmt: skip
    """k plane words of a block -> [(word, elements)]: ``elements[f]`` is the element whose
    index occupies field f (bits f*W .. f*W+k-1, W = ``field_bits(k, min_width)``) of
    ``word``; the bits of a field above the index are zero, or with ``zero_fill=False``
    whatever is cheapest (for lookups that ignore them: shuffles, the pair and quad tables,
    whose rows repeat the codebook modulo 2^k; not byte-select tables). Merges of w-bit
    fields for w in ``select_widths`` are one bit-select each (``bit_select``), the others
    two ANDs and an OR that ptxas schedules itself (a knob for register allocation only).

    Works on traced Uint32 values (in a kernel) and on Python ints (host tests) alike;
    the element bookkeeping is plain Python, fixed at trace time.
    """
    padded = list(planes[:k]) + [None] * (field_bits(k, min_width) - k)  # zero planes up to W
    return _merge_fields(padded, zero_fill, select_widths)


def _merge_fields(planes: list, zero_fill: bool, select_widths: tuple) -> list[tuple]:
    if len(planes) == 1:
        return [(planes[0], list(range(32)))]
    half = len(planes) // 2
    low = _merge_fields(planes[:half], zero_fill, select_widths)
    high = _merge_fields(planes[half:], zero_fill, select_widths)
    out = []
    for (x, elems), (y, _) in zip(low, high, strict=True):
        lo, hi = _merge_pair(x, y, half, zero_fill, half in select_widths)
        out += [(lo, elems[0::2]), (hi, elems[1::2])]
    return out


def _merge_pair(x, y, w: int, zero_fill: bool, select: bool):
    """Two words of w-bit fields -> (even fields, odd fields) as 2w-bit fields, x low (y
    None: a zero plane; without ``zero_fill`` its bits are left to x's neighbours)."""
    mask = _FIELD_MASK[w]
    if x is None:
        return None, None
    if y is None:
        return (x & mask, (x >> w) & mask) if zero_fill else (x, x >> w)
    if select:
        return bit_select(mask, x, y << w), bit_select(mask, x >> w, y)
    inv = ~mask & 0xFFFFFFFF
    return (x & mask) | ((y << w) & inv), ((x >> w) & mask) | (y & inv)


def bit_select(mask: int, x, y):
    """(x & mask) | (y & ~mask): one LOP3 with the mask as its immediate (written as two
    ANDs and an OR, ptxas kept an AND of its own for each side). Python ints too."""
    if isinstance(x, int) and isinstance(y, int):
        return (x & mask) | (y & ~mask & 0xFFFFFFFF)
    # lut 0xE4 = (a & c) | (b & ~c) for a = x, b = y, c = mask
    return _asm_u32(f"lop3.b32 $0, $1, $2, {mask:#x}, 0xe4;", x, y)


# ----------------------------------------------------------------------------- 16-bit pairs
#
# The tensor-core kernels dequantize into pairs of fp16/bf16 values packed in one 32-bit
# register (the operand format of mma.sync). These helpers work on such registers (Uint32).

_HALF2_ASM = {cutlass.Float16: "f16x2", cutlass.BFloat16: "bf16x2"}
_DTYPE_NAMES = {cutlass.Float16: "f16", cutlass.BFloat16: "bf16"}
_NEG_ZERO_X2 = 0x80008000  # -0.0 in both halves: x * s + (-0) == x * s exactly


def _asm_u32(text: str, *operands) -> Uint32:
    constraints = "=r," + ",".join("r" for _ in operands)
    ir_ops = [Uint32(x).ir_value() for x in operands]
    return Uint32(
        llvm.inline_asm(
            T.i32(), ir_ops, text, constraints,
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


def load_cluster_f32(ptr: cute.Pointer) -> Float32:
    """One fp32 from the shared memory of a CTA of the cluster (``ptr`` from
    ``cute.arch.map_dsmem_ptr``). A side effect for the compiler, so that it stays between
    the cluster barriers around it."""
    bits = llvm.inline_asm(
        T.i32(), [Uint32(ptr.toint()).ir_value()], "ld.shared::cluster.b32 $0, [$1];", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip
    return bits_to_f32(Int32(bits))


def prmt(a: Uint32, b: Uint32, selector) -> Uint32:
    """Byte permute: result byte i is byte (selector nibble i) of the 8-byte value b:a.
    A Python int selector becomes an immediate (no register, no move)."""
    if isinstance(selector, int):
        return _asm_u32(f"prmt.b32 $0, $1, $2, {selector:#x};", a, b)
    return _asm_u32("prmt.b32 $0, $1, $2, $3;", a, b, selector)


@cute.jit
def mul_x2(x: Uint32, s: Uint32, dtype: cutlass.Constexpr) -> Uint32:
    """Elementwise product of two fp16x2 / bf16x2 registers (an fma with -0: one instruction
    on sm_80 for both types)."""
    return _asm_u32(f"fma.rn.{_HALF2_ASM[dtype]} $0, $1, $2, $3;", x, s, Uint32(_NEG_ZERO_X2))


@cute.jit
def pack_x2(lo: Float32, hi: Float32, dtype: cutlass.Constexpr) -> Uint32:
    """Two fp32 values rounded to one fp16x2 / bf16x2 register, ``lo`` in the low half."""
    return Uint32(
        llvm.inline_asm(
            T.i32(), [Float32(hi).ir_value(), Float32(lo).ir_value()],
            f"cvt.rn.{_HALF2_ASM[dtype]}.f32 $0, $1, $2;", "=r,f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


def _entry(mCodebook: cute.Tensor, i, dtype, factor=None) -> Float32:
    """Codebook entry i times ``CODEBOOK_FACTOR`` (or ``factor``): the tables of the mma
    kernels carry the factor so that the absmax is one IMAD (``absmax_x2``) and their product
    is exact-scaled."""
    factor = CODEBOOK_FACTOR[_DTYPE_NAMES[dtype]] if factor is None else factor
    return Float32(mCodebook[i]) * Float32(factor)


@cute.jit
def codebook_x2_lane(
    mCodebook: cute.Tensor, k: cutlass.Constexpr[int], dtype: cutlass.Constexpr,
    factor: cutlass.Constexpr = None,
):  # fmt: skip
    """Each lane holds entry lane % 2^k (x ``CODEBOOK_FACTOR`` or ``factor``) in both
    halves, for ``codebook_lookup_x2``."""
    v = _entry(mCodebook, cute.arch.lane_idx() % (1 << k), dtype, factor)
    return pack_x2(v, v, dtype)


@cute.jit
def codebook_pair_lane(mCodebook: cute.Tensor, dtype: cutlass.Constexpr):
    """k = 2: lane L holds the pair (entry L & 3, entry (L >> 2) & 3), so one shuffle by a
    4-bit field holding two adjacent 2-bit indices returns both weights."""
    lane = cute.arch.lane_idx()
    return pack_x2(
        _entry(mCodebook, lane % 4, dtype), _entry(mCodebook, (lane // 4) % 4, dtype), dtype
    )


@cute.jit
def codebook_lookup_x2(cb_x2_lane: Uint32, index: Uint32) -> Uint32:
    """The entry of ``index`` (bits [4:0]; bits above are ignored) in both halves, by one
    shuffle. Every lane of the warp must call it."""
    return Uint32(cute.arch.shuffle_sync(Int32(cb_x2_lane), Int32(index)))


def codebook_pair_selector(i, j):
    """``prmt`` selector of entries i (low half) and j (high half), i, j in 0..3, from a
    4-entry codebook held as two registers of pairs: entry e is bytes 2e, 2e + 1 of the
    8-byte value, so the selector's nibbles are 2i, 2i + 1, 2j, 2j + 1 (ints or registers)."""
    return i * 0x22 + j * 0x2200 + 0x1010


@cute.jit
def codebook_pair_by_prmt(pairs: list, i: Uint32, j: Uint32) -> Uint32:
    """k = 2: entries i (low half) and j (high half) of the codebook held as two registers of
    pairs (``codebook_x2_pairs``), by one prmt: a few integer instructions where
    ``codebook_lookup_x2`` takes the shuffle pipe (what fills the quad table)."""
    return prmt(pairs[0], pairs[1], codebook_pair_selector(i, j))


def codebook_x2_pairs(mCodebook: cute.Tensor, k: int, dtype, factor=None) -> list:
    """For k <= 3: the 2^k entries (x ``CODEBOOK_FACTOR`` or ``factor``) as 16-bit values,
    two per register (entries 2i, 2i+1)."""
    return [
        pack_x2(_entry(mCodebook, i, dtype, factor), _entry(mCodebook, i + 1, dtype, factor), dtype)
        for i in range(0, 1 << k, 2)
    ]


def scaled_byte_tables(pairs: list, scale_x2: Uint32, dtype):
    """Codebook pairs times a block's scale, split into a low-byte and a high-byte table
    (entries 0-3 and 4-7 each) for ``byte_table_lookup``. Scaling the 4-8 entries of the
    table once per block is cheaper than scaling every looked-up pair."""
    scaled = [mul_x2(p, scale_x2, dtype) for p in pairs] + [Uint32(0)] * (4 - len(pairs))
    lo0 = prmt(scaled[0], scaled[1], 0x6420)
    hi0 = prmt(scaled[0], scaled[1], 0x7531)
    if len(pairs) <= 2:  # k = 2: entries 0-3 only; fields never reach the second table
        return lo0, lo0, hi0, hi0
    return lo0, prmt(scaled[2], scaled[3], 0x6420), hi0, prmt(scaled[2], scaled[3], 0x7531)


@cute.jit
def byte_table_lookup(tables, fields: Uint32):
    """Entries of the four 3-bit indices in the low four nibbles of ``fields`` (each nibble's
    bit 3 zero): (low bytes, high bytes) of the four 16-bit values, one register each."""
    lo0, lo1, hi0, hi1 = tables
    return prmt(lo0, lo1, fields), prmt(hi0, hi1, fields)


def pair_selector(i: int, j: int) -> int:
    """``prmt`` selector that joins 16-bit value i of register a and value j of register b
    (i, j in {0, 1}) into one register, a's value low."""
    lo = (2 * i, 2 * i + 1)
    hi = (4 + 2 * j, 4 + 2 * j + 1)
    return lo[0] | lo[1] << 4 | hi[0] << 8 | hi[1] << 12


def byte_pair_selector(i: int, j: int) -> int:
    """``prmt`` selector that builds a 16-bit pair from byte tables: value i (low byte from
    register a's byte i, high byte from b's byte i) low, value j high."""
    return i | (4 + i) << 4 | j << 8 | (4 + j) << 12


# ----------------------------------------------------------------------------- pair tables
#
# The GEMM's B dequantization: a thread's 8 weights of a block as 4 byte offsets into a
# shared-memory table of 2^(2k) codebook pairs (one LDS per mma register), and the E4M4
# absmax as an fp16x2/bf16x2 register in one IMAD.


@cute.jit
def rotr(x: Uint32, n: Int32) -> Uint32:
    """Rotate right by n (mod 32): one funnel shift (SHF.R.W)."""
    v = Uint32(x).ir_value()
    return Uint32(llvm.intr_fshr(v, v, Uint32(n).ir_value()))


# E4M4 (bias 11) is an IEEE-style minifloat: placed in the top bits of a wider float's
# exponent/mantissa field it reads as the true value times a power of two, normal and
# subnormal codes alike (fp16: code << 6 is 2^-4 x value; bf16: code << 3 is 2^-116 x
# value). Multiplying the code by MAGIC puts it in both halves at once; the codebook table
# carries the inverse factor, so codebook x absmax comes out exact-scaled with one HFMA2.
ABSMAX_MAGIC = {"f16": (1 << 6) | (1 << 22), "bf16": (1 << 3) | (1 << 19)}
CODEBOOK_FACTOR = {"f16": 2.0**4, "bf16": 2.0**116}


def absmax_x2(code: Uint32, dtype_name: str) -> Uint32:
    """E4M4 byte (0..255, already zero-extended) -> both halves of an fp16x2 / bf16x2
    register holding its value / ``CODEBOOK_FACTOR`` (bit-exact, subnormal codes too):
    one IMAD, where decoding through fp32 takes about six instructions."""
    return Uint32(code) * Uint32(ABSMAX_MAGIC[dtype_name])


# The GEMV at M <= 4, k = 3, 4 (and k = 2 at M <= 2, k = 5's pair table at M = 1) scales
# after the mma (``GemvKernel.split_blocks``): its tables carry SPLIT_FACTOR for both dtypes,
# and a block scale comes as fp32 value / 16: the E4M4 code << 6 read as fp16 (exact,
# subnormal codes too), widened.
SPLIT_FACTOR = 16.0


def absmax_pair_f32(codes: Uint32):
    """A column's two E4M4 codes (bytes 0, 1 of ``codes``) -> (fp32, fp32) of value / 16."""
    half2 = prmt(Uint32(codes), Uint32(0), 0x4140) << Uint32(6)  # code << 6 in each half
    return _half_to_f32(half2, "l"), _half_to_f32(half2, "h")


def absmax_f32(code: Uint32):
    """One E4M4 code (0..255, zero-extended) -> fp32 of value / 16."""
    return _half_to_f32(Uint32(code) << Uint32(6), "l")


def _half_to_f32(half2: Uint32, which: str) -> Float32:
    """The fp16 in the low ("l") or high ("h") half of ``half2`` as fp32 (one HADD2.F32)."""
    out = llvm.inline_asm(
        T.f32(), [Uint32(half2).ir_value()],
        f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.f32.f16 $0, {which}; }}", "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip
    return Float32(out)


def pair_table_index(p: int, k: int) -> tuple[int, int]:
    """Pair index -> (i0, i1): bit 2b of p is bit b of i0, bit 2b+1 is bit b of i1."""
    i0 = sum(((p >> (2 * b)) & 1) << b for b in range(k))
    i1 = sum(((p >> (2 * b + 1)) & 1) << b for b in range(k))
    return i0, i1


# A thread with t = lane % 4 owns the element pairs (8c + 2t, 8c + 2t + 1), c = 0..3, of a
# block: in plane b they are bits 8c + 2t (+1). Rotating plane b right by 2t - 2 - 2b puts
# them at 8c + 2 + 2b: for b <= 2 inside byte c ("lo" word, bits 2..7), for b >= 3 at bits
# 2b - 6 of byte c + 1 ("hi" word). One PRMT then assembles pair c's table byte offset
# 4 * p (p = the 2k-bit interleaved pair index) from lo byte c (bits 0..7) and hi byte c + 1
# (bits 8..11); the upper bytes replicate the sign of a hi byte, whose bit 7 is always 0.
_PAIR_MASK = 0x03030303


def _pair_bits(plane, t, to_bit: int, mask: int | None):
    """Plane word rotated right by 2t - ``to_bit``: the thread's pair c (bits 8c + 2t, + 1)
    lands at bits 8c + to_bit, + 1; then ``mask`` (None: unmasked, for a caller that selects
    the bits it keeps). One SHF and one LOP3 (the mask and the caller's OR). Host ints when
    ``t`` is an int (the host tests run this same code)."""
    if isinstance(t, int):
        rotated = _rotr_host(plane, (2 * t - to_bit) & 31)
        return rotated if mask is None else rotated & mask
    rotated = rotr(Uint32(plane), (t * 2 + (32 - to_bit)) & 31)
    return rotated if mask is None else rotated & Uint32(mask)


def _prmt4(a, b, selectors: list, t) -> list:
    """``prmt(a, b, s)`` for each selector s (host ints when ``t`` is an int)."""
    if isinstance(t, int):
        return [_prmt_host(a, b, s) for s in selectors]
    return [prmt(a, Uint32(b), s) for s in selectors]


def pair_mask(b: int) -> int:
    return _PAIR_MASK << (2 + 2 * b) if b <= 2 else _PAIR_MASK << (2 * b - 6)


def pair_offset_selector(c: int) -> int:
    """PRMT selector: byte 0 <- lo byte c, byte 1 <- hi byte c+1, bytes 2, 3 <- sign of hi
    byte 0 (always 0: hi bytes use bits 0..3 at most)."""
    return c | ((4 + (c + 1) % 4) << 4) | (0xC << 8) | (0xC << 12)


def pair_offsets(planes: list, t, k: int) -> list:
    """k plane words of a block -> this thread's 4 pair-table byte offsets (pair order c).

    2k + 4 instructions for 8 weights: k rotates, k LOP3 and 4 PRMT. ``planes`` are traced
    Uint32 values, or Python ints with ``t`` an int (host tests run this same code).
    """
    lo = hi = None
    for b in range(k):
        term = _pair_bits(planes[b], t, 2 + 2 * b, pair_mask(b))
        if b <= 2:
            lo = term if lo is None else lo | term
        else:
            hi = term if hi is None else hi | term
    if hi is None:
        hi = 0
    return _prmt4(lo, hi, [pair_offset_selector(c) for c in range(4)], t)


def pair_row_offsets(planes: list, t, k: int, lane4) -> list:
    """k plane words of a block -> this thread's 4 byte addresses 256 p + lane4 in a pair
    table of 256-byte rows, one 4-byte copy of entry p per lane (k <= 4: p has 2k <= 8
    bits). Same 2k + 4 instructions as ``pair_offsets``, and the lane's copy costs nothing
    more: plane b rotated right by 2t - 2b puts pair c's bits at 2b, 2b + 1 of byte c (p
    whole in byte c), and the PRMT takes byte 0 from ``lane4`` (4 x lane, < 128: its sign
    fills bytes 2, 3 with zeros) and byte 1 from byte c."""
    # Plane b's bits over whatever the planes before left above their slots: a chain of
    # bit-selects, unmasked rotations, one mask at the end where the planes leave bits of
    # each byte free (k < 4). k LOP3 for every k (k = 4: one fewer than masking each plane).
    lo = _pair_bits(planes[0], t, 0, None)
    for b in range(1, k):
        below = 0x01010101 * ((1 << 2 * b) - 1)  # the slots of planes < b in each byte
        lo = bit_select(below, lo, _pair_bits(planes[b], t, 2 * b, None))
    if k < 4:
        keep = 0x01010101 * ((1 << 2 * k) - 1)
        lo = lo & (keep if isinstance(lo, int) else Uint32(keep))
    return _prmt4(lo, lane4, [4 | (c << 4) | (0xC << 8) | (0xC << 12) for c in range(4)], t)


# The lane table's copy per lane (entry q of lane l at 128 q + 4 l: 32 KB at k = 4, half the
# row table) addressed without the lane table's LEA: the PRMT takes the address's byte 0 from
# a word whose bytes hold 4 x lane and one index bit at bit 7, byte 1 from a word whose
# bytes hold the other 7 bits. Plane 0's pair bits land at bits 6, 7 of byte c, planes
# 1..3 at bits 0..5: the entry q = p rotated right by one bit (``pair_half_entry``).
HALF_LANE_MASK = 0x80808080


def pair_half_entry(p: int) -> int:
    """Half-row table entry of interleaved pair index p (8 bits): p rotated right by one."""
    return (p >> 1) | ((p & 1) << 7)


def half_entry_pair(q):
    """Inverse of ``pair_half_entry``: the pair index entry q holds (q rotated left by one).
    Python ints or traced Int32 (the table fill)."""
    return ((q << 1) | (q >> 7)) & 0xFF


def pair_half_offsets(planes: list, t, lane4x4) -> list:
    """k = 4 plane words of a block -> this thread's 4 byte addresses 128 q + 4 lane in the
    lane-replicated table (``pair_half_entry``); ``lane4x4`` = 4 x lane in every byte.
    13 instructions (4 SHF, 5 LOP3, 4 PRMT): two LOP3 more than ``pair_row_offsets`` at
    k = 4 (the lane word, and clearing bit 7), three fewer than ``pair_offsets`` plus the
    lane table's LEA per pair. Python ints when ``t`` is an int."""
    rot = [_pair_bits(planes[b], t, to_bit, None) for b, to_bit in enumerate((6, 0, 2, 4))]
    lane_word = bit_select(HALF_LANE_MASK, rot[0], lane4x4)  # bit 7: plane 0's second bit
    # Bits 6..0 from plane 0 (first bit), 3, 2, 1; bit 7 stays zero, so that the PRMT's
    # sign fill of the upper bytes reads zeros.
    hi = rot[0] & (0x40404040 if isinstance(rot[0], int) else Uint32(0x40404040))
    for b, keep in ((3, 0xC0C0C0C0), (2, 0xF0F0F0F0), (1, 0xFCFCFCFC)):
        hi = bit_select(keep, hi, rot[b])
    selectors = [c | ((4 + c) << 4) | (0xC << 8) | (0xC << 12) for c in range(4)]
    return _prmt4(lane_word, hi, selectors, t)


def _rotr_host(x: int, n: int) -> int:
    x &= 0xFFFFFFFF
    return ((x >> n) | (x << (32 - n))) & 0xFFFFFFFF if n else x


def _prmt_host(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode) on host ints."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


# ----------------------------------------------------------------------------- cp.async


def g2s_copy_atom(dtype: type[cutlass.Numeric]):
    """A 16-byte cp.async (global -> shared) copy atom of ``dtype`` elements, bypassing L1
    (``cp_async_chunk`` is the GEMV's, with the L1 choice and a zero fill)."""
    return cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=128,
    )


def cp_async_chunk(dst: cute.Pointer, src_addr: Int64, through_l1: bool = False, fill=None):
    """One 16-byte cp.async from the global byte address ``src_addr`` to shared ``dst``.

    A kernel's K loop carries its copies' source addresses and adds one stride per tile:
    recomputing them from the tile index (what ``cute.copy`` on a tensor slice compiles to)
    cost the GEMV ~20 instructions per tile more. ``fill`` (Int32): where zero, write 16 zero
    bytes and read nothing (cp.async's src-size 0), e.g. activations past K."""
    mode = "ca" if through_l1 else "cg"
    size = Int32(16) if fill is None else Int32(16) * Int32(fill != 0)
    llvm.inline_asm(
        None, [Uint32(dst.toint()).ir_value(), Int64(src_addr).ir_value(), size.ir_value()],
        f"cp.async.{mode}.shared.global.L2::128B [$0], [$1], 16, $2;", "r,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


def store_global_if(ptr: cute.Pointer, words: list, pred: Int32) -> None:
    """4 or 8 32-bit words to global memory at ``ptr`` (16-byte aligned) where ``pred`` is
    nonzero: one or two predicated STG.128. An ``if`` around a store compiles to a branch
    and, when warp-wide instructions (shuffles) follow, a reconvergence pair (BSSY / BSYNC):
    three instructions more per store."""
    n = len(words)
    assert n in (4, 8), f"4 or 8 words, not {n}"
    ops = [Int32(pred).ir_value(), ptr.toint().ir_value()] + [Uint32(w).ir_value() for w in words]
    stores = " ".join(
        f"@p st.global.v4.b32 [$1+{16 * v}], {{${2 + 4 * v}, ${3 + 4 * v}, ${4 + 4 * v}, "
        f"${5 + 4 * v}}};"
        for v in range(n // 4)
    )
    llvm.inline_asm(
        None, ops, f"{{ .reg .pred p; setp.ne.b32 p, $0, 0; {stores} }}",
        "r,l," + ",".join("r" for _ in words) + ",~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


def prefetch_l2(ptr: cute.Pointer, nbytes) -> None:
    """Start pulling ``nbytes`` of global memory at ``ptr`` into L2 (sm_90 bulk prefetch:
    16-byte aligned, a multiple of 16 bytes). Nothing is held or waited for; the data is
    read from L2 later, so a prefetch of data another kernel still writes is harmless."""
    llvm.inline_asm(
        None, [ptr.toint().ir_value(), Int32(nbytes).ir_value()],
        "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


# ----------------------------------------------------------------------------- split-K


@cute.jit
def cta_sync(barrier: cutlass.Constexpr = None):
    """``bar.sync``: of the whole CTA (None), or named barrier (id, threads)."""
    if cutlass.const_expr(barrier is None):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=barrier[0], number_of_threads=barrier[1])


@cute.jit
def split_k_arrive(
    counter: cute.Pointer, splits: Int32, sFlag: cute.Tensor,
    barrier: cutlass.Constexpr = None,
) -> Int32:  # fmt: skip
    """After a CTA wrote its fp32 partials: publish them and count the CTA in on its output
    tile's counter. Returns nonzero in the CTA that arrived last, which may then read every
    split's partials; it resets the counter, so the next call needs no memset.

    Release = fence, then a relaxed atomic; acquire = the atomic, then a fence (the PTX
    memory model's fence patterns). The reset is a plain store after the acquire fence: a
    fence waits for every memory operation before it, so a reset before it (or an atomic
    with acq_rel semantics, one fence more) costs an L2 round trip each. ``barrier``: (id,
    threads) of the named barrier of the CTA's threads that take part (thread 0 among
    them); None: all of them."""
    cute.arch.fence_acq_rel_gpu()
    cta_sync(barrier)
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        prev = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        sFlag[0] = Int32(prev == splits - 1)
    cta_sync(barrier)
    last = sFlag[0]
    if last != 0:
        cute.arch.fence_acq_rel_gpu()
        if tidx == 0:
            _reset_counter(counter)
    return last


@cute.jit
def warp_split_arrive(counter: cute.Pointer, expected: Int32) -> Int32:
    """``split_k_arrive`` for one warp: after the warp wrote its fp32 partials, count it in
    on ``counter``; nonzero (in every lane) in the warp that arrived last of ``expected``,
    which resets the counter and may then read the others' partials."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_warp()
    last = Int32(0)
    if cute.arch.lane_idx() == 0:
        prev = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        last = Int32(prev == expected - 1)
    last = cute.arch.shuffle_sync(last, 0)
    if last != 0:
        cute.arch.fence_acq_rel_gpu()
        if cute.arch.lane_idx() == 0:
            _reset_counter(counter)
    return last


def _reset_counter(counter: cute.Pointer) -> None:
    """Zero a split-K counter for the next call (every arrival of this one has counted; the
    next launch sees the store once it has waited for this one)."""
    cute.make_tensor(counter, cute.make_layout(1))[0] = Int32(0)


# A split-K slot no partial occupies: an all-ones word, a NaN that no arithmetic makes (the
# GPU's NaNs are 0x7fffffff). Slot buffers start so and every reader leaves them so.
EMPTY_SLOT = -1


@cute.jit
def wait_previous_kernel(pdl: cutlass.Constexpr[bool]) -> None:
    """Under programmatic dependent launch (``pdl``), wait until the kernel before this one
    on the stream has finished and its writes are visible: before any memory access it may
    write. A no-op without it."""
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()


@cute.jit
def let_next_kernel_start(pdl: cutlass.Constexpr[bool]) -> None:
    """Let the next kernel on the stream launch (its CTAs wait in ``wait_previous_kernel``).
    Only after this CTA has waited, so that the chain of waits stays transitive. Without a
    signal the next launch comes in as this kernel exits."""
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()


def nanosleep(ns: int) -> None:
    """Suspend the thread for about ``ns`` nanoseconds (a polling loop's back-off)."""
    llvm.inline_asm(
        None, [], f"nanosleep.u32 {ns};", "",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


@cute.jit
def load_slot(ptr: cute.Pointer) -> Int32:
    """One word of a split-K slot (Int32 pointer), read from L2 (relaxed, GPU scope)."""
    return cute.arch.load(ptr, Int32, sem="relaxed", scope="gpu")


SLOT_VECTOR_WORDS = 4  # the widest load / store of slot words: 16 bytes


def _slot_vector_ptr(ptr: cute.Pointer, n: int) -> cute.Pointer:
    """``ptr`` (Int32, 4 n-byte aligned by the caller's layout) as an n-word aligned one."""
    return cute.make_ptr(Int32, ptr.toint(), cute.AddressSpace.gmem, assumed_align=4 * n)


@cute.jit
def load_slot_words(ptr: cute.Pointer, n: cutlass.Constexpr[int]) -> list:
    """n consecutive words of a split-K slot (n = 1, 2, 4, 8; ``ptr`` aligned to one access:
    4 n bytes, at most 16), read from L2 (relaxed, GPU scope): one load per 4 words."""
    assert n in (1, 2, 4, 8), f"slot runs of 1, 2, 4 or 8 words, not {n}"
    if cutlass.const_expr(n == 1):
        return [load_slot(ptr)]
    width = min(n, SLOT_VECTOR_WORDS)
    vt = ir.VectorType.get([width], Int32.mlir_type)
    words = []
    for i in cutlass.range_constexpr(n // width):
        v = cute.arch.load(_slot_vector_ptr(ptr + i * width, width), vt, sem="relaxed", scope="gpu")
        words += [Int32(vector.extract(v, dynamic_position=[], static_position=[e]))
                  for e in range(width)]  # fmt: skip
    return words


@cute.jit
def store_slot_words(ptr: cute.Pointer, words: list) -> None:
    """Store consecutive Int32 slot words (1, 2, 4 or 8; ``ptr`` aligned as in
    ``load_slot_words``) for other CTAs to read (relaxed, GPU scope): one store per 4."""
    n = len(words)
    assert n in (1, 2, 4, 8), f"slot runs of 1, 2, 4 or 8 words, not {n}"
    if cutlass.const_expr(n == 1):
        cute.arch.store(ptr, Int32(words[0]), sem="relaxed", scope="gpu")
    else:
        width = min(n, SLOT_VECTOR_WORDS)
        vt = ir.VectorType.get([width], Int32.mlir_type)
        for i in cutlass.range_constexpr(n // width):
            part = [Int32(w).ir_value() for w in words[i * width : (i + 1) * width]]
            cute.arch.store(_slot_vector_ptr(ptr + i * width, width),
                            vector.from_elements(vt, part), sem="relaxed", scope="gpu")  # fmt: skip


@cute.jit
def empty_slot_words(ptr: cute.Pointer, n: cutlass.Constexpr[int]) -> None:
    """Leave n consecutive slot words EMPTY_SLOT (``store_slot_words``)."""
    store_slot_words(ptr, [Int32(EMPTY_SLOT)] * n)


SLOT_POLL_NS = 128  # back-off between polls of an empty slot (a poll's L2 round trip: ~500 ns)


@cute.jit
def handover_owner(w_lo: Int32, w_hi: Int32, ctas: Int32) -> Int32:
    """The worker that sums a split strip (workers w_lo..w_hi; worker w runs in CTA
    w % ctas): the first in the CTA of highest index. It waits only for CTAs of lower index
    or its own, which the GPU dispatched no later than its own (the order CUTLASS's stream-K
    fix-up and CUB's decoupled look-back rely on), so the wait cannot deadlock."""
    to_last_cta = ctas - 1 - w_lo % ctas
    owner = w_hi
    if w_hi - w_lo > to_last_cta:  # the workers wrap past the grid's last CTA
        owner = w_lo + to_last_cta
    return owner


SPLIT_LOADS = 8  # partials loaded at once by sum_split_partials


@cute.jit
def sum_split_partials(first: cute.Pointer, stride: Int32, splits: Int32) -> Float32:
    """Sum of the fp32 partials at ``first + s * stride``, s = 0..splits-1, added in split
    order (deterministic). The loads go out SPLIT_LOADS at a time: one after another, each
    an L2 round trip, they cost about half a microsecond per split."""
    v = Float32(0.0)
    for s0 in cutlass.range(0, splits, SPLIT_LOADS, unroll=1):
        parts = []
        for j in cutlass.range_constexpr(SPLIT_LOADS):
            x = Float32(0.0)
            if s0 + j < splits:
                x = cute.arch.load(first + (s0 + j) * stride, Float32, cop="cg")
            parts.append(x)
        for j in cutlass.range_constexpr(SPLIT_LOADS):
            v = v + parts[j]  # + 0.0 past the last split leaves v unchanged
    return v


# ----------------------------------------------------------------------------- stream-K


# Stream-K run bounds in 32-bit unsigned arithmetic: a 64-bit division is a subroutine
# call, in the prologue and on the split-K hand-over's path (the GEMV: 0.1-0.5 us per call).
# The GEMV's units x worker slots < 2^32, the GEMM's once both are divided by their gcd
# (the hosts check, ``check_run_bounds``). ``wide`` (the grouped stream kernel, whose unit
# count depends on the routing): 32 bits where the product fits, checked at run time, else
# 64.
MAX_UNITS_X_WORKERS = 1 << 32


def check_run_bounds(units: int, workers: int, kernel: str = "GEMV") -> None:
    """Raise unless the 32-bit run arithmetic holds ``units`` x ``workers`` (GEMV: worker
    slots, CTAs x quads, idle ones included; GEMM: units and CTAs divided by their gcd)."""
    if units * workers >= MAX_UNITS_X_WORKERS:
        raise ValueError(
            f"{units} (output tile, K tile) units x {workers} stream-K worker slots >= 2^32: "
            f"the weight is too large for one {kernel} launch; split it along N"
        )


@cute.jit
def _div_runs(x: Int64, d, wide: cutlass.Constexpr[bool]) -> Int32:
    """x // d for run bounds (x >= 0, 0 < d < 2^31): 32-bit unless ``wide`` and x >= 2^32."""
    q = Int32(Uint32(x) // Uint32(d))
    if cutlass.const_expr(wide):
        if x >= Int64(MAX_UNITS_X_WORKERS):
            q = Int32(x // Int64(d))
    return q


@cute.jit
def run_start(w, units, workers, wide: cutlass.Constexpr[bool] = False) -> Int32:
    """First unit of worker w's run: runs split ``units`` into ``workers`` equal parts."""
    return _div_runs(Int64(w) * Int64(units), workers, wide)


@cute.jit
def worker_of(u, units, workers, wide: cutlass.Constexpr[bool] = False) -> Int32:
    """The worker whose run holds unit u (the inverse of ``run_start``)."""
    return _div_runs(Int64(u) * Int64(workers) + Int64(workers - 1), units, wide)


@cute.jit
def cta_first(c, workers, ctas, per_cta) -> Int32:
    """First of CTA c's consecutive workers, ``workers`` dealt to ``ctas`` <= workers CTAs:
    ``per_cta`` = workers // ctas each, one more for the first workers % ctas (c = ctas:
    workers)."""
    return c * per_cta + cutlass.min(c, workers - per_cta * ctas)


@cute.jit
def cta_of_worker(w, workers, ctas, per_cta) -> Int32:
    """The CTA that holds worker w (the inverse of ``cta_first``)."""
    longer = (workers - per_cta * ctas) * (per_cta + 1)  # the workers of CTAs with one more
    c = Int32(0)
    if w < longer:
        c = Int32(Uint32(w) // Uint32(per_cta + 1))
    else:
        c = workers - per_cta * ctas + Int32(Uint32(w - longer) // Uint32(per_cta))
    return c


# ----------------------------------------------------------------------------- k = 5 pair table
#
# The GEMV's pair table for k = 5 (``gemv.GEMV_LOOKUP[5]``): a pair's 4-bit fields (planes 0-3,
# merged as k = 4's) give a byte as in the k <= 4 pair table; its two fifth bits ha, hb (plane
# 4) pick one of four 64 KB quarters. Byte address hb << 16 | fields' byte << 8 | ha << 7 |
# lane << 2: a copy per lane, 128 KB.


def pair5_high_bytes(plane4, fields, lane_bytes) -> list:
    """pair_table5: per word of ``fields`` (4-bit fields of planes 0-3), the two registers
    whose bytes carry its pairs' fifth bits into the table address: (byte i = lane << 2 |
    ha << 7, byte i = hb), ha / hb the fifth bits of the pair in the word's byte i
    (``plane4``: bit e = bit 4 of element e's index). A word's field f holds element 4 f + r,
    so byte i's pair has both bits in plane4's byte i (bits r, r + 4): one shift and one mask
    each, shared by the word's four pairs. ``lane_bytes``: lane << 2 in every byte. Traced
    values and host ints alike."""
    out = []
    for _, elems in fields:
        r = elems[0]
        assert all(e == 4 * f + r for f, e in enumerate(elems)), elems
        ha_bytes = bit_select(0x80808080, plane4 << (7 - r), lane_bytes)
        hb_bytes = (plane4 >> (4 + r)) & 0x01010101
        out.append((ha_bytes, hb_bytes))
    return out


def pair5_selectors(i: int) -> tuple[int, int]:
    """pair_table5: the two prmt selectors that make the address of the pair in byte i of a
    fields word: prmt(word, ha_bytes) puts lane << 2 | ha << 7 in byte 0 and the fields'
    byte in byte 1; prmt(that, hb_bytes) adds hb as byte 2 and a zero byte 3 (hb's byte
    sign-replicated: its top bit is 0)."""
    return i << 4 | (4 + i), (8 | (4 + i)) << 12 | (4 + i) << 8 | 0x10


def pair5_entry_indices(row, slice_):
    """pair_table5: the codebook indices (low, high half) of the entries in a 16-byte slice
    of a 256-byte row (``fill_table``), the inverse of the address of ``pair5_selectors``:
    row = hb << 8 | fields' byte (la | lb << 4), slice = ha << 3 | lane >> 2. Traced values
    and host ints alike."""
    return (row & 15) | (slice_ >> 3) << 4, ((row >> 4) & 15) | (row >> 8) << 4
