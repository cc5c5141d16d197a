"""GEMM for M >= 5 (``kbit_cute.gemm`` sends it M > ``ops.gemv_max_m``) with mma.sync:
out[M, N] = A[M, K] @ W^T, W in the tiled kbit format. (``gemm_wgmma.WgmmaGemmKernel``: the
same kernel on Hopper's warpgroup MMA, config suffix "g".)

Mainloop (after the CUTLASS Ampere multistage GEMM, tensorop_gemm.py) over a stream-K
schedule: the (TILE_M x TILE_N output tile, TILE_K slice of K) units are split into equal
runs, one per CTA; a run is the end of one tile's K, whole tiles, and the start of another's.

* A and B tiles go global -> shared with 16-byte ``cp.async`` into a ring of ``stages``
  buffers (``commit_group`` / ``wait_group(stages - 2)``). A is swizzled for
  conflict-free ``ldmatrix``; B is the repack tiles copied verbatim ([col][kb][bit] words
  plus the absmax bytes), so a B stage costs k/8 + 1/32 bytes per weight of shared memory.
* A fragments come from ``ldmatrix.x4``; B fragments are made in registers: a thread of the
  m16n8k16 MMA owns column n = lane/4 and the K pairs (2t, 2t+1) + 8c (t = lane%4,
  c = 0..3) of each 32-weight block, so it reads the block's k plane words once and
  dequantizes exactly its 8 weights: every weight is dequantized once per CTA (warps
  tile N only, unless ``warps_m`` > 1 is asked for large tiles).
* Dequant per thread and block (k words -> 4 fp16/bf16 pairs = 4 B registers, 2k + 12
  instructions for 8 weights): one funnel rotate and one LOP3 per plane gather the bits
  of the 4 pairs, one PRMT per pair turns them into a byte offset (``pair_offsets``) into a
  shared table of 2^(2k) packed codebook pairs (one LDS gives both halves of a B register),
  and one HFMA2 applies the block's absmax, made from its E4M4 byte by one IMAD
  (``absmax_x2``). The table is compact (random lookups conflict: ~2 wavefronts per LDS
  at k = 4, measured), or one copy per lane (conflict-free): ``GemmConfig.table`` "lane"
  (32x the memory, one LEA more per lookup), "row" (64x, k <= 4, the
  PRMT makes the lane's address: ``pair_row_offsets``) or "half" (k = 4: the lane table's
  32x, addressed by the PRMT for two LOP3 per 8 weights more than "row":
  ``pair_half_offsets``); the dispatch table picks by measurement.
* Software pipelining: the next 32-weight block's B registers are dequantized while the
  current block's MMAs run (its plane words and absmax read from shared memory one block
  ahead), A fragments are loaded one k16 step ahead, and the next stage is waited for on
  the last k16 step of the current one, as in the CUTLASS multistage mainloop.
* Epilogue: fp32 accumulators x per-tensor scale (+ bias) -> shared memory -> 16-byte
  coalesced stores. Where runs meet in a tile, every CTA writes its fragment (thread-major,
  coalesced) to a workspace slot and counts itself in on the tile's counter; the last CTA
  sums the partials in worker order (``deterministic``: bit-identical run to run), or, in
  atomic mode, all CTAs ``red.add`` into a zeroed workspace that the last one reads and
  re-zeroes. Counters are reset by the last CTA too: no memset is ever needed between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.memory import SmemAllocator

from ..format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N
from .device_helpers import (
    CODEBOOK_FACTOR,
    absmax_x2,
    cta_sync,
    g2s_copy_atom,
    half_entry_pair,
    mul_x2,
    pair_half_offsets,
    pair_offsets,
    pair_row_offsets,
    prmt,
    run_start,
    smem_per_sm,
    split_k_arrive,
    target_arch_family,
    wait_previous_kernel,
    worker_of,
)

# Repack tile sizes, in the units the kernel copies.
_TILE_WORDS_PER_K = TILE_N * BLOCKS_PER_TILE_K  # int32 words of one repack tile, per bit
_TILE_ABSMAX = TILE_N * BLOCKS_PER_TILE_K  # absmax bytes of one repack tile
_CHUNK = 16  # bytes per cp.async
# Dequantized weight tiles of a specialized kernel's ring (``gemm_ws``): the producers run
# up to two K slices ahead of the wgmmas.
WEIGHT_TILES = 2
_C_PAD = 8  # elements of padding per epilogue row: rows start 4 banks apart (no conflicts)
_LANES = 32  # copies of a lane-replicated pair table: entry p of lane l at p * 128 + l * 4
_ROW_BYTES = 256  # row of a row table: entry p of lane l at p * 256 + l * 4
_REDUCE_FLOATS = 64  # partial values a thread loads per round of the ordered reduction
_BOUNDED_REGS = 168  # registers per thread of 3 CTAs of 128 threads (min_ctas_per_sm)
PRODUCER_THREADS = 128  # the copy-producer warpgroup of a "c" config


# ----------------------------------------------------------------------------- config

TABLE_LAYOUTS = ("compact", "lane", "row", "half")
_TABLE_SUFFIX = {"compact": "", "lane": "l", "row": "r", "half": "h"}  # in the config name
_TABLE_OF_SUFFIX = {suffix: layout for layout, suffix in _TABLE_SUFFIX.items()}


@dataclass(frozen=True)
class GemmConfig:
    """Compile-time tiling of ``GemmKernel``; ``name`` encodes it (it keys the caches)."""

    tile_m: int = 16
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    warps_m: int = 1
    warps_n: int = 4
    # Layout of the shared-memory pair table (measurement decides per (k, M bucket),
    # perf/bench_gemm.py), one of TABLE_LAYOUTS:
    # "compact": one copy; a warp's 32 lookups conflict (~2 wavefronts per LDS at k = 4).
    # "lane" (name suffix "l"): one copy per lane, conflict-free, for 32x the table's memory
    #   and one LEA per lookup.
    # "row" (suffix "r", k <= 4): one copy per lane in rows of 256 bytes: entry p of lane l
    #   at 256 p + 4 l, which the pair's PRMT assembles from the index byte and the lane
    #   byte (``pair_row_offsets``), so the lane costs no instruction (the lane table's LEA
    #   is one in ~9 of the mainloop's). Twice the lane table's memory (half of each row
    #   unused).
    # "half" (suffix "h", k = 4): the lane table's memory and conflict-free copies, addressed
    #   by the PRMT as in a row table, with one index bit beside the lane's byte
    #   (``pair_half_offsets``: two LOP3 per 8 weights more than "row", 3 fewer than "lane"),
    #   so that 3 CTAs of M tile 16 fit an SM where the row table's 64 KB allow 2.
    table: str = "compact"
    # Warpgroup MMA (name suffix "g", sm_90a: ``gemm_wgmma.WgmmaGemmKernel``): the
    # dequantized weights are wgmma's register operand, the activations its shared-memory
    # operand; warps_n / 4 warpgroups of 64-column m tiles.
    wgmma: bool = False
    # Warp-specialized wgmma (suffix "p" after "g", ``gemm_ws.WsGemmKernel``): producer
    # warps (as many as the MMA's per 32-weight block of a K slice) copy and dequantize the
    # weight into shared-memory fp16 tiles; the MMA warpgroups read both operands there.
    specialized: bool = False
    # Copy-producer wgmma (suffix "c" after "g", ``gemm_wgmma_producer``): one extra
    # warpgroup only copies the ring (cp.async onto mbarriers); the MMA warpgroups
    # dequantize in registers as "g" does, without a CTA barrier per K slice.
    producer: bool = False

    @property
    def lane_table(self) -> bool:
        return self.table == "lane"

    @property
    def row_table(self) -> bool:
        return self.table == "row"

    @property
    def half_table(self) -> bool:
        return self.table == "half"

    @property
    def copy_per_lane(self) -> bool:
        """Whether the pair table holds one copy per lane (lane or row layout)."""
        return self.table != "compact"

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def block_threads(self) -> int:
        """Threads of a CTA: the MMA threads, plus the copy producer's warpgroup ("c",
        ``gemm_wgmma_producer``) or, where specialized, as many producers per 32-weight block
        of a K slice (``gemm_ws``)."""
        if self.producer:
            return self.threads + PRODUCER_THREADS
        return self.threads * (1 + self.tile_k // 32 if self.specialized else 1)

    @property
    def copy_threads(self) -> int:
        """Threads that issue the ring's copies: the producer warpgroup, or the MMA threads."""
        return PRODUCER_THREADS if self.producer else self.threads

    @property
    def name(self) -> str:
        return (
            f"m{self.tile_m}n{self.tile_n}k{self.tile_k}s{self.stages}"
            f"w{self.warps_m}x{self.warps_n}"
            + _TABLE_SUFFIX.get(self.table, "?")
            + ("g" if self.wgmma else "")
            + ("p" if self.specialized else "")
            + ("c" if self.producer else "")
        )

    @staticmethod
    def parse(name: str) -> GemmConfig:
        """Inverse of ``name`` (the dispatch table stores names)."""
        import re

        m = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)x(\d+)([lrh]?)(g?)([pc]?)", name)
        if m is None:
            raise ValueError(f"not a GEMM config name: {name!r}")
        return GemmConfig(
            *(int(x) for x in m.groups()[:-3]),
            table=_TABLE_OF_SUFFIX[m.group(7)],
            wgmma=m.group(8) == "g",
            specialized=m.group(9) == "p",
            producer=m.group(9) == "c",
        )

    def problems(self) -> list[str]:
        """Why this config cannot be compiled (empty when it can)."""
        out = []
        if self.wgmma:
            # wgmma's N is the M tile (8..256); a warpgroup owns 64-column m tiles.
            if self.tile_m not in (16, 32, 64, 128, 256):
                out.append(f"tile_m must be 16, 32, 64, 128 or 256, got {self.tile_m}")
            if self.warps_m != 1 or self.warps_n not in (4, 8):
                out.append(
                    f"wgmma takes 1 or 2 warpgroups along N (w1x4, w1x8), got "
                    f"w{self.warps_m}x{self.warps_n}"
                )
            elif self.tile_n % (16 * self.warps_n):
                out.append(f"tile_n={self.tile_n} is not a multiple of 64 per warpgroup")
        elif self.tile_m not in (16, 32, 64, 128):
            out.append(f"tile_m must be 16, 32, 64 or 128, got {self.tile_m}")
        if self.tile_n not in (128, 256):
            out.append(f"tile_n must be 128 or 256, got {self.tile_n}")
        if self.tile_k not in (64, 128):
            out.append(f"tile_k must be 64 or 128, got {self.tile_k}")
        if not 3 <= self.stages <= 8:
            out.append(f"stages must be 3..8, got {self.stages}")
        if self.warps_m < 1 or self.tile_m % (16 * self.warps_m):
            out.append(f"tile_m={self.tile_m} is not a multiple of 16 * warps_m={self.warps_m}")
        if self.warps_n not in (1, 2, 4, 8, 16) or self.tile_n % (8 * self.warps_n):
            out.append(f"warps_n={self.warps_n} must be a power of two <= 16 dividing tile_n/8")
        if self.block_threads > (1024 if self.specialized else 512):
            out.append(f"{self.block_threads} threads per CTA; at most 512 (specialized 1024)")
        if self.specialized:
            if not self.wgmma:
                out.append("warp specialization (p) needs the warpgroup MMA (g)")
            if self.stages < 4:
                # the copies run stages - 2 slices ahead
                out.append(f"a specialized ring takes 4 stages or more, got {self.stages}")
        if self.producer and not self.wgmma:
            out.append("a copy producer (c) needs the warpgroup MMA (g)")
        if self.table not in TABLE_LAYOUTS:
            out.append(f"table must be one of {TABLE_LAYOUTS}, got {self.table!r}")
        if self.copy_threads < self.tile_k:
            # A copy passes must advance whole 8-row swizzle atoms.
            out.append(f"{self.copy_threads} threads cannot copy A rows of tile_k={self.tile_k}")
        return out

    def smem_bytes(self, k: int) -> int:
        """Dynamic shared memory of a CTA: pipeline (or the epilogue tile) + pair table."""
        return _smem_plan(self, k)["total"]


