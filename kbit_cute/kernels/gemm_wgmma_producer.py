"""``WgmmaGemmKernel`` with a copy-producer warpgroup (sm_90a, config suffix "gc").

Why: in the "g" kernel every thread copies its share of each K slice, and the CTA meets at a
barrier per slice before anyone reads it, so the MMA warpgroups run in lockstep: they
dequantize at the same time and then wait on the tensor cores at the same time (ncu,
session 16: tensor pipe 43-48% busy at M = 128 / 256, 72% of cycles with no eligible warp).
Here one extra warpgroup issues all the ring's cp.async copies, and each stage hands over on
mbarriers (``cutlass.pipeline.PipelineCpAsync``): "full" completes when the producer's
copies of the slice have landed, "empty" when every MMA thread is done with it. An MMA
warpgroup waits only for the slice it needs, so the two drift apart and one's dequant can
run while the other's wgmmas hold the tensor cores; the copy instructions and their
address math leave the MMA warps.

Registers: the producer gives its share back (``setmaxnreg``: ``PRODUCER_REGS``), the MMA
warps take the rest (``mma_regs``: 224 at two warpgroups, where "g" may use 255). The
epilogue stages its tile in the ring, as in "g": the producer starts a tile's copies only
after the MMA warps have finished the epilogue of the one before (named barrier
``_TILE_DONE``).

Measured (session 32, perf/NOTES.md, L2-cold graphs on an H100): against the "g" twin of
the same tiling at k = 4, M = 64 m64n256 1.01-1.08x, M = 128 m128n256 1.00-1.06x; at k = 5,
M = 128, m128n256 "gc" against the table's m128n128k128 "g" 1.09-1.16x. M tiles of 256 rows
lose (0.76-0.88x; not profiled: their MMA warps get 224 registers where "g" takes 254, and one
warpgroup issues all 256 rows' copies). The dispatch table takes "gc" for the M = 64 / 128
buckets where the tune measured it faster. What it does not change: the dequant's ~4.7
instructions per weight (m64n256; the GEMV spends ~3), which bound these M.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import warpgroup

from .gemm import PRODUCER_THREADS
from .gemm_wgmma import WgmmaGemmKernel

# Named barriers (0 is the CTA's __syncthreads).
_EPILOGUE_BARRIER = 1  # the MMA warps
_TILE_DONE = 2  # the MMA warps arrive after a tile's epilogue; the producer waits
PRODUCER_REGS = 56  # setmaxnreg of the producer warpgroup (its copy plan's offsets)


class ProducerGemmKernel(WgmmaGemmKernel):
    """``WgmmaGemmKernel`` whose ring is filled by a producer warpgroup on mbarriers."""

    def __init__(self, k: int, dtype: str, config):
        super().__init__(k, dtype, config)
        # What the MMA warps may use once the producer's registers are given back (a
        # multiple of 8, the whole register file for one CTA per SM).
        self.mma_regs = min(
            240, (65536 - PRODUCER_THREADS * PRODUCER_REGS) // self.threads // 8 * 8
        )

    def min_ctas_per_sm(self) -> int:
        return 1

    @cute.jit
    def role_tidx(self):
        """MMA threads 0.., producer threads 0.. (the copy plans count from 0)."""
        tidx, _, _ = cute.arch.thread_idx()
        return tidx - self.threads if tidx >= self.threads else tidx

    def epilogue_barrier(self):
        return (_EPILOGUE_BARRIER, self.threads)

    @cute.jit
    def build_pair_table(self, pCodebook: cute.Pointer, sTable_u8):
        """Built by the MMA threads (``kernel`` syncs the CTA before the first read)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < self.threads:
            WgmmaGemmKernel.build_pair_table(self, pCodebook, sTable_u8)

    @cute.jit
    def run_tiles(
        self, base_u8, run, pA, pPacked, pAbsmax, pCodebook, pScale, pBias, pOut, pWorkspace,
        pCounters, M, N, K, has_bias, atomic,
    ):  # fmt: skip
        """The ring's mbarriers and the pair table, then the two roles over the run."""
        tidx, _, _ = cute.arch.thread_idx()
        ring = pipeline.PipelineCpAsync.create(
            barrier_storage=cute.recast_ptr(base_u8 + self.plan["bars"], dtype=cutlass.Int64),
            num_stages=self.cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, PRODUCER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads),
        )  # (syncs the CTA after the mbarrier init)
        self.build_pair_table(pCodebook, base_u8 + self.plan["table"])
        cute.arch.sync_threads()
        if tidx >= self.threads:
            cute.arch.warpgroup_reg_dealloc(PRODUCER_REGS)
            self.produce(base_u8, ring, run, pA, pPacked, pAbsmax, M, N, K)
        else:
            cute.arch.warpgroup_reg_alloc(self.mma_regs)
            self.consume(
                base_u8, ring, run, pScale, pBias, pOut, pWorkspace, pCounters, M, N,
                has_bias, atomic,
            )  # fmt: skip

    @cute.jit
    def produce(self, base_u8, ring, run, pA, pPacked, pAbsmax, M, N, K):
        """Every K slice of the run's tiles into the ring, a stage as soon as it is empty."""
        sA, sW, sS, _, _ = self.smem_views(base_u8)
        filled = Int32(0)  # slices copied so far, over the run's tiles
        for t in cutlass.range(run[0], run[1], unroll=1):
            m_cta, n_cta, kt_begin, kt_end, _ = self.tile_work(t, run)
            if t != run[0]:
                # The tile before staged its epilogue in the ring.
                cute.arch.barrier(
                    barrier_id=_TILE_DONE, number_of_threads=self.threads + PRODUCER_THREADS
                )
            head, tail = self.ring_sources(pA, pPacked, pAbsmax, sA, sW, sS, M, N, K, m_cta, n_cta)
            for kt in cutlass.range(kt_begin, kt_end, unroll=1):
                state = self.ring_state(filled, producer=True)
                ring.producer_acquire(state)
                self.load_stage(*head, kt, state.index, *tail)
                ring.producer_commit(state)  # arrives when this thread's copies land
                filled = filled + 1

    def ring_state(self, count, producer: bool = False):
        """The pipeline state of the ``count``-th slice through the ring (the producer's
        starts on the empty barriers' completed first phase)."""
        roles = pipeline.PipelineUserType
        role = roles.Producer if producer else roles.Consumer
        state = pipeline.make_pipeline_state(role, self.cfg.stages)
        state.advance(count)
        return state

    @cute.jit
    def consume(
        self, base_u8, ring, run, pScale, pBias, pOut, pWorkspace, pCounters, M, N,
        has_bias, atomic,
    ):  # fmt: skip
        """The MMA warpgroups: each tile's K loop as ``WgmmaGemmKernel.tile``, the stages
        waited for and released on the ring's mbarriers, then the epilogue."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        _, sW, sS, sTable_u8, sFlag = self.smem_views(base_u8)
        tiled_mma, thr_mma, tCrA, tCrA32, tCrB, tCrC = self.mma_fragments(base_u8, tidx)
        regs = self.weight_registers(sW, sS, sTable_u8, tCrA32, tidx)
        nb = self.ks // 2  # 32-weight blocks per K slice: two k16 steps each
        used = Int32(0)  # slices consumed so far, over the run's tiles
        for t in cutlass.range(run[0], run[1], unroll=1):
            m_cta, n_cta, kt_begin, kt_end, handover = self.tile_work(t, run)
            n_iter = kt_end - kt_begin
            tCrC.fill(0.0)
            self.wait_slice(ring, used)
            self.block_registers(regs, used % cfg.stages, 0)
            for it in cutlass.range(n_iter, unroll=1):
                stage = (used + it) % cfg.stages
                for blk in cutlass.range_constexpr(nb):
                    self.issue_block(tiled_mma, tCrC, tCrA, tCrB, stage, blk)
                    if blk == 0 and it > 0:
                        # Only this block's wgmmas are in flight: the slice before is done.
                        ring.consumer_release(self.ring_state(used + it - 1))
                    if blk == nb - 1:
                        if it + 1 < n_iter:
                            self.wait_slice(ring, used + it + 1)
                            self.block_registers(regs, (used + it + 1) % cfg.stages, 0)
                    else:
                        self.block_registers(regs, stage, blk + 1)
            warpgroup.wait_group(0)
            ring.consumer_release(self.ring_state(used + n_iter - 1))
            used = used + n_iter
            # Both MMA warpgroups are done with the ring before the epilogue stages there.
            cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.threads)
            self.epilogue(
                thr_mma, tCrC, base_u8, sFlag, pScale, pBias, pOut, pWorkspace, pCounters,
                M, N, has_bias, atomic, m_cta, n_cta, t, handover,
            )  # fmt: skip
            if t + 1 < run[1]:
                # Everyone is done with the staging tile before the producer refills.
                cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER, number_of_threads=self.threads)
                cute.arch.barrier_arrive(
                    barrier_id=_TILE_DONE, number_of_threads=self.threads + PRODUCER_THREADS
                )

    @cute.jit
    def wait_slice(self, ring, count):
        """Wait for the ``count``-th slice's copies; cp.async wrote them through the
        generic proxy, wgmma reads them through the async proxy."""
        ring.consumer_wait(self.ring_state(count))
        cute.arch.fence_proxy("async.shared", space="cta")
