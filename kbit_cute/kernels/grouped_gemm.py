"""Grouped expert GEMM for MoE launches with many rows per expert (prefill).

``out[rows of e] = A[rows of e] @ W_e^T`` for the E stacked weights of a ``KbitExperts``, rows
sorted by expert, ``expert_offsets`` [E + 1] on the device, as the grouped GEMV kernels
(``grouped_gemv``) compute it; those re-stream an expert's weights for every 8 of its rows,
which loses to bf16 ``torch._grouped_mm`` once experts hold tens of rows (perf/NOTES.md). This
kernel runs the dense GEMM's mainloop and epilogue (``GemmKernel.tile``: cp.async ring,
ldmatrix, dequant in registers, mma.sync) on work items (M tile of one expert, N tile):

* Work slot s enumerates the M tiles of every expert in expert order (an expert with r rows
  has ceil(r / TILE_M) of them). Each CTA finds its slot's expert and M tile by scanning
  the offsets (a prefix count over the CTA, as the grouped GEMV finds its expert), so the
  host never reads the offsets and the launch is graph-capturable. The host launches a
  bound on the slots, min(E, R) + R // TILE_M; slots past the last tile exit at once.
* The tile is the dense GEMM's with A, the output and the weights moved to the expert: M =
  the expert's rows (rows past them are neither copied nor stored), its own scale, no bias,
  no split-K (prefill launches have tiles enough to fill the SMs).
* gate_up (fused SiLU(g) * u): a CTA's repack tile is gathered from two half tiles, the
  expert's gate columns 64 n.. (its first 64 columns) and the matching up columns I + 64 n..
  (the last 64): a repack tile stores column after column ([col][kb][bit] words, [col][kb]
  absmax bytes), so each half is one contiguous run. Every thread then holds the gate and
  the up accumulators of the same output columns (n8 tiles j and j + NJ / 2) and the
  epilogue writes SiLU(g) * u, rounded once, to the [R, I] output. I must be a multiple of
  64 (moe_gate_up's rule).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from ..format import TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .gemm import _DTYPES, GemmConfig, GemmKernel
from .grouped_gemv import expert_weights, find_work_slot, silu_times


def gate_up_source(kt64, n_cta, n_tiles128, off, per_tile, up):
    """Source offset of element ``off`` (a word or an absmax byte, ``per_tile`` of them per
    repack tile) of a fused gate/up CTA's repack tile at repack k-tile ``kt64``: the first
    half from gate half tile ``n_cta`` (64 columns), the second (``up`` = 1) from up half tile
    I / 64 + n_cta (I / 64 = n_tiles128 for N = 2 I). Kernel values or Python ints."""
    half = per_tile // 2
    half_tile = n_cta + up * n_tiles128
    tile = kt64 * n_tiles128 + half_tile // 2
    return tile * per_tile + (half_tile % 2) * half + off - up * half


class GroupedGemmKernel(GemmKernel):
    """``GemmKernel`` over (expert M tile, N tile) work items. Compile-time config: bits
    ``k``, dtype name, ``GemmConfig`` (no split-K: whole K per tile; gate_up: tile_n = 128),
    ``gate_up`` (fused SiLU(g) * u)."""

    def __init__(self, k: int, dtype: str, config: GemmConfig, gate_up: bool = False):
        super().__init__(k, dtype, config)
        # Its own launch and kernel take no programmatic dependent launch (no wait in it):
        # off, so that nothing inherited reads it as on.
        self.pdl = False
        if gate_up and config.tile_n != TILE_N:
            raise ValueError(f"a gate_up GroupedGemmKernel needs tile_n=128, got {config.name}")
        self.gate_up = gate_up
        self.out_cols = config.tile_n // 2 if gate_up else config.tile_n  # per CTA

    def out_width(self, N):
        """Output columns of a weight of N rows (gate_up: N / 2, SiLU(g) * u)."""
        return N // 2 if self.gate_up else N

    def has_repack_tile(self, n_cta, rn, n_tiles128):
        if self.gate_up:  # the host launches I / 64 = n_tiles128 column CTAs
            return n_cta < n_tiles128
        return super().has_repack_tile(n_cta, rn, n_tiles128)

    def repack_src(self, kt64, n_cta, rn, n_tiles128, off, per_tile):
        if not self.gate_up:
            return super().repack_src(kt64, n_cta, rn, n_tiles128, off, per_tile)
        up = Int32(off >= per_tile // 2)
        return gate_up_source(kt64, n_cta, n_tiles128, off, per_tile, up)

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (R, K) row-major, rows sorted by expert
        pPacked: cute.Pointer,  # int32 (E, words per expert)
        pAbsmax: cute.Pointer,  # uint8 (E, bytes per expert)
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (E,) per-expert scale
        pOffsets: cute.Pointer,  # int32 (E + 1,) row ranges
        pOut: cute.Pointer,  # (R, N) row-major; gate_up: (R, N / 2)
        R: Int32,
        N: Int32,  # the weight's rows (gate_up: gate and up)
        K: Int32,  # a multiple of 32
        E: Int32,
        slots: Int32,  # bound on the (expert, M tile) work slots
        stream: cuda.CUstream,
    ):
        n_ctas = (self.out_width(N) + self.out_cols - 1) // self.out_cols
        mOff = cute.make_tensor(pOffsets, cute.make_layout(E + 1))
        self.kernel(pA, pPacked, pAbsmax, pCodebook, pScale, mOff, pOut, R, N, K).launch(
            grid=[slots, n_ctas, 1],
            block=[self.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=_MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(
        self,
        pA: cute.Pointer,
        pPacked: cute.Pointer,
        pAbsmax: cute.Pointer,
        pCodebook: cute.Pointer,
        pScale: cute.Pointer,
        mOff: cute.Tensor,
        pOut: cute.Pointer,
        R: Int32,
        N: Int32,
        K: Int32,
    ):
        slot, n_cta, _ = cute.arch.block_idx()
        K = cute.assume(K, divby=32)
        warps = self.threads // 32
        smem = SmemAllocator()
        base_u8 = self.allocate_tile_smem(smem)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(warps + 4), byte_alignment=4)
        find_work_slot(mOff, slot, sScan, self.threads, self.cfg.tile_m)
        expert = sScan[warps]
        if expert >= 0:
            row_begin = sScan[warps + 1]
            rows = cutlass.max(cutlass.min(sScan[warps + 2], R - row_begin), 0)  # bad offsets
            m_tile = sScan[warps + 3]
            n_tiles = (N + TILE_N - 1) // TILE_N
            k_tiles = (K + TILE_K - 1) // TILE_K
            mWe, mSe = expert_weights(
                cute.make_tensor(pPacked, weight_words_layout(n_tiles, k_tiles, self.k)),
                cute.make_tensor(pAbsmax, weight_absmax_layout(n_tiles, k_tiles)),
                expert,
                self.k,
            )
            a_first = cute.assume(Int64(row_begin) * Int64(K), divby=32)
            n_out = self.out_width(N)
            o_first = cute.assume(Int64(row_begin) * Int64(n_out), divby=8)  # (host: N % 8 == 0)
            self.build_pair_table(pCodebook, base_u8 + self.plan["table"])
            # (no bias, no split-K: the bias, workspace and counter pointers are not read)
            self.tile(
                base_u8, pA + a_first, mWe.iterator, mSe.iterator, pScale + expert, pOut,
                pOut + o_first, pScale, mOff.iterator, rows, N, K, 0, 0, m_tile, n_cta, 0,
                0, (K + self.cfg.tile_k - 1) // self.cfg.tile_k, (Int32(1), Int32(0), Int32(0)),
            )  # fmt: skip

    @cute.jit
    def store_tile(self, thr_mma, tCrC, base_u8, pScale, pBias, pOut, M, N, has_bias, m_cta, n_cta):
        """gate_up: SiLU(g x scale) * (u x scale) -> dtype -> shared tile -> the coalesced
        stores of (M, N / 2) columns 64 n_cta..; otherwise the dense GEMM's store."""
        if cutlass.const_expr(not self.gate_up):
            GemmKernel.store_tile(
                self, thr_mma, tCrC, base_u8, pScale, pBias, pOut, M, N, has_bias, m_cta, n_cta
            )
        else:
            cfg = self.cfg
            sC = cute.make_tensor(cute.recast_ptr(base_u8, dtype=self.dtype), self.c_smem_layout())
            tCsC = thr_mma.partition_C(sC)  # (4, MI, NJ) like tCrC: NJ outermost
            scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
            half = cute.size(tCrC) // 2  # n8 tiles j < NJ / 2: gate columns; + half: up
            for v in cutlass.range_constexpr(half):
                tCsC[v] = self.dtype(silu_times(tCrC[v] * scale, tCrC[v + half] * scale))
            cute.arch.sync_threads()
            self.copy_out(
                sC,
                pOut,
                M,
                self.out_width(N),
                m_cta * cfg.tile_m,
                n_cta * self.out_cols,
                self.out_cols,
            )


