"""Host side of the mma.sync GEMM (``kbit_cute.gemm`` sends it M > 8, on small weights
M > 16..64: ``ops.gemv_max_m``): tiling and stream-K worker choice, split-K buffers, launch.

``gemm_mma(A2d, qw, bias, out)`` runs ``kernels/gemm.py`` on CUDA tensors. The tiling and
the worker count come from the measured table ``kernels/gemm_table.py`` (rows by k and M,
``plan_workers``), unless the caller passes ``config`` / ``splits`` / ``workers``.
``use_cublas(M, N, K, k, dev)`` says where the table found dequantize + cuBLAS faster;
``kbit_cute.gemm`` uses it to pick the path.

Split-K buffers live per (device, stream): an fp32 partials buffer (deterministic mode: the
last CTA of a tile sums the partials in worker order), an fp32 sums buffer kept at zero
(atomic mode: ``red.add``, the last CTA reads and re-zeroes its tile) and the tile counters,
kept at zero by the kernel. Nothing is cleared per call. They are driver memory
(``device.scratch_tensor``), outside torch's caching allocator, so a first call inside a
CUDA-graph capture or inductor's graph pool (``mode="reduce-overhead"``) allocates nothing
there; they grow to powers of two and are never freed while the process runs (a captured
graph may still point at an outgrown one). Where every run holds whole tiles the kernel
touches none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from . import device as _device
from .compile import MisalignedError, current_raw_stream, launcher
from .format import BLOCK, KbitWeight, padded_shape
from .kernels import gemm_table
from .kernels.dequantize import MAX_ROWS as MAX_DEQUANTIZE_ROWS
from .kernels.device_helpers import check_run_bounds
from .kernels.gemm import (
    GemmConfig,
    GemmKernel,
    for_arch,
    gemm_spec,
    has_wgmma,
    table_rows,
)

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
MIN_K_ITERS_PER_SPLIT = 2  # a split shorter than this is mostly pipeline fill and drain
_MAX_ELEMS = 1 << 31  # the kernel indexes A, out and the workspace with int32


# ----------------------------------------------------------------------------- choice


def small_weight(N: int, K: int, weight_over_l2: bool) -> bool:
    """Whether a weight [N, K] belongs to the table's small-weight class (``RULES_SMALL``):
    at most ``SMALL_WEIGHT_ELEMENTS`` and inside the L2."""
    return not weight_over_l2 and N * K <= gemm_table.SMALL_WEIGHT_ELEMENTS


def table_rule(
    k: int, M: int, weight_over_l2: bool = False, small: bool = False
) -> tuple[str, int, int]:
    """(config name, target CTAs per SM, max splits) of the table row for bits k and M rows.

    ``small`` (``small_weight``): the weight is of the small class, whose rows were tuned
    on such weights (``RULES_SMALL``: 2048x512 .. 2048x8192; at M = 64 an m32 tile beat
    the general row's m64 one by 1.3-1.5x, geomean over six shapes); where they have no
    row for M's bucket (the general row's m_max), the general rows apply.

    ``weight_over_l2``: the weight is larger than the L2, so every M tile streams it from
    DRAM again. Such weights have rows of their own (``RULES_OVER_L2``, tuned on weights
    over the L2; k = 4, M = 128 on 8192x28672: 140 us with their m128n256 tile against 170
    with the general row's m128n128). Where those rows stop short of M, a later general
    row whose tile covers M is taken (k = 2, M = 64 on 8192x28672 took 140 us with the
    M <= 64 row's m32 tile, 111 us with the M <= 128 row's m64 tile). The worker density
    stays M's row's."""
    rows = gemm_table.RULES.get(k)
    if not rows:
        raise ValueError(f"the GEMM table has no rows for k={k}")
    if small and not weight_over_l2:
        bucket = next((row[0] for row in rows if M <= row[0]), rows[-1][0])
        own = next((r for r in gemm_table.RULES_SMALL.get(k, ()) if r[0] == bucket), None)
        if own is not None:
            return own[1], own[2], own[3]
    if weight_over_l2:
        own = next((r for r in gemm_table.RULES_OVER_L2.get(k, ()) if M <= r[0]), None)
        if own is not None:
            return own[1], own[2], own[3]
    first = next((i for i, row in enumerate(rows) if M <= row[0]), len(rows) - 1)
    _, name, ctas_per_sm, max_splits = rows[first]
    if weight_over_l2:
        name = next((r[1] for r in rows[first:] if GemmConfig.parse(r[1]).tile_m >= M), name)
    return name, ctas_per_sm, max_splits


def output_tiles(M: int, N: int, cfg: GemmConfig) -> int:
    """TILE_M x TILE_N output tiles of an M x N problem."""
    return -(-M // cfg.tile_m) * -(-N // cfg.tile_n)


def choose_splits(
    M: int, N: int, K: int, cfg: GemmConfig, sm_count: int, ctas_per_sm: int, max_splits: int
) -> int:
    """K splits so that tiles x splits reaches ctas_per_sm x SMs, each split >= 2 K slices."""
    tiles = output_tiles(M, N, cfg)
    k_iters = -(-K // cfg.tile_k)
    want = -(-ctas_per_sm * sm_count // tiles)
    return max(1, min(want, max_splits, k_iters // MIN_K_ITERS_PER_SPLIT))


def plan_workers(
    M: int, N: int, K: int, cfg: GemmConfig, sm_count: int, ctas_per_sm: int, max_splits: int,
    resident: int | None = None,
) -> int:  # fmt: skip
    """CTAs (stream-K workers) of the launch. The kernel splits the (output tile, K slice)
    units into equal runs, one per CTA.

    One M tile (M <= tile_m): ``ctas_per_sm`` x SMs workers (at most ``resident`` per SM,
    what shared memory holds; at most ``max_splits`` per tile, each >= 2 K slices): every
    SM gets the same share, where whole tiles leave the last wave partly empty (8192x28672
    at M = 32: 224 tiles on 132 SMs). Several M tiles: whole tiles times ``choose_splits``,
    the split-K grid. There the CTAs that share a weight tile must run at the same time
    for its second read to hit the L2, which runs through consecutive tiles would undo."""
    tiles = output_tiles(M, N, cfg)
    if M > cfg.tile_m:
        return tiles * choose_splits(M, N, K, cfg, sm_count, ctas_per_sm, max_splits)
    units = tiles * -(-K // cfg.tile_k)
    per_sm = ctas_per_sm if resident is None else max(1, min(ctas_per_sm, resident))
    return max(1, min(per_sm * sm_count, tiles * max_splits, units // MIN_K_ITERS_PER_SPLIT))


def resident_ctas(cfg: GemmConfig, k: int, smem_per_sm: int) -> int:
    """CTAs of ``cfg`` that an SM's shared memory holds (1 KB per CTA is the driver's)."""
    return smem_per_sm // (cfg.smem_bytes(k) + 1024)


def plan(
    M: int, N: int, K: int, k: int, sm_count: int, l2_bytes: int | None = None,
    smem_per_sm: int | None = None, smem_per_block: int | None = None,
    config: GemmConfig | None = None, arch: str = "sm_90a",
) -> tuple[GemmConfig, int]:  # fmt: skip
    """The table's (config, workers) for this problem on a GPU with ``sm_count`` SMs,
    ``l2_bytes`` of L2 (None: the weight is taken to fit), ``smem_per_sm`` bytes of shared
    memory per SM (None: no residency limit) and ``smem_per_block`` per CTA (None: the
    table's tiling as written; else its compact-table twin where a pair table with a copy
    per lane does not fit). ``config``: that tiling instead of the table's, with the
    table's worker density. ``arch``: the device's target (wgmma rows take their mma.sync
    twin before sm_90a: ``gemm.for_arch``)."""
    over_l2 = weight_over_l2(N, K, k, l2_bytes)
    name, ctas_per_sm, max_splits = table_rule(k, M, over_l2, small_weight(N, K, over_l2))
    cfg = config
    if cfg is None:
        cfg = for_arch(GemmConfig.parse(name), arch)
        if smem_per_block is not None:
            cfg = _fitting(cfg, k, smem_per_block)
    resident = None if smem_per_sm is None else resident_ctas(cfg, k, smem_per_sm)
    return cfg, plan_workers(M, N, K, cfg, sm_count, ctas_per_sm, max_splits, resident)


def weight_bytes(N: int, K: int, k: int) -> int:
    """Bytes of a tiled kbit weight [N, K] (``KbitWeight.nbytes``): k plane words and one
    absmax byte per 32 weights of the padded shape."""
    k_pad, n_pad = padded_shape(K, N)
    return n_pad * k_pad // BLOCK * (4 * k + 1)


def weight_over_l2(N: int, K: int, k: int, l2_bytes: int | None) -> bool:
    """Whether the weight is larger than an L2 of ``l2_bytes`` (None: taken to fit)."""
    return l2_bytes is not None and weight_bytes(N, K, k) > l2_bytes


def prefer_cublas(
    M: int, k: int, weight_over_l2: bool = False, elements: int | None = None
) -> bool:
    """True where the table measured dequantize + cuBLAS faster than the kernel (for
    weights over the L2 their own threshold, where one was measured; for a weight of at
    most a ``CUBLAS_FROM_M_SMALL`` row's N x K ``elements``, that row's M for k if lower)."""
    thresholds = gemm_table.CUBLAS_FROM_M
    if weight_over_l2 and k in gemm_table.CUBLAS_FROM_M_OVER_L2:
        thresholds = gemm_table.CUBLAS_FROM_M_OVER_L2
    m0 = thresholds.get(k)
    if elements is not None and not weight_over_l2:
        row = next((r for size, r in gemm_table.CUBLAS_FROM_M_SMALL if elements <= size), {})
        small = row.get(k)
        if small is not None:
            m0 = small if m0 is None else min(m0, small)
    return m0 is not None and M >= m0


def use_cublas(M: int, N: int, K: int, k: int, dev: int) -> bool:
    """Whether ``kbit_cute.gemm`` takes dequantize + cuBLAS for this problem on CUDA device
    ``dev`` (``prefer_cublas`` with the weight's class and size; asked per call). Never for
    more rows than the dequantize kernel takes (``MAX_ROWS``): the GEMM has no such bound."""
    return N <= MAX_DEQUANTIZE_ROWS and prefer_cublas(M, k, _over_l2_on(N, K, k, dev), N * K)


@functools.lru_cache(maxsize=4096)
def _over_l2_on(N: int, K: int, k: int, dev: int) -> bool:
    return weight_over_l2(N, K, k, _device.check_device(dev).l2_bytes)


def table_configs(k: int) -> list[GemmConfig]:
    """The configs the table uses for bits k, its general, over-L2 and small-weight rows
    (what CI compiles and the tests cover)."""
    return [GemmConfig.parse(n) for n in dict.fromkeys(row[1] for row in table_rows(k))]


# ----------------------------------------------------------------------------- buffers


class _SplitKBuffers:
    """Split-K workspace of one (device, stream); see the module docstring."""

    def __init__(self, dev: int):
        self.dev = dev
        self.partials = self.sums = self.counters = None

    def _grown(self, old, numel: int, dtype: torch.dtype, fill_byte: int | None):
        if old is not None and old.numel() >= numel:
            return old
        n = 1 << (max(numel, 4096) - 1).bit_length()
        return _device.scratch_tensor(self.dev, n, dtype, fill_byte)

    def get(self, ws_elems: int, tiles: int, atomic: bool):
        if atomic:
            ws = self.sums = self._grown(self.sums, ws_elems, torch.float32, 0)
        else:
            ws = self.partials = self._grown(self.partials, ws_elems, torch.float32, None)
        self.counters = self._grown(self.counters, tiles, torch.int32, 0)
        return ws, self.counters


class _Launch(NamedTuple):
    """What a launch needs beyond the tensors; fixed per (shape, tiling, workers)."""

    cfg: GemmConfig
    workers: int
    run_gcd: int  # gcd(units, workers): the kernel's run arithmetic in reduced terms
    handover: bool  # runs end inside tiles: split-K workspace and counters
    tiles: int


def _launch_plan(M: int, N: int, K: int, cfg: GemmConfig, workers: int) -> _Launch:
    # Ordered partials take two slots per worker (the first and last tile of its run):
    # int32 workspace offsets; 32-bit run products once reduced by the gcd.
    workers = max(1, min(workers, (_MAX_ELEMS - 1) // (2 * cfg.tile_m * cfg.tile_n)))
    tiles = output_tiles(M, N, cfg)
    units = tiles * -(-K // cfg.tile_k)
    run_gcd = math.gcd(units, workers)
    check_run_bounds(units // run_gcd, workers, "GEMM")
    return _Launch(cfg, workers, run_gcd, hands_over(M, N, cfg, workers), tiles)


_buffers: dict[tuple[int, int], _SplitKBuffers] = {}
_plans: dict[tuple, _Launch] = {}  # the table's launch per shape
_launchers: dict[tuple[int, str, str], object] = {}


# ----------------------------------------------------------------------------- launch


def gemm_mma(
    A2d: torch.Tensor,
    qw: KbitWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    config: GemmConfig | str | None = None,
    splits: int | None = None,
    workers: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """out[M, N] = A2d[M, K] @ W^T (+ bias) by the mma.sync GEMM; returns ``out``.

    CUDA fp16/bf16 tensors; ``out`` contiguous [M, N] in A's dtype, ``bias`` [N] in A's
    dtype or None. ``config`` overrides the table's tiling; ``splits`` (a split-K grid:
    every output tile in that many K ranges) or ``workers`` (that many stream-K CTAs)
    override its worker count. ``deterministic``: the split-K reduction sums the partials
    in worker order (bit-identical run to run); otherwise they are added with atomics
    (order varies in the last fp32 bits).
    """
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"qw must be a KbitWeight, got {type(qw).__name__}")
    return launch(
        A2d, qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, bias, out,
        config=config, splits=splits, workers=workers, deterministic=deterministic,
    )  # fmt: skip


def launch(
    A2d, packed, absmax, codebook, scale, k: int, N: int, K: int, bias, out,
    *, config=None, splits=None, workers=None, deterministic: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``gemm_mma`` over the weight's tensors (the weight's own consistency is the caller's:
    ``ops.check_weight``)."""
    dtype = _check_args(A2d, packed, k, N, K, bias, out)
    M = A2d.shape[0]
    if M == 0:
        return out
    rows = (_MAX_ELEMS - 1) // (max(K, N) + 256)  # int32-safe rows per launch
    if M > rows:
        for r0 in range(0, M, rows):
            launch(
                A2d[r0 : r0 + rows], packed, absmax, codebook, scale, k, N, K, bias,
                out[r0 : r0 + rows], config=config, splits=splits, workers=workers,
                deterministic=deterministic,
            )  # fmt: skip
        return out
    dev = A2d.get_device()
    plan_ = _resolve(M, N, K, k, dev, config, splits, workers)
    cfg = plan_.cfg
    fn = _launchers.get((k, _DTYPES[dtype], cfg.name))
    if fn is None:
        fn = _launchers[(k, _DTYPES[dtype], cfg.name)] = launcher(gemm_spec(k, _DTYPES[dtype], cfg))
    stream = current_raw_stream(dev)
    bufs = _buffers.get((dev, stream))
    if bufs is None:
        bufs = _buffers[(dev, stream)] = _SplitKBuffers(dev)
    atomic = plan_.handover and not deterministic
    if not plan_.handover:  # the kernel reads no workspace and no counter: pass any buffer
        ws, counters = bufs.get(0, 0, atomic)
    else:  # atomic sums: one slab per tile; ordered partials: two per worker
        slabs = plan_.tiles if atomic else 2 * plan_.workers
        ws, counters = bufs.get(slabs * cfg.tile_m * cfg.tile_n, plan_.tiles, atomic)

    if not A2d.is_contiguous():
        A2d = A2d.contiguous()
    dst = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)  # 16-byte row stores
    has_bias = bias is not None
    if has_bias and bias.stride(0) != 1:
        bias = bias.contiguous()
    args = [
        A2d, packed, absmax, codebook, scale, bias if has_bias else dst, dst, ws, counters,
        M, N, K, plan_.workers, plan_.run_gcd, int(has_bias), int(atomic),
    ]  # fmt: skip
    try:
        fn(*args)
    except MisalignedError:
        # A view that does not start on a 16-byte boundary: copy it to fresh storage.
        args[0] = A2d.clone(memory_format=torch.contiguous_format)
        fn(*args)
    if dst is not out:
        out.copy_(dst)
    return out


