"""Grouped expert GEMV for MoE: every selected expert of a layer in one launch.

Two kernels share the GEMV's mainloop (``GemvKernel``): ``GroupedStreamKernel`` (below the
first) runs the GEMV's stream-K schedule over (expert pass, column group, K tile) units,
with quads of warps sharing the pair table, and serves launches of 16 or more experts
(decode at T >= 4; k = 5 only on sm_90, where its 128 KB table fits); ``GroupedGemvKernel``,
one small CTA per work item, serves the small launches (T = 1: its CTAs start early and
prefetch, see Overlap) and the large ones whose work slots overflow the stream kernel's
table; it looks up in registers or (``table``, the larger decode launches) in a GEMV lookup
table of its own. Launches of many rows per expert go to ``grouped_gemm.GroupedGemmKernel``.
``kbit_cute.grouped_ops`` picks.

``out[rows of e] = A[rows of e] @ W_e^T`` for the E stacked weights of a ``KbitExperts``,
rows sorted by expert, ``expert_offsets`` [E + 1] on the device. The per-expert work is the
GEMV's (``GemvKernel``: weights as the mma's operand A, dequantized in registers, a per-warp
shared-memory ring of K tiles in flight); what this module adds is the work list and the epilogues:

* Work items: grid (column group, K split, slot). Slot s is the s-th expert that has rows;
  each CTA finds its expert by scanning the offsets (one round of loads that hit L2, a
  prefix count over the CTA), so the host never reads the offsets and the launch is
  graph-capturable. Slots past the number of busy experts exit at once. The host launches
  min(E, rows) slots: at decode (a few tokens x top-k) that is the touched experts only.
* Rows: the mma's 8 activation columns take 8 rows of the expert; an expert with more rows
  runs the K loop once per 8 rows (passes). MoE decode gives an expert 1..8 rows.
* ``gate_up``: the weight is the fused [gate; up] = [2 I, K] of transformers' experts. A CTA
  owns 64 outputs: warps 0-1 read their gate columns, warps 2-3 the same columns of up, so
  one pass over the expert's weights gives both, and the epilogue writes SiLU(g) * u.
* Split-K: as the GEMV, fp32 partials in a workspace (slot, group, pass, split, row, col) and
  a self-resetting counter per (slot, group); the last CTA sums them in split order, so
  results are bit-identical run to run. Or (``cluster``, sm_90): the splits of a work item
  form a cluster and sum their partials through distributed shared memory, in the same
  order (the same bits), without the workspace's round trips through L2.
* Overlap (sm_90, programmatic dependent launch): a launch may start while the kernel before
  it on the stream still runs. Everything waits for that kernel (``griddepcontrol.wait``)
  before it touches memory, and a CTA lets the next launch start after its K loops, so that
  the next grid's CTAs land on SMs as these leave (evenly). With ``overlap`` set the caller
  vouches that the offsets and the weights were written before the previous kernel: the
  CTA finds its expert, loads its codebook and prefetches its weight range into L2 first,
  then waits, then lets the next launch start at once. At decode this hides the launch,
  the expert scan and the weights' DRAM latency behind the kernel before. Every CTA lets
  the next launch start only after it has waited, so the chain of waits is transitive.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..format import BLOCKS_PER_TILE_K, TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .device_helpers import (
    let_next_kernel_start,
    load_cluster_f32,
    prefetch_l2,
    run_start,
    smem_per_sm,
    split_k_arrive,
    sum_split_partials,
    target_arch_family,
    wait_previous_kernel,
)
from .gemv import (
    _DTYPES,
    COLS_PER_GROUP,
    GEMV_LOOKUP,
    LOOKUP,
    MMA_N,
    ROW_TILES,
    WARPS,
    GemvKernel,
)

ROWS_PER_PASS = MMA_N  # activation rows per mma: rows of an expert handled per K pass
GATE_UP_COLS = COLS_PER_GROUP // 2  # outputs per CTA of the fused gate/up kernel
_LOG2_E = 1.4426950408889634
SCAN_PER_THREAD = 4  # experts each thread checks per round of the slot -> expert scan


@cute.jit
def expert_tensors(k, gate_up, pA, pPacked, pAbsmax, pScale, pOffsets, pOut, R, N, K, E):
    """The grouped launch's global tensors (A, words, absmax, scales, offsets, out; the
    weights as one expert's layout, each expert ``expert`` of them further on) and sizes
    (column tiles, K tiles, intermediate, column groups: 64 outputs with gate/up)."""
    K = cute.assume(K, divby=32)
    n_tiles = (N + TILE_N - 1) // TILE_N
    k_tiles = (K + TILE_K - 1) // TILE_K
    inter = N // 2  # gate/up: I = N / 2, a multiple of 64 (the host checks)
    n_out = inter if cutlass.const_expr(gate_up) else N
    groups = inter // GATE_UP_COLS if cutlass.const_expr(gate_up) else n_tiles
    tensors = (
        cute.make_tensor(pA, cute.make_layout((R, K), stride=(K, 1))),
        cute.make_tensor(pPacked, weight_words_layout(n_tiles, k_tiles, k)),
        cute.make_tensor(pAbsmax, weight_absmax_layout(n_tiles, k_tiles)),
        cute.make_tensor(pScale, cute.make_layout(E)),
        cute.make_tensor(pOffsets, cute.make_layout(E + 1)),
        cute.make_tensor(pOut, cute.make_layout((R, n_out), stride=(n_out, 1))),
    )
    return tensors, (n_tiles, k_tiles, inter, groups)


@cute.jit
def expert_weights(mW: cute.Tensor, mS: cute.Tensor, expert, k: cutlass.Constexpr):
    """Expert ``expert``'s words and absmax: ``mW`` / ``mS`` (laid out as one expert) moved
    to its weights. Experts lie back to back, each a whole number of repack tiles (>= 1 KB
    apart)."""
    absmax_bytes = cute.size(mS.layout)  # one expert's: k words per absmax byte
    w_first = cute.assume(Int64(expert) * Int64(absmax_bytes * k), divby=TILE_N)
    s_first = cute.assume(Int64(expert) * Int64(absmax_bytes), divby=TILE_N)
    return (
        cute.make_tensor(mW.iterator + w_first, mW.layout),
        cute.make_tensor(mS.iterator + s_first, mS.layout),
    )


@cute.jit
def silu_times(gate: Float32, up: Float32) -> Float32:
    """SiLU(gate) * up, the fused gate/up epilogue (fp32)."""
    e = cute.math.exp2(gate * Float32(-_LOG2_E), fastmath=True)
    return gate / (Float32(1.0) + e) * up


@cute.jit
def cta_prefix_count(mine: Int32, sWarp: cute.Tensor, warps: cutlass.Constexpr):
    """(sum of ``mine`` over the CTA's threads before this one, sum over all): a shuffle scan
    per warp, the warp totals through ``sWarp`` (``warps`` entries). Syncs the CTA once; sync
    again before ``sWarp`` is rewritten."""
    tidx, _, _ = cute.arch.thread_idx()
    warp, lane = tidx // 32, tidx % 32
    incl = mine  # inclusive prefix over the warp
    for step in cutlass.range_constexpr(5):
        d = 1 << step
        other = cute.arch.shuffle_sync_up(incl, d)
        if lane >= d:
            incl = incl + other
    if lane == 31:
        sWarp[warp] = incl
    cute.arch.sync_threads()
    before = incl - mine
    total = Int32(0)
    for w in cutlass.range_constexpr(warps):
        n_w = sWarp[w]
        total = total + n_w
        if w < warp:
            before = before + n_w
    return before, total


@cute.jit
def find_work_slot(
    mOff: cute.Tensor,
    slot: Int32,
    sScan: cute.Tensor,
    threads: cutlass.Constexpr,
    tile_rows: cutlass.Constexpr = 0,
):
    """sScan[W..W+3] = (expert, first row, rows, tile) of work slot ``slot``, W = threads //
    32, or expert -1 past the last slot. Slots number, in expert order, the tiles of
    ``tile_rows`` rows of every expert (0: one slot per expert with rows, its tile 0), so
    the host never reads the offsets. Each round every thread counts the tiles of
    SCAN_PER_THREAD consecutive experts; a prefix count over the CTA places them. ``sScan``
    holds W + 4 ints; the CTA syncs once per round."""
    tidx, _, _ = cute.arch.thread_idx()
    E = cute.size(mOff) - 1
    W = threads // 32
    if tidx == 0:
        sScan[W] = Int32(-1)
    base = Int32(0)  # tiles of the experts before this round
    for first in cutlass.range(0, E, threads * SCAN_PER_THREAD, unroll=1):
        e0 = first + tidx * SCAN_PER_THREAD
        bounds = [mOff[cutlass.min(e0 + j, E)] for j in range(SCAN_PER_THREAD + 1)]
        tiles = []
        for j in cutlass.range_constexpr(SCAN_PER_THREAD):
            rows = cutlass.max(bounds[j + 1] - bounds[j], 0)
            if cutlass.const_expr(tile_rows == 0):
                tiles.append(Int32((e0 + j < E) & (rows > 0)))
            else:
                tiles.append(Int32(e0 + j < E) * ((rows + tile_rows - 1) // tile_rows))
        mine = tiles[0]
        for j in cutlass.range_constexpr(1, SCAN_PER_THREAD):
            mine = mine + tiles[j]
        before, total = cta_prefix_count(mine, sScan, W)
        start = base + before
        for j in cutlass.range_constexpr(SCAN_PER_THREAD):
            if slot >= start and slot < start + tiles[j]:
                sScan[W] = e0 + j
                sScan[W + 1] = bounds[j]
                sScan[W + 2] = bounds[j + 1] - bounds[j]
                sScan[W + 3] = slot - start
            start = start + tiles[j]
        base = base + total
        cute.arch.sync_threads()  # the warp totals are read before the next round


def cta_column_layout(gate_up: bool, intermediate: int = GATE_UP_COLS) -> cute.Layout:
    """(mma row g, column half h, row tile r, warp w) -> weight column, relative to the CTA's
    first column. Dense: the CTA's 128 columns, warp w the w-th 32. Gate/up: warps 0-1 take
    64 gate columns, warps 2-3 the same columns of the up half, ``intermediate`` further on.

    The kernel computes its columns from this layout; ``python -m layouts kernel moe`` draws it.
    """
    warp_mode = ((2, 2), (32, intermediate)) if gate_up else (WARPS, 32)
    return cute.make_layout((8, 2, ROW_TILES, warp_mode[0]), stride=(1, 8, 16, warp_mode[1]))


class GroupedGemvKernel(GemvKernel):
    """One CTA per (column group, K split, slot). Compile-time config: bits ``k``,
    activation dtype, ``gate_up`` (fused SiLU(g) * u)."""

    REAL_ROWS_ONLY = False  # (its gate/up spilled at 80 registers)

    def __init__(
        self,
        k: int,
        dtype: type[cutlass.Numeric],
        gate_up: bool,
        stages=None,
        cluster=None,
        table: bool = False,
    ):
        # One quad of column warps per CTA (measured: a second quad on the CTA's K tiles
        # gains nothing). Register lookups, or with ``table`` (k <= 4) the GEMV's 64 KB
        # shared-memory table per CTA: fewer instructions per weight, fewer CTAs per SM.
        lookup = GEMV_LOOKUP[k] if table else LOOKUP[k]
        super().__init__(k, ROWS_PER_PASS, dtype, stages, lookup=lookup, quads=1)
        self.gate_up = gate_up
        # ``cluster`` = C (sm_90): the launch's C K splits of a work item form a cluster and
        # sum their partials through distributed shared memory, without the workspace's L2
        # round trips (partials out, counter, partials back); the host then launches
        # exactly C splits. (sm_80 has no clusters: the workspace path.)
        self.cluster = cluster if self.pdl else None
        # Register cap: as many CTAs per SM as the shared-memory rings allow on the target
        # (at most 6), so the compiler keeps each thread to what that many CTAs can have.
        cta_bytes = 4 * self.stage_words() * self.stages * WARPS  # the ring
        cta_bytes += 4 * ROWS_PER_PASS * (COLS_PER_GROUP + 4) + 64  # the epilogue's
        cta_bytes += self.table_bytes
        # (sm_80: at most 5, 96 registers: its gate/up code spilled at 6.)
        most = 5 if target_arch_family() == "sm_80" else 6
        self.min_ctas_per_sm = max(1, min(most, smem_per_sm() // cta_bytes))

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (R, K) row-major, rows sorted by expert
        pPacked: cute.Pointer,  # int32 (E, words per expert)
        pAbsmax: cute.Pointer,  # uint8 (E, bytes per expert)
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (E,) per-expert scale
        pOffsets: cute.Pointer,  # int32 (E + 1,) row ranges
        pOut: cute.Pointer,  # (R, N_out) row-major: N_out = N, or N / 2 with gate_up
        pWorkspace: cute.Pointer,  # fp32 (slots, groups, passes, splits, 8, 128) if splits > 1
        pCounters: cute.Pointer,  # int32 (slots * groups,), zero; left zero
        R: Int32,
        N: Int32,  # weight rows (2 I with gate_up)
        K: Int32,
        E: Int32,
        slots: Int32,
        max_passes: Int32,  # workspace passes: ceil(max rows per expert / 8)
        splits: Int32,
        overlap: Int32,  # nonzero: offsets and weights may be read before the wait
        stream: cuda.CUstream,
    ):
        tensors, sizes = expert_tensors(
            self.k, self.gate_up, pA, pPacked, pAbsmax, pScale, pOffsets, pOut, R, N, K, E
        )
        mA, mW, mS, mScale, mOff, mOut = tensors
        n_tiles, k_tiles, inter, groups = sizes
        cluster = {"cluster": [1, self.cluster, 1]} if self.cluster else {}
        self.kernel(
            mA, mW, mS, pCodebook, mScale, mOff, mOut, pWorkspace, pCounters,
            n_tiles, k_tiles, inter, groups, max_passes, splits, overlap,
        ).launch(
            grid=[groups, splits, slots], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_ctas_per_sm, preferred_smem_carveout=-1,
            use_pdl=self.pdl, **cluster,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mW: cute.Tensor,  # one expert's ((128, n_tiles), (2, k_tiles), k) -> word
        mS: cute.Tensor,  # one expert's ((128, n_tiles), (2, k_tiles)) -> absmax byte
        pCodebook: cute.Pointer,
        mScale: cute.Tensor,
        mOff: cute.Tensor,
        mOut: cute.Tensor,
        pWorkspace: cute.Pointer,
        pCounters: cute.Pointer,
        n_tiles: Int32,
        k_tiles: Int32,
        inter: Int32,
        groups: Int32,
        max_passes: Int32,
        splits: Int32,
        overlap: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        group, split, slot = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4

        smem = SmemAllocator()
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        sScan = smem.allocate_tensor(Int32, cute.make_layout(WARPS + 4), byte_alignment=4)
        # One pass's outputs (rows x CTA columns) on their way to coalesced stores. Row
        # stride 132: the mma fragment's writes (8 columns x 4 row pairs) hit 32 banks.
        sOut = smem.allocate_tensor(
            Float32,
            cute.make_layout((ROWS_PER_PASS, COLS_PER_GROUP), stride=(COLS_PER_GROUP + 4, 1)),
            byte_alignment=16,
        )

        if overlap == 0:
            wait_previous_kernel(self.pdl)
        find_work_slot(mOff, slot, sScan, self.threads)  # the slot-th expert with rows
        expert = sScan[WARPS]
        row_begin = sScan[WARPS + 1]
        R = mA.shape[0]
        rows = cutlass.max(cutlass.min(sScan[WARPS + 2], R - row_begin), 0)  # bad offsets
        # Split-K partials have room for max_passes * 8 rows (the caller's bound); rows past
        # it are written as NaN rather than silently left out.
        done = rows
        if splits > 1 and not cutlass.const_expr(self.cluster):
            done = cutlass.min(rows, max_passes * ROWS_PER_PASS)
        if expert >= 0:
            if cutlass.const_expr(self.gate_up):
                cta_col = group * GATE_UP_COLS
                lay = cta_column_layout(True, inter)
            else:
                cta_col = group * COLS_PER_GROUP
                lay = cta_column_layout(False)
            col0 = cta_col + cute.crd2idx((g, 0, 0, warp), lay)
            mWe, mSe = expert_weights(mW, mS, expert, self.k)
            scale = mScale[expert]
            kt_begin = split * k_tiles // splits
            kt_end = (split + 1) * k_tiles // splits

            ctx = self.make_mainloop(smem, pCodebook, t)
            acc = ctx[-1]
            if overlap != 0:
                self.prefetch_weights(mWe, mSe, cta_col, inter, kt_begin, kt_end)
                wait_previous_kernel(self.pdl)
                let_next_kernel_start(self.pdl)
            mWs = cute.make_tensor(
                pWorkspace,
                cute.make_layout(
                    (COLS_PER_GROUP, ROWS_PER_PASS, splits, max_passes),
                    stride=(
                        1,
                        COLS_PER_GROUP,
                        ROWS_PER_PASS * COLS_PER_GROUP,
                        splits * ROWS_PER_PASS * COLS_PER_GROUP,
                    ),
                ),  # fmt: skip
            )
            ws_item = (slot * groups + group) * max_passes * splits * ROWS_PER_PASS * COLS_PER_GROUP
            mWs = cute.make_tensor(mWs.iterator + ws_item, mWs.layout)

            for p in cutlass.range((done + ROWS_PER_PASS - 1) // ROWS_PER_PASS, unroll=1):
                for r in cutlass.range_constexpr(ROW_TILES):
                    acc[r].fill(0.0)
                left = done - p * ROWS_PER_PASS
                pass_rows = (row_begin + p * ROWS_PER_PASS, left)
                self.mainloop(mA, mWe, mSe, col0, pass_rows, t, kt_begin, kt_end, ctx)
                self.pass_epilogue(
                    acc, scale, mOut, mWs, sOut, splits, p, row_begin, left, cta_col, t
                )
            if overlap == 0:
                let_next_kernel_start(self.pdl)

            if splits > 1 and not cutlass.const_expr(self.cluster):
                if split_k_arrive(pCounters + slot * groups + group, splits, sFlag) != 0:
                    self.reduce_splits(mWs, scale, mOut, sFlag, splits, done, row_begin, cta_col)
                if split == 0 and rows > done:
                    self.poison_rows(mOut, row_begin + done, rows - done, cta_col)

    @cute.jit
    def prefetch_weights(self, mWe, mSe, cta_col, inter, kt_begin, kt_end):
        """Bulk L2 prefetch of the CTA's weights in K tiles kt_begin..kt_end: its columns
        are two runs of 64 (dense: adjacent; gate/up: the gate run and the up run), each a
        contiguous range of words and of absmax bytes per K tile."""
        if cutlass.const_expr(self.pdl):
            tidx, _, _ = cute.arch.thread_idx()
            run = GATE_UP_COLS  # columns per run
            jobs = (kt_end - kt_begin) * 4  # (K tile, run, words | absmax)
            for j in cutlass.range(tidx, jobs, self.threads, unroll=1):
                kt = kt_begin + j // 4
                second = (j // 2) % 2
                col = cta_col + second * (inter if cutlass.const_expr(self.gate_up) else run)
                tile_col = (col % TILE_N, col // TILE_N)
                if j % 2 == 0:
                    off = cute.crd2idx((tile_col, (0, kt), 0), mWe.layout)
                    prefetch_l2(mWe.iterator + off, run * BLOCKS_PER_TILE_K * self.k * 4)
                else:
                    off = cute.crd2idx((tile_col, (0, kt)), mSe.layout)
                    prefetch_l2(mSe.iterator + off, run * BLOCKS_PER_TILE_K)

    @cute.jit
    def pass_epilogue(self, acc, scale, mOut, mWs, sOut, splits, p, row_begin, left, cta_col, t):
        """One pass's 8 rows: acc[r][i] is CTA column layout (g, i // 2, r, warp), row
        2 t + i % 2 of the pass. Unsplit: through shared memory to row-contiguous stores
        (and, for gate/up, to the thread that pairs a gate column with its up column);
        split: fp32 partials to the workspace."""
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        g = lane // 4
        _, split, _ = cute.arch.block_idx()
        for r in cutlass.range_constexpr(ROW_TILES):
            for i in cutlass.range_constexpr(4):
                c = warp * 32 + g + 16 * r + 8 * (i // 2)  # CTA-local column
                if splits > 1 and not cutlass.const_expr(self.cluster):
                    mWs[c, 2 * t + i % 2, split, p] = acc[r][i]
                else:
                    sOut[2 * t + i % 2, c] = acc[r][i]
        if cutlass.const_expr(self.cluster):
            self.cluster_reduce(sOut, scale, mOut, row_begin, p, left, cta_col)
        elif splits == 1:
            cute.arch.sync_threads()
            cols = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
            for j in cutlass.range_constexpr(ROWS_PER_PASS * cols // self.threads):
                o = tidx + j * self.threads
                m, c = o // cols, o % cols
                up = Float32(0.0)
                if cutlass.const_expr(self.gate_up):
                    up = sOut[m, c + GATE_UP_COLS]
                self.store_row(sOut[m, c], up, scale, mOut, row_begin, p, m, left, cta_col + c)
            cute.arch.sync_threads()  # sOut is rewritten by the next pass

    @cute.jit
    def cluster_reduce(self, sOut, scale, mOut, row_begin, p, left, cta_col):
        """Cluster path of a pass: every split has its partials in its sOut; CTA rank r sums
        the r-th slice of the outputs over the cluster's sOut buffers in split order and
        stores it. Cluster barriers before (all partials written) and after (no sOut is
        rewritten or released while another CTA reads it)."""
        tidx, _, _ = cute.arch.thread_idx()
        C = self.cluster
        rank = cute.arch.block_idx_in_cluster()
        cols = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
        per_cta = cols // C
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        bases = [cute.arch.map_dsmem_ptr(sOut.iterator, s) for s in range(C)]
        for j in cutlass.range_constexpr(-(-ROWS_PER_PASS * per_cta // self.threads)):
            o = tidx + j * self.threads
            if o < ROWS_PER_PASS * per_cta:
                m, c = o // per_cta, rank * per_cta + o % per_cta
                at = cute.crd2idx((m, c), sOut.layout)
                v, up = Float32(0.0), Float32(0.0)
                for s in cutlass.range_constexpr(C):  # split order: deterministic
                    v = v + load_cluster_f32(bases[s] + at)
                    if cutlass.const_expr(self.gate_up):
                        up = up + load_cluster_f32(bases[s] + (at + GATE_UP_COLS))
                self.store_row(v, up, scale, mOut, row_begin, p, m, left, cta_col + c)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def store_row(self, v, up, scale, mOut, row_begin, p, m, left, col):
        """out[row_begin + 8 p + m, col] from the accumulated v (gate_up: and up), if m is
        one of the expert's rows and col inside the output."""
        R, n_out = mOut.shape
        if m < left and col < n_out:
            r = v * scale
            if cutlass.const_expr(self.gate_up):
                r = silu_times(r, up * scale)
            mOut[row_begin + p * ROWS_PER_PASS + m, col] = self.dtype(r)

    @cute.jit
    def poison_rows(self, mOut, first, n, cta_col):
        """NaN into rows first..first + n of the CTA's outputs (rows the bound left out)."""
        tidx, _, _ = cute.arch.thread_idx()
        R, n_out = mOut.shape
        cols = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
        for o in cutlass.range(tidx, n * cols, self.threads, unroll=1):
            col = cta_col + o % cols
            if col < n_out:
                mOut[first + o // cols, col] = self.dtype(Float32(float("nan")))

    @cute.jit
    def reduce_splits(self, mWs, scale, mOut, sFlag, splits, rows, row_begin, cta_col):
        """The last CTA of a work item: sum every split's partials in split order and store."""
        tidx, _, _ = cute.arch.thread_idx()
        cols = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
        for o in cutlass.range(tidx, rows * cols, self.threads, unroll=1):
            c, m = o % cols, o // cols
            p, mp = m // ROWS_PER_PASS, m % ROWS_PER_PASS
            stride = cute.crd2idx((0, 0, 1, 0), mWs.layout)
            v = sum_split_partials(mWs.iterator + cute.crd2idx((c, mp, 0, p), mWs.layout),
                                   stride, splits)  # fmt: skip
            up = Float32(0.0)
            if cutlass.const_expr(self.gate_up):
                up = sum_split_partials(
                    mWs.iterator + cute.crd2idx((c + GATE_UP_COLS, mp, 0, p), mWs.layout),
                    stride,
                    splits,
                )
            self.store_row(v, up, scale, mOut, row_begin, p, mp, rows - p * ROWS_PER_PASS,
                           cta_col + c)  # fmt: skip


# Work slots a stream launch holds: one per (expert, pass of up to 8 rows); the host sends
# larger launches (prefill) to GroupedGemvKernel. 8 KB of shared memory.
MAX_SLOTS = 1024


def stream_column_layout(gate_up: bool, intermediate: int = GATE_UP_COLS) -> cute.Layout:
    """(mma row g, column half h, row tile r, warp w) -> weight column of a
    ``GroupedStreamKernel`` quad, relative to its group's first column. Dense: as
    ``cta_column_layout``. Gate/up: warp w takes gate columns 16 w + (g, 8 h) in row tile 0
    and the same columns of up (``intermediate`` further on) in row tile 1, so a thread
    holds both factors of each of its outputs."""
    if gate_up:
        return cute.make_layout((8, 2, ROW_TILES, WARPS), stride=(1, 8, intermediate, 16))
    return cta_column_layout(False)


class GroupedStreamKernel(GemvKernel):
    """Grouped experts on the GEMV's stream-K schedule (decode: few rows per expert).

    A strip is (slot, column group): 128 weight columns (gate/up: 64 outputs, their gate
    and up columns) of one slot's expert, all K; a slot is one pass of up to 8 rows of an
    expert with rows. Every CTA scans the offsets into the same slot table (shared memory),
    so every CTA knows the strip count and cuts the (strip, K tile) units into the same
    equal runs, one per quad of warps: ``strips x s`` runs (an s-way split-K) when the
    strips are fewer than the resident quads, else one run per quad, crossing strips. So
    every SM gets the same share of the weights whatever the routing, and the quads of a
    CTA share the GEMV's pair table (k = 5: 128 KB on sm_90; on sm_80 shuffles, one quad
    per CTA, and the dispatch keeps k = 5 on the grid kernel there). Partial strips are
    summed by their last worker in worker order (bit-identical run to run), as in the GEMV.
    """

    WIDE_RUNS = True  # its unit count depends on the routing
    # Not yet on the polled hand-over: an owner's sum needs the strip's epilogue from the slot
    # table (gather_owned_strips takes the GEMV's), and its 8-row slots allow 2 per round.
    POLLED_HANDOVER = False

    def __init__(self, k: int, dtype: type[cutlass.Numeric], gate_up: bool, stages=None):
        # Quads per CTA: at most 6 (80 registers); k = 2, 3 spilled there: 5 (96). k = 5 on
        # sm_90 looks up in the GEMV's 128 KB pair_table5, which leaves room for 3 (with
        # 2 stages 4: slower, session 28); on sm_80 by shuffles, one quad per CTA.
        self.MAX_QUADS = 6 if k >= 4 else 5
        super().__init__(k, ROWS_PER_PASS, dtype, stages, extra_smem=8 * MAX_SLOTS + 64)
        self.gate_up = gate_up

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (R, K) row-major, rows sorted by expert
        pPacked: cute.Pointer,  # int32 (E, words per expert)
        pAbsmax: cute.Pointer,  # uint8 (E, bytes per expert)
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (E,) per-expert scale
        pOffsets: cute.Pointer,  # int32 (E + 1,) row ranges
        pOut: cute.Pointer,  # (R, N_out) row-major: N_out = N, or N / 2 with gate_up
        pWorkspace: cute.Pointer,  # fp32 (2 ctas quads, 8, 128): partial strips
        pCounters: cute.Pointer,  # int32 (slots * groups * 4,), zero; left zero
        R: Int32,
        N: Int32,  # weight rows (2 I with gate_up)
        K: Int32,
        E: Int32,
        slots: Int32,  # bound on the work slots, <= MAX_SLOTS
        ctas: Int32,
        min_run: Int32,  # K tiles a split strip's run keeps at least
        overlap: Int32,  # nonzero: offsets and weights may be read before the wait
        stream: cuda.CUstream,
    ):
        tensors, sizes = expert_tensors(
            self.k, self.gate_up, pA, pPacked, pAbsmax, pScale, pOffsets, pOut, R, N, K, E
        )
        mA, mW, mS, mScale, mOff, mOut = tensors
        n_tiles, k_tiles, inter, groups = sizes
        mWs = self.strip_workspace(pWorkspace, ctas * self.quads)
        self.kernel(
            mA, mW, mS, pCodebook, mScale, mOff, mOut, mWs, pCounters,
            n_tiles, k_tiles, inter, groups, slots, min_run, overlap,
        ).launch(**self.launch_options(ctas, stream))  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mW: cute.Tensor,  # one expert's ((128, n_tiles), (2, k_tiles), k) -> word
        mS: cute.Tensor,  # one expert's ((128, n_tiles), (2, k_tiles)) -> absmax byte
        pCodebook: cute.Pointer,
        mScale: cute.Tensor,
        mOff: cute.Tensor,
        mOut: cute.Tensor,
        mWs: cute.Tensor,  # (column in strip, row, slot) fp32; slot 2 w + (0 first, 1 last)
        pCounters: cute.Pointer,
        n_tiles: Int32,
        k_tiles: Int32,
        inter: Int32,
        groups: Int32,
        slots: Int32,
        min_run: Int32,
        overlap: Int32,
    ):
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        wn, quad = warp % WARPS, warp // WARPS
        g, t = lane // 4, lane % 4

        if overlap == 0:
            wait_previous_kernel(self.pdl)
        smem = SmemAllocator()
        ctx = self.make_mainloop(smem, pCodebook, t)  # (the pair table syncs the CTA)
        acc = ctx[-1]
        # Row 0: the slot's expert; row 1: its first row << 4 | its rows (1..8).
        sSlots = smem.allocate_tensor(
            Int32, cute.make_layout((2, MAX_SLOTS), stride=(MAX_SLOTS, 1)), byte_alignment=16
        )
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.warps), byte_alignment=4)
        busy = self.slot_table(mOff, mA.shape[0], sSlots, sWarp, slots)

        # The schedule, the same in every CTA: s runs per strip of >= min_run K tiles while
        # the strips are fewer than the quads, else one run per quad.
        strips = busy * groups
        units = strips * k_tiles
        workers = ctas * self.quads
        if strips > 0:
            if strips < workers:
                s = cutlass.min(cutlass.min(workers // strips, k_tiles // min_run), 16)
                workers = strips * cutlass.max(s, 1)
        worker = quad * ctas + cta
        u_begin = run_start(worker, units, workers, wide=True)
        u_end = run_start(worker + 1, units, workers, wide=True)
        strip_first = u_begin // k_tiles
        strip_end = (u_end - 1) // k_tiles + 1  # past the worker's last strip
        if worker >= workers or u_end <= u_begin:
            strip_end = strip_first
        run = (u_begin, u_end, strip_first, strip_end)
        if overlap != 0:
            self.prefetch_run(mW, mS, sSlots, run, k_tiles, groups, inter)
            wait_previous_kernel(self.pdl)
            let_next_kernel_start(self.pdl)

        per_group = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
        lay = stream_column_layout(self.gate_up, inter)
        for strip in cutlass.range(strip_first, strip_end, unroll=1):
            kt_begin = cutlass.max(u_begin - strip * k_tiles, 0)
            kt_end = cutlass.min(u_end - strip * k_tiles, k_tiles)
            slot = strip // groups
            group = strip - slot * groups
            expert = sSlots[0, slot]
            row_begin, rows = sSlots[1, slot] >> 4, sSlots[1, slot] & 15
            mWe, mSe = expert_weights(mW, mS, expert, self.k)
            col0 = group * per_group + cute.crd2idx((g, 0, 0, wn), lay)
            second = None
            if cutlass.const_expr(self.gate_up):  # the up run: row tile 1 of the layout
                second = col0 - g + cute.crd2idx((0, 0, 1, 0), lay)
            for r in cutlass.range_constexpr(ROW_TILES):
                acc[r].fill(0.0)
            self.mainloop(mA, mWe, mSe, col0, (row_begin, rows), t, kt_begin, kt_end, ctx,
                          second)  # fmt: skip
            n_out = mOut.shape[1]
            out_rows = cute.make_tensor(
                mOut.iterator + Int64(row_begin) * Int64(n_out),
                cute.make_layout((rows, n_out), stride=(n_out, 1)),
            )
            epi = (mScale[expert], out_rows, group)
            wslot = 2 * worker + Int32(strip != strip_first)
            self.finish_strip(acc, epi, mWs, pCounters, strip, wn, t, wslot,
                              (units, workers, k_tiles))  # fmt: skip
        if overlap == 0:
            let_next_kernel_start(self.pdl)

    @cute.jit
    def slot_table(self, mOff, R, sSlots, sWarp, slots) -> Int32:
        """Fill ``sSlots`` with the launch's work slots in expert order, one per pass of up
        to 8 rows of each expert with rows (row ranges clipped to 0..R); returns their count,
        at most ``slots`` (the host's bound, never reached with valid offsets). Each round,
        every thread checks SCAN_PER_THREAD consecutive experts; a prefix count over the CTA
        places their slots."""
        tidx, _, _ = cute.arch.thread_idx()
        E = cute.size(mOff) - 1
        base = Int32(0)  # slots before this round
        for first in cutlass.range(0, E, self.threads * SCAN_PER_THREAD, unroll=1):
            e0 = first + tidx * SCAN_PER_THREAD
            bounds = [
                cutlass.max(cutlass.min(mOff[cutlass.min(e0 + j, E)], R), 0)
                for j in range(SCAN_PER_THREAD + 1)
            ]
            passes = [
                Int32(e0 + j < E)
                * ((cutlass.max(bounds[j + 1] - bounds[j], 0) + ROWS_PER_PASS - 1) // ROWS_PER_PASS)
                for j in range(SCAN_PER_THREAD)
            ]
            mine = passes[0]
            for j in cutlass.range_constexpr(1, SCAN_PER_THREAD):
                mine = mine + passes[j]
            before, total = cta_prefix_count(mine, sWarp, self.warps)
            rank = base + before
            for j in cutlass.range_constexpr(SCAN_PER_THREAD):
                for p in cutlass.range(passes[j], unroll=1):
                    if rank < slots:
                        row = bounds[j] + p * ROWS_PER_PASS
                        sSlots[0, rank] = e0 + j
                        sSlots[1, rank] = (row << 4) | cutlass.min(bounds[j + 1] - row, 8)
                    rank = rank + 1
            base = base + total
            cute.arch.sync_threads()  # the warp totals are read before the next round
        return cutlass.min(base, slots)

    @cute.jit
    def prefetch_run(self, mW, mS, sSlots, run, k_tiles, groups, inter):
        """Bulk L2 prefetch of the warp's weights over its run: per K tile, its two runs of
        16 columns' words and absmax (each contiguous in the format)."""
        if cutlass.const_expr(self.pdl):
            warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
            wn = warp % WARPS
            per_group = GATE_UP_COLS if cutlass.const_expr(self.gate_up) else COLS_PER_GROUP
            lay = stream_column_layout(self.gate_up, inter)
            u_begin, u_end, strip_first, strip_end = run
            for strip in cutlass.range(strip_first, strip_end, unroll=1):
                kt_begin = cutlass.max(u_begin - strip * k_tiles, 0)
                kt_end = cutlass.min(u_end - strip * k_tiles, k_tiles)
                slot = strip // groups
                mWe, mSe = expert_weights(mW, mS, sSlots[0, slot], self.k)
                wcol = (strip - slot * groups) * per_group + cute.crd2idx((0, 0, 0, wn), lay)
                second = wcol + cute.crd2idx((0, 0, 1, 0), lay)  # dense: wcol + 16
                jobs = (kt_end - kt_begin) * 4  # (K tile, run of 16, words | absmax)
                for j in cutlass.range(lane, jobs, 32, unroll=1):
                    kt = kt_begin + j // 4
                    col = wcol
                    if (j // 2) % 2 != 0:
                        col = second
                    tile_col = (col % TILE_N, col // TILE_N)
                    if j % 2 == 0:
                        off = cute.crd2idx((tile_col, (0, kt), 0), mWe.layout)
                        prefetch_l2(mWe.iterator + off, 16 * BLOCKS_PER_TILE_K * self.k * 4)
                    else:
                        off = cute.crd2idx((tile_col, (0, kt)), mSe.layout)
                        prefetch_l2(mSe.iterator + off, 16 * BLOCKS_PER_TILE_K)

    @cute.jit
    def store_fragment(self, acc, epi, wn, t):
        """A whole-K strip from the accumulators (dense: acc[r][i] is column 16 r +
        8 (i // 2) + g of the warp; gate/up: acc[0][i] gate and acc[1][i] up of output
        8 (i // 2) + g of the warp's 16), row 2 t + i % 2 of the slot."""
        scale, mOut, group = epi
        g = cute.arch.lane_idx() // 4
        for i in cutlass.range_constexpr(4):
            m = 2 * t + i % 2
            if cutlass.const_expr(self.gate_up):
                col = group * GATE_UP_COLS + wn * 16 + g + 8 * (i // 2)
                self.store_out(acc[0][i], acc[1][i], scale, mOut, m, col)
            else:
                for r in cutlass.range_constexpr(ROW_TILES):
                    col = group * COLS_PER_GROUP + wn * 32 + g + 16 * r + 8 * (i // 2)
                    self.store_out(acc[r][i], Float32(0.0), scale, mOut, m, col)

    @cute.jit
    def store_columns(self, v, epi, wn):
        """A reduced strip: lane c holds v[m] of the warp's column c (gate/up: c < 16 gate,
        c >= 16 the up column of output c - 16)."""
        scale, mOut, group = epi
        lane = cute.arch.lane_idx()
        for m in cutlass.range_constexpr(ROWS_PER_PASS):
            if cutlass.const_expr(self.gate_up):
                up = cute.arch.shuffle_sync_down(v[m], 16)
                if lane < 16:
                    col = group * GATE_UP_COLS + wn * 16 + lane
                    self.store_out(v[m], up, scale, mOut, m, col)
            else:
                col = group * COLS_PER_GROUP + wn * 32 + lane
                self.store_out(v[m], Float32(0.0), scale, mOut, m, col)

    @cute.jit
    def store_out(self, v, up, scale, mOut, m, col):
        """out[m, col] of the slot's rows (mOut: its rows only) from the sum v (gate_up:
        SiLU(v) * up), if inside."""
        rows, n_out = mOut.shape
        if m < rows and col < n_out:
            r = v * scale
            if cutlass.const_expr(self.gate_up):
                r = silu_times(r, up * scale)
            mOut[m, col] = self.dtype(r)


def _fake_args(dt, ints: tuple) -> tuple:
    """Compile-time stand-ins for a grouped launch's arguments: its pointers (A, words,
    absmax, codebook, scales, offsets, out, workspace, counters), ``ints`` and the stream;
    both grouped kernels take them in this order."""
    from ..compile import fake_ptr, fake_stream

    return (
        fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
        fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32, 4), fake_ptr(cutlass.Int32, 4),
        fake_ptr(dt, 2), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
        *(Int32(v) for v in ints), fake_stream(),
    )  # fmt: skip


def grouped_stream_spec(k: int, dtype: str, gate_up: bool, stages: int | None = None):
    """The compiled variant of ``GroupedStreamKernel`` (bits, dtype name, fused gate/up;
    ``stages`` overrides the ring depth, for tuning)."""
    from ..compile import KernelSpec

    def build():
        dt = _DTYPES[dtype]
        # R, N, K, E, slots, ctas, min_run, overlap
        args = _fake_args(dt, (1, 128, 64, 1, 1, 1, 4, 0))
        return GroupedStreamKernel(k, dt, gate_up, stages), args

    kind = "gate_up" if gate_up else "down"
    suffix = f"_s{stages}" if stages else ""
    return KernelSpec(f"grouped_stream_{kind}_k{k}_{dtype}{suffix}", build,
                      expect=("LDGSTS", "HMMA"))  # fmt: skip


def grouped_gemv_spec(
    k: int,
    dtype: str,
    gate_up: bool,
    stages: int | None = None,
    cluster: int | None = None,
    table: bool = False,
):
    """The compiled variant of ``GroupedGemvKernel`` (bits, dtype name, fused gate/up;
    ``stages`` overrides the ring depth; ``cluster``: K splits summed in a cluster;
    ``table``: the GEMV's shared-memory lookup table)."""
    from ..compile import KernelSpec

    def build():
        dt = _DTYPES[dtype]
        # R, N, K, E, slots, max_passes, splits, overlap
        args = _fake_args(dt, (1, 128, 64, 1, 1, 1, 1, 0))
        return GroupedGemvKernel(k, dt, gate_up, stages, cluster, table), args

    kind = "gate_up" if gate_up else "down"
    suffix = (f"_s{stages}" if stages else "") + (f"_c{cluster}" if cluster else "")
    suffix += "_table" if table else ""
    return KernelSpec(f"grouped_gemv_{kind}_k{k}_{dtype}{suffix}", build, expect=("LDGSTS", "HMMA"))


# Ring depth of launches that touch few experts (decode): each CTA has few K tiles and few
# CTAs share an SM, so more tiles in flight per warp pay (Qwen3-Coder-Next T = 1: 18.3 ->
# 16.8 us); with many experts the default depth's CTAs per SM pay more.
DECODE_STAGES = 5


# K splits a decode launch may sum in a cluster (distributed shared memory) on sm_90 (4
# measured slower: the cluster barrier waits for the slowest of four).
CLUSTER_SPLITS = (2,)


def specs():
    return (
        [
            grouped_gemv_spec(k, d, gu, stages)
            for k in (2, 3, 4, 5)
            for d in _DTYPES
            for gu in (False, True)
            for stages in (None, DECODE_STAGES)
        ]
        + [
            grouped_gemv_spec(k, d, gu, DECODE_STAGES, c)
            for k in (2, 3, 4, 5)
            for d in _DTYPES
            for gu in (False, True)
            for c in CLUSTER_SPLITS
        ]
        + [
            grouped_gemv_spec(k, d, gu, DECODE_STAGES, c, table=True)
            for k in (2, 3, 4)
            for d in _DTYPES
            for gu in (False, True)
            for c in (None, *CLUSTER_SPLITS)
        ]
        + [grouped_stream_spec(k, d, gu) for k in (2, 3, 4, 5) for d in _DTYPES for gu in (0, 1)]
    )
