"""GEMV for M = 1..4: out[M, N] = A[M, K] @ W^T, W in the tiled kbit format.

Decode is bound by streaming W, so the kernel reads the tiled words straight
into registers (16-byte loads, no shared-memory tile, no barrier in the main
loop) and spends as few instructions per weight as it can:

* each thread owns ``COLS`` adjacent output columns; in the [col][kb][bit] tile
  order their words are contiguous, so one thread loads 8*k*COLS bytes per
  k-tile with LDG.128 and a warp reads a contiguous 256*k*COLS bytes;
* bit planes become index fields SWAR-style (``planes_to_fields``: about
  0.5 instructions per weight), and a lookup is one shift and one shuffle;
* each 32-weight block is a dot product in codebook units, scaled once by its
  E4M4 absmax; the per-tensor scale and the bias are applied in the epilogue;
* A is read as 8-wide vectors (the same address across the warp: one
  broadcast transaction) and reused for the thread's ``COLS`` columns.

Grid: (column groups of 64, K splits). The 4 warps of a CTA take 4 slices of
the CTA's K range and are summed through shared memory. With several splits
each CTA writes fp32 partials to a workspace and the last CTA of a column
group (an atomic counter it resets, so no memset is ever needed) sums them in
split order: results are bit-identical run to run.
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
    codebook_lookup,
    decode_e4m4,
    field_bits,
    load_codebook_lane,
    planes_to_fields,
)

COLS = 2  # output columns per thread (its 2 x COLS absmax bytes make one 32-bit word)
WARPS = 4
COLS_PER_GROUP = 32 * COLS  # columns of one CTA (a half repack tile)
A_VEC = 8  # A elements per vector load (16 bytes)


class GemvKernel:
    """Compile-time config: bits ``k``, rows bucket ``m`` (1, 2 or 4), activation dtype."""

    threads = 32 * WARPS

    def __init__(self, k: int, m: int, dtype: type[cutlass.Numeric]):
        self.k, self.m, self.dtype = k, m, dtype

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
        pWorkspace: cute.Pointer,  # fp32 (splits, m, column groups * 64) when splits > 1
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
        k, m_rows = self.k, self.m
        tidx, _, _ = cute.arch.thread_idx()
        group, split, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        M, K = mA.shape
        n0 = group * COLS_PER_GROUP + lane * COLS  # this thread's first column

        # This warp's slice of the K tiles: split s, warp w -> slice s * WARPS + w.
        slices = splits * WARPS
        slice_id = split * WARPS + warp
        kt_begin = slice_id * k_tiles // slices
        kt_end = (slice_id + 1) * k_tiles // slices

        cb_lane = load_codebook_lane(cute.make_tensor(pCodebook, cute.make_layout(1 << k)), k)
        words_per_thread = COLS * BLOCKS_PER_TILE_K * k
        acc = cute.make_rmem_tensor((COLS, m_rows), Float32)
        acc.fill(0.0)
        # Two register buffers in ping-pong: the next K tile's words are in flight while
        # this one is dequantized, so a warp always has a load outstanding (no copies).
        rW = [cute.make_rmem_tensor((words_per_thread,), Int32) for _ in range(2)]
        # The thread's COLS x 2 absmax bytes are one aligned 32-bit word ([col][kb] order).
        rS = [cute.make_rmem_tensor((1,), Int32) for _ in range(2)]
        if kt_begin < kt_end:
            self.load_tile(mW, mS, n0, kt_begin, rW[0], rS[0])
        for kt in cutlass.range(kt_begin, kt_end, 2, unroll=1):
            for b in cutlass.range_constexpr(2):
                if kt + b < kt_end:
                    if kt + b + 1 < kt_end:
                        self.load_tile(mW, mS, n0, kt + b + 1, rW[1 - b], rS[1 - b])
                    self.dot_tile(mA, rW[b], rS[b], cb_lane, kt + b, acc)

        self.epilogue(acc, pScale, pBias, mOut, mWs, pCounters, splits, has_bias, group, split)

    @cute.jit
    def dot_tile(self, mA, rW, rS, cb_lane, kt, acc):
        """acc[c, m] += the K tile's 64 weights of column c . A[m, tile], block by block."""
        k, m_rows, W = self.k, self.m, field_bits(self.k)
        M, K = mA.shape
        rA = cute.make_rmem_tensor((A_VEC, m_rows), self.dtype)  # a row's 8 values contiguous
        blk = cute.make_rmem_tensor((COLS, m_rows), Float32)
        for kb in cutlass.range_constexpr(BLOCKS_PER_TILE_K):
            k0 = kt * TILE_K + kb * BLOCK
            # Index fields of each column's block; a trace-time table says where each
            # element's index sits.
            fields = []
            for c in cutlass.range_constexpr(COLS):
                base = (c * BLOCKS_PER_TILE_K + kb) * k
                fields.append(planes_to_fields([Uint32(rW[base + i]) for i in range(k)], k))
            blk.fill(0.0)
            for g in cutlass.range_constexpr(BLOCK // A_VEC):
                if k0 < K:
                    for m in cutlass.range_constexpr(m_rows):
                        row = cutlass.min(m, M - 1)  # rows past M: recomputed, not stored
                        a_off = cute.assume(row * K + k0 + g * A_VEC, divby=A_VEC)
                        gA = cute.make_tensor(mA.iterator + a_off, cute.make_layout(A_VEC))
                        cute.autovec_copy(gA, rA[None, m])
                else:
                    rA.fill(0.0)  # K padding: weights are zero, A must not be NaN
                for e in cutlass.range_constexpr(A_VEC):
                    j = g * A_VEC + e
                    for c in cutlass.range_constexpr(COLS):
                        word, off = _field_of(fields[c], j, W)
                        wv = codebook_lookup(cb_lane, Int32(word >> off))
                        for m in cutlass.range_constexpr(m_rows):
                            blk[c, m] = blk[c, m] + wv * Float32(rA[e, m])
            for c in cutlass.range_constexpr(COLS):
                amax = decode_e4m4(rS[0] >> (8 * (c * BLOCKS_PER_TILE_K + kb)))
                for m in cutlass.range_constexpr(m_rows):
                    acc[c, m] = acc[c, m] + blk[c, m] * amax

    @cute.jit
    def load_tile(self, mW, mS, n0, kt, rW, rS):
        """Words and absmax bytes of columns n0..n0+COLS-1, both K blocks of tile kt: each a
        contiguous run in the [col][kb][bit] order (16-byte loads for the words)."""
        w_off = cute.assume(cute.crd2idx((n0, kt * BLOCKS_PER_TILE_K, 0), mW.layout), divby=4)
        cute.autovec_copy(cute.make_tensor(mW.iterator + w_off, cute.make_layout(rW.shape)), rW)
        s_off = cute.assume(cute.crd2idx((n0, kt * BLOCKS_PER_TILE_K), mS.layout), divby=4)
        s_word = cute.recast_ptr(mS.iterator + s_off, dtype=Int32)
        cute.autovec_copy(cute.make_tensor(s_word, cute.make_layout(1)), rS)

    @cute.jit
    def epilogue(self, acc, pScale, pBias, mOut, mWs, pCounters, splits, has_bias, group, split):
        """Sum the CTA's 4 warps, then store (one split) or go through the workspace."""
        m_rows = self.m
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        M, N = mOut.shape
        smem = SmemAllocator()
        sRed = smem.allocate_tensor(
            Float32, cute.make_layout((COLS_PER_GROUP, m_rows, WARPS)), byte_alignment=16
        )
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        for c in cutlass.range_constexpr(COLS):
            for m in cutlass.range_constexpr(m_rows):
                sRed[lane * COLS + c, m, warp] = acc[c, m]
        cute.arch.sync_threads()

        scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
        mBias = cute.make_tensor(pBias, cute.make_layout(N))
        outputs = COLS_PER_GROUP * m_rows
        for i in cutlass.range_constexpr((outputs + self.threads - 1) // self.threads):
            o = tidx + i * self.threads
            col, m = o % COLS_PER_GROUP, o // COLS_PER_GROUP
            if o < outputs:
                v = sRed[col, m, 0]
                for w in cutlass.range_constexpr(1, WARPS):
                    v = v + sRed[col, m, w]
                if splits == 1:
                    self.store(v, scale, mBias, mOut, has_bias, m, group * COLS_PER_GROUP + col)
                else:
                    mWs[group * COLS_PER_GROUP + col, m, split] = v
        if splits > 1:
            # Publish the partials, then count this CTA in; the last one reduces.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                counter = pCounters + group
                prev = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                last = Int32(prev == splits - 1)
                if last != 0:
                    cute.arch.atomic_exch(counter, Int32(0))  # ready for the next call
                sFlag[0] = last
            cute.arch.sync_threads()
            if sFlag[0] != 0:
                cute.arch.fence_acq_rel_gpu()
                for i in cutlass.range_constexpr((outputs + self.threads - 1) // self.threads):
                    o = tidx + i * self.threads
                    col, m = o % COLS_PER_GROUP, o // COLS_PER_GROUP
                    if o < outputs:
                        gcol = group * COLS_PER_GROUP + col
                        v = Float32(0.0)
                        for s in cutlass.range(splits, unroll=1):  # fixed order: deterministic
                            v = v + cute.arch.load(
                                mWs.iterator + cute.crd2idx((gcol, m, s), mWs.layout),
                                Float32,
                                cop="cg",
                            )
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


def _field_of(fields, j: int, width: int):
    """(word value, bit offset) of element j's index in ``planes_to_fields`` output."""
    for word, elems in fields:
        if j in elems:
            return word, elems.index(j) * width
    raise AssertionError(f"element {j} has no field")


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}
M_BUCKETS = (1, 2, 4)


def gemv_spec(k: int, m: int, dtype: str):
    """The compiled variant of ``GemvKernel`` for bits ``k``, rows bucket ``m``, dtype name."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32, 4), fake_ptr(dt, 2),
            fake_ptr(dt, 2), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
            Int32(1), Int32(1), Int32(32), Int32(1), Int32(0), fake_stream(),
        )  # fmt: skip
        return GemvKernel(k, m, dt), args

    return KernelSpec(f"gemv_k{k}_m{m}_{dtype}", build, expect=("LDG.E.128", "SHFL"))


def specs():
    return [gemv_spec(k, m, d) for k in (2, 3, 4, 5) for m in M_BUCKETS for d in _DTYPES]