def _smem_plan(cfg: GemmConfig, k: int) -> dict:
    """Byte offsets of the shared-memory regions (Python ints, fixed at trace time)."""
    rtiles = (cfg.tile_k // TILE_K) * (cfg.tile_n // TILE_N)
    a_stage = cfg.tile_m * cfg.tile_k * 2
    w_stage = rtiles * _TILE_WORDS_PER_K * k * 4
    s_stage = rtiles * _TILE_ABSMAX
    # A specialized kernel's two dequantized weight tiles (wgmma's shared operand,
    # 128-byte swizzled: 1 KB aligned).
    h_stage = cfg.tile_n * cfg.tile_k * 2 if cfg.specialized else 0
    h = -(-cfg.stages * (a_stage + w_stage + s_stage) // 1024) * 1024
    pipe = cfg.stages * (a_stage + w_stage + s_stage)
    if cfg.specialized:
        pipe = h + WEIGHT_TILES * h_stage
    epi = cfg.tile_m * (cfg.tile_n + _C_PAD) * 2
    union = -(-max(pipe, epi) // 1024) * 1024
    table = (4 << (2 * k)) * (_LANES if cfg.lane_table or cfg.half_table else 1)
    if cfg.row_table:
        table = _ROW_BYTES << (2 * k)
    return dict(
        a=0,
        w=cfg.stages * a_stage,
        s=cfg.stages * (a_stage + w_stage),
        h=h,
        a_stage=a_stage,
        w_stage=w_stage,
        s_stage=s_stage,
        h_stage=h_stage,
        union=union,
        table=union,
        table_bytes=table,
        flag=union + table,
        # a copy producer's full and empty mbarriers, one each per stage (8 bytes each)
        bars=union + table + 16,
        total=union + table + 16 + (16 * cfg.stages if cfg.producer else 0),
    )


# ----------------------------------------------------------------------------- kernel


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}


class GemmKernel:
    """mma.sync GEMM over a kbit weight. Compile-time config: ``k``, dtype name, ``GemmConfig``."""

    def __init__(self, k: int, dtype: str, config: GemmConfig):
        problems = GemmKernel.problems(k, dtype, config)
        if problems:
            raise ValueError(f"GemmKernel(k={k}, {dtype}, {config.name}): " + "; ".join(problems))
        self.k, self.dtype_name, self.cfg = k, dtype, config
        self.dtype = _DTYPES[dtype]
        self.threads = config.threads
        self.plan = _smem_plan(config, k)
        # Static tiling numbers used while tracing.
        self.rk_n = config.tile_k // TILE_K  # repack k-tiles per CTA k-slice
        self.rn_n = config.tile_n // TILE_N  # repack n-tiles per CTA tile
        self.ks = config.tile_k // 16  # k16 MMA steps per k-slice
        self.nj = config.tile_n // (8 * config.warps_n)  # n8 MMA tiles per warp (reps)
        self.tile_words = _TILE_WORDS_PER_K * k  # int32 words of one repack tile
        # Programmatic dependent launch (sm_90): the launch is set up while the kernel
        # before runs; the next one comes in as this one exits. Measured (H100, k = 2, 4,
        # M = 16..64, three shapes): 2.6% faster than without (every point 0-5%); letting
        # the next in right after the wait was 1.7% (two points 10-17% slower: its waiting
        # CTAs held SM slots of this grid's last wave).
        self.pdl = target_arch_family() == "sm_90"

    def min_ctas_per_sm(self) -> int:
        """``min_blocks_per_mp`` of the launch (0: the compiler's choice). Warp tiles of 64
        rows (m64 w1x4) took 165-203 registers depending on unrelated code, i.e. 2 or 3
        CTAs per SM (8192x28672 M = 256 k = 4: 505 us at 199, 434 at 168): they are bounded
        at 168 for 3 CTAs where shared memory holds 3 (no spills on sm_90; sm_80, measured
        nowhere, spilled at k = 3 and keeps the compiler's choice)."""
        if self.cfg.tile_m // self.cfg.warps_m < 64 or target_arch_family() != "sm_90":
            return 0
        by_smem = smem_per_sm() // (self.plan["total"] + 1024)
        ctas = min(by_smem, 65536 // (self.threads * _BOUNDED_REGS))
        return ctas if ctas > 1 else 0

    @staticmethod
    def problems(k: int, dtype: str, config: GemmConfig) -> list[str]:
        out = list(config.problems())
        if k not in (2, 3, 4, 5):
            out.append(f"k must be 2..5, got {k}")
        if dtype not in _DTYPES:
            out.append(f"dtype must be 'f16' or 'bf16', got {dtype!r}")
        if config.row_table and k > 4:
            out.append(f"a row table needs 2k <= 8 index bits, k={k}")
        if config.half_table and k != 4:
            out.append(f"a half-row table is for k = 4 (k < 4: the row table is small), k={k}")
        return out

    @staticmethod
    def can_implement(k: int, dtype: str, config: GemmConfig, smem_limit: int = 227 * 1024):
        """True when the variant compiles and its shared memory fits ``smem_limit`` bytes
        (227 KB on sm_90, 163 KB on sm_80)."""
        return not GemmKernel.problems(k, dtype, config) and config.smem_bytes(k) <= smem_limit

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (M, K) row-major, dtype, 16-byte aligned
        pPacked: cute.Pointer,  # int32 tiled words
        pAbsmax: cute.Pointer,  # uint8 tiled absmax
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (1,) per-tensor scale
        pBias: cute.Pointer,  # (N,) dtype; read only if has_bias
        pOut: cute.Pointer,  # (M, N) row-major, dtype, 16-byte aligned
        pWorkspace: cute.Pointer,  # fp32: partials (ordered) or zeroed sums (atomic)
        pCounters: cute.Pointer,  # int32 (m tiles * n tiles,), zero; left zero
        M: Int32,
        N: Int32,
        K: Int32,  # a multiple of 32
        workers: Int32,  # CTAs of the stream-K schedule, <= its units (host: plan_workers)
        run_gcd: Int32,  # gcd(units, workers): the run arithmetic uses the reduced fraction
        has_bias: Int32,
        atomic: Int32,  # 0: ordered split-K reduction (deterministic), 1: red.add
        stream: cuda.CUstream,
    ):
        K = cute.assume(K, divby=BLOCK)
        self.kernel(
            pA, pPacked, pAbsmax, pCodebook, pScale, pBias, pOut, pWorkspace, pCounters,
            M, N, K, workers, run_gcd, has_bias, atomic,
        ).launch(
            grid=[workers, 1, 1], block=[self.cfg.block_threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_ctas_per_sm(), preferred_smem_carveout=-1,
            use_pdl=self.pdl,
        )  # fmt: skip

    # ------------------------------------------------------------------------- device

    @cute.kernel
    def kernel(
        self,
        pA: cute.Pointer,
        pPacked: cute.Pointer,
        pAbsmax: cute.Pointer,
        pCodebook: cute.Pointer,
        pScale: cute.Pointer,
        pBias: cute.Pointer,
        pOut: cute.Pointer,
        pWorkspace: cute.Pointer,
        pCounters: cute.Pointer,
        M: Int32,
        N: Int32,
        K: Int32,
        workers: Int32,
        run_gcd: Int32,
        has_bias: Int32,
        atomic: Int32,
    ):
        worker, _, _ = cute.arch.block_idx()
        # A, the codebook and the split-K scratch may be the kernel before's outputs.
        wait_previous_kernel(self.pdl)
        # Stream-K: the (output tile, K slice) units, K slices fastest and output tiles m
        # fastest (the CTAs that share a weight tile run together: one HBM read), are split
        # into ``workers`` equal runs, one per CTA. A run covers the end of one tile, whole
        # tiles, and the start of another; the workers that meet in a tile hand over
        # through the split-K workspace (``epilogue``). Every SM gets the same work, where
        # a grid of whole tiles leaves the last wave partly empty.
        run = self.stream_k_run(M, N, K, worker, workers, run_gcd)
        base_u8 = self.allocate_tile_smem(SmemAllocator())
        self.run_tiles(
            base_u8, run, pA, pPacked, pAbsmax, pCodebook, pScale, pBias, pOut, pWorkspace,
            pCounters, M, N, K, has_bias, atomic,
        )  # fmt: skip

    @cute.jit
    def run_tiles(
        self, base_u8, run, pA, pPacked, pAbsmax, pCodebook, pScale, pBias, pOut, pWorkspace,
        pCounters, M, N, K, has_bias, atomic,
    ):  # fmt: skip
        """The worker's run (``stream_k_run``) tile by tile in the shared memory at
        ``base_u8``: the pair table, then ``tile`` for each (a subclass may split the CTA
        into roles here: ``gemm_wgmma_producer``)."""
        self.build_pair_table(pCodebook, base_u8 + self.plan["table"])
        for t in cutlass.range(run[0], run[1], unroll=1):
            m_cta, n_cta, kt_begin, kt_end, handover = self.tile_work(t, run)
            self.tile(
                base_u8, pA, pPacked, pAbsmax, pScale, pBias, pOut, pWorkspace, pCounters,
                M, N, K, has_bias, atomic, m_cta, n_cta, t, kt_begin, kt_end, handover,
            )  # fmt: skip
            # The next tile's prologue refills the union this epilogue read from. (Not
            # before the first tile: its copies would wait for the pair table's codebook
            # loads; 2048x10240 M = 16, 4 K slices per CTA: 10% slower.)
            cute.arch.sync_threads()

    @cute.jit
    def stream_k_run(self, M, N, K, worker, workers, run_gcd):
        """This worker's run of the stream-K schedule (``kernel``): (first tile, last tile
        + 1, then what ``tile_work`` needs: worker, first unit, end unit, units_r,
        workers_r, K slices per tile, m tiles)."""
        cfg = self.cfg
        m_ctas = (M + cfg.tile_m - 1) // cfg.tile_m
        k_iters = (K + cfg.tile_k - 1) // cfg.tile_k
        units = m_ctas * ((N + cfg.tile_n - 1) // cfg.tile_n) * k_iters
        # Run bounds from units / workers reduced by their gcd: 32-bit products (the host
        # checks) even for split-K grids of whole tiles at large M (1.8 M units x 14 K CTAs).
        units_r, workers_r = units // run_gcd, workers // run_gcd
        u_begin = run_start(worker, units_r, workers_r)
        u_end = run_start(worker + 1, units_r, workers_r)
        t_first = u_begin // k_iters
        t_end = (u_end - 1) // k_iters + 1
        return t_first, t_end, worker, u_begin, u_end, units_r, workers_r, k_iters, m_ctas

    @cute.jit
    def tile_work(self, t, run):
        """Tile ``t`` of the run (``stream_k_run``): (m_cta, n_cta, first K slice, end K
        slice, split-K hand-over) for ``tile``."""
        t_first, _, worker, u_begin, u_end, units_r, workers_r, k_iters, m_ctas = run
        t_units = t * k_iters
        # Workers whose runs meet tile t: w_lo holds its first K slice, w_hi its last.
        # w_lo's partial is in slot 2 w_lo if its run starts in this tile, else in
        # 2 w_lo + 1 (its last tile); every later worker starts here: slot 2 w.
        w_lo = worker_of(t_units, units_r, workers_r)
        w_hi = worker_of(t_units + k_iters - 1, units_r, workers_r)
        starts_here = run_start(w_lo, units_r, workers_r) >= t_units
        first_slot = 2 * w_lo + 1 - Int32(starts_here)
        handover = (w_hi - w_lo + 1, 2 * worker + Int32(t != t_first), first_slot)
        kt_begin = cutlass.max(u_begin - t_units, 0)
        kt_end = cutlass.min(u_end - t_units, k_iters)
        return t % m_ctas, t // m_ctas, kt_begin, kt_end, handover

    @cute.jit
    def role_tidx(self):
        """The thread's index among the threads of its role (copies, table, epilogue): the
        CTA's thread index here; a specialized kernel's producers count from 0 as well."""
        tidx, _, _ = cute.arch.thread_idx()
        return tidx

    def epilogue_barrier(self):
        """Named barrier (id, threads) of the threads that run the epilogue; None: the CTA."""
        return None

    def smem_views(self, base_u8):
        """The regions of ``tile``'s shared memory (``_smem_plan``): the A ring (TILE_M,
        TILE_K, stages) swizzled, the B words and the absmax bytes (stages x repack tiles),
        the pair table (bytes) and the split-K flag. The epilogue tile overlays the ring."""
        plan = self.plan
        sA = cute.make_tensor(
            cute.recast_ptr(base_u8 + plan["a"], dtype=self.dtype), self.a_smem_layout()
        )
        sW = cute.recast_ptr(base_u8 + plan["w"], dtype=Int32)
        sS = base_u8 + plan["s"]
        sFlag = cute.make_tensor(
            cute.recast_ptr(base_u8 + plan["flag"], dtype=Int32), cute.make_layout(1)
        )
        return sA, sW, sS, base_u8 + plan["table"], sFlag

    @cute.jit
    def ring_sources(self, pA, pPacked, pAbsmax, sA, sW, sS, M, N, K, m_cta, n_cta):
        """What ``refill`` passes to ``load_stage`` besides the K slice and the stage (the
        loop-invariant copy plan of this tile)."""
        mA = cute.make_tensor(pA, cute.make_layout((M, K), stride=(K, 1)))
        a_off = self.a_copy_offsets(sA, mA, m_cta)
        n_tiles128 = (N + TILE_N - 1) // TILE_N
        k_tiles64 = (K + TILE_K - 1) // TILE_K
        return (pPacked, pAbsmax, sA, sW, sS, mA, a_off), (n_cta, n_tiles128, k_tiles64)

    @cute.jit
    def refill(self, ring, kt, kt_end, stage):
        """cp.async of K slice ``kt`` into ring buffer ``stage`` where the run holds it, then
        one commit group either way (the waits count groups); returns the next buffer."""
        head, tail = ring
        if kt < kt_end:
            self.load_stage(*head, kt, stage, *tail)
        cute.arch.cp_async_commit_group()
        stage = stage + 1
        if stage == self.cfg.stages:
            stage = 0
        return stage

    def allocate_tile_smem(self, smem: SmemAllocator):
        """The shared memory ``tile`` works in (``plan["total"]`` bytes), as bytes."""
        return cute.recast_ptr(
            smem.allocate(self.plan["total"], byte_alignment=1024), dtype=cutlass.Uint8
        )

    @cute.jit
    def tile(
        self, base_u8, pA, pPacked, pAbsmax, pScale, pBias, pOut, pWorkspace, pCounters,
        M, N, K, has_bias, atomic, m_cta, n_cta, tile, kt_begin, kt_end, handover,
    ):  # fmt: skip
        """Output tile ``tile`` = (m_cta, n_cta) over K slices [kt_begin, kt_end) (units of
        tile_k), in the shared memory at ``base_u8`` (``plan["total"]`` bytes; the pair
        table built): the mainloop, then the epilogue with the split-K ``handover``."""
        cfg, k = self.cfg, self.k
        tidx, _, _ = cute.arch.thread_idx()
        n_iter = kt_end - kt_begin
        sA, sW, sS, sTable_u8, sFlag = self.smem_views(base_u8)

        # ---- MMA partitions: warps tile (M, N) as (warps_m, warps_n)
        tiled_mma = self.make_tiled_mma()
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA[None, None, 0]))  # (8, MI, KS)
        tiled_ldsm = self.make_a_ldsm(tiled_mma)
        thr_ldsm = tiled_ldsm.get_slice(tidx)
        tCsA_ld = thr_ldsm.partition_S(sA)  # (CPY, MI, KS, stages)
        tCrA_ld = thr_ldsm.retile(tCrA)
        # B fragments are made by the dequant; their shape comes from a stand-in (N, K) tile.
        stand_in = cute.make_tensor(sA.iterator, cute.make_layout((cfg.tile_n, cfg.tile_k)))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(stand_in))  # ((2,2), NJ, KS)
        tCrB32 = cute.recast_tensor(tCrB, Int32)  # ((1,2), NJ, KS): one register per pair
        stand_in = cute.make_tensor(sA.iterator, cute.make_layout((cfg.tile_m, cfg.tile_n)))
        tCrC = tiled_mma.make_fragment_C(thr_mma.partition_C(stand_in))  # (4, MI, NJ) fp32
        tCrC.fill(0.0)

        # ---- per-thread copy and fragment offsets (loop invariant)
        ring = self.ring_sources(pA, pPacked, pAbsmax, sA, sW, sS, M, N, K, m_cta, n_cta)
        t4 = tidx % 4
        col0 = self.rep0_column(tidx)

        # ---- prologue: fill stages - 1 buffers, then the first fragments
        for s in cutlass.range_constexpr(cfg.stages - 1):
            self.refill(ring, kt_begin + s, kt_end, s)
        cute.arch.cp_async_wait_group(cfg.stages - 2)
        cute.arch.sync_threads()

        rP = cute.make_rmem_tensor((2 * k, self.nj), Int32)  # planes of one repack k-tile
        rS = cute.make_rmem_tensor((self.nj,), Int32)  # its absmax byte pairs
        read_stage = Int32(0)
        write_stage = Int32(cfg.stages - 1)
        cute.copy(tiled_ldsm, tCsA_ld[None, None, 0, read_stage], tCrA_ld[None, None, 0])
        self.load_b_rk(sW, sS, rP, rS, read_stage, 0, col0)
        self.dequant_block(sTable_u8, rP, rS, tCrB32, 0, t4)

        nb = self.ks // 2  # 32-weight blocks per k-slice
        for it in cutlass.range(n_iter, unroll=1):
            for s in cutlass.range_constexpr(self.ks):
                if s == self.ks - 1:
                    # Every read of the current buffer has been issued: wait for the next
                    # one, and the barrier frees the current one for the copy at s == 0.
                    read_stage = read_stage + 1
                    if read_stage == cfg.stages:
                        read_stage = 0
                    cute.arch.cp_async_wait_group(cfg.stages - 2)
                    cute.arch.sync_threads()
                s_next = (s + 1) % self.ks
                cute.copy(
                    tiled_ldsm, tCsA_ld[None, None, s_next, read_stage], tCrA_ld[None, None, s_next]
                )
                # B for the next block is dequantized while this step's MMAs run.
                if s == self.ks - 1:
                    self.load_b_rk(sW, sS, rP, rS, read_stage, 0, col0)
                    self.dequant_block(sTable_u8, rP, rS, tCrB32, 0, t4)
                elif s % 2 == 0 and s // 2 + 1 < nb:
                    blk = s // 2 + 1
                    if blk % 2 == 0:
                        self.load_b_rk(sW, sS, rP, rS, read_stage, blk // 2, col0)
                    self.dequant_block(sTable_u8, rP, rS, tCrB32, blk, t4)
                if s == 0:
                    write_stage = self.refill(
                        ring, kt_begin + it + cfg.stages - 1, kt_end, write_stage
                    )
                cute.gemm(tiled_mma, tCrC, tCrA[None, None, s], tCrB[None, None, s], tCrC)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every warp is done with the stages: the union is free

        self.epilogue(
            thr_mma, tCrC, base_u8, sFlag, pScale, pBias, pOut, pWorkspace, pCounters,
            M, N, has_bias, atomic, m_cta, n_cta, tile, handover,
        )  # fmt: skip

    # ------------------------------------------------------------------------- layouts

    def make_tiled_mma(self):
        """mma.sync m16n8k16, fp32 accumulate; warps tile (M, N) as (warps_m, warps_n)."""
        return cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            cute.make_layout((self.cfg.warps_m, self.cfg.warps_n, 1)),
        )

    def make_a_ldsm(self, tiled_mma):
        """shared -> register copy of the A fragments of ``tiled_mma``: ldmatrix.x4."""
        ldsm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        return cute.make_tiled_copy_A(ldsm, tiled_mma)

    def a_smem_layout(self):
        """(TILE_M, TILE_K, stages) K-major in 8 x 64 atoms, 16-byte chunks XOR-swizzled by
        row: ldmatrix reads 8 rows of one chunk column without bank conflicts."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        shape = (self.cfg.tile_m, self.cfg.tile_k, self.cfg.stages)
        return cute.tile_to_shape(atom, shape, (0, 1, 2))

    # Which mode of the MMA's C coordinates is the output column (N).
    C_N_MODE = 1

    def c_mma_layout(self):
        """The staging tile in the MMA's C coordinates: (TILE_M, TILE_N)."""
        return self.c_smem_layout()

    def c_smem_layout(self):
        """Epilogue staging tile (TILE_M, TILE_N), rows padded by _C_PAD elements: a warp's
        fragment stores (8 rows x 4 threads) hit 32 different banks."""
        cfg = self.cfg
        return cute.make_layout((cfg.tile_m, cfg.tile_n), stride=(cfg.tile_n + _C_PAD, 1))

    # Shared-memory store plans: plain index arithmetic that the kernel calls with its
    # thread index and ``kbit_cute.layouts`` with ints (the bank-conflict maps of
    # ``python -m layouts kernel gemm``). Each gives one thread's (destination, active) in
    # one pass; ``active`` is a Python True where every thread is busy (no predicate).

    # Which weight columns a thread dequantizes: ``nj`` reps, rep j at column
    # rep0_column + rep_offset(j) of the CTA tile (the B fragments' columns of the MMA).

    def rep0_column(self, tidx):
        """Column of the thread's rep 0: its warp's n8 tile, lane / 4 inside it."""
        return ((tidx // 32) // self.cfg.warps_m) * 8 + (tidx % 32) // 4

    def rep_offset(self, j: int) -> int:
        """Column offset of rep j from rep 0 (the warps' n8 tiles side by side)."""
        return 8 * self.cfg.warps_n * j

    def a_copy_plan(self, tidx, i: int):
        """A cp.async, pass i < a_passes(): ((row, k) of the thread's 16-byte chunk in the
        (TILE_M, TILE_K) tile, active). TILE_K / 8 threads copy a row; passes advance
        a_rows_per_pass() rows (whole swizzle atoms)."""
        cfg = self.cfg
        chunks_row = cfg.tile_k // 8
        rows = self.a_rows_per_pass()
        row = tidx // chunks_row + i * rows
        return (row, (tidx % chunks_row) * 8), rows * (i + 1) <= cfg.tile_m or row < cfg.tile_m

    def w_copy_passes(self) -> int:
        """cp.async passes of the CTA over one repack tile's words."""
        return -(-(self.tile_words * 4 // _CHUNK) // self.cfg.copy_threads)

    def w_copy_plan(self, tidx, i: int):
        """B words cp.async of one repack tile, pass i < w_copy_passes(): (first int32 word
        of the thread's 16-byte chunk, active); chunk tidx + i * threads (coalesced)."""
        chunks, T = self.tile_words * 4 // _CHUNK, self.cfg.copy_threads
        q = tidx + i * T
        return q * 4, chunks % T == 0 or q < chunks

    def absmax_copy_plan(self, tidx):
        """Absmax cp.async of one repack tile: (first byte of the thread's 16-byte chunk,
        active). The CTA's last threads copy the 16 chunks: the words leave those idle when
        64 k chunks are not a multiple of the CTA size."""
        q = tidx - (self.cfg.copy_threads - _TILE_ABSMAX // _CHUNK)
        return q * _CHUNK, q >= 0

    def table_store_bytes(self) -> int:
        """Bytes of one pair-table store: an entry, or 4 lanes' copies of one."""
        return 16 if self.cfg.copy_per_lane else 4

    def table_stores(self) -> int:
        """Stores that fill the pair table (a row table's used halves)."""
        used = self.plan["table_bytes"] // (2 if self.cfg.row_table else 1)
        return used // self.table_store_bytes()

    def table_passes(self) -> int:
        """Store passes of the CTA over the pair table."""
        return -(-self.table_stores() // self.threads)

    def table_plan(self, tidx, i: int):
        """Pair-table build, pass i < table_passes(): ((entry, byte offset in the table) the
        thread's store writes, active). One copy per lane: store q writes lanes 4 (q % 8) ..
        4 (q % 8) + 3 of entry q // 8 (in the first half of its row in a row table)."""
        q = tidx + i * self.threads
        active = self.table_stores() % self.threads == 0 or q < self.table_stores()
        if self.cfg.row_table:
            return (q // 8, (q // 8) * _ROW_BYTES + (q % 8) * 16), active
        if self.cfg.lane_table or self.cfg.half_table:
            return (q // 8, q * 16), active
        return (q, q * 4), active

    # ------------------------------------------------------------------------- pieces

    @cute.jit
    def build_pair_table(self, pCodebook: cute.Pointer, sTable_u8):
        """table[p] = (cb[i0], cb[i1]) x factor in the activation dtype, p = interleaved
        pair index (``pair_table_index``); 2^(2k) 32-bit entries."""
        k = self.k
        tidx = self.role_tidx()
        mCb = cute.make_tensor(pCodebook, cute.make_layout(1 << k))
        factor = Float32(CODEBOOK_FACTOR[self.dtype_name])
        pair = cute.make_rmem_tensor((2,), self.dtype)
        copies = cute.make_rmem_tensor((self.table_store_bytes() // 4,), Int32)
        for i in cutlass.range_constexpr(self.table_passes()):
            (p, off), active = self.table_plan(tidx, i)
            if cutlass.const_expr(self.cfg.half_table):
                p = half_entry_pair(p)  # the pair this entry holds
            if active:
                i0 = Int32(0)
                i1 = Int32(0)
                for b in cutlass.range_constexpr(k):
                    i0 = i0 | (((p >> (2 * b)) & 1) << b)
                    i1 = i1 | (((p >> (2 * b + 1)) & 1) << b)
                pair[0] = self.dtype(mCb[i0] * factor)
                pair[1] = self.dtype(mCb[i1] * factor)
                copies.fill(cute.recast_tensor(pair, Int32)[0])
                dst = sTable_u8 + cute.assume(off, divby=self.table_store_bytes())
                dst = cute.recast_ptr(dst, dtype=Int32)
                cute.autovec_copy(copies, cute.make_tensor(dst, cute.make_layout(copies.shape)))

    @cute.jit
    def a_copy_offsets(self, sA, mA, m_cta):
        """Per-thread A copy plan: [0] the smem element offset of the thread's chunk in stage
        0 (later passes add whole swizzle atoms), [1 + i] the global element offset of pass
        i's chunk at k-slice 0, or -1 for a row past M: those rows are not copied (their
        stale shared data reaches only their own output rows, which are never stored; a
        copy of row M - 1 for each of them measured slow: 8192x28672 M = 33 k = 4 172 vs
        123 us)."""
        cfg = self.cfg
        tidx = self.role_tidx()
        M, K = mA.shape
        (row0, kk), _ = self.a_copy_plan(tidx, 0)  # pass i: row0 + i * a_rows_per_pass()
        offs = cute.make_rmem_tensor((self.a_passes() + 1,), Int32)
        offs[0] = cute.crd2idx((cutlass.min(row0, cfg.tile_m - 1), kk, 0), sA.layout)
        for i in cutlass.range_constexpr(self.a_passes()):
            row = cfg.tile_m * m_cta + row0 + i * self.a_rows_per_pass()
            offs[i + 1] = Int32(-1)
            if row < M:
                offs[i + 1] = row * K + kk
        return offs

    def a_rows_per_pass(self) -> int:
        return self.cfg.copy_threads // (self.cfg.tile_k // 8)

    def a_passes(self) -> int:
        return -(-self.cfg.tile_m // self.a_rows_per_pass())

    @cute.jit
    def load_stage(
        self, pPacked, pAbsmax, sA, sW, sS, mA, a_off, kt, stage, n_cta, n_tiles128, k_tiles64
    ):
        """cp.async of CTA k-slice ``kt`` (A rows, B words, absmax) into buffer ``stage``."""
        cfg, plan = self.cfg, self.plan
        tidx = self.role_tidx()
        M, K = mA.shape
        g2s_w = g2s_copy_atom(Int32)
        g2s_a = g2s_copy_atom(self.dtype)
        # A: chunks past K are zero-filled (the padded weights there are zero, and A must
        # not be NaN). Every thread's chunks share one chunk column, hence one K check.
        rows_pass = self.a_rows_per_pass()
        gk = kt * cfg.tile_k + self.a_copy_plan(tidx, 0)[0][1]
        a_stage = stage * (cfg.tile_m * cfg.tile_k)
        zero8 = cute.make_rmem_tensor((8,), self.dtype)
        zero8.fill(0.0)
        for i in cutlass.range_constexpr(self.a_passes()):
            if self.a_copy_plan(tidx, i)[1]:
                # pass i's chunk: pass 0's + i * rows_pass rows = whole swizzle atoms
                s_off = cute.assume(a_off[0] + a_stage + i * rows_pass * 64, divby=8)
                dst = cute.make_tensor(sA.iterator + s_off, cute.make_layout(8))
                if gk < K:
                    if a_off[i + 1] >= 0:
                        g_off = cute.assume(a_off[i + 1] + kt * cfg.tile_k, divby=8)
                        cute.copy(
                            g2s_a, cute.make_tensor(mA.iterator + g_off, cute.make_layout(8)), dst
                        )
                else:
                    cute.autovec_copy(zero8, dst)
        # B: RK x RN repack tiles, each a contiguous run of words and one of absmax bytes.
        # Tiles past the padded weight (TILE_N = 256 over an odd tile count, TILE_K = 128
        # over an odd one) are skipped: stale shared data there meets zero A or unstored
        # output columns, and every word pattern dequantizes to a finite value.
        for rk in cutlass.range_constexpr(self.rk_n):
            for rn in cutlass.range_constexpr(self.rn_n):
                kt64 = kt * self.rk_n + rk
                if kt64 < k_tiles64 and self.has_repack_tile(n_cta, rn, n_tiles128):
                    r = rk * self.rn_n + rn
                    w_dst = stage * (plan["w_stage"] // 4) + r * self.tile_words
                    for i in cutlass.range_constexpr(self.w_copy_passes()):
                        w, active = self.w_copy_plan(tidx, i)
                        if active:
                            src = self.repack_src(kt64, n_cta, rn, n_tiles128, w, self.tile_words)
                            src = pPacked + cute.assume(src, divby=4)
                            dst = sW + cute.assume(w_dst + w, divby=4)
                            cute.copy(
                                g2s_w,
                                cute.make_tensor(src, cute.make_layout(4)),
                                cute.make_tensor(dst, cute.make_layout(4)),
                            )
                    b, active = self.absmax_copy_plan(tidx)
                    if active:
                        src = self.repack_src(kt64, n_cta, rn, n_tiles128, b, _TILE_ABSMAX)
                        src = pAbsmax + cute.assume(src, divby=16)
                        dst = sS + cute.assume(
                            stage * plan["s_stage"] + r * _TILE_ABSMAX + b, divby=16
                        )
                        cute.copy(
                            g2s_w,
                            cute.make_tensor(
                                cute.recast_ptr(src, dtype=Int32), cute.make_layout(4)
                            ),
                            cute.make_tensor(
                                cute.recast_ptr(dst, dtype=Int32), cute.make_layout(4)
                            ),
                        )

    # Where the CTA's repack tiles come from: its TILE_N / 128 repack n-tiles side by side
    # (a subclass may gather other columns: the grouped GEMM's fused gate/up).

    def has_repack_tile(self, n_cta, rn, n_tiles128):
        """Whether the CTA's repack tile ``rn`` lies inside the (padded) weight."""
        return n_cta * self.rn_n + rn < n_tiles128

    def repack_src(self, kt64, n_cta, rn, n_tiles128, off, per_tile):
        """Source offset of element ``off`` (a word or an absmax byte, ``per_tile`` of them
        per repack tile) of the CTA's repack tile ``rn`` at repack k-tile ``kt64``."""
        return (kt64 * n_tiles128 + n_cta * self.rn_n + rn) * per_tile + off

    @cute.jit
    def load_b_rk(self, sW, sS, rP, rS, stage, rk, col0):
        """All 2k plane words (both K blocks) of repack k-tile ``rk`` of buffer ``stage`` for
        this thread's NJ columns, and their absmax byte pairs."""
        k, plan = self.k, self.plan
        col_words = BLOCKS_PER_TILE_K * k  # a column's words in a repack tile: 16-byte
        align = 4 if k % 2 == 0 else 2  # aligned for even k, 8-byte for odd k
        for j in cutlass.range_constexpr(self.nj):
            # rep0_column + rep_offset(j) % TILE_N stays inside rep 0's repack tile
            cj = self.rep_offset(j)
            r = rk * self.rn_n + cj // TILE_N
            col = col0 + cj % TILE_N
            off = stage * (plan["w_stage"] // 4) + r * self.tile_words + col * col_words
            src = cute.make_tensor(sW + cute.assume(off, divby=align), cute.make_layout(2 * k))
            cute.autovec_copy(src, rP[None, j])
            s_off = stage * plan["s_stage"] + r * _TILE_ABSMAX + col * BLOCKS_PER_TILE_K
            s_ptr = cute.recast_ptr(sS + cute.assume(s_off, divby=2), dtype=cutlass.Uint16)
            rS[j] = Int32(cute.make_tensor(s_ptr, cute.make_layout(1))[0])

    @cute.jit
    def dequant_block(self, sTable_u8, rP, rS, tCrB32, blk, t4):
        """B registers of k16 steps 2 blk and 2 blk + 1 (one 32-weight block), every rep."""
        k = self.k
        lane4 = (cute.arch.lane_idx() * 4) if self.cfg.copy_per_lane else None
        kb2 = blk % BLOCKS_PER_TILE_K
        for j in cutlass.range_constexpr(self.nj):
            planes = [Uint32(rP[kb2 * k + b, j]) for b in range(k)]
            if cutlass.const_expr(self.cfg.row_table):
                offsets = pair_row_offsets(planes, t4, k, lane4)
            elif cutlass.const_expr(self.cfg.half_table):
                offsets = pair_half_offsets(planes, t4, Uint32(lane4) * Uint32(0x01010101))
            else:
                offsets = pair_offsets(planes, t4, k)
            code = prmt(Uint32(rS[j]), Uint32(0), 0x4440 | kb2)  # byte kb2, zero-extended
            scale_x2 = absmax_x2(code, self.dtype_name)
            for c in cutlass.range_constexpr(4):
                pair = self.table_load(sTable_u8, offsets[c], lane4)
                w = mul_x2(Uint32(pair), scale_x2, self.dtype)
                self.set_pair(tCrB32, j, 2 * blk + c // 2, c % 2, Int32(w))

    @cute.jit
    def set_pair(self, frag32, j, step, half, w):
        """Register of weight pair (column rep j, k16 ``step``, K half ``half``: pairs
        2t and 2t + 8) in the B fragments."""
        frag32[(0, half), j, step] = w

    @cute.jit
    def table_load(self, sTable_u8, off, lane4):
        """32-bit entry of the pair table at compact byte offset ``off`` (4 x the pair
        index); in a lane-replicated table, this lane's copy (``lane4`` = 4 x lane); in a
        row or half-row table ``off`` is the lane's copy already."""
        if cutlass.const_expr(self.cfg.lane_table):
            off = (Int32(off) << 5) + lane4  # one LEA
        ptr = cute.recast_ptr(sTable_u8 + cute.assume(Int32(off), divby=4), dtype=Int32)
        return cute.make_tensor(ptr, cute.make_layout(1))[0]

    # ------------------------------------------------------------------------- epilogue

    @cute.jit
    def epilogue(
        self, thr_mma, tCrC, base_u8, sFlag, pScale, pBias, pOut, pWorkspace,
        pCounters, M, N, has_bias, atomic, m_cta, n_cta, tile, handover,
    ):  # fmt: skip
        """Split-K hand-over, then scale (+ bias) and the coalesced store. ``handover`` =
        (arrivals, my_slot, first_slot): the workers meeting in this tile (1: this CTA holds
        all of K and stores), this CTA's partial slot, and the first worker's slot (the
        later workers' slots follow 2 apart: ``kernel``)."""
        tidx = self.role_tidx()
        T = self.threads
        V = cute.size(tCrC)
        acc = cute.make_tensor(tCrC.iterator, cute.make_layout(V))  # flat view
        arrivals, my_slot, first_slot = handover
        do_store = Int32(1)
        if arrivals > 1:
            # Workspace rows of 4 fp32 per thread, thread-major: every access is a
            # coalesced 16-byte vector. Ordered: [slot][V/4][T][4]; atomic: [tile][...].
            slab = V * T
            if atomic == 0:
                mine = my_slot * slab
                for v4 in cutlass.range_constexpr(V // 4):
                    off = cute.assume(mine + (v4 * T + tidx) * 4, divby=4)
                    dst = cute.make_tensor(pWorkspace + off, cute.make_layout(4))
                    cute.autovec_copy(self._four(acc, v4), dst)
            else:
                mine = tile * slab
                for v4 in cutlass.range_constexpr(V // 4):
                    off = cute.assume(mine + (v4 * T + tidx) * 4, divby=4)
                    self.red_add4(pWorkspace + off, self._four(acc, v4))
            # The last CTA of the tile reduces and stores.
            do_store = split_k_arrive(pCounters + tile, arrivals, sFlag, self.epilogue_barrier())
            if do_store != 0:
                if atomic == 0:
                    acc.fill(0.0)
                    later = first_slot - first_slot % 2  # slot of the first worker, - 2
                    # Worker order (deterministic); the loads of ``batch`` partials go out
                    # together: one L2 round trip per batch, not per partial (stream-K
                    # tiles meet up to ~30 runs on small-N shapes).
                    batch = max(1, _REDUCE_FLOATS // V)
                    for i0 in cutlass.range(0, arrivals, batch, unroll=1):
                        parts = []
                        for j in cutlass.range_constexpr(batch):
                            slot = first_slot
                            if i0 + j > 0:
                                slot = later + 2 * (i0 + j)
                            # past the last arrival: re-read this CTA's own slot, added as 0
                            slot = cutlass.select_(i0 + j < arrivals, slot, my_slot)
                            for v4 in cutlass.range_constexpr(V // 4):
                                off = cute.assume(slot * slab + (v4 * T + tidx) * 4, divby=4)
                                parts.append(self.load_cg4(pWorkspace + off))
                        for j in cutlass.range_constexpr(batch):
                            live = Float32(1.0) if j == 0 else Float32(i0 + j < arrivals)
                            for v4 in cutlass.range_constexpr(V // 4):
                                vals = parts[j * (V // 4) + v4]
                                for e in cutlass.range_constexpr(4):
                                    acc[v4 * 4 + e] = acc[v4 * 4 + e] + vals[e] * live
                else:
                    zero4 = cute.make_rmem_tensor((4,), Float32)
                    zero4.fill(0.0)
                    theirs = tile * slab
                    for v4 in cutlass.range_constexpr(V // 4):
                        off = cute.assume(theirs + (v4 * T + tidx) * 4, divby=4)
                        vals = self.load_cg4(pWorkspace + off)
                        for e in cutlass.range_constexpr(4):
                            acc[v4 * 4 + e] = vals[e]
                        # Leave the workspace zero for the next call.
                        cute.autovec_copy(
                            zero4, cute.make_tensor(pWorkspace + off, cute.make_layout(4))
                        )
        if do_store != 0:
            self.store_tile(
                thr_mma, tCrC, base_u8, pScale, pBias, pOut, M, N, has_bias, m_cta, n_cta
            )

    @cute.jit
    def _four(self, acc, v4):
        r = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            r[e] = acc[v4 * 4 + e]
        return r

    @cute.jit
    def red_add4(self, ptr, vals):
        """Four fp32 added to global memory at ``ptr`` (16-byte aligned) by one atomic:
        ``red.global.add.v4.f32`` on sm_90 (a quarter of the scalar atomics' L2 operations),
        four scalar ``red`` before it."""
        if cutlass.const_expr(target_arch_family() == "sm_90"):
            cute.arch.red(ptr, vals.load(), op="add", dtype=Float32, sem="relaxed", scope="gpu")
        else:
            for e in cutlass.range_constexpr(4):
                cute.arch.red(ptr + e, vals[e], op="add", dtype=Float32, sem="relaxed", scope="gpu")

    @cute.jit
    def load_cg4(self, ptr):
        """Four fp32 from L2 (ld.global.cg.v4): partials other CTAs wrote."""
        vec = cute.arch.load(ptr, cutlass._mlir.ir.VectorType.get([4], Float32.mlir_type), cop="cg")
        r = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            r[e] = Float32(llvm.extractelement(vec, Int32(e).ir_value()))
        return r

    @cute.jit
    def store_tile(self, thr_mma, tCrC, base_u8, pScale, pBias, pOut, M, N, has_bias, m_cta, n_cta):
        """acc x scale (+ bias) -> dtype -> shared tile -> 16-byte coalesced global stores."""
        cfg = self.cfg
        m0, n0 = m_cta * cfg.tile_m, n_cta * cfg.tile_n
        sC = cute.make_tensor(cute.recast_ptr(base_u8, dtype=self.dtype), self.c_smem_layout())
        c_mma = self.c_mma_layout()
        tCsC = thr_mma.partition_C(cute.make_tensor(sC.iterator, c_mma))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor(c_mma.shape))
        scale = cute.make_tensor(pScale, cute.make_layout(1))[0]
        mBias = cute.make_tensor(pBias, cute.make_layout(N))
        tCrD = cute.make_fragment_like(tCrC, self.dtype)
        for v in cutlass.range_constexpr(cute.size(tCrC)):
            r = tCrC[v] * scale
            if has_bias != 0:
                r = r + Float32(mBias[cutlass.min(n0 + tCcC[v][self.C_N_MODE], N - 1)])
            tCrD[v] = self.dtype(r)
        cute.autovec_copy(tCrD, tCsC)
        cta_sync(self.epilogue_barrier())
        self.copy_out(sC, pOut, M, N, m0, n0, cfg.tile_n)

    @cute.jit
    def copy_out(self, sC, pOut, M, N, m0, n0, cols: cutlass.Constexpr):
        """The first ``cols`` columns of the staged tile ``sC`` to rows m0.. and columns n0..
        of the (M, N) output: 16-byte coalesced stores, element stores at a ragged edge."""
        cfg = self.cfg
        tidx = self.role_tidx()
        mOut = cute.make_tensor(pOut, cute.make_layout((M, N), stride=(N, 1)))
        chunks_row = cols // 8
        chunks = cfg.tile_m * chunks_row
        vec_ok = N % 8 == 0
        for i in cutlass.range_constexpr((chunks + self.threads - 1) // self.threads):
            q = tidx + i * self.threads
            if chunks % self.threads == 0 or q < chunks:
                row, cc = q // chunks_row, q % chunks_row
                gm, gn = m0 + row, n0 + cc * 8
                src = cute.local_tile(sC[row, None], (8,), (cc,))
                if gm < M:
                    if vec_ok and gn + 8 <= N:
                        off = cute.assume(gm * N + gn, divby=8)
                        cute.autovec_copy(src, cute.make_tensor(pOut + off, cute.make_layout(8)))
                    else:
                        for e in cutlass.range_constexpr(8):
                            if gn + e < N:
                                mOut[gm, gn + e] = src[e]


def gemm_spec(k: int, dtype: str, config: GemmConfig):
    """The compiled variant of ``GemmKernel`` for bits ``k``, dtype name and tiling."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32, 4), fake_ptr(cutlass.Float32, 4), fake_ptr(dt, 2),
            fake_ptr(dt), fake_ptr(cutlass.Float32), fake_ptr(cutlass.Int32, 4),
            Int32(5), Int32(128), Int32(64), Int32(1), Int32(1), Int32(0), Int32(0), fake_stream(),
        )  # fmt: skip
        if config.producer:
            from .gemm_wgmma_producer import ProducerGemmKernel

            return ProducerGemmKernel(k, dtype, config), args
        if config.specialized:
            from .gemm_ws import WsGemmKernel

            return WsGemmKernel(k, dtype, config), args
        if config.wgmma:
            from .gemm_wgmma import WgmmaGemmKernel

            return WgmmaGemmKernel(k, dtype, config), args
        return GemmKernel(k, dtype, config), args

    expect = ("HGMMA", "LDGSTS") if config.wgmma else ("HMMA", "LDGSTS", "LDSM")
    return KernelSpec(f"gemm_k{k}_{dtype}_{config.name}", build, expect=expect)


def gemm_spec_named(name: str):
    """``gemm_spec`` from its variant name, ``gemm_k<k>_<dtype>_<config name>`` (any
    tiling, not only the table's: what a parallel compile of tune candidates sends its
    worker processes)."""
    parts = name.split("_", 3)
    if len(parts) != 4 or parts[0] != "gemm" or parts[1] not in ("k2", "k3", "k4", "k5"):
        raise ValueError(f"not a GEMM variant name: {name!r}")
    _, k, dtype, config = parts
    if dtype not in _DTYPES:
        raise ValueError(f"not a GEMM variant name: {name!r}")
    return gemm_spec(int(k[1]), dtype, GemmConfig.parse(config))


def has_wgmma(arch: str) -> bool:
    """Whether the target (``device.arch_name``) has the warpgroup MMA: sm_90a only."""
    return arch.startswith("sm_90")


def for_arch(cfg: GemmConfig, arch: str) -> GemmConfig:
    """``cfg``, or on a target without wgmma its mma.sync twin: M tiles of at most 128
    rows, 3 stages; the 128-row ones m128n128 over 2 x 4 warps (64 x 32 warp tiles:
    m128n256 w2x4 spills on sm_80 at k = 5)."""
    if not cfg.wgmma or has_wgmma(arch):
        return cfg
    if cfg.tile_m >= 128:
        return replace(
            cfg, wgmma=False, specialized=False, producer=False, tile_m=128, tile_n=128,
            stages=3, warps_m=2, warps_n=4,
        )  # fmt: skip
    return replace(cfg, wgmma=False, specialized=False, producer=False, stages=3)


def table_specs(arch: str) -> list:
    """The variants the dispatch table uses on ``arch``, fp16 and bf16 (compiled and gated
    in CI)."""

    out = []
    for k in (2, 3, 4, 5):
        cfgs = {for_arch(GemmConfig.parse(row[1]), arch): None for row in table_rows(k)}
        out += [gemm_spec(k, dt, cfg) for cfg in cfgs for dt in _DTYPES]
    return out


def table_rows(k: int) -> list[tuple]:
    """Every row of the dispatch table for bits k: the general rows, then those for
    weights over the L2 and for small weights (``gemm_table``)."""
    from . import gemm_table

    return [
        *gemm_table.RULES.get(k, ()), *gemm_table.RULES_OVER_L2.get(k, ()),
        *gemm_table.RULES_SMALL.get(k, ()),
    ]  # fmt: skip
