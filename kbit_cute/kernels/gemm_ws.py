"""Warp-specialized GEMM on Hopper's warpgroup MMA (sm_90a, config suffix "gp").

``WgmmaGemmKernel`` has each warpgroup dequantize a block, issue its wgmmas, wait for the
ones before and only then dequantize the next: at 2 warpgroups per SM (128 accumulators
plus the weight fragments per thread) nothing covers the chain of dependent shared-memory
loads of the dequant (ncu, session 16: tensor pipe 48% busy, 72% of cycles with no
eligible warp). Here the two jobs run in different warps:

* producer warpgroups, one group of the MMA's size per 32-weight block of a K slice
  (the dequant needs many warps: a warp retires ~1 weight per clock): the first copies
  the K slices of A, the plane words and the absmax bytes into the cp.async ring; each
  dequantizes its block exactly as ``WgmmaGemmKernel`` does (same thread -> fragment
  mapping, same pair table) and stores the fragments into fp16/bf16 weight tiles in
  wgmma's 128-byte swizzled K-major layout;
* MMA warpgroups only wait for a slice, issue its wgmmas with both operands in shared
  memory (weights as A: out^T = W A^T, the rows of A on wgmma's N) and release the slice
  before last, then run the epilogue of ``GemmKernel`` (split-K hand-over included).

Hand-over: named barriers, one "full" and one "empty" per weight tile (two tiles,
``WEIGHT_TILES``). Producers arrive on full after their stores (and a proxy fence: wgmma
reads shared memory through the async proxy); the MMA warps sync on it. The MMA warps
arrive on empty once the slice's wgmmas are complete (``wait_group(1)`` after the next
slice's), and producers sync on it before they overwrite that slice's weight tile and
refill its ring stage (copies run stages - 2 slices ahead: the ring is deep, the weight
tiles are not). Only for slices that the tile's later slices wait for, so that every
arrive has its sync within the tile (named barriers carry no phase).

Status (session 28, perf/NOTES.md): correct, and slower than the dispatch table's kernels
at every point measured (8192x28672 k = 4 M = 16 / 32 / 64: 97 / 131 / 146 us against 61 /
77 / 94), so no table row uses it; ``bench_gemm --tune --with NAME`` times it. ncu: the
producers' dequant costs ~6.6 instructions per weight (the GEMV's ~3: a store per pair and
its swizzled address, the scale per pair), and their proxy fences wait for the copies in
flight. Those could be mended (stmatrix stores, the activations by TMA, the GEMV's
dequant), but not its shared-memory traffic: lookup, fp16 store, wgmma's read, the words and
the activations are 7.6-9.1 bytes per weight, 167-200 B per clock at k = 4's read rate where an
SM serves 128 (k = 5: ~140-165, k = 2, 3 more), so this design tops out below the read
bandwidth at every k (perf/NOTES.md, session 30). Kept as a tested base, not the way forward.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .device_helpers import smem_per_sm
from .gemm import WEIGHT_TILES, GemmKernel
from .gemm_wgmma import _M_TILE, WgmmaGemmKernel

# Named barrier ids (0 is the CTA's __syncthreads).
_EPILOGUE_BARRIER = 1  # the MMA warps
_PRODUCER_BARRIER = 2  # the producer warps: a slice's copies landed
_FULL0 = 3  # + weight tile: stored (producers arrive, the MMA warps sync)
_EMPTY0 = _FULL0 + WEIGHT_TILES  # + weight tile: its wgmmas are complete (the reverse)


class WsGemmKernel(WgmmaGemmKernel):
    """``WgmmaGemmKernel`` split into producer (copy + dequant) and MMA warpgroups."""

    def __init__(self, k: int, dtype: str, config):
        super().__init__(k, dtype, config)
        self.producer_groups = config.tile_k // 32  # one per 32-weight block of a slice
        self.producers = self.producer_groups * self.threads
        self.pair = self.producers + self.threads  # threads of a full / empty barrier

    def min_ctas_per_sm(self) -> int:
        """As many CTAs per SM as the shared memory holds, at least one, at most as many as
        leave the MMA threads their accumulators + 56 registers (the bound is 64 K / (CTAs
        x threads) for every thread: no spills at m16 / m32 tiles with 80)."""
        cfg = self.cfg
        by_smem = smem_per_sm() // (self.plan["total"] + 1024)
        need = cfg.tile_m * cfg.tile_n // self.threads + 56
        return max(1, min(by_smem, 65536 // (cfg.block_threads * need)))

    @cute.jit
    def role_tidx(self):
        tidx, _, _ = cute.arch.thread_idx()
        return tidx % self.threads

    def epilogue_barrier(self):
        return (_EPILOGUE_BARRIER, self.threads)

    @cute.jit
    def build_pair_table(self, pCodebook: cute.Pointer, sTable_u8):
        """Built by the first producer group, for every producer (a CTA barrier: the
        producers of other groups read it from their first slice on)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx >= self.threads and tidx < 2 * self.threads:
            GemmKernel.build_pair_table(self, pCodebook, sTable_u8)
        cute.arch.sync_threads()

    def h_smem_tensor(self, base_u8):
        """The dequantized weight tiles (TILE_N, TILE_K, WEIGHT_TILES), wgmma's A operand."""
        cfg = self.cfg
        return self.sw128_tensor(base_u8 + self.plan["h"], (cfg.tile_n, cfg.tile_k, WEIGHT_TILES))

    def make_ss_tiled_mma(self):
        """wgmma m64 x tile_m x k16 with both operands in shared memory."""
        op = warpgroup.MmaF16BF16Op(
            self.dtype, cutlass.Float32, (_M_TILE, self.cfg.tile_m, 16),
            warpgroup.OperandSource.SMEM, OperandMajorMode.K, OperandMajorMode.K,
        )  # fmt: skip
        return cute.make_tiled_mma(op, cute.make_layout((self.groups, 1, 1)))

    @cute.jit
    def tile(
        self, base_u8, pA, pPacked, pAbsmax, pScale, pBias, pOut, pWorkspace, pCounters,
        M, N, K, has_bias, atomic, m_cta, n_cta, tile, kt_begin, kt_end, handover,
    ):  # fmt: skip
        # (``kernel`` syncs the CTA after each tile: the epilogue's staging tile overlays
        # the ring the next tile's copies fill.)
        n_iter = kt_end - kt_begin
        group = cute.arch.warp_idx() // (self.threads // 32) - 1  # -1: the MMA warps
        if group >= 0:
            for q in cutlass.range_constexpr(self.producer_groups):
                if group == q:
                    self.produce(
                        base_u8, pA, pPacked, pAbsmax, M, N, K, m_cta, n_cta, kt_begin, kt_end, q
                    )
        else:
            tiled_mma = self.make_ss_tiled_mma()
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # onto the zeroed accumulators
            tidx, _, _ = cute.arch.thread_idx()
            thr_mma = tiled_mma.get_slice(tidx)
            cfg = self.cfg
            stand_in = cute.make_tensor(base_u8, cute.make_layout((cfg.tile_n, cfg.tile_m)))
            tCrC = tiled_mma.make_fragment_C(thr_mma.partition_C(stand_in))
            tCrC.fill(0.0)
            self.consume(base_u8, tiled_mma, thr_mma, tCrC, n_iter)
            sFlag = self.smem_views(base_u8)[4]
            self.epilogue(
                thr_mma, tCrC, base_u8, sFlag, pScale, pBias, pOut, pWorkspace, pCounters,
                M, N, has_bias, atomic, m_cta, n_cta, tile, handover,
            )  # fmt: skip

    @cute.jit
    def consume(self, base_u8, tiled_mma, thr_mma, tCrC, n_iter):
        """The MMA warpgroups' K loop: wait for a slice, its wgmmas, release the one before."""
        cfg = self.cfg
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(self.h_smem_tensor(base_u8)))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(self.b_smem_tensor(base_u8)))
        stage = Int32(0)  # of the cp.async ring (activations)
        for it in cutlass.range(n_iter, unroll=1):
            h = it % WEIGHT_TILES
            cute.arch.barrier(barrier_id=_FULL0 + h, number_of_threads=self.pair)
            warpgroup.fence()
            for s in cutlass.range_constexpr(self.ks):
                cute.gemm(tiled_mma, tCrC, tCrA[None, None, s, h], tCrB[None, None, s, stage], tCrC)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            # Slice it - 1 is complete: the producers of slice it + 1 wait for that.
            if it >= 1 and it + 1 < n_iter:
                cute.arch.barrier_arrive(
                    barrier_id=_EMPTY0 + (it - 1) % WEIGHT_TILES, number_of_threads=self.pair
                )
            stage = stage + 1
            if stage == cfg.stages:
                stage = 0
        warpgroup.wait_group(0)
        # Every MMA warpgroup is done with the ring before the epilogue stages its tile there.
        cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.threads)

    @cute.jit
    def produce(
        self, base_u8, pA, pPacked, pAbsmax, M, N, K, m_cta, n_cta, kt_begin, kt_end,
        blk: cutlass.Constexpr,
    ):  # fmt: skip
        """Producer group ``blk``'s K loop: block ``blk`` of every slice dequantized into a
        weight tile, then the hand-over (module docstring); group 0 also copies, stages - 2
        slices ahead."""
        cfg = self.cfg
        rt = self.role_tidx()
        n_iter = kt_end - kt_begin
        sA, sW, sS, sTable_u8, sFlag = self.smem_views(base_u8)
        # The dequant writes wgmma's register-A fragments (as WgmmaGemmKernel's MMA thread
        # rt would hold them), then stores them where the same thread's view of the
        # shared-memory tile puts them.
        tiled_rs = WgmmaGemmKernel.make_tiled_mma(self)
        thr_rs = tiled_rs.get_slice(rt)
        stand_in = cute.make_tensor(sA.iterator, cute.make_layout((cfg.tile_n, cfg.tile_k)))
        tCrW = tiled_rs.make_fragment_A(thr_rs.partition_A(stand_in))  # ((2,2,2), MT, KS)
        tCrW32 = cute.recast_tensor(tCrW, Int32)
        tCsW = thr_rs.partition_A(self.h_smem_tensor(base_u8))  # (.., MT, KS, WEIGHT_TILES)
        t4 = rt % 4
        col0 = self.rep0_column(rt)
        rP = cute.make_rmem_tensor((2 * self.k, self.nj), Int32)
        rS = cute.make_rmem_tensor((self.nj,), Int32)

        ahead = cfg.stages - 2
        ring = None
        if cutlass.const_expr(blk == 0):
            ring = self.ring_sources(pA, pPacked, pAbsmax, sA, sW, sS, M, N, K, m_cta, n_cta)
            for s in cutlass.range_constexpr(ahead):
                self.refill(ring, kt_begin + s, kt_end, s)
        stage = Int32(0)
        write_stage = Int32(ahead)
        for it in cutlass.range(n_iter, unroll=1):
            h = it % WEIGHT_TILES
            # Slice it - 2's wgmmas are complete: its weight tile and ring stage are free.
            if it >= WEIGHT_TILES:
                cute.arch.barrier(barrier_id=_EMPTY0 + h, number_of_threads=self.pair)
            if cutlass.const_expr(blk == 0):
                # (Copies spread over every producer were slower: each one's proxy fence
                # then waits for its own copies in flight; session 28.)
                write_stage = self.refill(ring, kt_begin + it + ahead, kt_end, write_stage)
                cute.arch.cp_async_wait_group(ahead)
                # Its copies of the slice, visible to wgmma (async proxy) and, after the
                # barrier, to every producer.
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_PRODUCER_BARRIER, number_of_threads=self.producers)
            self.load_b_rk(sW, sS, rP, rS, stage, blk // 2, col0)
            self.dequant_block(sTable_u8, rP, rS, tCrW32, blk, t4)
            for s in cutlass.range_constexpr(2 * blk, 2 * blk + 2):
                cute.autovec_copy(tCrW[None, None, s], tCsW[None, None, s, h])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier_arrive(barrier_id=_FULL0 + h, number_of_threads=self.pair)
            stage = stage + 1
            if stage == cfg.stages:
                stage = 0
        if cutlass.const_expr(blk == 0):
            cute.arch.cp_async_wait_group(0)
