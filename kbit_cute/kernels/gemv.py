"""GEMV for M = 1..8 (and up to 64 in row sets of 8): out[M, N] = A[M, K] @ W^T, W in the
tiled kbit format, on tensor cores.

Decode is bound by streaming W, and the issue rate, not the loads, is what limits a
dequantizing kernel: at 3 TB/s each SM must retire ~22 (k=4) to ~41 (k=2) weights per
clock with 128 thread-instructions. So the multiply-adds go to ``mma.sync`` m16n8k16 with
the weights as operand A (16 output columns x 16 K) and the activations as operand B
(16 K x 8 rows, rows past M unused): the fp32 accumulation is free, and M = 8 costs little
more than M = 1. What is left per weight is the dequantization into fp16/bf16 pairs:

* each warp streams its 32 columns' K tiles (plane words, absmax, activation rows) through
  its own shared-memory ring with cp.async, a few tiles ahead, syncing only with itself:
  bytes in flight cost no registers (``copy_from`` / ``read_tile``);
* a thread owns 16 consecutive K of one 32-weight block for 4 columns (two mma row
  tiles); it reads the columns' bit-plane words from the ring, picks its 16-bit half of
  each plane and merges the planes into index fields SWAR-style (``planes_to_fields``);
* indices become values two at a time: for k = 3, 4 by one shared-memory load from a
  256-entry table of pairs (a copy per lane, so no bank conflicts; its address one
  ``prmt``), for k = 2 four at a time from a table of quads (one 8-byte load), for k = 5
  from a 128 KB pair table whose address also takes the indices' fifth bits (two ``prmt``;
  ``pair5_high_bytes``), or by warp shuffles from a table in registers (small k = 5
  weights, sm_80; register lookups also serve k <= 4 in single-quad CTAs, e.g. the grouped
  MoE kernel), times the block's absmax (one 2-wide multiply; the E4M4 byte becomes a
  half2 scale with one IMAD, ``absmax_x2``). At M <= 4, k = 3, 4, M = 1, k = 5 (table
  lookups) and M <= 2, k = 2 the scale comes after the mma instead (``split_blocks``):
  its activation columns 2 m + b hold row m masked to block b, and each tile's results
  are folded with fp32 block scales; k = 2 at M <= 2 and k = 4 at M = 1 split each
  column across the mma's rows g, g + 8 instead (``row_roles``: activation columns
  4 m + 2 b + role), so that a lookup lands where the mma wants it;
* mma.sync pairs K positions to registers in a fixed pattern; since the dot product does
  not care about the order of K, each register takes the two weights that the SWAR fields
  deliver side by side, and the activations are permuted to match (one ``prmt`` per pair,
  shared by all columns of the thread).

Schedule (stream-K): the weight is (column tile, K tile) units in column-tile-major order,
split into ``workers`` equal contiguous runs. A worker is a quad of 4 warps (32 columns
each: one repack tile); a CTA holds ``quads`` of them. A run may start and end inside a
column tile: the warp then writes its fp32 partial to a workspace slot, and after its strips
the strip's owner (its worker in the CTA of highest index) waits for the others' slots,
sums them in worker order (bit-identical run to run) and empties them again, so no memset
is ever needed (``finish_strip``, ``gather_strip``; one L2 round trip where a counter took
three).
``workers`` = column tiles x s is an s-way split-K; the library picks that form (a run
that crosses a column tile drains and refills its ring there: measured slower) with as
many workers as fit one wave (``ops.kernel_grid``), except at M = 1 where that leaves some
SMs a quad more than others (``ops.even_workers``): there the ``crossing`` variant, whose
ring runs on across a strip's end, takes equal runs on every SM.
The pair table (k <= 4) is shared by the quads of a CTA (up to 7, one CTA per SM). Workers
interleave over the CTAs, except in the crossing variants and those with CTA groups (M >= 2
where CTAs hold more than two workers, ``ops.gemv_cta_groups``): a CTA holds consecutive
workers; with CTA groups a strip's workers in one CTA sum through shared memory before the
hand-over (``finish_cta_group``), so that an owner gathers a slot per CTA.

Launch (sm_90): programmatic dependent launch hides the launch behind the previous kernel's
tail; meanwhile multi-quad CTAs only pull their first K tiles into L2 (harmless), then the
kernel waits for that kernel before any other memory access, starts its first copies, fills
the pair table, and lets the next launch start after its strips, before the split-K gather
(a CTA's first signal counts: one with idle quads gives it at its start).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ..format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .device_helpers import (
    EMPTY_SLOT,
    SLOT_POLL_NS,
    SPLIT_FACTOR,
    absmax_f32,
    absmax_pair_f32,
    absmax_x2,
    bits_to_f32,
    byte_pair_selector,
    byte_table_lookup,
    codebook_lookup_x2,
    codebook_pair_by_prmt,
    codebook_pair_lane,
    codebook_x2_lane,
    codebook_x2_pairs,
    cp_async_chunk,
    cta_first,
    cta_of_worker,
    empty_slot_words,
    f32_to_bits,
    field_bits,
    handover_owner,
    let_next_kernel_start,
    load_slot,
    load_slot_words,
    mul_x2,
    nanosleep,
    pair5_entry_indices,
    pair5_high_bytes,
    pair5_selectors,
    pair_selector,
    planes_to_fields,
    prefetch_l2,
    prmt,
    run_start,
    scaled_byte_tables,
    smem_per_sm,
    store_slot_words,
    target_arch_family,
    wait_previous_kernel,
    warp_split_arrive,
    worker_of,
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
# Deeper rings where they measured faster on sm_90 (H100), by (k, rows bucket): k = 3 at M = 2
# with 4 stages was 2-4.5% faster on all eight shapes timed (session 39, medians of three
# passes, us, 3 -> 4 stages: 8192x28672 40.00 -> 38.60, 28672x8192 38.31 -> 37.07, 4096x14336
# 12.11 -> 11.89, 14336x4096 12.25 -> 11.70, 3584x18944 14.27 -> 13.68, 5120x13824 14.16 ->
# 13.74, 2048x10240 6.54 -> 6.38, 10240x2048 6.32 -> 6.22). Not taken: k = 3 at M = 4 (0.98-1.01x),
# M = 1 (8192x28672 37.1 -> 37.7), k = 2 at M = 2 (1.00-1.05x); k = 4 by its grid, below.
RING_STAGES_SM90 = {(3, 2): 4}
# k = 4 on sm_90 takes a ring of DEEP_RING_STAGES at the rows buckets DEEP_RING_M where the
# default variant's grid (``ops.kernel_grid``) has at most DEEP_RING_MAX_WORKERS workers per SM
# and runs of at most DEEP_RING_MAX_RUN K tiles (``ops.gemv_variant``): with few, short runs
# per SM a deeper ring is what keeps bytes in flight; many or long runs keep them without it.
# Session 40, 27 shapes (``python -m perf.gemv_kernel_check --no-check --k 4 --m 1 2 4 --stages
# 3 4 --passes 3``), 3 -> 4 stages (medians of three passes): at most 4 workers per SM and
# runs of at most 14 K tiles 0.91-1.00x (M = 4: 8192x2048 0.911, 12288x2048 0.915, 10240x2048
# 0.928; M = 2 0.955-0.987; M = 1 10240x2048 0.948, 5120x2048 0.953, 2048x12288 0.967,
# 14336x4096 1.002); elsewhere 0.97-1.08x (8192x28672, 6.8 per SM: M = 1 / 2 / 4 1.036 /
# 1.040 / 1.077; 28672x8192, runs of 56: 1.014; 18944x3584, 7.0 per SM: 1.065 / 1.024;
# 4096x14336, 5.9 per SM: 1.036 / 1.026, at M = 1 runs of 16: 0.996; 3584x18944 at M = 1, 4.5
# per SM: 1.038; 2048x10240, 4.8 per SM: 0.982 / 0.966). Small weights, where every grid
# qualifies: 2048x2048 M = 1 / 2 / 4 1.002 / 0.96 / 0.944, 2048x512 and 512x2048 0.99-1.00x.
# k = 2 at M = 1, 2, 4 and k = 3 at M = 1, 4 on twelve of these shapes: 0.96-1.04x with no
# pattern; not taken.
DEEP_RING_STAGES = {4: 4}
DEEP_RING_M = (1, 2, 4)
DEEP_RING_MAX_WORKERS = 4
DEEP_RING_MAX_RUN = 14
# Lookups in registers (what a CTA of one quad uses, e.g. the grouped MoE kernel) and the
# GEMV's defaults: the shared-memory pair table wherever it serves k (see GemvKernel).
LOOKUP = {2: "pair_shuffle", 3: "byte_tables", 4: "shuffle", 5: "shuffle"}
GEMV_LOOKUP = {2: "quad_table", 3: "pair_table", 4: "pair_table", 5: "pair_table5"}
GEMV_LOOKUP_SM80 = {**GEMV_LOOKUP, 5: "shuffle"}
# Weights under SMALL_WEIGHT elements take these lookups instead (``gemv_lookup``, by size
# alone, for every rows bucket): k = 5's 128 KB table costs more to fill than it saves on a
# short call. Since its fill makes each entry once (session 30; it was 2^23 before), best of
# two passes, M = 1 / 2 / 4 / 8, us, pair_table5 / shuffles: 2048x512 3.15 / 3.10, 3.72 /
# 3.45, 4.04 / 3.88, 5.37 / 5.42; 2048x1024 3.18 / 3.38, 3.87 / 3.81, 4.07 / 4.10, 5.39 /
# 5.49; 2048x2048 3.88 / 4.14, 4.20 / 4.13, 4.34 / 4.37, 5.58 / 5.76; 2048x4096 4.89 / 5.45,
# 5.03 / 5.36, 5.15 / 5.67, 6.57 / 7.12 (from 2^21 elements the table wins or ties, M = 2
# at most 0.12 us behind).
SMALL_WEIGHT = 1 << 21
SMALL_WEIGHT_LOOKUP = {5: "shuffle"}
# A ring of this depth fits more quads per CTA beside k = 5's 128 KB table (m <= 2: 7, not
# 5; m = 8: 5, not 3): what ``ops.gemv_variant`` takes at the rows buckets MORE_QUADS_M where
# the split rule wants more than MORE_QUADS_FROM workers per SM. 8192x28672 (6.8 per SM), us,
# 3 / 2 stages: M = 5 69.6 / 64.4, M = 8 72.5 / 65.6 (H100, session 28; H200, session 41: M = 8
# 73.16 / 64.01); M = 4 kept 3 stages (58.95 / 61.30), and so did the shapes with fewer
# workers (4096x14336, 3.4 per SM: M = 8 20.2 / 22.2 on the H100). M = 1, 2 took 2 stages
# until session 41 (session 27: 57.4 / 55.4, 57.5 / 55.6), but the kernel has changed since
# (the table filled once per entry, the scales after the mma at M = 1): on the H200, medians of
# five passes (``python -m perf.gemv_kernel_check --no-check --k 5 --m 1 2 8 --stages 2 3``),
# M = 1 50.48 / 57.28, M = 2 58.74 / 58.60, and 3 stages faster at M = 1, 2 on 28672x8192,
# 4096x14336 and 3584x18944 too (1.4-7.4%); on the H100 the library's M = 1 (2 stages) took
# 56.07 us where 3 stages had measured 53.8 (sessions 34-35, 40).
# On devices of fast memory (``ops.has_fast_memory``: the H200) the shallow ring also wins on
# weights of more than MORE_QUADS_FAST_ELEMS elements with fewer workers: H200, M = 5 / 8, us,
# 3 / 2 stages (``perf.gemv_kernel_check --no-check --k 5 --m 5 8 --stages 2 3 --passes 3``,
# session 41): 3584x18944 24.05 / 20.39, 24.99 / 21.31; 5120x13824 22.91 / 20.32; 4096x14336
# 18.97 / 18.05; 28672x8192 57.05 / 54.86; 2048x10240 9.84 / 9.26; 2048x5120 7.06 / 6.93, 7.39
# / 7.17; 5120x2048 8.05 / 7.94; 11008x4096, 10240x2048 1-3% faster; 14336x4096, 18944x3584
# within 1%; up to 2^23 elements slower: 4096x2048 7.14 / 8.68, 2048x2048 5.53 / 6.26,
# 2048x4096 6.56 / 6.85.
MORE_QUADS_STAGES = {5: 2}
MORE_QUADS_M = (8,)
MORE_QUADS_FROM = 5
MORE_QUADS_FAST_ELEMS = 1 << 23
# Shared-memory tables indexed by one byte of index fields, a copy per lane of a wavefront
# so that its loads hit distinct banks (``TABLE_COPIES``); a prmt builds the byte address
# row * 256 + lane copy from the fields' byte and the lane's byte. Pair table (k = 3, 4): row
# p = the pair (codebook[p & 15], codebook[p >> 4]), 4 bytes per lane (half of each row
# unused). Quad table (k = 2): row p = the two pairs of four 2-bit indices, 8 bytes per lane
# of a half-warp (half of each row unused): one 8-byte load per 4 weights instead of one
# 4-byte load per 2.
# Pair table for k = 5 ("pair_table5"): a pair's two 5-bit indices are its 4-bit fields'
# byte (from planes 0-3, as k = 4) and the two fifth bits ha, hb (plane 4), which pick one of
# four 64 KB-halves: byte address hb << 16 | fields' byte << 8 | ha << 7 | lane << 2. 128 KB
# with a copy per lane (conflict-free): one shared-memory wavefront per pair where two
# shuffles took two, and 275 instead of 354 instructions per K tile (M = 1). 8192x28672
# M = 1 63.0 -> 57.4 us, 4096x14336 21.4 -> 17.8, 14336x4096 19.5 -> 16.6 (session 27).
TABLE_ROW = 256
TABLE_BYTES = 256 * TABLE_ROW
TABLE_ENTRY_BYTES = {"pair_table": 4, "quad_table": 8, "pair_table5": 4}
# Copies of a table row, one per lane of a shared-memory wavefront: a warp's 4-byte loads are
# one wavefront of 32 lanes, its 8-byte loads two of 16 (lanes l and l + 16 share a copy).
TABLE_COPIES = {"pair_table": 32, "quad_table": 16, "pair_table5": 32}
TABLE_BYTES_OF = {
    "pair_table": TABLE_BYTES,
    "quad_table": TABLE_BYTES,
    "pair_table5": 2 * TABLE_BYTES,
}
CHUNK_WORDS = 4  # one cp.async moves 16 bytes
# Named barriers of the CTA groups (``finish_cta_group``): one per group, GROUP_BARRIER0 + the
# group's first quad in the CTA (0 is sync_threads').
GROUP_BARRIER0 = 1
# Partials a lane loads per round of the split-K reduction (``reduce_strip``): each round is
# an L2 round trip, so rows x workers per round as large as registers allow.
REDUCE_LOADS = 32
# Slots an owner loads per polling round (``gather_strip``), by rows bucket m. With a slot's
# rows adjacent (one 8/16-byte load per slot at m = 2/4) more slots per round pay: m = 4 at
# 8 rather than 4 and m = 2 at 12 rather than 6 (session 23, ``perf.gemv_kernel_check``, 7
# shapes x k = 2..5, alternating processes: M = 4 geomean 0.970, 2048x512 4.36 -> 3.92 us;
# M = 2 0.984). m = 4 at 12 was slower (geomean 1.016), and m = 4 at 8 with a word per load
# 1.055. m = 1 at 16, m = 8 at 2: earlier measurements (halving m = 1 slowed 2048x512 k = 4
# from 2.71 to 2.90 us). m = 2 at 16 spills on sm_90a.
POLL_WORKERS = {1: 16, 2: 12, 4: 8, 8: 2}
# The crossing variants' runs by quad (``GemvKernel.skew_shift``), per k: how much more of its
# CTA's K tiles each quad takes than the quad below it, as a share of the mean run. With equal
# runs a CTA's quads end in order, the highest first (the warp schedulers give the higher
# quads' warps more issue slots; 8192x28672 k = 3: 0.42 us a quad of 7, k = 2 0.17). k = 3 at
# 0.008 / 0.013 / 0.02 (us, 8192x28672, 28672x8192, 4096x14336): 37.97 / 37.77 / 37.58, 38.27
# / 38.12 / 37.99, 12.00 / 11.90 / 11.85. k = 2 spilled with it (72 registers) unless the run
# bounds went to uniform registers (``cute.arch.make_warp_uniform``), and then at 0.013 ran
# 0.98-1.03x of equal runs (k = 3 with uniform bounds: 1.00-1.02x): k = 2 keeps equal runs.
# The CTA groups' runs (M = 2..8, k = 3) skewed the same way inside each strip: 0.98 / 0.99x
# at M = 2 / 4 on 8192x28672, 1.01-1.06x on five smaller shapes (session 37): equal runs.
QUAD_SKEW = {3: 0.02}
# An owner with at most this many slots takes rounds this wide instead: a wide round costs
# its predicated loads and tests even where few slots are real (M = 4, k = 4, us, 4 per
# round / 8 / this: 512x2048 2.82 / 2.98 / 2.86, 2048x8192 6.06 / 6.21 / 6.11; over 8
# shapes x k = 2..5 against 4 per round: M = 4 geomean 0.977, M = 2 0.988; session 23).
POLL_WORKERS_FEW = {2: 6, 4: 4}
# The copies address activations by 32-bit byte offsets (``copy_sources``): A (all of its
# rows, in the grouped kernels) must be smaller.
MAX_A_BYTES = 1 << 32
ABSMAX_WORDS = WARP_COLS * BLOCKS_PER_TILE_K // 4  # a warp's absmax bytes of a K tile
A_ROW_WORDS = TILE_K // 2  # one activation row of a K tile (16-bit values)
A_ROW_CHUNKS = A_ROW_WORDS // 4  # its 16-byte copies (8 activations each)
# ``GemvKernel.row_roles``, by lookup: (K positions role 1 lies ahead of role 0, the runs
# (first, count) of role 0's positions among a thread's 16). The quad table's entry holds
# fields 0, 1 and 2, 3 of a byte, K positions e, e + 2 | e + 4, e + 6 (2-bit fields of even
# or odd positions); the pair table's fields words hold positions j, j + 4 in byte 0 and
# j + 8, j + 12 in byte 1 (4-bit fields of positions j mod 4).
ROLE_RUNS = {"quad_table": (4, ((0, 4), (8, 4))), "pair_table": (8, ((0, 8),))}
# Where ``row_roles`` is taken (sm_90): (k, lookup) -> the largest rows bucket (B's 8
# columns hold (row, block, role), so at most 2). Library A/B on the H200 (session 42, two
# rounds, alternating processes, us): k = 2 M = 1 / 2 4.5-8% faster on seven shapes
# (8192x28672 30.35 / 31.76 -> 29.01 / 30.11); k = 4 M = 1 1-5% (8192x28672 37.67 -> 36.10,
# 3584x18944 13.90 -> 13.18, 14336x4096 11.97 -> 11.59), but M = 2 mixed (2048x5120 4.62 ->
# 4.96, 14336x4096 11.89 -> 12.15; its CTA-group variants spilled at 72 registers); k = 3
# M = 1 1-2.5% (8192x28672 37.12 -> 36.47), but its crossing variant spilled at 72, and
# M = 2 mixed: not taken.
ROLE_MAX_M = {(2, "quad_table"): 2, (4, "pair_table"): 1}


def gemv_mma(dtype: type[cutlass.Numeric]):
    """The kernel's mma.sync m16n8k16 (fp32 accumulate): ``(atom, tiled_mma)``, one warp.

    One function so that ``kbit_cute.layouts.kernel_layouts`` draws the very layouts the
    kernel partitions its fragments with. Call it while tracing.
    """
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (MMA_M, MMA_N, MMA_K)))
    return atom, cute.make_tiled_mma(atom)


class GemvKernel:
    """Compile-time config: bits ``k``, rows bucket ``m`` (1, 2, 4 or 8), activation dtype."""

    MAX_QUADS = 7  # quads per CTA sharing a pair table (8, at 64 registers, spilled)
    REGISTER_LOOKUP_QUADS = 7  # quads per CTA without a table, on sm_90
    # K tiles of each quad's run pulled into L2 while the launch waits for the kernel before
    # it (multi-quad CTAs: one per SM, which lands as soon as the one before leaves).
    PREFETCH_TILES = 2
    # Only the lanes of real activation rows read them (``read_tile``); the others keep
    # zeros, which costs a kernel registers across the K loop (the grouped grid kernel's
    # gate/up spilled): it turns this off.
    REAL_ROWS_ONLY = True
    # Stream-K run bounds in 64-bit arithmetic (``run_start``); the GEMV's fit 32 bits.
    WIDE_RUNS = False
    # Field widths whose plane merges are one bit-select each (``planes_to_fields``; the
    # others two ANDs and an OR), by k, for row buckets m <= 2 and m >= 4: k = 2 / 3 / 4
    # 152 -> 148, 208 -> 194, 210 -> 194 SASS instructions per K tile (M = 1), k = 5 384 ->
    # 354 (at w = 2 too its M = 1 variant spilled at 72 registers). Measured (H100, session
    # 22): k = 3..5 at M = 1 2-8% faster, k = 4 at M = 4 1-3%. k = 5 at m >= 4 takes none:
    # the GEMV's M = 4 was 2-5% slower with them, the grouped kernels' 8 rows spilled.
    SELECT_WIDTHS = {2: (1, 2, 4), 3: (1, 2, 4), 4: (1, 2, 4), 5: (1, 4)}
    SELECT_WIDTHS_WIDE_M = {**SELECT_WIDTHS, 5: ()}
    # Split-K hand-over (``finish_strip``): the strip's owner polls the others' slots (its
    # workspace holds EMPTY_SLOT words between calls), or the counter's last arrival sums.
    # The slots' layout follows (``strip_workspace``): the owner keeps a column's rows
    # together, the counter path row-major.
    POLLED_HANDOVER = True
    # Variants with ``cta_groups`` (``finish_cta_group``): where every run lies in one strip,
    # a CTA's consecutive workers of a strip sum through shared memory before the polled
    # hand-over, so that an owner gathers a slot per CTA, not per worker. From rows bucket
    # CTA_GROUPS_FROM_M on (M = 1 polls every slot in one round: no gain there) and where
    # the CTAs hold more than CTA_GROUPS_MIN_WORKERS workers on average (``ops.gemv_cta_groups``;
    # their split counts: ``ops.grouped_splits``).
    # Session 31, us, per-worker / CTA groups: 14336x4096 M = 4 k = 2 11.84 / 10.71, k = 5
    # 18.50 / 16.67; 4096x14336 M = 8 k = 2 15.68 / 12.77; 2048x5120 M = 8 k = 4 7.14 / 5.91;
    # 8192x28672 M = 8 k = 2 42.91 / 38.23. The variant costs 0.1-0.3 us on short calls
    # (512x2048 M = 4 k = 4 2.71 / 2.94; 4096x2048, two workers per CTA, M = 8 6.25 / 6.50),
    # hence the bounds.
    CTA_GROUPS_FROM_M = 2
    CTA_GROUPS_MIN_WORKERS = 2
    # Row sets (variants with ``row_sets``): rows bucket ROW_SETS_M serving M > m as
    # ceil(M / m) sets of m rows, the launch grid's y (``row_set_views``). Each set is the
    # stream-K grid of its own rows, with its own workspace slots and counters, and
    # dequantizes the weight again (read from L2 where the sets run side by side): for small
    # weights, whose calls are latency-bound, faster than the GEMM at M = 9..64
    # (``ops.GEMV_ROW_SETS``). A variant of its own: in the plain m = 8 variants the views'
    # pointers cost registers (k = 5: 96 -> 110).
    ROW_SETS_M = 8

    def __init__(
        self,
        k: int,
        m: int,
        dtype: type[cutlass.Numeric],
        stages: int | None = None,
        lookup: str | None = None,
        quads: int | None = None,
        extra_smem: int = 0,
        cta_groups: bool = False,
        crossing: bool = False,
        row_sets: bool = False,
    ):
        """``extra_smem``: shared-memory bytes a subclass's kernel adds per CTA;
        ``cta_groups``: the variant with CTA groups (``finish_cta_group``); ``crossing``: the
        variant for runs that cross strips, whose ring runs on across a strip's end
        (``mainloop``'s ``carry``; ``ops.even_workers``); ``row_sets``: the variant that
        serves M > m in sets of m rows (``ROW_SETS_M``)."""
        self.k, self.m, self.dtype = k, m, dtype
        if row_sets and (m != self.ROW_SETS_M or crossing):
            raise ValueError(f"GEMV row sets: rows bucket {self.ROW_SETS_M} without crossing runs")
        self.row_sets = row_sets
        if cta_groups and not (self.POLLED_HANDOVER and m >= self.CTA_GROUPS_FROM_M):
            raise ValueError(f"GEMV m={m}: no CTA groups below m={self.CTA_GROUPS_FROM_M}")
        if cta_groups and crossing:
            raise ValueError("GEMV: CTA groups hold runs of one strip each, none crosses")
        self.cta_groups = cta_groups
        # A variant of its own: a first version that ran every launch this way (runs in one
        # strip too) cost short calls and the M = 4 launches 2-12% (2048x512 M = 1 k = 2 2.65
        # -> 2.98 us, 4096x4096 M = 4 k = 4 5.92 -> 6.32; session 34), though the K loops kept
        # their instruction counts.
        self.crossing = crossing
        # The crossing variants' skew (``QUAD_SKEW``) in 1/65536 of the mean run per q (n - q).
        skew = QUAD_SKEW.get(k, 0.0) if crossing else 0.0
        self.skew16 = round(skew / 2 * 65536)
        # K tiles in flight per warp, in its shared-memory ring (see STAGES).
        sm90_stages = RING_STAGES_SM90.get((k, m)) if target_arch_family() == "sm_90" else None
        self.stages = stages or sm90_stages or STAGES[k]
        # How indices become values. Issue slots and the integer ALU pipe (half the issue
        # rate) are what these kernels run out of, so each k takes the lookup with the
        # fewest instructions per weight:
        # "quad_table" (the default for k = 2): the same with four 2-bit indices per byte
        #   and two pairs per entry: one 8-byte load per 4 weights.
        # "pair_table" (the default for k = 3, 4): one shared-memory load per pair
        #   from a 256-entry table of pairs, its address one prmt from the byte that holds
        #   the pair's two 4-bit fields; 64 KB shared by the quads of a CTA (up to 7: 28
        #   warps per SM). k = 4: 223 instead of ~300 instructions per K tile.
        # "pair_table5" (the default for k = 5 on sm_90): the pair table over the two 4-bit
        #   fields of planes 0-3, the fifth bits picking one of four sub-tables (128 KB,
        #   ``pair5_high_bytes``): 275 instead of 354 instructions per K tile, half the
        #   shared-memory wavefronts of the shuffles.
        # Register lookups (small k = 5 weights, and CTAs of one quad such as the grouped
        # kernel's):
        # k = 2: one shuffle per pair from a 16-entry table of pairs (two adjacent 2-bit
        #        fields are its lane index);
        # k = 3: byte-select tables, scaled per block, four lookups per two prmt;
        # k >= 4: one shuffle per weight, two merged into a pair with one prmt.
        self.lookup = lookup or default_lookup(k)
        if not GemvKernel.lookup_fits(self.lookup, k):
            raise ValueError(f"GEMV lookup {self.lookup!r} does not serve k={k}")
        self.byte_tables = self.lookup == "byte_tables"
        # M <= 4, k = 3, 4 (and k = 5's pair table at M = 1): the block scales go after the
        # mma (``mma_tile``), not onto every weight pair: 14-16 instructions per K tile less
        # (k = 3 M = 4 210 -> 195). M = 1: 2-5% faster (session 19); M = 2, 4 with the CTA
        # groups of session 31: k = 3 0.90-0.99x, k = 4 0.97-1.00x (A/B, 10 shapes, session
        # 36). Not taken: k = 2 at M = 4, 8 (its quads cost two multiplies per shared-memory
        # load: 10 instructions more), k = 5 at M = 2, 4 (0.98-1.03x, mostly slower), k = 5 with
        # shuffles, sm_80 (k = 3 spilled at its 72-register bound). k = 5's pair table at
        # M = 1 takes it (not measured without: M = 1 and 2 ran within 1% there). k = 2 at
        # M = 1 in the crossing variant (the one large weights run), which is latency-bound,
        # not issue-bound (ncu, session 39): 161 instructions per K tile against 147, but no
        # multiply between each table load and its mma; 8192x28672 30.57 / 31.00 -> 30.07 /
        # 30.05 us, 28672x8192 29.66 / 30.15 -> 29.43 / 29.68 (alternate processes, session
        # 40); the plain k = 2 variants spilled with it (72 registers). Since session 42 k = 2
        # at M <= 2 scales after the mma in every variant, in ``row_roles``' mma layout.
        #
        # ``row_roles`` (``ROLE_MAX_M``: k = 2 at M <= 2, k = 4 at M = 1): the mma's rows g
        # and g + 8 take the same weight column, row g the thread's K positions of "role 0",
        # row g + 8 those of role 1 (``ROLE_RUNS``' shift ahead), each against an activation
        # column of its own (``read_tile``), so a lookup lands where the mma wants it: a
        # quad entry's two pairs (fields 0, 1 | 2, 3 of a byte: positions e, e + 2 | e + 4,
        # e + 6) are one load of two of its registers, where per-column entries needed ~25
        # register moves per K tile; the activation pairs halve (4 per K tile), and each
        # lane scales its column's sum for one block, in fp32. K loop (sm_90a, f16) k = 2
        # M = 1 / 2 148 -> 130 / 127 instructions, its crossing variant 161 -> 131; k = 4
        # M = 1 194 -> 183 (crossing 194 -> 187). Measured: ``ROLE_MAX_M``.
        self.row_roles = (
            m <= ROLE_MAX_M.get((k, self.lookup), 0) and target_arch_family() == "sm_90"
        )  # fmt: skip
        self.split_blocks = (
            (m <= 4 and k in (3, 4) or m == 1 and self.lookup == "pair_table5")
            and target_arch_family() == "sm_90"
        ) or self.row_roles  # fmt: skip
        self.table = self.lookup in TABLE_ENTRY_BYTES  # a shared-memory table per CTA
        self.table_bytes = TABLE_BYTES_OF.get(self.lookup, 0)
        # pair_table5 merges planes 0-3 as k = 4 does (4-bit fields); plane 4 goes into the
        # table address (``pair5_high_bytes``).
        self.high_plane = self.lookup == "pair_table5"
        merged_k = 4 if self.high_plane else k
        min_width = {"byte_tables": 4, "pair_table": 4, "quad_table": 2}.get(self.lookup, 1)
        self.field_width = field_bits(merged_k, min_width)
        widths = self.SELECT_WIDTHS_WIDE_M if m >= 4 else self.SELECT_WIDTHS
        self.select_widths = widths[merged_k]
        # Workers (quads of 4 column warps) per CTA. The 64 KB pair table is shared by as
        # many quads as the shared memory of an SM holds besides it, up to 7 (at 8, 64
        # registers, it spilled). Register lookups (k = 5) on sm_90: 7 quads as well, one CTA
        # per SM, so that a grid of full CTAs leaves no SM with a quad less (``ops.kernel_
        # grid``; 8192x28672 72.3 -> 70.8 us, 14336x4096 24.4 -> 21.8 against one quad per
        # CTA, 7 of them per SM); REGISTER_LOOKUP_QUADS = 1 keeps one (sm_80 spilled at 72).
        if quads is None:
            quads = 1
            if self.table:
                ring = 4 * self.stage_words() * self.stages * WARPS
                room = smem_per_sm() - self.table_bytes - 1024 - extra_smem
                quads = max(1, min(self.MAX_QUADS, room // ring))
            elif target_arch_family() == "sm_90":
                quads = self.REGISTER_LOOKUP_QUADS
        self.quads = quads
        # A quad's skew shift stays under half a run (``skewed_worker`` relies on it).
        if skew * quads**2 / 8 >= 0.5:
            raise ValueError(f"GEMV: QUAD_SKEW[{k}] = {skew} with {quads} quads shifts whole runs")
        self.warps = WARPS * quads
        self.threads = 32 * self.warps
        # Registers per thread, and whether the launch bounds them. Quads sharing a pair
        # table: one CTA per SM, every register its threads can have. One quad per CTA on
        # sm_90: 64 fill an SM with 32 warps; k = 5 and k = 4 at m = 8 spill at 64 (72: 28
        # warps); k = 2 fits 64 unbounded (bounded, it spilled at m = 4). sm_80's code
        # spills under those bounds: unbounded there (up to 96).
        if self.quads > 1:
            self.regs, self.bound_regs = min(255, 65536 // self.threads // 8 * 8), True
        elif target_arch_family() == "sm_80":
            self.regs, self.bound_regs = 96, False
        else:
            self.regs = 72 if k == 5 or (k, m) == (4, 8) else 64
            self.bound_regs = k != 2
        # + the reserved 1 KB
        smem = 4 * self.stage_words() * self.stages * self.warps + 1024 + extra_smem
        smem += self.table_bytes
        if smem > smem_per_sm():
            raise ValueError(
                f"GEMV k={k} m={m} {self.lookup} with {quads} quads needs {smem} bytes of "
                f"shared memory per CTA, more than an SM has ({smem_per_sm()}): fewer quads"
            )
        self.ctas_per_sm = max(1, min(65536 // (self.regs * self.threads), smem_per_sm() // smem))
        # Programmatic dependent launch (sm_90 on): the launch may start while the kernel
        # before it still runs; ``wait_previous_kernel`` before any memory access keeps it safe.
        self.pdl = target_arch_family() == "sm_90"
        # The prefetch pays where CTAs land early (one per SM: multi-quad CTAs; k = 5 with 7
        # quads, 2048x2048 5.86 -> 5.24 us); one-quad CTAs lost by it (k = 5 when it had
        # them, 4096x14336: 25.4 -> 26.5 us).
        self.prefetch_tiles = self.PREFETCH_TILES if self.quads > 1 and self.pdl else 0

    @staticmethod
    def lookup_fits(lookup: str, k: int) -> bool:
        """Whether a lookup serves k: a pair shuffle needs 2-bit fields, byte tables <= 8
        entries, the pair table two fields per byte (k <= 4), pair_table5 exactly one plane
        past those fields (k = 5); shuffles serve every k."""
        if lookup == "pair_table5":
            return k == 5
        limits = {
            "pair_shuffle": 2, "quad_table": 2, "byte_tables": 3, "pair_table": 4, "shuffle": 5
        }  # fmt: skip
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
        pWorkspace: cute.Pointer,  # fp32 (2 workers, 128, m): partial strips
        pCounters: cute.Pointer,  # int32 (4 column tiles,), zero; left zero
        M: Int32,
        N: Int32,
        K: Int32,
        workers: Int32,  # 1 <= workers <= column tiles x K tiles
        ctas: Int32,  # ctas x quads >= workers
        per_cta: Int32,  # workers // ctas
        splits: Int32,  # workers // column tiles where CTA groups apply, else 0 (``cta_args``)
        has_bias: Int32,
        stream: cuda.CUstream,
    ):
        K = cute.assume(K, divby=BLOCK)
        n_tiles = (N + TILE_N - 1) // TILE_N
        k_tiles = (K + TILE_K - 1) // TILE_K
        mW = cute.make_tensor(pPacked, weight_words_layout(n_tiles, k_tiles, self.k))
        mS = cute.make_tensor(pAbsmax, weight_absmax_layout(n_tiles, k_tiles))
        mA = cute.make_tensor(pA, cute.make_layout((M, K), stride=(K, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((M, N), stride=(N, 1)))
        mWs = self.strip_workspace(pWorkspace, workers)
        row_sets = 1
        if cutlass.const_expr(self.row_sets):
            row_sets = (M + self.m - 1) // self.m
        self.kernel(
            mA, mW, mS, pCodebook, pScale, pBias, mOut, mWs, pCounters, n_tiles, k_tiles, workers,
            per_cta, splits, has_bias,
        ).launch(**self.launch_options(ctas, stream, row_sets))  # fmt: skip

    def strip_workspace(self, pWorkspace: cute.Pointer, workers) -> cute.Tensor:
        """The split-K workspace as (column of a strip, row, slot) fp32: two slots per
        worker, its first strip's partial and its last one's (``finish_strip``). Polled
        hand-over: a column's m rows adjacent, which the owner loads at once (M = 4: one
        16-byte load where it took four); counter path: row-major, whose row-by-row loads
        coalesce across the lanes (``reduce_strip``)."""
        m = self.m
        stride = (m, 1, m * TILE_N) if self.POLLED_HANDOVER else (1, TILE_N, m * TILE_N)
        layout = cute.make_layout((TILE_N, m, 2 * workers), stride=stride)
        return cute.make_tensor(pWorkspace, layout)

    def launch_options(self, ctas, stream, row_sets=1) -> dict:
        """``launch`` arguments of a stream-K grid of ``ctas`` CTAs (one wave) per row set:
        the register bound where there is one, programmatic dependent launch where the
        target has it."""
        return dict(
            grid=[ctas, row_sets, 1], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.ctas_per_sm if self.bound_regs else 0,
            preferred_smem_carveout=-1, use_pdl=self.pdl,
        )  # fmt: skip

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
        mWs: cute.Tensor,  # (column in tile, row, slot) fp32; slot 2 w + (0 first, 1 last)
        pCounters: cute.Pointer,
        n_tiles: Int32,
        k_tiles: Int32,
        workers: Int32,
        per_cta: Int32,
        splits: Int32,
        has_bias: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, row_set, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.row_sets):
            mA, mOut, mWs, pCounters = self.row_set_views(
                mA, mOut, mWs, pCounters, row_set, n_tiles
            )
        # warp_idx() is warp-uniform to the compiler: the schedule's values below then live
        # in uniform registers, not in the 64 per thread.
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        wn, quad = warp % WARPS, warp // WARPS
        M, K = mA.shape
        # mma fragment coordinates: lane = 4 * g + t. The thread's mma rows are g and g + 8
        # of each row tile; its K run in a tile is block kb = t / 2, half h = t % 2.
        g, t = lane // 4, lane % 4

        # Where every run lies in one strip (``workers`` = column tiles x s, the library's
        # s-way splits) a CTA holds consecutive workers, so that a strip's workers in one CTA
        # sum through shared memory first (``finish_cta_group``); otherwise workers
        # interleave over the CTAs. Either way a grid with idle quads spreads its work over
        # every SM that has a CTA.
        # (The host divides: ``cta_args``. Divisions here lie on the path to the first
        # loads: 512x2048 M = 1 2.5 -> 2.8 us with two more of them.)
        # The crossing variants hold consecutive workers too: their runs are of equal length
        # but for one tile, and the longer ones come every units % workers-th worker, a period
        # that can divide the CTA count (924 runs over 28672 units: 28 longer ones 33 apart on
        # 132 CTAs, all in the same 33 SMs if interleaved). (Folding their branch into the
        # grouped one below changed the grouped variants' compiled entry: kept apart.)
        grouped = False
        first_worker = Int32(0)
        if cutlass.const_expr(self.cta_groups):
            grouped = splits != 0
            first_worker = cta_first(cta, workers, ctas, per_cta)
        groups = (splits, per_cta, first_worker)
        worker = quad * ctas + cta
        busy = worker < workers
        if cutlass.const_expr(self.crossing):
            worker = cta_first(cta, workers, ctas, per_cta) + quad
            busy = worker < cta_first(cta + 1, workers, ctas, per_cta)
        if grouped:
            worker = first_worker + quad
            busy = worker < cta_first(cta + 1, workers, ctas, per_cta)
        units = n_tiles * k_tiles
        if cutlass.const_expr(self.crossing):
            unit = self.skew_unit(units, workers)
            u_begin, u_end = self.skewed_run(worker, units, workers, per_cta, unit)
        else:
            u_begin = run_start(worker, units, workers)
            u_end = run_start(worker + 1, units, workers)
        nt_first = u_begin // k_tiles
        rows = (Int32(0), M)
        # The launch overlaps the previous kernel's tail (programmatic dependent launch):
        # pull the first K tiles and the codebook into L2 meanwhile (harmless even if that
        # kernel writes them: L2 is where writes land), then wait for it.
        if cutlass.const_expr(self.prefetch_tiles > 0):
            if warp % WARPS == 0 and busy:
                self.prefetch_first_tiles(mW, mS, pCodebook, nt_first, u_begin, u_end, k_tiles)
        wait_previous_kernel(self.pdl)

        # Table kernels: the first K tiles' copies go out before the pair table is filled,
        # so that their DRAM latency and the fill overlap (k = 2..4, 2048x512 to 4096x14336:
        # 0.3-0.7 us less per call with the prefetch above).
        run = (u_begin - nt_first * k_tiles, cutlass.min(u_end - nt_first * k_tiles, k_tiles))
        col0_first = nt_first * TILE_N + wn * WARP_COLS + g
        cursor = src = None
        if cutlass.const_expr(self.crossing):  # the ring runs on across the run's strips
            cursor = self.run_cursor(u_end - u_begin, run[0])
            src = self.run_sources()

        def prime(ring):
            if cutlass.const_expr(self.crossing):
                self.start_run(mA, mW, mS, ring, rows, col0_first, src, cursor, busy)
            else:
                self.prime_first_strip(mA, mW, mS, ring, rows, col0_first, run, busy)

        smem = SmemAllocator()
        # (the pair table syncs the CTA)
        ctx = self.make_mainloop(smem, pCodebook, t, prime if self.table else None)
        acc = ctx[-1]
        if busy:
            scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
            mBias = cute.make_tensor(pBias, cute.make_layout(mOut.shape[1]))
            if cutlass.const_expr(self.crossing and not self.table):
                self.start_run(mA, mW, mS, ctx[5], rows, col0_first, src, cursor, busy)
            for nt in cutlass.range(nt_first, (u_end - 1) // k_tiles + 1, unroll=1):
                kt_begin = cutlass.max(u_begin - nt * k_tiles, 0)
                kt_end = cutlass.min(u_end - nt * k_tiles, k_tiles)
                for r in cutlass.range_constexpr(ROW_TILES):
                    acc[r].fill(0.0)
                col0 = nt * TILE_N + wn * WARP_COLS + g
                # Activation rows 0..M-1 feed the mma's columns (``read_tile``); columns past
                # M hold finite values that are never stored. The run's (the first strip's)
                # copies were started above.
                if cutlass.const_expr(self.crossing):
                    carry = (src, cursor, Int32(nt == (u_end - 1) // k_tiles))
                    self.mainloop(mA, mW, mS, col0, rows, t, kt_begin, kt_end, ctx, carry=carry)
                else:
                    primed = Int32(nt == nt_first) if cutlass.const_expr(self.table) else None
                    self.mainloop(mA, mW, mS, col0, rows, t, kt_begin, kt_end, ctx, primed=primed)
                if cutlass.const_expr(self.row_roles):
                    self.combine_roles(acc)
                epi = (scale, mBias, mOut, has_bias, nt)
                plan = (units, workers, k_tiles)
                if grouped:
                    self.finish_cta_group(acc, epi, mWs, ctx[5], nt, wn, t, worker, plan, groups)
                else:
                    slot = 2 * worker + Int32(nt != nt_first)
                    whole = None
                    if cutlass.const_expr(self.crossing):  # (the run covered the strip)
                        whole = Int32(kt_begin == 0) * Int32(kt_end == k_tiles)
                    self.finish_strip(acc, epi, mWs, pCounters, nt, wn, t, slot, plan, whole)
            if cutlass.const_expr(self.POLLED_HANDOVER):
                # The next launch may come in once the K loops are done, before the
                # split-K gather: its CTAs land and prefetch while the owners wait for the
                # others' partials (8192x28672 k = 2, 3 1.5-3% faster, other shapes within
                # +-1%).
                let_next_kernel_start(self.pdl)
                self.gather_owned_strips(
                    worker, (pScale, mBias, mOut, has_bias), mWs, wn, (units, workers, k_tiles),
                    groups,
                )  # fmt: skip
        # A CTA's first signal is the one that counts (later ones are no-ops). Warps without
        # a worker give theirs here at once: in a CTA with idle quads, at the kernel's start.
        # (The signal at the start in every CTA measured no better, perf/NOTES.md session 21;
        # when CTAs of the next launch could share an SM with working ones, they slowed
        # them: k = 5 with one-quad CTAs, 14336x4096, 23 -> 34 us.)
        let_next_kernel_start(self.pdl)

    @cute.jit
    def row_set_views(self, mA, mOut, mWs, pCounters, row_set, n_tiles):
        """Row set ``row_set``'s A and out rows (m of them, fewer in the last set), and its
        own workspace slots and split-K counters (one per warp strip of the ``n_tiles``
        column tiles): past the sets before it."""
        M, K = mA.shape
        N = mOut.shape[1]
        first = row_set * self.m
        rows = cutlass.min(M - first, self.m)
        mA = cute.make_tensor(mA.iterator + first * K, cute.make_layout((rows, K), stride=(K, 1)))
        mOut = cute.make_tensor(
            mOut.iterator + first * N, cute.make_layout((rows, N), stride=(N, 1))
        )
        mWs = cute.make_tensor(mWs.iterator + row_set * cute.cosize(mWs.layout), mWs.layout)
        return mA, mOut, mWs, pCounters + row_set * (n_tiles * WARPS)

    @cute.jit
    def prime_first_strip(self, mA, mW, mS, ring, rows, col0, run, busy):
        """``issue_prologue`` of the worker's first strip (the thread's column ``col0``, K
        tiles ``run`` = (first, end)), if the warp has a worker (``busy``)."""
        if busy:
            warp_ring, cols = self.warp_ring(ring, col0)
            src = self.copy_sources(mA, mW, mS, cols, rows, run[0])
            prologue = (src, len(cols), rows, run[0], run[1], warp_ring, self.activation_tiles(mA))
            self.issue_prologue(mA, mW, mS, *prologue)

    @staticmethod
    def run_cursor(tiles, kt):
        """Where a worker's run stands (register tensor): [K tiles still to copy, K tile of
        the next copy in its strip, ring stage to read next]."""
        cursor = cute.make_rmem_tensor((3,), Int32)
        cursor[0], cursor[1], cursor[2] = tiles, kt, Int32(0)
        return cursor

    @staticmethod
    def run_sources():
        """Register tensors for ``copy_sources`` of the next copy, carried across strips."""
        return cute.make_rmem_tensor((1,), Int64), cute.make_rmem_tensor((2,), Uint32)

    @cute.jit
    def start_run(self, mA, mW, mS, ring, rows, col0, src, cursor, busy):
        """``issue_prologue`` of the worker's run (``cursor``: ``run_cursor``), if the warp
        has one (``busy``): the sources of its first K tile (the thread's column ``col0`` of
        the first strip) into ``src``, then its first stages - 1 tiles, across a strip's end
        if the run goes on past it."""
        if busy:
            warp_ring, cols = self.warp_ring(ring, col0)
            w_src, off = self.copy_sources(mA, mW, mS, cols, rows, cursor[1])
            src[0][0], src[1][0], src[1][1] = w_src[0], off[0], off[1]
            a_tiles = self.activation_tiles(mA)
            for s in cutlass.range_constexpr(self.stages - 1):
                if cursor[0] > 0:
                    dst = warp_ring + s * self.stage_words()
                    self.copy_from(mA, mS, src, len(cols), rows, cursor[1], dst, a_tiles)
                    self.advance_run(mW, mS, src, cursor)
                cute.arch.cp_async_commit_group()

    @cute.jit
    def advance_run(self, mW, mS, src, cursor):
        """``src`` and ``cursor`` past the copy of one K tile: one add per source, and at a
        strip's end the jump to the next strip's first tile."""
        self.advance_sources(src, mW, mS)
        cursor[0], cursor[1] = cursor[0] - 1, cursor[1] + 1
        if cursor[1] == mW.shape[1][1]:
            cursor[1] = Int32(0)
            self.advance_sources(src, mW, mS, to_next_strip=True)

    @cute.jit
    def prefetch_first_tiles(self, mW, mS, pCodebook, nt, u_begin, u_end, k_tiles):
        """Bulk L2 prefetch of the first ``prefetch_tiles`` K tiles of the quad's run (its 128
        columns of a K tile: one contiguous range of words, one of absmax bytes) and of the
        codebook (which the table fill waits for). Lanes of the quad's first warp."""
        lane = cute.arch.lane_idx()
        kt = u_begin - nt * k_tiles + lane // 2
        if lane < 2 * self.prefetch_tiles and kt < cutlass.min(u_end - nt * k_tiles, k_tiles):
            if lane % 2 == 0:
                off = cute.crd2idx(((0, nt), (0, kt), 0), mW.layout)
                prefetch_l2(mW.iterator + off, TILE_N * BLOCKS_PER_TILE_K * self.k * 4)
            else:
                off = cute.crd2idx(((0, nt), (0, kt)), mS.layout)
                prefetch_l2(mS.iterator + off, TILE_N * BLOCKS_PER_TILE_K)
        if lane == 31:
            prefetch_l2(pCodebook, 4 << self.k)  # 16-byte aligned (the launch checks)

    def stage_words(self) -> int:
        """Int32 words of one warp's ring stage: its 32 columns' plane words for both
        blocks of a K tile, their 64 absmax bytes, and ``m`` activation rows of 64 K."""
        return WARP_COLS * BLOCKS_PER_TILE_K * self.k + ABSMAX_WORDS + self.m * A_ROW_WORDS

    def make_mainloop(self, smem: SmemAllocator, pCodebook: cute.Pointer, t, prime=None):
        """What the K loop works with, made once per CTA: (codebook registers, 16-bit half
        selector, mma atom, A and B fragments, shared-memory ring, the registers of one K
        tile, accumulators per row tile). ``prime(ring)``, if given, runs before the pair
        table is filled (e.g. to start the first copies)."""
        k = self.k
        mCodebook = cute.make_tensor(pCodebook, cute.make_layout(1 << k))
        factor = SPLIT_FACTOR if self.split_blocks else None
        if self.byte_tables or self.lookup == "quad_table":  # (the quad fill: by prmt)
            codebook = codebook_x2_pairs(mCodebook, k, self.dtype, factor)
        elif self.lookup == "pair_shuffle":  # (k = 2: never scaled after the mma)
            codebook = codebook_pair_lane(mCodebook, self.dtype)
        else:
            codebook = codebook_x2_lane(mCodebook, k, self.dtype, factor)
        half_select = Uint32(0x5410) + Uint32(t % 2) * Uint32(0x2222)  # 16-bit half h of a word
        atom, tiled_mma = gemv_mma(self.dtype)
        frag_a = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((MMA_M, MMA_K)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((MMA_N, MMA_K)))
        if cutlass.const_expr(self.table):
            table = smem.allocate_tensor(
                Uint32, cute.make_layout(self.table_bytes // 4), byte_alignment=1024
            )
        ring = smem.allocate_tensor(
            Int32,
            cute.make_layout(self.stage_words() * self.stages * self.warps),
            byte_alignment=16,
        )
        if prime is not None:
            prime(ring)
        if cutlass.const_expr(self.table):
            codebook = self.make_table(table, codebook)
        buf = self.make_buffers()
        acc = [
            tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((MMA_M, MMA_N)))
            for _ in range(ROW_TILES)
        ]
        if cutlass.const_expr(self.split_blocks):
            # The mma's per-tile results (``acc`` above; ``row_roles`` takes one column at a
            # time: one fragment) and the totals: per row tile, the thread's columns g, g + 8
            # for activation row t (``row_roles``: for its (row t // 2, block t % 2) until
            # ``combine_roles``).
            buf = (*buf, acc[:1] if self.row_roles else acc)
            acc = [cute.make_rmem_tensor((2,), Float32) for _ in range(ROW_TILES)]
        return codebook, half_select, atom, frag_a, frag_b, ring, buf, acc

    def make_table(self, table: cute.Tensor, cb_lane):
        """Fill the CTA's shared pair or quad table (``table``: ``self.table_bytes`` of shared
        memory) from the codebook lanes (``cb_lane``: entry lane % 2^k in both halves; the
        quad table: the four entries as two pair registers, ``codebook_x2_pairs``);
        returns (table byte pointer, this lane's byte offset register). Threads write 16-byte
        slices (2 or 4 lanes' copies of a row)."""
        tidx, _, _ = cute.arch.thread_idx()
        self.fill_table(table, cb_lane, tidx)
        cute.arch.sync_threads()
        lane_offset = Uint32((tidx % TABLE_COPIES[self.lookup]) * TABLE_ENTRY_BYTES[self.lookup])
        if cutlass.const_expr(self.high_plane):
            lane_offset = lane_offset * Uint32(0x01010101)  # in every byte (``pair5_high_bytes``)
        return cute.recast_ptr(table.iterator, dtype=cutlass.Uint8), lane_offset

    @cute.jit
    def fill_table(self, table, cb_lane, tidx):
        """Fill the table's rows with ``TABLE_COPIES`` copies of each entry (pair_table5: two
        entries per row, one per half-row). Thread u makes entry u once (two shuffles, or two
        prmt for the quad table) and stores its copies in 16-byte slices, lane l starting at
        slice l % (slices of an entry), so that the 8 lanes of a quarter-warp store hit 8
        different bank groups. (A thread per slice took 2-4 shuffles per slice: 128-512 warp
        shuffles per CTA before its first K tile.)"""
        halves = 2 if self.high_plane else 1  # entries per row
        per_entry = TABLE_ENTRY_BYTES[self.lookup] * TABLE_COPIES[self.lookup] // 16
        entries = self.table_bytes // TABLE_ROW * halves
        lane = tidx % 32
        for i in cutlass.range_constexpr(-(-entries // self.threads)):
            u = tidx + i * self.threads
            if u < entries:  # warp-uniform (entries and threads are multiples of 32)
                p, half = u // halves, u % halves
                p32 = Uint32(p)
                if cutlass.const_expr(self.lookup == "quad_table"):
                    # fields 0, 1 | 2, 3 of the byte, 2 bits each, by prmt from the entries'
                    # two pair registers (4 shuffles per slice before: k = 2 M = 1..8 2-5%
                    # slower on weights of 2048x512..2048x12288; session 30)
                    three = Uint32(3)
                    lo = codebook_pair_by_prmt(cb_lane, p32 & three, (p32 >> 2) & three)
                    hi = codebook_pair_by_prmt(cb_lane, (p32 >> 4) & three, p32 >> 6)
                    entry = [lo, hi, lo, hi]
                else:
                    if cutlass.const_expr(self.high_plane):
                        lo_index, hi_index = pair5_entry_indices(p32, Uint32(half * per_entry))
                    else:
                        lo_index, hi_index = p32 & Uint32(15), p32 >> 4
                    lo = codebook_lookup_x2(cb_lane, lo_index)
                    hi = codebook_lookup_x2(cb_lane, hi_index)
                    entry = [prmt(lo, hi, 0x5410)] * 4
                for s in cutlass.range_constexpr(per_entry):
                    self.store_slice(table, p, half * per_entry + (lane + s) % per_entry, entry)

    @cute.jit
    def store_slice(self, table, p, sl, words: list):
        """Slice ``sl`` (16 bytes) of table row ``p``: four words."""
        four = cute.make_rmem_tensor((4,), Uint32)
        for j in cutlass.range_constexpr(4):
            four[j] = words[j]
        dst = table.iterator + cute.assume(p * (TABLE_ROW // 4) + sl * 4, divby=4)
        cute.autovec_copy(four, cute.make_tensor(dst, cute.make_layout(4)))

    @cute.jit
    def mainloop(self, mA, mW, mS, col0, rows, t, kt_begin, kt_end, ctx, second=None,
                 primed=None, carry=None):  # fmt: skip
        """acc += K tiles kt_begin..kt_end of the thread's columns times the activations of
        ``rows`` = (first row, count): the mma's columns take rows first.. first + count - 1
        as ``read_tile`` assigns them.
        The warp's 32 columns are col0 - g onwards, or with ``second`` two runs of 16: that
        many, then 16 from column ``second`` (the grouped gate/up kernel: gate, then up).

        Each warp streams its own 32 columns through its shared-memory ring: cp.async
        copies run stages - 1 K tiles ahead while the warp dequantizes the current one from
        registers; only the warp itself waits (``sync_warp``), never the CTA.
        ``primed`` (Int32, nonzero): ``issue_prologue`` of this run was already called.

        ``carry`` = (sources, cursor, last) (``crossing`` variants): this is one strip of a
        stream-K run that ``start_run`` began; the copies follow the run's cursor, into the
        next strip's first tiles before this strip's last ones are read, and the ring drains
        only after the run's ``last`` strip. Without it the K tiles are a run of their own,
        whose ring drains at its end (a run across strips refills it in the next: a DRAM
        round trip per crossing)."""
        codebook, half_select, atom, frag_a, frag_b, ring, buf, acc = ctx
        S = self.stages
        g = cute.arch.lane_idx() // 4
        warp_ring, cols = self.warp_ring(ring, col0, second)
        if cutlass.const_expr(carry is None):
            # The copies' sources, one add per address and tile: at the loop, S - 1 ahead.
            src = self.copy_sources(mA, mW, mS, cols, rows, kt_begin)
            a_tiles = self.activation_tiles(mA)
            steps = (warp_ring, g, t, rows, ctx, mA, mW, mS, len(cols), a_tiles)
            prologue = (mA, mW, mS, src, len(cols), rows, kt_begin, kt_end, warp_ring, a_tiles)
            if cutlass.const_expr(primed is None):
                self.issue_prologue(*prologue)
            else:
                if primed == 0:
                    self.issue_prologue(*prologue)
                else:
                    for _ in cutlass.range_constexpr(S - 1):
                        self.advance_sources(src, mW, mS)
            self.k_steps(steps, src, (kt_begin, kt_end), None, Int32(0))
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()  # a next pass may refill the ring
        else:
            # Segments of steps whose copies stay in one strip: the sources jump to the next
            # strip between them, outside the steps (a check per copy cost 6-17 instructions
            # per step, predicated).
            src, cursor, last = carry
            a_tiles = self.activation_tiles(mA)
            steps = (warp_ring, g, t, rows, ctx, mA, mW, mS, len(cols), a_tiles)
            k_tiles = mW.shape[1][1]
            kt, left, copy_kt, read = kt_begin, cursor[0], cursor[1], cursor[2]
            while kt < kt_end:
                n = cutlass.min(kt_end - kt, k_tiles - copy_kt)
                made = cutlass.min(n, left)
                read = self.k_steps(steps, src, (kt, kt + n), (kt + made, copy_kt - kt), read)
                left, copy_kt, kt = left - made, copy_kt + made, kt + n
                if copy_kt == k_tiles:
                    copy_kt = Int32(0)
                    self.advance_sources(src, mW, mS, to_next_strip=True)
            cursor[0], cursor[1], cursor[2] = left, copy_kt, read
            if last != 0:
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_warp()

    @cute.jit
    def k_steps(self, steps, src, tiles, copies, read):
        """The K loop's steps for tiles (first, end), the ring read from stage ``read`` on;
        returns the stage to read next. The step of tile kt copies K tile kt + shift of
        ``src``'s strip into the ring if kt < limit (``copies`` = (limit, shift); None: the
        tile stages - 1 ahead if it lies before ``tiles``' end, the form the variants without
        a run cursor compiled to before it, byte for byte), and moves ``src`` on by one
        tile."""
        warp_ring, g, t, rows, ctx, mA, mW, mS, runs, a_tiles = steps
        codebook, half_select, atom, frag_a, frag_b, ring, buf, acc = ctx
        S, sw = self.stages, self.stage_words()
        if cutlass.const_expr(copies is None):
            write = Int32(S - 1)
        else:
            limit, shift = copies
            write = read - 1
            if read == 0:
                write = Int32(S - 1)
        for kt in cutlass.range(tiles[0], tiles[1], unroll=1):
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_warp()  # every lane's copies of stage ``read`` have landed
            self.read_tile(warp_ring + cute.assume(read * sw, divby=CHUNK_WORDS), g, t, rows, buf)
            if cutlass.const_expr(copies is None):
                if kt + S - 1 < tiles[1]:
                    dst = warp_ring + cute.assume(write * sw, divby=CHUNK_WORDS)
                    self.copy_from(mA, mS, src, runs, rows, kt + S - 1, dst, a_tiles)
            else:
                if kt < limit:
                    dst = warp_ring + cute.assume(write * sw, divby=CHUNK_WORDS)
                    self.copy_from(mA, mS, src, runs, rows, kt + shift, dst, a_tiles)
            self.advance_sources(src, mW, mS)
            cute.arch.cp_async_commit_group()
            self.mma_tile(buf, codebook, half_select, atom, frag_a, frag_b, acc)
            # The next step refills the stage read in this one, after its sync_warp: every
            # lane has read it by then.
            write = read
            read = read + 1
            if read == S:
                read = Int32(0)
        return read

    def warp_ring(self, ring, col0, second=None):
        """(The warp's ring in ``ring``, [(column in tile, tile)] of its first column, or of
        its two runs of 16 with ``second``): what ``copy_sources`` takes."""
        S, sw = self.stages, self.stage_words()
        warp_ring = ring.iterator + cute.assume(cute.arch.warp_idx() * (S * sw), divby=CHUNK_WORDS)
        wcol = col0 - cute.arch.lane_idx() // 4  # the warp's first column, 16-aligned
        cols = [(wcol % TILE_N, wcol // TILE_N)]
        if cutlass.const_expr(second is not None):
            cols.append((second % TILE_N, second // TILE_N))
        return warp_ring, cols

    @cute.jit
    def issue_prologue(self, mA, mW, mS, src, runs, rows, kt_begin, kt_end, warp_ring, a_tiles):
        """Copies of the run's first stages - 1 K tiles into the warp's ring (one commit
        group each, empty past the run), from ``copy_sources`` ``src`` of tile ``kt_begin``,
        which it advances past them."""
        sw = self.stage_words()
        for s in cutlass.range_constexpr(self.stages - 1):
            if kt_begin + s < kt_end:
                dst = warp_ring + s * sw
                self.copy_from(mA, mS, src, runs, rows, kt_begin + s, dst, a_tiles)
            cute.arch.cp_async_commit_group()
            self.advance_sources(src, mW, mS)

    def make_buffers(self):
        """Registers of one K tile: the words of the thread's 4 columns' block, their absmax
        codes, and the thread's 16 activations."""
        activations = cute.make_rmem_tensor((THREAD_K,), self.dtype)
        if cutlass.const_expr(self.REAL_ROWS_ONLY):
            activations.fill(0.0)  # what lanes past the real rows keep (``read_tile``)
        return (
            cute.make_rmem_tensor((self.k, 2 * ROW_TILES), Int32),
            cute.make_rmem_tensor(
                (2 * ROW_TILES,),
                cutlass.Uint16 if self.split_blocks and not self.row_roles else cutlass.Uint8,
            ),
            activations,
        )

    def copy_counts(self) -> tuple[int, int]:
        """16-byte chunks of one ring stage: (plane words, activations); absmax: 4."""
        return WARP_COLS * BLOCKS_PER_TILE_K * self.k // CHUNK_WORDS, self.m * A_ROW_CHUNKS

    @cute.jit
    def copy_sources(self, mA, mW, mS, cols, rows, kt):
        """Where the lane's copies of K tile kt (``copy_from``) come from, as register
        tensors: ([word address], [absmax offset, activation offset]), the offsets 32-bit,
        in bytes from the tensors' first elements. ``cols``: [(column in tile, tile)] of the
        warp's first column, or of its two runs of 16 (each contiguous in the format). A lane
        copies word chunks of one run only: all of them with one run, those of run lane // 16
        with two, so each lane's chunks lie at fixed distances from one address. Lanes without
        a copy get an unused value."""
        lane = cute.arch.lane_idx()
        first_row, _ = rows
        M, K = mA.shape
        runs = len(cols)
        w_first = cute.crd2idx((cols[0], (0, kt), 0), mW.layout)
        s_first = cute.crd2idx((cols[0], (0, kt)), mS.layout)
        if cutlass.const_expr(runs == 2):  # lanes 16-31 copy the second run's words,
            if lane >= 16:  # lanes 2, 3 its absmax
                w_first = cute.crd2idx((cols[1], (0, kt), 0), mW.layout)
            if lane >= 2:
                s_first = cute.crd2idx((cols[1], (0, kt)), mS.layout)
        lane_in_run = lane % (32 // runs)
        w_src = cute.make_rmem_tensor((1,), Int64)
        w_src[0] = (mW.iterator + w_first + lane_in_run * CHUNK_WORDS).toint()
        off = cute.make_rmem_tensor((2,), Uint32)
        off[0] = Uint32(s_first + (lane % (4 // runs)) * 16)
        a_off = (first_row + lane // A_ROW_CHUNKS) * K + kt * TILE_K + lane % A_ROW_CHUNKS * 8
        off[1] = Uint32(a_off * (self.dtype.width // 8))  # (chunks lane + 32 i: row + 4 i)
        return w_src, off

    def advance_sources(self, src, mW, mS, to_next_strip: bool = False):
        """``copy_sources`` of the next K tile: one add per offset, two for the address; or
        (``to_next_strip``, from one past a strip's last K tile) of the next strip's first
        one."""
        w_step = Int64(cute.crd2idx(((0, 0), (0, 1), 0), mW.layout)) * 4
        s_step = Uint32(cute.crd2idx(((0, 0), (0, 1)), mS.layout))
        a_step = Uint32(TILE_K * self.dtype.width // 8)
        if cutlass.const_expr(to_next_strip):
            k_tiles = mW.shape[1][1]
            w_step = Int64(cute.crd2idx(((0, 1), (0, 0), 0), mW.layout)) * 4 - w_step * k_tiles
            s_step = Uint32(cute.crd2idx(((0, 1), (0, 0)), mS.layout)) - s_step * Uint32(k_tiles)
            a_step = Uint32(0) - a_step * Uint32(k_tiles)
        w_src, off = src
        w_src[0] = w_src[0] + w_step
        off[0] = off[0] + s_step
        off[1] = off[1] + a_step

    def activation_tiles(self, mA):
        """K tiles whose activation chunk of this lane lies inside K (the lane's chunk of a
        later tile is zero-filled): ``copy_from`` then compares one number per tile."""
        chunk_k = cute.arch.lane_idx() % A_ROW_CHUNKS * 8
        return (mA.shape[1] - chunk_k + TILE_K - 1) // TILE_K

    @cute.jit
    def copy_from(self, mA, mS, src, runs: cutlass.Constexpr, rows, kt, dst, a_tiles):
        """cp.async of K tile kt of the warp's columns, from ``copy_sources`` ``src``, into
        the ring stage at ``dst``: [plane words: (col, kb, bit), contiguous in the tiled
        format | absmax: (col, kb) | activation rows: (K, row)]. Activations of tiles from
        ``a_tiles`` (``activation_tiles``) on are zero-filled: they lie past K, where the
        padded weights are zero, and A must not be NaN."""
        lane = cute.arch.lane_idx()
        _, n_rows = rows
        w_chunks, a_chunks = self.copy_counts()
        lanes = 32 // runs  # per run
        run_chunks = w_chunks // runs
        w_src, off = src
        w_addr = w_src[0]
        for i in cutlass.range_constexpr(-(-run_chunks // lanes)):
            c = lane % lanes + lanes * i  # the lane's chunk of its run
            chunk_dst = dst + cute.assume(
                (lane // lanes * run_chunks + c) * CHUNK_WORDS, divby=CHUNK_WORDS
            )
            addr = w_addr + lanes * 16 * i
            if cutlass.const_expr(lanes * (i + 1) <= run_chunks):  # every lane has a chunk
                cp_async_chunk(chunk_dst, addr)
            elif c < run_chunks:
                cp_async_chunk(chunk_dst, addr)
        s_dst = dst + 4 * w_chunks
        if lane < ABSMAX_WORDS // CHUNK_WORDS:
            s_addr = mS.iterator.toint() + Int64(off[0])
            cp_async_chunk(s_dst + cute.assume(lane * CHUNK_WORDS, divby=4), s_addr)
        a_dst = s_dst + ABSMAX_WORDS
        for i in cutlass.range_constexpr(-(-a_chunks // 32)):
            q = lane + 32 * i
            if q < a_chunks and q // A_ROW_CHUNKS < n_rows:
                # Activations: the other warps of the CTA read the same rows, so through L1.
                d = a_dst + cute.assume(q * CHUNK_WORDS, divby=CHUNK_WORDS)
                inside = Int32(kt < a_tiles)
                a_off = off[1] + Uint32(
                    32 // A_ROW_CHUNKS * i * mA.shape[1] * (self.dtype.width // 8)
                )
                a_addr = mA.iterator.toint() + Int64(a_off)
                cp_async_chunk(d, a_addr, through_l1=True, fill=inside)

    @cute.jit
    def read_tile(self, src, g, t, rows, buf):
        """The thread's part of the ring stage at ``src`` into registers: the k plane words
        of block t // 2 of its columns g + 8 j (j = 0..3), their absmax codes, and the
        activations of its K run t that its mma column g takes (row g, if g < count; with
        ``split_blocks`` / ``row_roles`` per the mode's comment below)."""
        rW, rS, rA = buf[:3]
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
            if cutlass.const_expr(self.row_roles):  # the code of the lane's block t % 2
                rS[j] = absmax[c * BLOCKS_PER_TILE_K + t % 2]
            elif cutlass.const_expr(self.split_blocks):  # both blocks' codes
                rS[j] = cute.make_tensor(
                    cute.recast_ptr(absmax.iterator, dtype=cutlass.Uint16), cute.make_layout(32)
                )[c]
            else:
                rS[j] = absmax[c * BLOCKS_PER_TILE_K + kb]
        # Only the lanes of real rows load: at M = 1 four lanes instead of 32 (8 loading half
        # a run each with ``row_roles``), 2 instead of 8 shared-memory wavefronts per tile
        # (k = 2 is bound by that pipe). The other mma
        # columns keep finite values (zeros or an earlier tile's) and are never stored.
        # Without REAL_ROWS_ONLY they read row count - 1 instead.
        _, n_rows = rows
        if cutlass.const_expr(self.row_roles):
            # mma column g = 4 m + 2 b + role takes row m's activations in block b at the
            # role's K positions (``read_activations``); the lanes whose K positions (block
            # t // 2) are of another block keep zeros.
            rA.fill(0.0)  # (per tile: no registers live across the K loop for them)
            if g // 4 < n_rows and g // 2 % 2 == kb:
                self.read_activations(src, g // 4, t, rA, g % 2)
        elif cutlass.const_expr(self.split_blocks):
            # mma column g = 2 m + b takes row m's activations in block b: the lanes whose
            # K positions (block t // 2) are of another block keep zeros.
            if g // 2 < n_rows and g % 2 == kb:
                self.read_activations(src, g // 2, t, rA)
        elif cutlass.const_expr(self.REAL_ROWS_ONLY):
            if g < n_rows:
                self.read_activations(src, g, t, rA)
        else:
            self.read_activations(src, cutlass.min(g, n_rows - 1), t, rA)

    @cute.jit
    def read_activations(self, src, row, t, rA, role=None):
        """The thread's 16 activations of ``row`` (K run t) from the ring stage at ``src``;
        with ``role`` (``row_roles``) only role 0's K positions, role 1 reading its own ones
        (``ROLE_RUNS``' shift ahead) into the same places."""
        a_off = cute.assume(
            WARP_COLS * BLOCKS_PER_TILE_K * self.k
            + ABSMAX_WORDS
            + row * A_ROW_WORDS
            + t * (THREAD_K // 2),
            divby=CHUNK_WORDS,
        )
        src = cute.recast_ptr(src + a_off, dtype=self.dtype)
        if cutlass.const_expr(role is None):
            cute.autovec_copy(cute.make_tensor(src, cute.make_layout(THREAD_K)), rA)
        else:
            shift, runs = ROLE_RUNS[self.lookup]
            src = src + cute.assume(role * shift, divby=shift)
            for first, n in runs:
                cute.autovec_copy(
                    cute.make_tensor(src + first, cute.make_layout(n)),
                    cute.make_tensor(rA.iterator + first, cute.make_layout(n)),
                )

    def mma_tile(self, buf, codebook, half_select, atom, frag_a, frag_b, acc):
        """acc[r] += this K tile of the thread's columns (row tile r) times the activations."""
        rW, rS, rA = buf[:3]
        act = cute.recast_tensor(rA, Uint32)  # act[i] = activations (2i, 2i+1)
        if cutlass.const_expr(self.row_roles):
            self.mma_row_roles(rW, rS, codebook, half_select, atom, frag_a, frag_b, act,
                               buf[3][0], acc)  # fmt: skip
            return
        k, W = self.k, self.field_width
        a_regs = cute.recast_tensor(frag_a, Uint32)
        b_regs = cute.recast_tensor(frag_b, Uint32)
        if cutlass.const_expr(self.split_blocks):
            # The weights stay unscaled (the tables carry SPLIT_FACTOR); each tile's mma
            # results are scaled per block afterwards (mma column 2 t + b: block b).
            one = Uint32(0x3C003C00 if self.dtype is cutlass.Float16 else 0x3F803F80)
            scales = [one] * (2 * ROW_TILES)  # (byte tables: scaled by 1.0)
        else:
            # Each column's block scale in both halves, one IMAD (the tables carry the
            # factor).
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
            high = None  # pair_table5: each fields word's ``pair5_high_bytes``, in order
            if cutlass.const_expr(self.high_plane):
                fields = planes_to_fields(planes[:4], 4, W, False, self.select_widths)
                high = pair5_high_bytes(planes[4], fields, codebook[1])
            else:
                fields = planes_to_fields(planes, k, W, self.byte_tables, self.select_widths)
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
                    if self.lookup == "quad_table":
                        if p % 2 == 0:  # pairs p and p + 1: one byte, one 8-byte entry
                            assert pairs[p + 1][0] is word and pairs[p + 1][1][0] == fa + 2
                            quad = self.lookup_quad(codebook, word, fa2)
                            for j in range(2):
                                w_pairs[half][p + j] = self.scaled(quad[j], scale)
                    elif self.byte_tables:
                        w_pairs[half][p] = self.lookup_pair(tables, word, fa2, fb2)
                    else:
                        word_high = None
                        if cutlass.const_expr(self.high_plane):  # (the word's own entry)
                            word_high = next(
                                h for (w, _), h in zip(fields, high, strict=True) if w is word
                            )
                        w_pairs[half][p] = self.scaled(
                            self.lookup_pair(codebook, word, fa2, fb2, word_high), scale
                        )
            if cutlass.const_expr(self.split_blocks):
                mma_acc = buf[3][r]
                mma_acc.fill(0.0)
            else:
                mma_acc = acc[r]
            for s in range(THREAD_K // 4):  # 4 K positions per mma step
                # Register order of an m16n8k16 A fragment: (row g, K pair 0), (row g + 8,
                # pair 0), (row g, pair 1), (row g + 8, pair 1); B: pair 0, pair 1.
                a_regs[0] = w_pairs[0][2 * s]
                a_regs[1] = w_pairs[1][2 * s]
                a_regs[2] = w_pairs[0][2 * s + 1]
                a_regs[3] = w_pairs[1][2 * s + 1]
                b_regs[0] = b_pairs[2 * s]
                b_regs[1] = b_pairs[2 * s + 1]
                cute.gemm(atom, mma_acc, frag_a, frag_b, mma_acc)
            if cutlass.const_expr(self.split_blocks):
                # mma_acc[2 h + b]: column g + 8 h, block b, activation row t
                for h in range(2):
                    s0, s1 = absmax_pair_f32(rS[2 * r + h])
                    acc[r][h] = acc[r][h] + s0 * mma_acc[2 * h] + s1 * mma_acc[2 * h + 1]

    def mma_row_roles(self, rW, rS, codebook, half_select, atom, frag_a, frag_b, act,
                      mma_acc, acc):  # fmt: skip
        """``mma_tile`` with ``row_roles``: acc[r][h] += this K tile of column 16 r + 8 h + g
        for the lane's (row t // 2, block t % 2); the kernel calls ``combine_roles`` after
        each strip. Each column is one mma row tile: rows g (role 0) and g + 8 (role 1: K
        positions ``ROLE_RUNS``' shift ahead), two mma steps (``_role_steps``) into
        ``mma_acc``; the lane's mma column 2 t is role 0 and 2 t + 1 role 1 of its (row,
        block), so its sum is C[g, 2 t] + C[g + 8, 2 t + 1]: fragment values 0 and 3."""
        a_regs = cute.recast_tensor(frag_a, Uint32)
        b_regs = cute.recast_tensor(frag_b, Uint32)
        k, W = self.k, self.field_width
        tile_words, steps = [], None
        for r in range(ROW_TILES):  # (the plane words die first: fewer registers live)
            # Plane b of both columns of this row tile, the thread's half of each:
            # bits 0-15 = column col0 + 16 r, bits 16-31 = column col0 + 16 r + 8.
            planes = [
                prmt(Uint32(rW[b, 2 * r]), Uint32(rW[b, 2 * r + 1]), half_select) for b in range(k)
            ]
            fields = planes_to_fields(planes, k, W, False, self.select_widths)
            tile_words.append([word for word, _ in fields])
            if steps is None:  # (word indices and K positions: the same for every row tile)
                steps = _role_steps(fields, self.lookup)
        # role 0's K positions (role 1 lanes hold their own at the same places)
        b_pairs = [[self.activation_pair(act, *e) for e in ks] for _, ks in steps]
        for r, words in enumerate(tile_words):
            for h in range(2):  # column col0 + 16 r + 8 h: bytes 2 h, 2 h + 1 of each word
                mma_acc.fill(0.0)
                for s, (sources, _) in enumerate(steps):
                    quads = {}
                    for i, (w, byte, part) in enumerate(sources):
                        byte += 2 * h
                        if cutlass.const_expr(part is None):  # a pair entry
                            a_regs[i] = self.lookup_pair(codebook, words[w], 2 * byte, 2 * byte + 1)
                        else:  # half ``part`` of a quad entry
                            if (w, byte) not in quads:
                                quads[w, byte] = self.lookup_quad(codebook, words[w], 4 * byte)
                            a_regs[i] = quads[w, byte][part]
                    b_regs[0], b_regs[1] = b_pairs[s]
                    cute.gemm(atom, mma_acc, frag_a, frag_b, mma_acc)
                acc[r][h] = acc[r][h] + absmax_f32(rS[2 * r + h]) * (mma_acc[0] + mma_acc[3])

    @cute.jit
    def combine_roles(self, acc):
        """After a strip's K tiles (``row_roles``): the lanes' (row t // 2, block t % 2)
        sums into ``split_blocks``' layout, row t's column totals in lane t."""
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(ROW_TILES):
            for h in cutlass.range_constexpr(2):
                v = acc[r][h] + cute.arch.shuffle_sync_bfly(acc[r][h], 1)  # both blocks
                if cutlass.const_expr(self.m > 1):  # row t from lane 4 g + 2 t
                    v = cute.arch.shuffle_sync(v, lane // 4 * 4 + lane % 4 * 2 % 4)
                acc[r][h] = v

    def scaled(self, pair, scale):
        """A looked-up weight pair times its block's scale (as it is with ``split_blocks``:
        the scale comes after the mma)."""
        return pair if self.split_blocks else mul_x2(pair, scale, self.dtype)

    def lookup_pair(self, codebook, word, fa: int, fb: int, high=None):
        """Codebook values of fields fa and fb of ``word`` as one 16-bit pair (fa low);
        ``high``: the word's ``pair5_high_bytes`` (pair_table5)."""
        W = self.field_width
        if self.byte_tables:
            # Four 4-bit fields per lookup: nibbles 0-3 or (shifted down) 4-7.
            quad = fa // 4
            sel = word if quad == 0 else word >> 16
            lo, hi = byte_table_lookup(codebook, sel)
            return prmt(lo, hi, byte_pair_selector(fa % 4, fb % 4))
        elif self.high_plane:
            assert fb == fa + 1 and fa % 2 == 0
            table, _ = codebook
            ha_bytes, hb_bytes = high
            first, second = pair5_selectors(fa // 2)
            addr = prmt(prmt(word, ha_bytes, first), hb_bytes, second)
            entry = cute.recast_ptr(table + cute.assume(Int32(addr), divby=4), dtype=Uint32)
            return cute.make_tensor(entry, cute.make_layout(1))[0]
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

    def lookup_quad(self, codebook, word, fa: int):
        """Quad table (k = 2): the values of fields fa..fa + 3 (one byte) of ``word`` as two
        16-bit pairs (fa, fa + 1) and (fa + 2, fa + 3), by one 8-byte shared-memory load."""
        assert fa % 4 == 0 and self.field_width == 2
        table, lane_offset = codebook
        # address byte 0 = the lane's copy, byte 1 = the fields' byte, bytes 2, 3 = 0
        addr = prmt(word, lane_offset, 0x5504 | (fa // 4) << 4)
        entry = cute.recast_ptr(table + cute.assume(Int32(addr), divby=8), dtype=Uint32)
        quad = cute.make_rmem_tensor((2,), Uint32)
        cute.autovec_copy(cute.make_tensor(entry, cute.make_layout(2)), quad)
        return quad[0], quad[1]

    def activation_pair(self, act, ea: int, eb: int):
        """Activations of the thread's K positions ea and eb (0..15) as one register."""
        if ea // 2 == eb // 2 and ea % 2 == 0 and eb == ea + 1:
            return act[ea // 2]
        return prmt(act[ea // 2], act[eb // 2], pair_selector(ea % 2, eb % 2))

    @cute.jit
    def finish_strip(self, acc, epi, mWs, pCounters, strip, wn, t, slot, plan, whole=None):
        """Output of the warp's strip (32 columns of schedule strip ``strip``) after its K
        run: stored if the run covered all K (``store_fragment``), else its fp32 partial goes
        to workspace slot ``slot`` and the strip's workers' partials are summed in worker
        order (bit-identical run to run) and stored (``store_columns``). ``epi``: what the
        stores need; ``outputs``: which column and row each accumulator is. ``whole`` (the
        crossing variants): whether the run covered the strip, which the run itself tells
        (their runs are skewed: ``skew_shift``).

        Who sums: with ``POLLED_HANDOVER`` the strip's owner, after its strips
        (``gather_owned_strips``); otherwise the last worker to count itself in on the
        strip's counter, here."""
        units, workers, k_tiles = plan
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(whole is not None):
            assert self.POLLED_HANDOVER
            if whole != 0:
                self.store_fragment(acc, epi, wn, t)
            else:
                self.write_slot(acc, mWs, wn, t, slot)
            return
        # Workers whose runs meet this strip: w_lo holds its first K tile, w_hi its last.
        wide = self.WIDE_RUNS
        w_lo = worker_of(strip * k_tiles, units, workers, wide)
        w_hi = worker_of(strip * k_tiles + k_tiles - 1, units, workers, wide)
        if w_lo == w_hi:
            self.store_fragment(acc, epi, wn, t)
        elif cutlass.const_expr(self.POLLED_HANDOVER):
            self.write_slot(acc, mWs, wn, t, slot)
        else:
            in_tile0 = wn * WARP_COLS + lane // 4
            for v, m, col in self.outputs(acc, t):
                if m < self.m:
                    cute.arch.store(mWs.iterator + cute.crd2idx((in_tile0 + col, m, slot),
                                                                mWs.layout), v)  # fmt: skip
            counter = pCounters + (strip * WARPS + wn)
            if warp_split_arrive(counter, w_hi - w_lo + 1) != 0:
                first_slot = self.first_slot(w_lo, strip, plan)
                self.reduce_strip(mWs, epi, wn, first_slot, w_hi - w_lo)

    @cute.jit
    def write_slot(self, acc, mWs, wn, t, slot):
        """The warp's partial strip into workspace slot ``slot``, for its owner to read
        (relaxed, GPU scope): a run of adjacent slot words a store."""
        in_tile0 = wn * WARP_COLS + cute.arch.lane_idx() // 4
        words = cute.recast_ptr(mWs.iterator, dtype=Int32)
        for values, m, col in self.slot_runs(acc, t):
            if m < self.m:
                ptr = words + cute.crd2idx((in_tile0 + col, m, slot), mWs.layout)
                store_slot_words(ptr, [f32_to_bits(v) for v in values])

    @staticmethod
    def cta_args(cta_groups: bool, N: int, workers: int, ctas: int) -> tuple[int, int]:
        """The kernel's (per_cta, splits) arguments for a grid of ``workers`` on ``ctas``
        CTAs (host side, so that the kernel does not divide): workers // ctas, and, for a
        variant with CTA groups, the splits where every worker's run lies in one strip
        (``workers`` = column tiles x splits), else 0 (the workers interleave over the
        CTAs; ``finish_strip``)."""
        n_tiles = -(-N // TILE_N)
        grouped = cta_groups and workers % n_tiles == 0
        return workers // ctas, workers // n_tiles if grouped else 0

    @cute.jit
    def finish_cta_group(self, acc, epi, mWs, ring, strip, wn, t, worker, plan, groups):
        """``finish_strip`` where the CTA holds consecutive workers and each run lies in one
        strip (``cta_args``; ``groups``: (splits, workers per CTA, the CTA's first worker)).
        The strip's workers in this CTA (its group, a run of quads) sum through shared
        memory first: each but the last puts its accumulators into its warps' drained rings
        and arrives on the group's named barrier; the last (the group's leader) waits there
        and adds them to its own in worker order. The leader then stores the strip if the
        group holds all of it, else writes the group's partial to a slot of the CTA: 2 c if
        the group starts at the CTA's first worker, else 2 c + 1 (the CTA's last group,
        whose strip goes on in a later CTA). A split strip's owner (``strip_owner``) then
        gathers one slot per CTA, not one per worker, in the per-worker scheme's slot order
        (``strip_slot``)."""
        splits, _, first = groups  # (first: the CTA's first worker)
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        quad = cute.arch.warp_idx() // WARPS
        end = cta_first(cta + 1, plan[1], ctas, groups[1])
        w_lo = strip * splits
        g_lo = cutlass.max(w_lo, first)
        g_hi = cutlass.min(w_lo + splits, end) - 1
        if g_hi > g_lo:
            threads = (g_hi - g_lo + 1) * (32 * WARPS)
            barrier_id = GROUP_BARRIER0 + g_lo - first
            parts = cute.make_tensor(cute.recast_ptr(ring.iterator, dtype=Float32), ring.layout)
            stage_words = self.stages * self.stage_words()
            lane = cute.arch.lane_idx()
            if worker != g_hi:
                own = cute.arch.warp_idx() * stage_words + lane
                for r, j, i in self.acc_values(acc):
                    parts[own + 32 * i] = acc[r][j]
                cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=threads)
            else:
                cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
                for q in cutlass.range(g_lo - first, quad, unroll=1):
                    other = (q * WARPS + wn) * stage_words + lane
                    for r, j, i in self.acc_values(acc):
                        acc[r][j] = acc[r][j] + parts[other + 32 * i]
        if worker == g_hi:
            if g_lo == w_lo and g_hi == w_lo + splits - 1:
                self.store_fragment(acc, epi, wn, t)
            else:
                self.write_slot(acc, mWs, wn, t, 2 * cta + Int32(g_lo != first))

    @staticmethod
    def acc_values(acc) -> list:
        """[(row tile r, index j, i)]: the thread's accumulators acc[r][j], numbered i."""
        pairs = [(r, j) for r in range(ROW_TILES) for j in range(cute.size(acc[r]))]
        return [(r, j, i) for i, (r, j) in enumerate(pairs)]

    @cute.jit
    def first_slot(self, w_lo, strip, plan) -> Int32:
        """The slot of a split strip's first worker: w_lo wrote slot 2 w_lo if its run starts
        at this strip, else 2 w_lo + 1 (its last strip); every later worker starts here and
        wrote slot 2 w (``strip_slot``)."""
        units, workers, k_tiles = plan
        starts_here = run_start(w_lo, units, workers, self.WIDE_RUNS) >= strip * k_tiles
        return 2 * w_lo + 1 - Int32(starts_here)

    @cute.jit
    def skew_unit(self, units, workers) -> Int32:
        """The crossing variants' shift per q (n - q) (``skew_shift``), in 1/65536 K tiles:
        ``QUAD_SKEW`` / 2 x the mean run (``run_start``'s arithmetic, once); 0 without skew."""
        unit = Int32(0)
        if cutlass.const_expr(self.skew16 > 0):
            unit = run_start(self.skew16, units, workers, self.WIDE_RUNS)
        return unit

    @staticmethod
    def skew_shift(q, n, unit) -> Int32:
        """How many K tiles before its equal run's start quad q of a CTA's n (q = n: the next
        CTA's first) starts in the crossing variants: about skew / 2 x the mean run x q (n -
        q), so that quad q takes about 1 + skew (q - (n - 1) / 2) mean runs and the CTA's
        block of K tiles stays where it was (q = 0, n). Small next to a run (at most 0.12 of
        it at skew 0.02 and 7 quads), so each unit's worker is its equal run's or the next
        (``skewed_worker``)."""
        return (q * cutlass.max(n - q, 0) * unit + (1 << 15)) >> 16

    @cute.jit
    def skewed_run(self, worker, units, workers, per_cta, unit):
        """(First unit, end) of this warp's run in the crossing variants (its CTA's quad;
        ``unit``: ``skew_unit``'s)."""
        u_begin = run_start(worker, units, workers, self.WIDE_RUNS)
        u_end = run_start(worker + 1, units, workers, self.WIDE_RUNS)
        if cutlass.const_expr(self.skew16 > 0):
            cta, _, _ = cute.arch.block_idx()
            ctas, _, _ = cute.arch.grid_dim()
            quad = cute.arch.warp_idx() // WARPS
            n = cta_first(cta + 1, workers, ctas, per_cta) - cta_first(cta, workers, ctas, per_cta)
            u_begin = u_begin - self.skew_shift(quad, n, unit)
            u_end = u_end - self.skew_shift(quad + 1, n, unit)
        return u_begin, u_end

    @cute.jit
    def skewed_start(self, w, units, workers, per_cta, unit) -> Int32:
        """First unit of any worker w's run in the crossing variants (w = workers: units)."""
        u = run_start(w, units, workers, self.WIDE_RUNS)
        if cutlass.const_expr(self.skew16 > 0):
            ctas, _, _ = cute.arch.grid_dim()
            c = cta_of_worker(w, workers, ctas, per_cta)
            first = cta_first(c, workers, ctas, per_cta)
            n = cta_first(c + 1, workers, ctas, per_cta) - first
            u = u - self.skew_shift(w - first, n, unit)
        return u

    @cute.jit
    def skewed_worker(self, u, units, workers, per_cta, unit):
        """(The worker whose run holds unit u in the crossing variants, its run's first
        unit): the equal runs' worker w, or w + 1 where w + 1's run starts earlier."""
        w = worker_of(u, units, workers, self.WIDE_RUNS)
        start = self.skewed_start(w, units, workers, per_cta, unit)
        if cutlass.const_expr(self.skew16 > 0):
            next_start = self.skewed_start(w + 1, units, workers, per_cta, unit)
            if u >= next_start:
                w, start = w + 1, next_start
        return w, start

    @cute.jit
    def gather_owned_strips(self, worker, epi, mWs, wn, plan, groups):
        """The polled hand-over's sums: of the worker's first and last strip, those it owns
        (``strip_owner``). After all its strips, so that no K run waits and the K loop's
        registers are free for a round of loads (what it needs is re-derived from the
        kernel's arguments here, not kept across the loop). Every worker stored its
        partials before waiting for any, and an owner waits only for CTAs of lower index or
        its own: no wait can deadlock, even where the grid does not fit the GPU at once.
        ``epi``: (scale pointer, bias, out, has_bias); ``groups``: ``finish_cta_group``'s."""
        units, workers, k_tiles = plan
        pScale, mBias, mOut, has_bias = epi
        if cutlass.const_expr(self.crossing):
            self.gather_owned_crossing(worker, epi, mWs, wn, plan, groups[1])
            return
        wide = self.WIDE_RUNS
        first = run_start(worker, units, workers, wide) // k_tiles
        last = (run_start(worker + 1, units, workers, wide) - 1) // k_tiles
        if cutlass.const_expr(self.cta_groups):
            if groups[0] != 0:  # grouped: the run lies in one strip
                last = first
        for i in cutlass.range(1 + Int32(last != first), unroll=1):
            strip = first + i * (last - first)
            owns, first_slot, later = self.strip_owner(worker, strip, plan, groups)
            if owns:
                scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
                epi_strip = (scale, mBias, mOut, has_bias, strip)
                self.gather_strip(mWs, epi_strip, wn, first_slot, later)

    @cute.jit
    def gather_owned_crossing(self, worker, epi, mWs, wn, plan, per_cta):
        """``gather_owned_strips`` of the crossing variants: with consecutive workers per CTA
        a split strip's owner is w_hi, the worker that holds its last K tile (in the CTA of
        highest index, as ``handover_owner`` wants), which its own run tells; only owners look
        for the strip's first worker w_lo (``skewed_worker``). Cheaper than the per-strip
        inverses of ``strip_owner`` for every warp: the warps that finish early run this
        beside the others' K loops (2-5% on the crossing grids, session 36)."""
        units, workers, k_tiles = plan
        pScale, mBias, mOut, has_bias = epi
        unit = self.skew_unit(units, workers)
        u_begin, u_end = self.skewed_run(worker, units, workers, per_cta, unit)
        first = u_begin // k_tiles
        last = (u_end - 1) // k_tiles
        for i in cutlass.range(1 + Int32(last != first), unroll=1):
            strip = first + i * (last - first)
            s_lo = strip * k_tiles
            s_end = s_lo + k_tiles
            # holds the strip's last tile, and the run starts after its first: split
            if u_begin < s_end and u_end >= s_end and u_begin > s_lo:
                w_lo, lo_start = self.skewed_worker(s_lo, units, workers, per_cta, unit)
                # (``first_slot``: w_lo's slot 2 w_lo if its run starts in this strip)
                first_slot = 2 * w_lo + 1 - Int32(lo_start >= s_lo)
                scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
                epi_strip = (scale, mBias, mOut, has_bias, strip)
                self.gather_strip(mWs, epi_strip, wn, first_slot, worker - w_lo)

    @cute.jit
    def strip_owner(self, worker, strip, plan, groups):
        """(Whether ``worker`` sums split strip ``strip``, the slot of its part 0, the number
        of later parts). Per worker (``finish_strip``): the strip's worker in the CTA of
        highest index (``handover_owner``), over slots of workers w_lo .. w_hi (the crossing
        variants: ``gather_owned_crossing``). Per CTA
        (``cta_args``, ``finish_cta_group``): the group's leader in the strip's last CTA c,
        where the strip began in an earlier CTA c_lo, over slots of CTAs c_lo .. c: 2 c_lo + 1
        if the strip starts inside CTA c_lo, else 2 c_lo, then 2 c' of each later CTA c'."""
        units, workers, k_tiles = plan
        splits, per_cta, cta_start = groups
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        wide = self.WIDE_RUNS
        owns = Int32(0)
        first_slot = Int32(0)
        later = Int32(0)
        grouped = False
        if cutlass.const_expr(self.cta_groups):
            grouped = splits != 0
        if grouped:
            w_lo = strip * splits
            if w_lo < cta_start and worker == w_lo + splits - 1:
                c_lo = cta_of_worker(w_lo, workers, ctas, per_cta)
                owns = Int32(1)
                first_slot = 2 * c_lo + Int32(w_lo != cta_first(c_lo, workers, ctas, per_cta))
                later = cta - c_lo
        else:
            w_lo = worker_of(strip * k_tiles, units, workers, wide)
            w_hi = worker_of(strip * k_tiles + k_tiles - 1, units, workers, wide)
            if w_lo != w_hi and handover_owner(w_lo, w_hi, ctas) == worker:
                owns = Int32(1)
                first_slot = self.first_slot(w_lo, strip, plan)
                later = w_hi - w_lo
        return owns != 0, first_slot, later

    @staticmethod
    def strip_slot(first_slot, i):
        """The workspace slot of a split strip's part i (0: in ``first_slot``; the later ones
        start at the strip: slot 2 p). Parts are workers (``finish_strip``: 0 is w_lo, and p
        a worker) or CTAs (``finish_cta_group``: 0 is the strip's first CTA, p a CTA)."""
        return first_slot - (first_slot % 2) * Int32(i != 0) + 2 * i

    @cute.jit
    def gather_strip(self, mWs, epi, wn, first_slot, later):
        """The owner's sum of a split strip: lane c sums column c over the strip's parts in
        worker order (slots ``first_slot`` then ``later`` more, ``strip_slot``), and stores; in
        rounds of ``POLL_WORKERS`` slots, or ``POLL_WORKERS_FEW`` where that many hold them
        all."""
        few = POLL_WORKERS_FEW.get(self.m, 0)
        if cutlass.const_expr(few > 0):
            if later < few:
                self.gather_rounds(mWs, epi, wn, first_slot, later, few)
            else:
                self.gather_rounds(mWs, epi, wn, first_slot, later, POLL_WORKERS[self.m])
        else:
            self.gather_rounds(mWs, epi, wn, first_slot, later, POLL_WORKERS[self.m])

    @cute.jit
    def gather_rounds(self, mWs, epi, wn, first_slot, later, batch: cutlass.Constexpr[int]):
        """``gather_strip`` in rounds of ``batch`` slots: a round loads ``batch`` parts'
        slots at once and reloads the empty ones together until none is left
        (``load_slots``; between reloads it polls one word per slot, ``await_probes``): one
        L2 round trip per round when the others are done, about two after the last of them
        when not. Then it empties them."""
        lane = cute.arch.lane_idx()
        c = wn * WARP_COLS + lane
        words = cute.recast_ptr(mWs.iterator, dtype=Int32)
        v = [Float32(0.0) for _ in range(self.m)]
        parts = cute.make_rmem_tensor((batch * self.m,), Int32)
        for b0 in cutlass.range(0, later + 1, batch, unroll=1):
            pending = self.load_slots(parts, words, mWs.layout, c, first_slot, b0, later, True)
            while cute.arch.vote_any_sync(pending != 0):
                self.await_probes(words, mWs.layout, wn, first_slot, b0, later, batch)
                pending = self.load_slots(parts, words, mWs.layout, c, first_slot, b0, later, False)
            for j in cutlass.range_constexpr(batch):
                if b0 + j <= later:
                    slot = self.strip_slot(first_slot, b0 + j)
                    for m in cutlass.range_constexpr(self.m):
                        v[m] = v[m] + bits_to_f32(parts[j * self.m + m])
                    empty_slot_words(words + cute.crd2idx((c, 0, slot), mWs.layout), self.m)
        self.store_columns(v, epi, wn)

    @cute.jit
    def await_probes(self, words, layout, wn, first_slot, b0, later, batch):
        """Wait until each slot of a round (workers b0 .. b0 + batch - 1, up to ``later``)
        holds its probe word (the warp's column 0, row 0): lane j polls worker b0 + j's.
        One word per slot and poll: polling every word of a round, the owners that finish
        first loaded more from L2 than the K loops did (M = 4: 3% slower at 8192x28672)."""
        lane = cute.arch.lane_idx()
        ptr = words + cute.crd2idx(
            (wn * WARP_COLS, 0, self.strip_slot(first_slot, b0 + lane)), layout
        )
        polls = lane < batch and b0 + lane <= later
        probe = Int32(0)
        if polls:
            probe = load_slot(ptr)
        while cute.arch.vote_any_sync(probe == Int32(EMPTY_SLOT)):
            nanosleep(SLOT_POLL_NS)
            if polls:
                probe = load_slot(ptr)

    @cute.jit
    def load_slots(self, parts, words, layout, c, first_slot, b0, later,
                   first: cutlass.Constexpr[bool]) -> Int32:  # fmt: skip
        """One polling pass over a round's slots (parts b0 .. b0 + batch - 1 of the strip,
        up to ``later``): loads every word (``first``: and zeroes the rest of
        ``parts``), else reloads the empty ones. Returns nonzero while one is empty."""
        batch = cute.size(parts) // self.m
        pending = Int32(0)
        for j in cutlass.range_constexpr(batch):
            slot = self.strip_slot(first_slot, b0 + j)
            real = b0 + j <= later
            run = [j * self.m + r for r in range(self.m)]  # the slot column's m adjacent words
            if cutlass.const_expr(first):
                for i in run:
                    parts[i] = Int32(0)
            empty = Int32(1)  # the first pass loads every slot
            if cutlass.const_expr(not first):
                empty = Int32(0)
                for i in run:
                    empty = empty | Int32(parts[i] == Int32(EMPTY_SLOT))
            if real and empty != 0:
                got = load_slot_words(words + cute.crd2idx((c, 0, slot), layout), self.m)
                for i, x in zip(run, got, strict=True):
                    parts[i] = x
            for i in run:
                pending = pending | Int32(parts[i] == Int32(EMPTY_SLOT))
        return pending

    def slot_runs(self, acc, t) -> list:
        """``outputs`` as [(values, first row, column)] runs of adjacent words of the polled
        hand-over's slots (a column's rows together): the C fragment's row pairs (2t, 2t + 1)
        where m holds both (even m, not ``split_blocks``: one 8-byte store instead of two,
        M = 2, 4 1-2% faster), else single rows."""
        outs = self.outputs(acc, t)
        if self.split_blocks or self.m == 1:
            return [([v], m, col) for v, m, col in outs]
        pairs = zip(outs[0::2], outs[1::2], strict=True)
        return [([v0, v1], m, col) for (v0, m, col), (v1, _, _) in pairs]

    def outputs(self, acc, t) -> list:
        """[(value, activation row, column - g of the warp's 32)] of the thread's
        accumulators. The C fragment: acc[r][i] is column 16 r + 8 (i // 2) + g, row
        2 t + i % 2; with ``split_blocks`` acc[r][h] is column 16 r + 8 h + g, row t."""
        if self.split_blocks:
            return [(acc[r][h], t, 16 * r + 8 * h) for r in range(ROW_TILES) for h in range(2)]
        return [
            (acc[r][i], 2 * t + i % 2, 16 * r + 8 * (i // 2))
            for r in range(ROW_TILES)
            for i in range(4)
        ]

    @cute.jit
    def store_fragment(self, acc, epi, wn, t):
        """Store the warp's whole-K accumulators: column tile nt of the output."""
        scale, mBias, mOut, has_bias, nt = epi
        in_tile0 = wn * WARP_COLS + cute.arch.lane_idx() // 4
        for v, m, col in self.outputs(acc, t):
            if m < self.m:
                self.store(v, scale, mBias, mOut, has_bias, m, nt * TILE_N + in_tile0 + col)

    @cute.jit
    def store_columns(self, v, epi, wn):
        """Store the reduced sums v[m] of the lane's column of the warp's 32."""
        scale, mBias, mOut, has_bias, nt = epi
        c = wn * WARP_COLS + cute.arch.lane_idx()
        for m in cutlass.range_constexpr(self.m):
            self.store(v[m], scale, mBias, mOut, has_bias, m, nt * TILE_N + c)

    @cute.jit
    def reduce_strip(self, mWs, epi, wn, first_slot, later):
        """Lane c sums column c of the strip over the partial slots (``first_slot``, then
        ``later`` more, 2 apart), in worker order, all m rows at once: each round of loads
        is one L2 round trip for ``batch`` workers, coalesced across the warp (row-major
        slots on this path: ``strip_workspace``)."""
        lane = cute.arch.lane_idx()
        c = wn * WARP_COLS + lane
        batch = max(2, REDUCE_LOADS // self.m)
        v = [
            cute.arch.load(mWs.iterator + cute.crd2idx((c, m, first_slot), mWs.layout),
                           Float32, cop="cg")
            for m in range(self.m)
        ]  # fmt: skip
        for b0 in cutlass.range(0, later, batch, unroll=1):
            parts = []
            for j in cutlass.range_constexpr(batch):
                slot = first_slot - first_slot % 2 + 2 * (b0 + j + 1)
                for m in cutlass.range_constexpr(self.m):
                    x = Float32(0.0)
                    if b0 + j < later:
                        ptr = mWs.iterator + cute.crd2idx((c, m, slot), mWs.layout)
                        x = cute.arch.load(ptr, Float32, cop="cg")
                    parts.append(x)
            for j in cutlass.range_constexpr(batch):
                for m in cutlass.range_constexpr(self.m):
                    v[m] = v[m] + parts[j * self.m + m]  # + 0.0 past the last worker
        self.store_columns(v, epi, wn)

    @cute.jit
    def store(self, v, scale, mBias, mOut, has_bias, m, n):
        """out[m, n] = v * scale (+ bias[n]) in the output dtype, inside the true (M, N)."""
        M, N = mOut.shape
        if m < M and n < N:
            r = v * scale
            if has_bias != 0:
                r = r + Float32(mBias[n])
            mOut[m, n] = self.dtype(r)


def _role_steps(fields, lookup: str) -> list:
    """``row_roles``: a column's two mma steps from its row tile's ``fields``, as [(A
    sources, B's K pairs)]: the sources (fields word index, byte of the column's first: 0
    or 1, half of a quad entry: 0 / 1, or None for a pair entry) of the fragment's a0..a3
    = (row g, K slots pair 0), (row g + 8, pair 0), (row g, pair 1), (row g + 8, pair 1);
    B's K pairs are role 0's positions of slot pairs 0 and 1 (row g + 8 takes them shifted
    by ``ROLE_RUNS``' shift: role 1)."""
    shift, runs = ROLE_RUNS[lookup]
    role0 = [e for first, n in runs for e in range(first, first + n)]

    def pair(elems, f):  # the K positions of fields f, f + 1 (role 0's), checked
        a, b = elems[f], elems[f + 1]
        assert a in role0 and b in role0, (a, b)
        return a, b

    steps = []
    if lookup == "quad_table":  # a fields word a step: bytes 0, 1, each an entry
        for w, (_, elems) in enumerate(fields):
            ks = []
            for byte in (0, 1):
                ks.append(pair(elems, 4 * byte))
                assert elems[4 * byte + 2 : 4 * byte + 4] == [e + shift for e in ks[-1]]
            steps.append(([(w, byte, half) for byte in (0, 1) for half in (0, 1)], ks))
    else:  # pair table: two fields words a step, each byte 0 (role 0) and 1 (role 1)
        for w in range(0, len(fields), 2):
            ks = []
            for v in (w, w + 1):
                elems = fields[v][1]
                ks.append(pair(elems, 0))
                assert elems[2:4] == [e + shift for e in ks[-1]]
            steps.append(([(v, byte, None) for v in (w, w + 1) for byte in (0, 1)], ks))
    assert len(steps) == THREAD_K // 8
    return steps


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
    quads: int | None = None, cta_groups: bool = False, crossing: bool = False,
    row_sets: bool = False,
):  # fmt: skip
    """The compiled variant of ``GemvKernel`` for bits ``k``, rows bucket ``m``, dtype name
    (``stages``, ``lookup``, ``quads``: override the defaults, for tuning; ``cta_groups``:
    the variant with CTA groups; ``crossing``: for runs that cross strips; ``row_sets``:
    for M > m in sets of m rows)."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32), fake_ptr(cutlass.Float32, 4), fake_ptr(dt, 2),
            fake_ptr(dt, 2), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
            Int32(1), Int32(1), Int32(32), Int32(1), Int32(1), Int32(1), Int32(0), Int32(0),
            fake_stream(),
        )  # fmt: skip
        kernel = GemvKernel(k, m, dt, stages, lookup, quads, cta_groups=cta_groups,
                            crossing=crossing, row_sets=row_sets)  # fmt: skip
        return kernel, args

    suffix = (f"_s{stages}" if stages else "") + (f"_{lookup}" if lookup else "")
    suffix += (f"_q{quads}" if quads else "") + ("_g" if cta_groups else "")
    suffix += ("_x" if crossing else "") + ("_r" if row_sets else "")
    return KernelSpec(f"gemv_k{k}_m{m}_{dtype}{suffix}", build, expect=("LDGSTS", "HMMA"))


def gemv_lookup(k: int, N: int, K: int) -> str | None:
    """The lookup of the GEMV variant for a weight [N, K]: None (the default) or, for a
    weight under ``SMALL_WEIGHT`` elements, ``SMALL_WEIGHT_LOOKUP``'s where it differs from
    the target's default (sm_80's k = 5 default is the shuffles already)."""
    lookup = SMALL_WEIGHT_LOOKUP.get(k) if N * K < SMALL_WEIGHT else None
    return None if lookup == default_lookup(k) else lookup


def default_lookup(k: int) -> str:
    """The GEMV's lookup for k on the compile target (sm_80: k = 5's 128 KB table would
    leave an SM one quad of warps, so the shuffles)."""
    return (GEMV_LOOKUP_SM80 if target_arch_family() == "sm_80" else GEMV_LOOKUP)[k]


def _more_quads_stages(k: int, m: int) -> tuple[int, ...]:
    """k = 5's shallower ring where ``ops.gemv_variant`` may take it (rows buckets)."""
    return (MORE_QUADS_STAGES[k],) if k in MORE_QUADS_STAGES and m in MORE_QUADS_M else ()


def _deep_ring_stages(k: int, m: int, sm90: bool) -> tuple[int, ...]:
    """k = 4's deeper ring where ``ops.gemv_variant`` may take it (sm_90, rows buckets)."""
    return (DEEP_RING_STAGES[k],) if sm90 and k in DEEP_RING_STAGES and m in DEEP_RING_M else ()


def specs(arch: str | None = None):
    """The GEMV variants the library ships on ``arch`` (default: the compile target)."""
    from ..compile import target_arch

    sm90 = (arch or target_arch()).startswith("sm_9")
    return (
        [gemv_spec(k, m, d) for k in (2, 3, 4, 5) for m in M_BUCKETS for d in _DTYPES]
        + [
            gemv_spec(k, m, d, lookup=lk)
            for k, lk in SMALL_WEIGHT_LOOKUP.items()
            for m in M_BUCKETS
            for d in _DTYPES
        ]
        + [
            gemv_spec(k, m, d, st)
            for k, st in MORE_QUADS_STAGES.items()
            for m in MORE_QUADS_M
            for d in _DTYPES
        ]
        + [  # k = 4's deeper ring on few, short runs (sm_90)
            gemv_spec(k, m, d, st)
            for k, st in DEEP_RING_STAGES.items()
            for m in DEEP_RING_M
            for d in _DTYPES
            if sm90
        ]
        + [  # CTA groups: the default lookup's (large weights), ring depths as above
            gemv_spec(k, m, d, st, cta_groups=True)
            for k in (2, 3, 4, 5)
            for m in M_BUCKETS
            if m >= GemvKernel.CTA_GROUPS_FROM_M
            for st in (None, *_more_quads_stages(k, m), *_deep_ring_stages(k, m, sm90))
            for d in _DTYPES
        ]
        + [  # runs across strips: what ``ops.even_workers`` gives (M = 1, sm_90; k = 4 on
            # devices of fast memory, ``ops.has_fast_memory``), ring depths as above
            gemv_spec(k, 1, d, st, crossing=True)
            for k in (2, 3, 4, 5)
            for st in (None, *_more_quads_stages(k, 1), *_deep_ring_stages(k, 1, sm90))
            for d in _DTYPES
            if sm90
        ]
        + [  # row sets (M = 9..64 on small weights, ``ops.gemv_max_m``): every lookup and
            # ring depth the m = 8 bucket takes, with and without CTA groups
            gemv_spec(k, GemvKernel.ROW_SETS_M, d, st, lk, cta_groups=groups, row_sets=True)
            for k in (2, 3, 4, 5)
            for lk, st in (
                (None, None),
                *([(SMALL_WEIGHT_LOOKUP[k], None)] if k in SMALL_WEIGHT_LOOKUP else []),
                *((None, st) for st in _more_quads_stages(k, GemvKernel.ROW_SETS_M)),
            )
            for groups in (False, True)
            if not (groups and lk is not None)
            for d in _DTYPES
        ]
    )
