"""GEMM on Hopper's warpgroup MMA (sm_90a): ``GemmKernel`` with ``wgmma`` in place of
mma.sync (config suffix "g").

The weight is wgmma's A operand, from registers, and the activations its B operand, from
shared memory: the MMA computes out^T = W A^T tile by tile, the weight columns on wgmma's
M (64 per warpgroup and m tile) and the rows of A on its N (the CTA's M tile, 16..256).
Everything else is the mma.sync kernel's: the stream-K schedule, the cp.async ring (A in
the same 128-byte swizzle, which is wgmma's K-major SW128 layout), the pair-table
dequant, the split-K hand-over and the epilogue (through a transposed view of its tile).

Why: a thread of a warpgroup holds the A fragment of mma.sync's m16n8k16 for rows g and
g + 8 of its warp's 16 rows, i.e. two of ``dequant_block``'s B columns, so the dequant
is unchanged; but one wgmma replaces the warp's (M tile / 8) HMMA and its ldmatrix loads
of A, and it runs asynchronously while the next block is dequantized.

Pipelining: a 32-weight block's two k16 wgmmas are one commit group; the thread waits for
all but the newest group after issuing it (``wait_group(1)``) and then dequantizes the next
block, so registers are rewritten only after the wgmmas that read them finished. A stage
of the ring is refilled two K slices after it was read (``stages - 2`` slices in flight),
when its last wgmma is complete.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .gemm import _C_PAD, GemmKernel

_WARPGROUP = 128  # threads
_M_TILE = 64  # weight columns of one wgmma (its M)


class WgmmaGemmKernel(GemmKernel):
    """``GemmKernel`` with the weight tile as wgmma's register operand (sm_90a)."""

    def __init__(self, k: int, dtype: str, config):
        super().__init__(k, dtype, config)
        self.groups = config.threads // _WARPGROUP
        self.m_tiles = config.tile_n // (_M_TILE * self.groups)  # per warpgroup
        self.nj = 2 * self.m_tiles  # columns g and g + 8 of each m tile

    def min_ctas_per_sm(self) -> int:
        """The compiler's choice: the m64+ register bound of the mma.sync warp tiles (168)
        would spill the wgmma accumulators (128 per thread at m256n128)."""
        return 0

    def make_tiled_mma(self):
        """wgmma m64 x tile_m x k16, A (weights) from registers, B (activations) K-major
        from shared memory; warpgroups side by side along the weight columns."""
        op = warpgroup.MmaF16BF16Op(
            self.dtype, Float32, (_M_TILE, self.cfg.tile_m, 16),
            warpgroup.OperandSource.RMEM, OperandMajorMode.K, OperandMajorMode.K,
        )  # fmt: skip
        return cute.make_tiled_mma(op, cute.make_layout((self.groups, 1, 1)))

    # A thread holds rows g and g + 8 (g = lane / 4) of its warp's 16 rows of each m tile.

    def rep0_column(self, tidx):
        warp = tidx // 32
        return (warp // 4) * _M_TILE + (warp % 4) * 16 + (tidx % 32) // 4

    def rep_offset(self, j: int) -> int:
        return _M_TILE * self.groups * (j // 2) + 8 * (j % 2)

    @cute.jit
    def set_pair(self, frag32, j, step, half, w):
        # wgmma's register A, per k16 step: (row g, k 2t), (g + 8, 2t), (g, 2t + 8),
        # (g + 8, 2t + 8), one 32-bit pair each.
        frag32[(0, j % 2, half), j // 2, step] = w

    # The accumulators are (weight column, row): the epilogue stages them through the
    # transposed view of the staging tile.
    C_N_MODE = 0

    def c_mma_layout(self):
        cfg = self.cfg
        return cute.make_layout((cfg.tile_n, cfg.tile_m), stride=(1, cfg.tile_n + _C_PAD))

    def b_smem_tensor(self, base_u8):
        """The A ring (``a_smem_layout``'s bytes) as wgmma's B operand: the same 8 x 64
        atoms."""
        cfg = self.cfg
        return self.sw128_tensor(base_u8 + self.plan["a"], (cfg.tile_m, cfg.tile_k, cfg.stages))

    def sw128_tensor(self, ptr_u8, shape):
        """``shape`` = (rows, K, buffers) of the activation dtype at ``ptr_u8`` in wgmma's
        128-byte swizzled K-major layout, the swizzle on the pointer (how descriptors are
        made)."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
        layout = cute.tile_to_shape(atom, shape, (0, 1, 2))
        ptr = cute.recast_ptr(ptr_u8, layout.inner, dtype=self.dtype)
        return cute.make_tensor(ptr, layout.outer)

    def mma_fragments(self, base_u8, tidx):
        """(tiled MMA, thread slice, weight fragments A and their 32-bit view, activation
        descriptors B over the ring's stages, accumulators C) of MMA thread ``tidx``."""
        cfg = self.cfg
        tiled_mma = self.make_tiled_mma()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # onto the zeroed accumulators
        thr_mma = tiled_mma.get_slice(tidx)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(self.b_smem_tensor(base_u8)))
        # (register fragments: the stand-ins give their shapes)
        stand_in = cute.make_tensor(base_u8, cute.make_layout((cfg.tile_n, cfg.tile_k)))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(stand_in))  # ((2,2,2), MT, KS)
        tCrA32 = cute.recast_tensor(tCrA, Int32)  # ((1,2,2), MT, KS)
        stand_in = cute.make_tensor(base_u8, cute.make_layout((cfg.tile_n, cfg.tile_m)))
        tCrC = tiled_mma.make_fragment_C(thr_mma.partition_C(stand_in))
        return tiled_mma, thr_mma, tCrA, tCrA32, tCrB, tCrC

    def issue_block(self, tiled_mma, tCrC, tCrA, tCrB, stage, blk: int):
        """The wgmmas of 32-weight block ``blk`` (two k16 steps) on ring stage ``stage`` as
        one commit group, then wait for all groups before it."""
        warpgroup.fence()
        for s in range(2 * blk, 2 * blk + 2):
            cute.gemm(tiled_mma, tCrC, tCrA[None, None, s], tCrB[None, None, s, stage], tCrC)
        warpgroup.commit_group()
        warpgroup.wait_group(1)

    def weight_registers(self, sW, sS, sTable_u8, tCrA32, tidx):
        """``regs`` of ``block_registers`` for MMA thread ``tidx``: the ring views, registers
        for a repack tile's plane words and absmax pairs, the weight fragments, the thread's
        first column and quad position."""
        rP = cute.make_rmem_tensor((2 * self.k, self.nj), Int32)
        rS = cute.make_rmem_tensor((self.nj,), Int32)
        return sW, sS, sTable_u8, rP, rS, tCrA32, self.rep0_column(tidx), tidx % 4

    def block_registers(self, regs, stage, blk: int):
        """Weight registers of block ``blk`` of the slice in ring stage ``stage``, its repack
        tile's plane words loaded first where the block starts one. ``regs`` = (sW, sS,
        sTable_u8, rP, rS, tCrA32, col0, t4)."""
        sW, sS, sTable_u8, rP, rS, tCrA32, col0, t4 = regs
        if blk % 2 == 0:
            self.load_b_rk(sW, sS, rP, rS, stage, blk // 2, col0)
        self.dequant_block(sTable_u8, rP, rS, tCrA32, blk, t4)

    @cute.jit
    def tile(
        self, base_u8, pA, pPacked, pAbsmax, pScale, pBias, pOut, pWorkspace, pCounters,
        M, N, K, has_bias, atomic, m_cta, n_cta, tile, kt_begin, kt_end, handover,
    ):  # fmt: skip
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        n_iter = kt_end - kt_begin
        sA, sW, sS, sTable_u8, sFlag = self.smem_views(base_u8)  # sA: the cp.async side

        tiled_mma, thr_mma, tCrA, tCrA32, tCrB, tCrC = self.mma_fragments(base_u8, tidx)
        tCrC.fill(0.0)

        ring = self.ring_sources(pA, pPacked, pAbsmax, sA, sW, sS, M, N, K, m_cta, n_cta)

        # ---- prologue: stages - 2 slices in flight (a stage is refilled two slices after
        # it was read, when its wgmmas are known complete)
        ahead = cfg.stages - 2
        for s in cutlass.range_constexpr(ahead):
            self.refill(ring, kt_begin + s, kt_end, s)
        cute.arch.cp_async_wait_group(ahead - 1)
        cute.arch.sync_threads()

        read_stage = Int32(0)
        write_stage = Int32(ahead)
        regs = self.weight_registers(sW, sS, sTable_u8, tCrA32, tidx)
        self.block_registers(regs, read_stage, 0)

        nb = self.ks // 2  # 32-weight blocks per k-slice: two k16 steps each
        for it in cutlass.range(n_iter, unroll=1):
            for blk in cutlass.range_constexpr(nb):
                # After it only this block's group is in flight, so every other block's
                # registers, and the stage read two slices ago, are free while it runs.
                self.issue_block(tiled_mma, tCrC, tCrA, tCrB, read_stage, blk)
                if blk == 0:
                    write_stage = self.refill(ring, kt_begin + it + ahead, kt_end, write_stage)
                # The next block's registers, while this block's wgmmas run.
                if blk == nb - 1:
                    # After the barrier every warpgroup's earlier groups are complete (the
                    # stage two slices back is free) and the next slice's stage has landed.
                    read_stage = read_stage + 1
                    if read_stage == cfg.stages:
                        read_stage = 0
                    cute.arch.cp_async_wait_group(ahead - 1)
                    cute.arch.sync_threads()
                    self.block_registers(regs, read_stage, 0)
                else:
                    self.block_registers(regs, read_stage, blk + 1)

        warpgroup.wait_group(0)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        self.epilogue(
            thr_mma, tCrC, base_u8, sFlag, pScale, pBias, pOut, pWorkspace, pCounters,
            M, N, has_bias, atomic, m_cta, n_cta, tile, handover,
        )  # fmt: skip
