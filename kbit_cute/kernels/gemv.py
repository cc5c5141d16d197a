"""GEMV for M = 1..8: out[M, N] = A[M, K] @ W^T, W in the tiled kbit format, on tensor cores.

Decode is bound by streaming W, and the issue rate, not the loads, is what limits a
dequantizing kernel: at 3 TB/s each SM must retire ~22 (k=4) to ~41 (k=2) weights per
clock with 128 thread-instructions. So the multiply-adds go to ``mma.sync`` m16n8k16 with
the weights as operand A (16 output columns x 16 K) and the activations as operand B
(16 K x 8 rows, rows past M unused): the fp32 accumulation is free, and M = 8 costs little
more than M = 1. What is left per weight is the dequantization into fp16/bf16 pairs:

* each warp streams its 32 columns' K tiles (plane words, absmax, activation rows) through
  its own shared-memory ring with cp.async, a few tiles ahead, syncing only with itself:
  bytes in flight cost no registers (``copy_tile`` / ``read_tile``);
* a thread owns 16 consecutive K of one 32-weight block for 4 columns (two mma row
  tiles); it reads the columns' bit-plane words from the ring, picks its 16-bit half of
  each plane and merges the planes into index fields SWAR-style (``planes_to_fields``);
* indices become values by byte-select tables in registers (k <= 3, ``prmt``) or a
  warp-shuffle table (k >= 4), two weights per 32-bit register, times the block's absmax
  (one 2-wide multiply; the E4M4 byte becomes a half2 scale with one IMAD, ``absmax_x2``);
* mma.sync pairs K positions to registers in a fixed pattern; since the dot product does
  not care about the order of K, each register takes the two weights that the SWAR fields
  deliver side by side, and the activations are permuted to match (one ``prmt`` per pair,
  shared by all columns of the thread).

Grid: (128-column groups = one repack tile, K splits). The 4 warps of a CTA take 32
columns each (times ``warps_k`` warp sets that split the CTA's K range, an option). With
several splits each CTA writes fp32 partials to a workspace and the last CTA of a column
group (an atomic counter it resets, so no memset is ever needed) sums them in split order:
results are bit-identical run to run.
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
    g2s_copy_atom,
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
# Shared-memory ring per warp: each warp copies its own 32 columns' K tiles (words, absmax,
# activation rows) with cp.async, stages - 1 tiles ahead of the one it works on. Bytes in
# flight then cost no registers (a register ring capped them near 16 KB per SM, which by
# Little's law held the stream to ~2 TB/s), and a warp syncs only with itself.
STAGES = {2: 3, 3: 3, 4: 3, 5: 3}
LOOKUP = {2: "pair_shuffle", 3: "byte_tables", 4: "shuffle", 5: "shuffle"}
# Pair table (k = 4): entry p = (codebook[p & 15], codebook[p >> 4]), one copy per lane so
# that a warp's 32 loads hit 32 banks: byte address p * 256 + lane * 4 (a prmt builds it
# from the pair's byte and the lane's byte; rows are 256 bytes, half of each unused).
PAIR_TABLE_ROW = 256
PAIR_TABLE_BYTES = 256 * PAIR_TABLE_ROW
CHUNK_WORDS = 4  # one cp.async moves 16 bytes
ABSMAX_WORDS = WARP_COLS * BLOCKS_PER_TILE_K // 4  # a warp's absmax bytes of a K tile
A_ROW_WORDS = TILE_K // 2  # one activation row of a K tile (16-bit values)


def gemv_mma(dtype: type[cutlass.Numeric]):
    """The kernel's mma.sync m16n8k16 (fp32 accumulate): ``(atom, tiled_mma)``, one warp.

    One function so that ``kbit_cute.layouts.kernel_layouts`` draws the very layouts the
    kernel partitions its fragments with. Call it while tracing.
    """
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (MMA_M, MMA_N, MMA_K)))
    return atom, cute.make_tiled_mma(atom)


class GemvKernel:
    """Compile-time config: bits ``k``, rows bucket ``m`` (1, 2, 4 or 8), activation dtype."""

    def __init__(
        self,
        k: int,
        m: int,
        dtype: type[cutlass.Numeric],
        stages: int | None = None,
        lookup: str | None = None,
        warps_k: int | None = None,
    ):
        self.k, self.m, self.dtype = k, m, dtype
        # K tiles in flight per warp, in its shared-memory ring (see STAGES).
        self.stages = stages or STAGES[k]
        # How indices become values. Issue slots and the integer ALU pipe (half the issue
        # rate) are what these kernels run out of, so each k takes the lookup with the
        # fewest instructions per weight:
        # k = 2: one shuffle per pair from a 16-entry table of pairs (two adjacent 2-bit
        #        fields are its lane index);
        # k = 3: byte-select tables, scaled per block, four lookups per two prmt;
        # k >= 4: one shuffle per weight, two merged into a pair with one prmt.
        # "pair_table" (k <= 4, an option): one shared-memory load per pair from a
        # 256-entry table of pairs, its address one prmt from the byte that holds the
        # pair's two 4-bit fields. A third fewer instructions at k = 4, but the 64 KB
        # table halves the warps per SM: it measured equal at k = 4, 10% faster at k = 3
        # on 8192x28672 and slower on small shapes (perf/NOTES.md).
        self.lookup = lookup or LOOKUP[k]
        if not GemvKernel.lookup_fits(self.lookup, k):
            raise ValueError(f"GEMV lookup {self.lookup!r} does not serve k={k}")
        self.byte_tables = self.lookup == "byte_tables"
        self.field_width = field_bits(k, 4 if self.lookup in ("byte_tables", "pair_table") else 1)
        # Warps per CTA: 4 column warps (one repack tile), times warps_k that split the
        # CTA's K range and add up in shared memory: the 64 KB pair table is shared by
        # more warps, so more of them fit on an SM.
        self.warps_k = warps_k or (2 if self.lookup == "pair_table" else 1)
        self.warps = WARPS * self.warps_k
        self.threads = 32 * self.warps

    @staticmethod
    def lookup_fits(lookup: str, k: int) -> bool:
        """Whether a lookup serves k: a pair shuffle needs 2-bit fields, byte tables <= 8
        entries, the pair table two fields per byte (k <= 4); shuffles serve every k."""
        limits = {"pair_shuffle": 2, "byte_tables": 3, "pair_table": 4, "shuffle": 5}
        return lookup in limits and k <= limits[lookup]

    @staticmethod
    def can_implement(k: int, m: int, dtype) -> bool:
        return k in (2, 3, 4, 5) and m in M_BUCKETS and dtype in (cutlass.Float16, cutlass.BFloat16)

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
        wn, wk = warp % WARPS, warp // WARPS  # column warp, K part
        M, K = mA.shape
        # mma fragment coordinates: lane = 4 * g + t. The thread's mma rows are g and g + 8
        # of each row tile; its K run in a tile is block kb = t / 2, half h = t % 2.
        g, t = lane // 4, lane % 4
        col0 = group * COLS_PER_GROUP + wn * WARP_COLS + g
        kt_begin = split * k_tiles // splits
        kt_end = (split + 1) * k_tiles // splits
        if cutlass.const_expr(self.warps_k > 1):  # this warp's part of the CTA's K tiles
            n_kt = kt_end - kt_begin
            kt_begin, kt_end = (
                kt_begin + wk * n_kt // self.warps_k,
                kt_begin + (wk + 1) * n_kt // self.warps_k,
            )

        smem = SmemAllocator()
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)

        ctx = self.make_mainloop(smem, pCodebook, t)
        acc = ctx[-1]
        for r in cutlass.range_constexpr(ROW_TILES):
            acc[r].fill(0.0)
        # Activation rows 0..M-1 feed the mma's columns g; threads past M reuse row M-1
        # (finite values, never stored).
        self.mainloop(mA, mW, mS, col0, (Int32(0), M), t, kt_begin, kt_end, ctx)
        if cutlass.const_expr(self.warps_k > 1):
            self.add_k_parts(acc, ctx[5], wk)

        self.epilogue(
            acc, pScale, pBias, mOut, mWs, pCounters, sFlag, splits, has_bias, col0, t, wk == 0
        )

    @cute.jit
    def add_k_parts(self, acc, ring, wk):
        """Column warp wn of K part 0 takes the sums of the other K parts' warp wn, through
        the ring's shared memory (every warp is past its K loop, so the ring is free)."""
        acc_n = ROW_TILES * 4
        lay = cute.make_layout((acc_n, self.threads // self.warps_k, self.warps_k))
        buf = cute.make_tensor(cute.recast_ptr(ring.iterator, dtype=Float32), lay)
        tidx, _, _ = cute.arch.thread_idx()
        col_thread = tidx % (self.threads // self.warps_k)
        cute.arch.sync_threads()
        if wk > 0:
            for r in cutlass.range_constexpr(ROW_TILES):
                for i in cutlass.range_constexpr(4):
                    buf[r * 4 + i, col_thread, wk] = acc[r][i]
        cute.arch.sync_threads()
        if wk == 0:
            for p in cutlass.range_constexpr(1, self.warps_k):
                for r in cutlass.range_constexpr(ROW_TILES):
                    for i in cutlass.range_constexpr(4):
                        acc[r][i] = acc[r][i] + buf[r * 4 + i, col_thread, p]

    def stage_words(self) -> int:
        """Int32 words of one warp's ring stage: its 32 columns' plane words for both
        blocks of a K tile, their 64 absmax bytes, and ``m`` activation rows of 64 K."""
        return WARP_COLS * BLOCKS_PER_TILE_K * self.k + ABSMAX_WORDS + self.m * A_ROW_WORDS

    def make_mainloop(self, smem: SmemAllocator, pCodebook: cute.Pointer, t):
        """What the K loop works with, made once per CTA: (codebook registers, 16-bit half
        selector, mma atom, A and B fragments, shared-memory ring, the registers of one K
        tile, accumulators per row tile)."""
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
        if cutlass.const_expr(self.lookup == "pair_table"):
            codebook = self.make_pair_table(smem, codebook)
        ring = smem.allocate_tensor(
            Int32,
            cute.make_layout(self.stage_words() * self.stages * self.warps),
            byte_alignment=16,
        )
        buf = self.make_buffers()
        acc = [
            tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((MMA_M, MMA_N)))
            for _ in range(ROW_TILES)
        ]
        return codebook, half_select, atom, frag_a, frag_b, ring, buf, acc

    def make_pair_table(self, smem: SmemAllocator, cb_lane):
        """Fill the CTA's shared pair table from the codebook lanes (``cb_lane``: entry
        lane % 16 in both halves); returns (table byte pointer, this lane's byte offset
        register). Each thread writes 8 rows' 4-lane slices with 16-byte stores."""
        table = smem.allocate_tensor(
            Uint32, cute.make_layout(PAIR_TABLE_BYTES // 4), byte_alignment=1024
        )
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        slices = PAIR_TABLE_ROW // 2 // 16  # 16-byte slices of a row's used half
        for i in range(256 * slices // self.threads):
            chunk = tidx + i * self.threads
            p, sl = chunk // slices, chunk % slices
            lo = codebook_lookup_x2(cb_lane, Uint32(p) & Uint32(15))
            hi = codebook_lookup_x2(cb_lane, Uint32(p) >> Uint32(4))
            v = prmt(lo, hi, 0x5410)
            four = cute.make_rmem_tensor((4,), Uint32)
            four.fill(v)
            dst = table.iterator + cute.assume(p * (PAIR_TABLE_ROW // 4) + sl * 4, divby=4)
            cute.autovec_copy(four, cute.make_tensor(dst, cute.make_layout(4)))
        cute.arch.sync_threads()
        return cute.recast_ptr(table.iterator, dtype=cutlass.Uint8), Uint32(lane * 4)

    @cute.jit
    def mainloop(self, mA, mW, mS, col0, rows, t, kt_begin, kt_end, ctx):
        """acc += K tiles kt_begin..kt_end of the thread's columns times the activations of
        ``rows`` = (first row, count): mma column g takes row first + min(g, count - 1).

        Each warp streams its own 32 columns through its shared-memory ring: cp.async
        copies run stages - 1 K tiles ahead while the warp dequantizes the current one from
        registers; only the warp itself waits (``sync_warp``), never the CTA."""
        codebook, half_select, atom, frag_a, frag_b, ring, buf, acc = ctx
        S, sw = self.stages, self.stage_words()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        g = lane // 4
        warp_ring = ring.iterator + cute.assume(warp * (S * sw), divby=CHUNK_WORDS)
        wcol = col0 - g  # the warp's first column, 32-aligned: (column in tile, tile) once
        in_tile, n_tile = wcol % TILE_N, wcol // TILE_N
        for s in cutlass.range_constexpr(S - 1):
            if kt_begin + s < kt_end:
                self.copy_tile(mA, mW, mS, in_tile, n_tile, rows, kt_begin + s, warp_ring + s * sw)
            cute.arch.cp_async_commit_group()
        read = Int32(0)
        for kt in cutlass.range(kt_begin, kt_end, unroll=1):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_warp()  # every lane's copies of stage ``read`` have landed
            self.read_tile(warp_ring + cute.assume(read * sw, divby=CHUNK_WORDS), g, t, rows, buf)
            # The stage read last step is free: every lane passed the sync_warp above.
            write = read + (S - 1)
            if write >= S:
                write = write - S
            if kt + S - 1 < kt_end:
                dst = warp_ring + cute.assume(write * sw, divby=CHUNK_WORDS)
                self.copy_tile(mA, mW, mS, in_tile, n_tile, rows, kt + S - 1, dst)
            cute.arch.cp_async_commit_group()
            self.mma_tile(buf, codebook, half_select, atom, frag_a, frag_b, acc)
            read = read + 1
            if read == S:
                read = Int32(0)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()  # a next pass may refill the ring

    def make_buffers(self):
        """Registers of one K tile: the words of the thread's 4 columns' block, their absmax
        codes, and the thread's 16 activations."""
        return (
            cute.make_rmem_tensor((self.k, 2 * ROW_TILES), Int32),
            cute.make_rmem_tensor((2 * ROW_TILES,), cutlass.Uint8),
            cute.make_rmem_tensor((THREAD_K,), self.dtype),
        )

    @cute.jit
    def copy_tile(self, mA, mW, mS, in_tile, n_tile, rows, kt, dst):
        """cp.async of K tile kt of the warp's 32 columns into the ring stage at ``dst``:
        [plane words: (col, kb, bit), contiguous in the tiled format | absmax: (col, kb) |
        activation rows: (K, row)]. Activations past K are zero-filled (the padded weights
        there are zero, and A must not be NaN)."""
        k = self.k
        lane = cute.arch.lane_idx()
        first_row, n_rows = rows
        M, K = mA.shape
        g2s = g2s_copy_atom(Int32)
        # Activations: the other warps of the CTA read the same rows, so through L1.
        g2s_l1 = g2s_copy_atom(Int32, through_l1=True)
        w_first = cute.crd2idx(((in_tile, n_tile), (0, kt), 0), mW.layout)
        w_chunks = WARP_COLS * BLOCKS_PER_TILE_K * k // CHUNK_WORDS
        for i in cutlass.range_constexpr((w_chunks + 31) // 32):
            c = lane + 32 * i
            src = mW.iterator + cute.assume(w_first + c * 4, divby=4)
            chunk_dst = dst + cute.assume(c * 4, divby=4)
            if cutlass.const_expr(32 * (i + 1) <= w_chunks):  # every lane has a chunk
                _copy_chunk(g2s, src, chunk_dst)
            elif c < w_chunks:
                _copy_chunk(g2s, src, chunk_dst)
        s_first = cute.crd2idx(((in_tile, n_tile), (0, kt)), mS.layout)
        s_dst = dst + 4 * w_chunks
        if lane < ABSMAX_WORDS // CHUNK_WORDS:
            src = cute.recast_ptr(
                mS.iterator + cute.assume(s_first + lane * 16, divby=16), dtype=Int32
            )
            _copy_chunk(g2s, src, s_dst + cute.assume(lane * 4, divby=4))
        a_dst = s_dst + ABSMAX_WORDS
        a_chunks = self.m * A_ROW_WORDS // CHUNK_WORDS
        for i in cutlass.range_constexpr((a_chunks + 31) // 32):
            q = lane + 32 * i
            row, c = q // (A_ROW_WORDS // CHUNK_WORDS), q % (A_ROW_WORDS // CHUNK_WORDS)
            if q < a_chunks:
                if row < n_rows:
                    d = a_dst + cute.assume(q * CHUNK_WORDS, divby=CHUNK_WORDS)
                    kk = kt * TILE_K + c * (CHUNK_WORDS * 2)
                    if kk < K:
                        off = cute.assume((first_row + row) * K + kk, divby=8)
                        _copy_chunk(g2s_l1, cute.recast_ptr(mA.iterator + off, dtype=Int32), d)
                    else:
                        zero = cute.make_rmem_tensor((CHUNK_WORDS,), Int32)
                        zero.fill(0)
                        cute.autovec_copy(zero, cute.make_tensor(d, cute.make_layout(CHUNK_WORDS)))

    @cute.jit
    def read_tile(self, src, g, t, rows, buf):
        """The thread's part of the ring stage at ``src`` into registers: the k plane words
        of block t // 2 of its columns g + 8 j (j = 0..3), their absmax codes, and its 16
        activations (K run t of row min(g, count - 1))."""
        rW, rS, rA = buf
        k = self.k
        kb = t // 2
        absmax = cute.make_tensor(
            cute.recast_ptr(src + WARP_COLS * BLOCKS_PER_TILE_K * k, dtype=cutlass.Uint8),
            cute.make_layout(WARP_COLS * BLOCKS_PER_TILE_K),
        )
        for j in cutlass.range_constexpr(2 * ROW_TILES):
            c = g + 8 * j
            w_off = cute.assume(c * (BLOCKS_PER_TILE_K * k) + kb * k, divby=k if k % 2 == 0 else 1)
            cute.autovec_copy(cute.make_tensor(src + w_off, cute.make_layout(k)), rW[None, j])
            rS[j] = absmax[c * BLOCKS_PER_TILE_K + kb]
        _, n_rows = rows
        row = cutlass.min(g, n_rows - 1)
        a_off = cute.assume(
            WARP_COLS * BLOCKS_PER_TILE_K * k
            + ABSMAX_WORDS
            + row * A_ROW_WORDS
            + t * (THREAD_K // 2),
            divby=CHUNK_WORDS,
        )
        cute.autovec_copy(
            cute.make_tensor(
                cute.recast_ptr(src + a_off, dtype=self.dtype), cute.make_layout(THREAD_K)
            ),
            rA,
        )

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
        elif self.lookup == "pair_table":
            assert fb == fa + 1 and fa % 2 == 0  # one byte: a 256-entry pair index
            table, lane_offset = codebook
            # address byte 0 = the lane's copy, byte 1 = the pair index, bytes 2, 3 = 0
            addr = prmt(word, lane_offset, 0x5504 | (fa // 2) << 4)
            entry = cute.recast_ptr(table + cute.assume(Int32(addr), divby=4), dtype=Uint32)
            return cute.make_tensor(entry, cute.make_layout(1))[0]
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
    def epilogue(
        self, acc, pScale, pBias, mOut, mWs, pCounters, sFlag, splits, has_bias, col0, t, owner
    ):
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
                if owner:
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


def _copy_chunk(atom, src: cute.Pointer, dst: cute.Pointer):
    """One 16-byte cp.async, global ``src`` -> shared ``dst`` (Int32 pointers)."""
    cute.copy(
        atom,
        cute.make_tensor(src, cute.make_layout(CHUNK_WORDS)),
        cute.make_tensor(dst, cute.make_layout(CHUNK_WORDS)),
    )


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
M_BUCKETS = (1, 2, 4, 8)  # activation rows per variant: the mma has 8 columns


def gemv_spec(
    k: int, m: int, dtype: str, stages: int | None = None, lookup: str | None = None,
    warps_k: int | None = None,
):  # fmt: skip
    """The compiled variant of ``GemvKernel`` for bits ``k``, rows bucket ``m``, dtype name
    (``stages``, ``lookup``, ``warps_k``: override the defaults, for tuning)."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32, 4), fake_ptr(dt, 2),
            fake_ptr(dt, 2), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
            Int32(1), Int32(1), Int32(32), Int32(1), Int32(0), fake_stream(),
        )  # fmt: skip
        return GemvKernel(k, m, dt, stages, lookup, warps_k), args

    suffix = (f"_s{stages}" if stages else "") + (f"_{lookup}" if lookup else "")
    suffix += f"_wk{warps_k}" if warps_k else ""
    return KernelSpec(f"gemv_k{k}_m{m}_{dtype}{suffix}", build, expect=("LDGSTS", "HMMA"))


def specs():
    return [gemv_spec(k, m, d) for k in (2, 3, 4, 5) for m in M_BUCKETS for d in _DTYPES]
