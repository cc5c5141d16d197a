"""GEMV for M = 1..4: out[M, N] = A[M, K] @ W^T, W in the tiled kbit format, on tensor cores.

Decode is bound by streaming W, and the issue rate, not the loads, is what limits a
dequantizing kernel: at 3 TB/s each SM must retire ~22 (k=4) to ~41 (k=2) weights per
clock with 128 thread-instructions. So the multiply-adds go to ``mma.sync`` m16n8k16 with
the weights as operand A (16 output columns x 16 K) and the activations as operand B
(16 K x 8 rows, rows past M unused): the fp32 accumulation is free, and M = 4 costs what
M = 1 does. What is left per weight is the dequantization into fp16/bf16 pairs:

* a thread owns 16 consecutive K of one 32-weight block for 4 columns (two mma row
  tiles); it loads the columns' bit-plane words straight into registers (no shared-memory
  tile, no barrier in the main loop), picks its 16-bit half of each plane and merges the
  planes into index fields SWAR-style (``planes_to_fields``);
* indices become values by byte-select tables in registers (k <= 3, ``prmt``) or a
  warp-shuffle table (k >= 4), two weights per 32-bit register, times the block's absmax
  (one 2-wide multiply; the E4M4 byte becomes a half2 scale with one IMAD, ``absmax_x2``);
* mma.sync pairs K positions to registers in a fixed pattern; since the dot product does
  not care about the order of K, each register takes the two weights that the SWAR fields
  deliver side by side, and the activations are permuted to match (one ``prmt`` per pair,
  shared by all columns of the thread).

Grid: (128-column groups = one repack tile, K splits). The 4 warps of a CTA take 32
columns each. With several splits each CTA writes fp32 partials to a workspace and the
last CTA of a column group (an atomic counter it resets, so no memset is ever needed)
sums them in split order: results are bit-identical run to run.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.memory import SmemAllocator

from ..format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .device_helpers import (
    absmax_x2,
    byte_pair_selector,
    byte_table_lookup,
    codebook_lookup_x2,
    codebook_pair_lane,
    codebook_x2_lane,
    codebook_x2_pairs,
    field_bits,
    mul_x2,
    pair_selector,
    planes_to_fields,
    prmt,
    scaled_byte_tables,
    split_k_arrive,
    sum_split_partials,
)

WARPS = 4
MMA_M, MMA_N, MMA_K = 16, 8, 16
ROW_TILES = 2  # mma row tiles (16 columns each) per warp
WARP_COLS = MMA_M * ROW_TILES
COLS_PER_GROUP = WARP_COLS * WARPS  # one repack tile
THREAD_K = BLOCK // 2  # a thread's K run per tile: half of one block
# Register buffers per warp: a warp has stages - 1 K tiles (256 k bytes each) in flight
# while it works on one. Measured on the H100 (perf/gemv_kernel_check.py --stages 2 3 4,
# 3 shapes, M = 1 and 4): k = 2, 3 are best with 3; k = 4, 5 with 2 (a deeper ring costs
# registers, hence warps per SM, and was up to 20% slower).
STAGES = {2: 3, 3: 3, 4: 2, 5: 2}


def gemv_mma(dtype: type[cutlass.Numeric]):
    """The kernel's mma.sync m16n8k16 (fp32 accumulate): ``(atom, tiled_mma)``, one warp.

    One function so that ``kbit_cute.layouts.kernel_layouts`` draws the very layouts the
    kernel partitions its fragments with. Call it while tracing.
    """
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (MMA_M, MMA_N, MMA_K)))
    return atom, cute.make_tiled_mma(atom)


class GemvKernel:
    """Compile-time config: bits ``k``, rows bucket ``m`` (1, 2 or 4), activation dtype."""

    threads = 32 * WARPS

    def __init__(self, k: int, m: int, dtype: type[cutlass.Numeric], stages: int | None = None):
        self.k, self.m, self.dtype = k, m, dtype
        # K tiles in flight per warp, in registers (see STAGES).
        self.stages = stages or STAGES[k]
        # How indices become values. The integer ALU pipe runs at half the issue rate and
        # is what these kernels saturate first, so each k takes the lookup with the fewest
        # integer instructions per weight:
        # k = 2: one shuffle per pair from a 16-entry table of pairs (two adjacent 2-bit
        #        fields are its lane index);
        # k = 3: byte-select tables, scaled per block, four lookups per two prmt;
        # k >= 4: one shuffle per weight, two merged into a pair with one prmt.
        self.lookup = {2: "pair_shuffle", 3: "byte_tables"}.get(k, "shuffle")
        self.byte_tables = self.lookup == "byte_tables"
        self.field_width = field_bits(k, 4 if self.byte_tables else 1)

    @staticmethod
    def can_implement(k: int, m: int, dtype) -> bool:
        return k in (2, 3, 4, 5) and m in (1, 2, 4) and dtype in (cutlass.Float16, cutlass.BFloat16)

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (M, K) row-major, dtype
        pPacked: cute.Pointer,  # int32 tiled words
        pAbsmax: cute.Pointer,  # uint8 tiled absmax
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (1,) per-tensor scale
        pBias: cute.Pointer,  # (N,) dtype; read only if has_bias
        pOut: cute.Pointer,  # (M, N) row-major, dtype
        pWorkspace: cute.Pointer,  # fp32 (splits, m, column groups * 128) when splits > 1
        pCounters: cute.Pointer,  # int32 (column groups,), zero; left zero
        M: Int32,
        N: Int32,
        K: Int32,
        splits: Int32,
        has_bias: Int32,
        stream: cuda.CUstream,
    ):
        K = cute.assume(K, divby=BLOCK)
        n_tiles = (N + TILE_N - 1) // TILE_N
        k_tiles = (K + TILE_K - 1) // TILE_K
        groups = n_tiles * (TILE_N // COLS_PER_GROUP)
        mW = cute.make_tensor(pPacked, weight_words_layout(n_tiles, k_tiles, self.k))
        mS = cute.make_tensor(pAbsmax, weight_absmax_layout(n_tiles, k_tiles))
        mA = cute.make_tensor(pA, cute.make_layout((M, K), stride=(K, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((M, N), stride=(N, 1)))
        mWs = cute.make_tensor(
            pWorkspace,
            cute.make_layout(
                (groups * COLS_PER_GROUP, self.m, splits),
                stride=(1, groups * COLS_PER_GROUP, self.m * groups * COLS_PER_GROUP),
            ),
        )
        self.kernel(
            mA, mW, mS, pCodebook, pScale, pBias, mOut, mWs, pCounters, k_tiles, splits, has_bias
        ).launch(grid=[groups, splits, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,  # (M, K)
        mW: cute.Tensor,  # ((128, n_tiles), (2, k_tiles), k) -> word
        mS: cute.Tensor,  # ((128, n_tiles), (2, k_tiles)) -> absmax byte
        pCodebook: cute.Pointer,
        pScale: cute.Pointer,
        pBias: cute.Pointer,
        mOut: cute.Tensor,  # (M, N)
        mWs: cute.Tensor,  # (group columns, m, splits) fp32
        pCounters: cute.Pointer,
        k_tiles: Int32,
        splits: Int32,
        has_bias: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        group, split, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        M, K = mA.shape
        # mma fragment coordinates: lane = 4 * g + t. The thread's mma rows are g and g + 8
        # of each row tile; its K run in a tile is block kb = t / 2, half h = t % 2.
        g, t = lane // 4, lane % 4
        col0 = group * COLS_PER_GROUP + warp * WARP_COLS + g
        kt_begin = split * k_tiles // splits
        kt_end = (split + 1) * k_tiles // splits

        smem = SmemAllocator()
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)

        ctx = self.make_mainloop(pCodebook, t)
        acc = ctx[-1]
        for r in cutlass.range_constexpr(ROW_TILES):
            acc[r].fill(0.0)
        row = cutlass.min(g, M - 1)  # rows past M: recomputed, never stored
        self.mainloop(mA, mW, mS, col0, row, t, kt_begin, kt_end, ctx)

        self.epilogue(acc, pScale, pBias, mOut, mWs, pCounters, sFlag, splits, has_bias, col0, t)

    def make_mainloop(self, pCodebook: cute.Pointer, t):
        """What the K loop works with, made once per CTA: (codebook registers, 16-bit half
        selector, mma atom, A and B fragments, register ring, accumulators per row tile)."""
        k = self.k
        mCodebook = cute.make_tensor(pCodebook, cute.make_layout(1 << k))
        if self.byte_tables:
            codebook = codebook_x2_pairs(mCodebook, k, self.dtype)
        elif self.lookup == "pair_shuffle":
            codebook = codebook_pair_lane(mCodebook, self.dtype)
        else:
            codebook = codebook_x2_lane(mCodebook, k, self.dtype)
        half_select = Uint32(0x5410) + Uint32(t % 2) * Uint32(0x2222)  # 16-bit half h of a word
        atom, tiled_mma = gemv_mma(self.dtype)
        frag_a = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((MMA_M, MMA_K)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((MMA_N, MMA_K)))
        bufs = [self.make_buffers() for _ in range(self.stages)]
        acc = [
            tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((MMA_M, MMA_N)))
            for _ in range(ROW_TILES)
        ]
        return codebook, half_select, atom, frag_a, frag_b, bufs, acc

    @cute.jit
    def mainloop(self, mA, mW, mS, col0, row, t, kt_begin, kt_end, ctx):
        """acc += K tiles kt_begin..kt_end of the thread's columns times activation row
        ``row``. A ring of register buffers: the next stages - 1 K tiles are in flight while
        one is dequantized, so a warp always has loads outstanding (no copies, no barrier)."""
        codebook, half_select, atom, frag_a, frag_b, bufs, acc = ctx
        S = self.stages
        for b in cutlass.range_constexpr(S - 1):
            if kt_begin + b < kt_end:
                self.load_tile(mA, mW, mS, col0, row, t, kt_begin + b, bufs[b])
        for kt in cutlass.range(kt_begin, kt_end, S, unroll=1):
            for b in cutlass.range_constexpr(S):
                if kt + b < kt_end:
                    if kt + b + S - 1 < kt_end:
                        nxt = bufs[(b + S - 1) % S]  # the one finished last step
                        self.load_tile(mA, mW, mS, col0, row, t, kt + b + S - 1, nxt)
                    self.mma_tile(bufs[b], codebook, half_select, atom, frag_a, frag_b, acc)

    def make_buffers(self):
        """Registers of one K tile: the words of the thread's 4 columns' block, their absmax
        codes, and the thread's 16 activations."""
        return (
            cute.make_rmem_tensor((self.k, 2 * ROW_TILES), Int32),
            cute.make_rmem_tensor((2 * ROW_TILES,), cutlass.Uint8),
            cute.make_rmem_tensor((THREAD_K,), self.dtype),
        )

    @cute.jit
    def load_tile(self, mA, mW, mS, col0, row, t, kt, buf):
        """Load K tile kt of the thread's columns col0 + 8 j (one repack tile holds all
        four: the column is split into (column in tile, tile) once, not per column)."""
        rW, rS, rA = buf
        k = self.k
        kb = kt * BLOCKS_PER_TILE_K + t // 2
        in_tile, n_tile = col0 % TILE_N, col0 // TILE_N
        for j in cutlass.range_constexpr(2 * ROW_TILES):  # column col0 + 8 j
            col = (in_tile + 8 * j, n_tile)
            # The k plane words of (column, block) are contiguous ([col][kb][bit] order).
            w_off = cute.assume(cute.crd2idx((col, kb, 0), mW.layout), divby=k if k % 2 == 0 else 1)
            cute.autovec_copy(
                cute.make_tensor(mW.iterator + w_off, cute.make_layout(k)), rW[None, j]
            )
            rS[j] = mS[col, kb]
        M, K = mA.shape
        k0 = kt * TILE_K + t * THREAD_K
        if k0 < K:
            a_off = cute.assume(row * K + k0, divby=THREAD_K)
            cute.autovec_copy(cute.make_tensor(mA.iterator + a_off, cute.make_layout(THREAD_K)), rA)
        else:
            rA.fill(0.0)  # K padding: the weights there are zero, A must not be NaN

    def mma_tile(self, buf, codebook, half_select, atom, frag_a, frag_b, acc):
        """acc[r] += this K tile of the thread's columns (row tile r) times the activations."""
        rW, rS, rA = buf
        k, W = self.k, self.field_width
        act = cute.recast_tensor(rA, Uint32)  # act[i] = activations (2i, 2i+1)
        a_regs = cute.recast_tensor(frag_a, Uint32)
        b_regs = cute.recast_tensor(frag_b, Uint32)
        # Each column's block scale in both halves, one IMAD (the tables carry the factor).
        scales = [
            absmax_x2(Uint32(rS[j]) & Uint32(0xFF), _DTYPE_NAME[self.dtype])
            for j in range(2 * ROW_TILES)
        ]
        b_pairs = None
        for r in range(ROW_TILES):
            # Plane b of both columns of this row tile, the thread's half of each:
            # bits 0-15 = column col0 + 16 r, bits 16-31 = column col0 + 16 r + 8.
            planes = [
                prmt(Uint32(rW[b, 2 * r]), Uint32(rW[b, 2 * r + 1]), half_select) for b in range(k)
            ]
            fields = planes_to_fields(planes, k, W)
            pairs = _pairs_of(fields, W)  # [(word, (field, element) x 2)] per mma register
            if b_pairs is None:  # the activation pairs serve every row tile
                b_pairs = [self.activation_pair(act, ea, eb) for _, (_, ea), (_, eb) in pairs]
            w_pairs = [[None] * len(pairs) for _ in range(2)]  # [column of the tile][pair]
            for half in range(2):  # column col0 + 16 r + 8 half
                scale = scales[2 * r + half]
                if self.byte_tables:  # the block's scale goes into its tables
                    tables = scaled_byte_tables(codebook, scale, self.dtype)
                for p, (word, (fa, _), (fb, _)) in enumerate(pairs):
                    fa2, fb2 = fa + half * 32 // W // 2, fb + half * 32 // W // 2
                    if self.byte_tables:
                        w_pairs[half][p] = self.lookup_pair(tables, word, fa2, fb2)
                    else:
                        w_pairs[half][p] = mul_x2(
                            self.lookup_pair(codebook, word, fa2, fb2), scale, self.dtype
                        )
            for s in range(THREAD_K // 4):  # 4 K positions per mma step
                # Register order of an m16n8k16 A fragment: (row g, K pair 0), (row g + 8,
                # pair 0), (row g, pair 1), (row g + 8, pair 1); B: pair 0, pair 1.
                a_regs[0] = w_pairs[0][2 * s]
                a_regs[1] = w_pairs[1][2 * s]
                a_regs[2] = w_pairs[0][2 * s + 1]
                a_regs[3] = w_pairs[1][2 * s + 1]
                b_regs[0] = b_pairs[2 * s]
                b_regs[1] = b_pairs[2 * s + 1]
                cute.gemm(atom, acc[r], frag_a, frag_b, acc[r])

    def lookup_pair(self, codebook, word, fa: int, fb: int):
        """Codebook values of fields fa and fb of ``word`` as one 16-bit pair (fa low)."""
        W = self.field_width
        if self.byte_tables:
            # Four 4-bit fields per lookup: nibbles 0-3 or (shifted down) 4-7.
            quad = fa // 4
            sel = word if quad == 0 else word >> 16
            lo, hi = byte_table_lookup(codebook, sel)
            return prmt(lo, hi, byte_pair_selector(fa % 4, fb % 4))
        elif self.lookup == "pair_shuffle":
            assert fb == fa + 1  # adjacent 2-bit fields: one 4-bit pair index
            return codebook_lookup_x2(codebook, word >> (fa * W) if fa else word)
        else:
            # (Moving half of these shifts to the FMA pipe as mul.hi measured slower.)
            va = codebook_lookup_x2(codebook, word >> (fa * W) if fa else word)
            vb = codebook_lookup_x2(codebook, word >> (fb * W) if fb else word)
            return prmt(va, vb, 0x5410)

    def activation_pair(self, act, ea: int, eb: int):
        """Activations of the thread's K positions ea and eb (0..15) as one register."""
        if ea // 2 == eb // 2 and ea % 2 == 0 and eb == ea + 1:
            return act[ea // 2]
        return prmt(act[ea // 2], act[eb // 2], pair_selector(ea % 2, eb % 2))

    @cute.jit
    def epilogue(self, acc, pScale, pBias, mOut, mWs, pCounters, sFlag, splits, has_bias, col0, t):
        """C fragment: acc[r][i] is column col0 + 16 r + 8 (i // 2), row 2 t + i % 2."""
        m_rows = self.m
        tidx, _, _ = cute.arch.thread_idx()
        group, split, _ = cute.arch.block_idx()
        M, N = mOut.shape
        scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
        mBias = cute.make_tensor(pBias, cute.make_layout(N))
        for r in cutlass.range_constexpr(ROW_TILES):
            for i in cutlass.range_constexpr(4):
                col = col0 + 16 * r + 8 * (i // 2)
                m = 2 * t + i % 2
                if m < m_rows:
                    if splits == 1:
                        self.store(acc[r][i], scale, mBias, mOut, has_bias, m, col)
                    else:
                        mWs[col, m, split] = acc[r][i]
        if splits > 1:
            if split_k_arrive(pCounters + group, splits, sFlag) != 0:  # the last CTA reduces
                outputs = COLS_PER_GROUP * m_rows
                for i in cutlass.range_constexpr((outputs + self.threads - 1) // self.threads):
                    o = tidx + i * self.threads
                    col, m = o % COLS_PER_GROUP, o // COLS_PER_GROUP
                    if o < outputs:
                        gcol = group * COLS_PER_GROUP + col
                        first = mWs.iterator + cute.crd2idx((gcol, m, 0), mWs.layout)
                        stride = cute.crd2idx((0, 0, 1), mWs.layout)
                        v = sum_split_partials(first, stride, splits)
                        self.store(v, scale, mBias, mOut, has_bias, m, gcol)

    @cute.jit
    def store(self, v, scale, mBias, mOut, has_bias, m, n):
        """out[m, n] = v * scale (+ bias[n]) in the output dtype, inside the true (M, N)."""
        M, N = mOut.shape
        if m < M and n < N:
            r = v * scale
            if has_bias != 0:
                r = r + Float32(mBias[n])
            mOut[m, n] = self.dtype(r)


def _pairs_of(fields, width: int):
    """Pair the thread's K positions for the mma registers, as the SWAR fields lie.

    ``fields`` covers 32 elements: 0-15 are the thread's 16 K positions of the row tile's
    first column, 16-31 the same positions of its second column, and both columns' fields
    sit at the same offsets, 32 / (2 W) fields apart. Each register takes two fields of
    one word (so one shift-free lookup serves both with byte tables). Returns 8 pairs
    [(word, (field a, K position a), (field b, K position b))] for the first column.
    """
    pairs = []
    second = 32 // width // 2  # field offset of the second column
    for word, elems in fields:
        first = [(f, e) for f, e in enumerate(elems) if e < 16]
        assert all(elems[f + second] == e + 16 for f, e in first), elems
        for i in range(0, len(first), 2):
            pairs.append((word, first[i], first[i + 1]))
    assert len(pairs) == THREAD_K // 2, pairs
    return pairs


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}
_DTYPE_NAME = {v: n for n, v in _DTYPES.items()}
M_BUCKETS = (1, 2, 4)


def gemv_spec(k: int, m: int, dtype: str, stages: int | None = None):
    """The compiled variant of ``GemvKernel`` for bits ``k``, rows bucket ``m``, dtype name
    (``stages``: override the register pipeline depth, for tuning)."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32, 4), fake_ptr(dt, 2),
            fake_ptr(dt, 2), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
            Int32(1), Int32(1), Int32(32), Int32(1), Int32(0), fake_stream(),
        )  # fmt: skip
        return GemvKernel(k, m, dt, stages), args

    suffix = f"_s{stages}" if stages else ""
    return KernelSpec(f"gemv_k{k}_m{m}_{dtype}{suffix}", build, expect=("LDG.E.128", "HMMA"))


def specs():
    return [gemv_spec(k, m, d) for k in (2, 3, 4, 5) for m in M_BUCKETS for d in _DTYPES]