def dispatch_plan(M: int, N: int, K: int, k: int, dev: int) -> tuple[GemmConfig, int]:
    """(config, workers) that ``gemm_mma`` launches for this problem on CUDA device ``dev``."""
    got = _resolve(M, N, K, k, dev, None, None, None)
    return got.cfg, got.workers


def hands_over(M: int, N: int, cfg: GemmConfig, workers: int) -> bool:
    """Whether runs of ``workers`` CTAs end inside output tiles (then they hand over through
    the split-K workspace; else each CTA holds whole tiles)."""
    return output_tiles(M, N, cfg) % workers != 0


def _resolve(M, N, K, k, dev, config, splits, workers) -> _Launch:
    """The caller's tiling and worker count, or the table's for this shape (cached)."""
    if config is None and splits is None and workers is None:
        key = (k, N, K, M, dev)
        got = _plans.get(key)
        if got is None:
            props = _device.check_device(dev)
            cfg, planned = plan(
                M, N, K, k, props.sm_count, props.l2_bytes, props.smem_per_sm,
                props.smem_per_block_optin, arch=props.arch,
            )  # fmt: skip
            _check_smem(cfg, k, props)
            got = _plans[key] = _launch_plan(M, N, K, cfg, planned)
        return got
    if splits is not None and workers is not None:
        raise ValueError("pass splits or workers, not both")
    for name, v in (("splits", splits), ("workers", workers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    props = _device.check_device(dev)
    if config is None:
        cfg = plan(
            M, N, K, k, props.sm_count, props.l2_bytes, None, props.smem_per_block_optin,
            arch=props.arch,
        )[0]  # fmt: skip
    elif isinstance(config, str):
        cfg = GemmConfig.parse(config)
    elif isinstance(config, GemmConfig):
        cfg = config
    else:
        raise TypeError(f"config must be a GemmConfig or its name, got {type(config).__name__}")
    problems = GemmKernel.problems(k, "f16", cfg)
    if cfg.wgmma and not has_wgmma(props.arch):
        problems.append(f"wgmma (suffix g) needs sm_90a; {props.name} is {props.arch}")
    if problems:
        raise ValueError(f"GEMM config {cfg.name}: " + "; ".join(problems))
    _check_smem(cfg, k, props)
    tiles = output_tiles(M, N, cfg)
    k_iters = -(-K // cfg.tile_k)
    if splits is not None:  # whole tiles x splits (at most one K slice each)
        n = tiles * min(splits, k_iters)
    elif workers is not None:  # a worker of no unit would only wait
        n = min(workers, tiles * k_iters)
    else:  # the table's density for this tiling
        n = plan(M, N, K, k, props.sm_count, props.l2_bytes, props.smem_per_sm, config=cfg)[1]
    return _launch_plan(M, N, K, cfg, n)


def _fitting(cfg: GemmConfig, k: int, smem_per_block: int) -> GemmConfig:
    """The table's config, or its compact-table twin where the pair table with a copy per
    lane does not fit ``smem_per_block`` bytes (the H100-measured table on an A100: 163 KB)."""
    if cfg.copy_per_lane and cfg.smem_bytes(k) > smem_per_block:
        return dataclasses.replace(cfg, table="compact")
    return cfg


def _check_smem(cfg: GemmConfig, k: int, props) -> None:
    need = cfg.smem_bytes(k)
    if need > props.smem_per_block_optin:
        raise ValueError(
            f"GEMM config {cfg.name} needs {need} bytes of shared memory at k={k}; "
            f"{props.name} allows {props.smem_per_block_optin} per CTA (use fewer stages)"
        )


def _check_args(A2d, packed, k, N, K, bias, out) -> torch.dtype:
    if not isinstance(A2d, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise TypeError("A2d and out must be torch tensors")
    if k not in (2, 3, 4, 5):
        raise ValueError(f"k must be 2..5, got {k}")
    if A2d.ndim != 2 or A2d.shape[1] != K:
        raise ValueError(f"A2d must be [M, K={K}], got shape {tuple(A2d.shape)}")
    if A2d.dtype not in _DTYPES:
        raise TypeError(f"A2d must be float16 or bfloat16, got {A2d.dtype}")
    if tuple(out.shape) != (A2d.shape[0], N) or out.dtype != A2d.dtype:
        raise ValueError(
            f"out must be a {A2d.dtype} tensor of shape {(A2d.shape[0], N)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,) or bias.dtype != A2d.dtype
    ):
        raise ValueError(f"bias must be a {A2d.dtype} tensor of shape ({N},)")
    if not A2d.is_cuda:
        raise ValueError(f"gemm_mma runs on CUDA tensors; A2d is on {A2d.device}")
    for name, t in (("the weight", packed), ("out", out), ("bias", bias)):
        if t is not None and t.device != A2d.device:
            raise ValueError(f"A2d is on {A2d.device} but {name} is on {t.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return A2d.dtype