def grouped_gemm_spec(k: int, dtype: str, config: GemmConfig, gate_up: bool = False):
    """The compiled variant of ``GroupedGemmKernel`` (bits, dtype name, tiling, fused
    gate/up)."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32, 4), fake_ptr(cutlass.Float32, 4),
            fake_ptr(cutlass.Int32, 4), fake_ptr(dt),
            Int32(5), Int32(128), Int32(64), Int32(1), Int32(1), fake_stream(),
        )  # fmt: skip
        return GroupedGemmKernel(k, dtype, config, gate_up), args

    name = f"grouped_gemm{'_gate_up' if gate_up else ''}_k{k}_{dtype}_{config.name}"
    return KernelSpec(name, build, expect=("HMMA", "LDGSTS", "LDSM"))


# Registers capped for 3 CTAs (12 warps) per SM: the fused gate/up had grown to 189 registers
# at k = 4 (2 CTAs); at <= 168 no variant spills (compile-only, sm_90a).
_MIN_CTAS_PER_SM = 3
# The tiling of the grouped GEMM, gate/up and down (the dense dispatch table's M = 64 row on
# large weights).
CONFIG = GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=4, warps_m=1, warps_n=4)


def specs():
    return [
        grouped_gemm_spec(k, d, CONFIG, g)
        for k in (2, 3, 4, 5)
        for d in _DTYPES
        for g in (False, True)
    ]
