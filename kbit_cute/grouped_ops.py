"""Grouped expert matmuls for MoE: the torch API and ``torch.library`` ops.

    kbit_cute::grouped_gemm(A, packed, absmax, codebook, scale, expert_offsets, k, N, K,
                            max_rows) -> out [R, N]
    kbit_cute::moe_gate_up(A, packed, absmax, codebook, scale, expert_offsets, k, N, K,
                           max_rows) -> out [R, N / 2]

``A`` [R, K] holds rows sorted by expert, ``expert_offsets`` [E + 1] (int32, on A's device)
the row range of each expert; the weights are a ``KbitExperts`` (E stacked tiled weights,
one codebook, a scale per expert). On CUDA one kernel launch serves every expert and the
host never reads the offsets, so a MoE layer can be captured in a CUDA graph. On the CPU:
dequantize + a matmul per expert.

``max_rows`` is a static bound on any one expert's rows (0: R). A MoE layer passes the token
count, since a token picks an expert at most once. The kernel for large launches
(``GroupedGemvKernel``) keeps split-K partial sums for that many rows per expert; rows past
the bound come out as NaN, never silently wrong. Launches with 16 or more busy experts
(``GroupedStreamKernel``, stream-K over every SM; k = 5 on sm_90 only) do not need the
bound, nor do
launches of 16 or more rows per busy expert on average (prefill), which run
``GroupedGemmKernel``: the dense GEMM's mma tiles of 64 rows per (expert, M tile) work item
(gate/up: SiLU(g) * u in its epilogue).

``overlap=True`` (H100 and later) lets a launch find its experts and prefetch their weights
while the kernel before it on the stream still runs; it reads ``A`` and writes ``out`` only
after that kernel has finished. The caller vouches that the kernel launched just before
did not write the offsets or the weights: true in a MoE layer (gate_up after the row
gather, down after gate_up), not for offsets computed by the kernel right before. Only
launches whose experts fit ``_SMALL_LAUNCH_BYTES`` prefetch (decode's few tokens): more
bytes would be evicted from L2 by the running kernel's stream before they are used.
"""

from __future__ import annotations

import torch

from . import device as _device
from .compile import current_raw_stream, launcher
from .experts import KbitExperts, check_experts
from .format import dequantize as dequantize_reference
from .ops import _GEMV_DTYPES, _split_scratch

__all__ = ["grouped_gemm", "moe_gate_up"]

_is_compiling = torch.compiler.is_compiling
ROWS_PER_PASS = 8  # kernels.grouped_gemv.ROWS_PER_PASS (not imported: keeps cutlass lazy)
_CTA_COLS = 128  # weight columns per CTA (gate/up: 64 outputs of each half)
_GATE_UP_ALIGN = 64


def grouped_gemm(
    A: torch.Tensor,
    experts: KbitExperts,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    max_rows_per_expert: int | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """out[r] = A[r] @ W_e^T for every row r in expert e's range offsets[e]:offsets[e+1].

    A [R, K] fp16/bf16 (CUDA) or any float dtype (CPU), rows sorted by expert; output in
    A's dtype. Rows outside every range are not written. ``overlap``: see the module text.
    """
    return _call("grouped_gemm", A, experts, expert_offsets, out, max_rows_per_expert, overlap)


def moe_gate_up(
    A: torch.Tensor,
    gate_up: KbitExperts,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    max_rows_per_expert: int | None = None,
    overlap: bool = False,
) -> torch.Tensor:
    """SiLU(A W_gate^T) * (A W_up^T) per expert, from the fused [gate; up] weight of each
    expert (``gate_up.N`` = 2 I, gate rows first: transformers' ``gate_up_proj``) in one pass
    over it. Returns [R, I]; I must be a multiple of 64. ``overlap``: see the module text."""
    return _call("moe_gate_up", A, gate_up, expert_offsets, out, max_rows_per_expert, overlap)


def _call(name, A, ex, offsets, out, max_rows, overlap):
    if not isinstance(ex, KbitExperts):
        raise TypeError(f"{name} takes a KbitExperts, got {type(ex).__name__}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    bound = _check_bound(max_rows)
    args = (A, ex.packed, ex.absmax, ex.codebook, ex.scale, offsets, ex.k, ex.N, ex.K, bound,
            overlap)  # fmt: skip
    if _is_compiling():
        if out is None:
            return getattr(torch.ops.kbit_cute, name)(*args)
        getattr(torch.ops.kbit_cute, name + "_out")(*args, out)
        return out
    return _impl(name == "moe_gate_up", *args, out)


def _check_bound(max_rows) -> int:
    if max_rows is None:
        return 0
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows <= 0:
        raise ValueError(f"max_rows_per_expert must be a positive int, got {max_rows!r}")
    return max_rows


# ---------------------------------------------------------------------------- checks


def _check_args(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out):
    E = check_experts(packed, absmax, codebook, scale, k, N, K)
    if not isinstance(A, torch.Tensor) or A.ndim != 2 or A.shape[1] != K:
        raise ValueError(
            f"A must be a 2-D [rows, K={K}] tensor, got "
            f"{tuple(A.shape) if isinstance(A, torch.Tensor) else type(A).__name__}"
        )
    if A.device != packed.device:
        raise ValueError(f"A is on {A.device} but the experts are on {packed.device}; move one")
    if A.is_cuda and A.dtype not in _GEMV_DTYPES:
        raise TypeError(f"on CUDA, A must be float16 or bfloat16, got {A.dtype}")
    if (
        not isinstance(offsets, torch.Tensor)
        or offsets.dtype != torch.int32
        or tuple(offsets.shape) != (E + 1,)
        or offsets.device != A.device
    ):
        raise ValueError(
            f"expert_offsets must be an int32 tensor of shape ({E + 1},) on {A.device}, got "
            + (
                f"{offsets.dtype} {tuple(offsets.shape)} on {offsets.device}"
                if isinstance(offsets, torch.Tensor)
                else type(offsets).__name__
            )
        )
    if gate_up and (N % 2 or (N // 2) % _GATE_UP_ALIGN):
        raise ValueError(
            f"moe_gate_up needs the fused [gate; up] weight with N = 2 I, I a multiple of "
            f"{_GATE_UP_ALIGN}; got N={N}"
        )
    n_out = N // 2 if gate_up else N
    if out is not None and (
        tuple(out.shape) != (A.shape[0], n_out)
        or out.dtype != A.dtype
        or out.device != A.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {A.dtype} tensor of shape {(A.shape[0], n_out)} on "
            f"{A.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return E, n_out


# ---------------------------------------------------------------------------- implementation


def _impl(
    gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, max_rows, overlap, out=None
):  # fmt: skip
    E, n_out = _check_args(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out)
    if out is None:
        out = A.new_empty((A.shape[0], n_out))
    if A.shape[0] == 0:
        return out
    if not A.is_cuda:
        return _reference(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out)
    _launch(gate_up, A.contiguous(), packed, absmax, codebook, scale, offsets, k, N, K,
            max_rows, out, E, overlap=overlap)  # fmt: skip
    return out


def _reference(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out):
    """CPU: dequantize each expert that has rows, matmul, SiLU(g) * u for gate_up."""
    ex = KbitExperts(packed, absmax, codebook, scale, k, N, K, A.dtype)
    bounds = offsets.tolist()  # CPU tensors: reading them costs nothing
    R = A.shape[0]
    for e in range(len(bounds) - 1):
        lo, hi = max(bounds[e], 0), min(bounds[e + 1], R)
        if hi <= lo:
            continue
        W = dequantize_reference(ex.expert(e), torch.float32)
        y = A[lo:hi].float() @ W.T
        if gate_up:
            g, u = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(g) * u
        out[lo:hi] = y.to(out.dtype)
    return out


def grouped_splits(
    items: int,
    k_tiles: int,
    sm_count: int,
    ctas_per_sm: int = 3,
    pow2: bool = True,
    min_run: int = 8,
) -> int:
    """K splits for ``items`` (slots x column groups) CTAs: at most 16, a power of two
    unless ``pow2`` is off (the table launches: Qwen3-Coder-Next's T = 1 gate_up, 80 items,
    3 splits 10.6 us against 11.4 for 2; the register-lookup launches keep the rounding:
    k = 5 at 3 splits measured 25-30% slower at T = 1).

    Measured on the H100 (``python -m perf.moe_kernel_check``, Qwen3-Coder-Next experts,
    splits 1/2/4/8): unlike the GEMV, these CTAs are few and short, and what costs is a
    second wave (3-4 CTAs fit per SM) and split-K's extra round trips; best was about 3
    CTAs per SM in all, each with at least 8 K tiles. CTAs with the 64 KB lookup table fit
    2 per SM: ``ctas_per_sm`` 2 (4 splits there measured 30-50% slower than 2), and their
    splits keep ``min_run`` 6 K tiles at least, not 8 (GLM-4.7-Flash's T = 1 down, 64 items
    of 24 K tiles: 4 splits 7.7 us against 8.3 for 3).
    """
    want = max(1, min(ctas_per_sm * sm_count // items, k_tiles // min_run, 16))
    return 1 << (want.bit_length() - 1) if pow2 else want


# Split-K workspace budget: beyond it the split count drops (fp32 partials of every row).
_WORKSPACE_LIMIT = 64 << 20
# A launch whose experts hold at most this many bytes (about half the H100's L2) is a
# decode launch: with ``overlap`` it prefetches them into L2 (more would be evicted by the
# running kernel's stream before use), and its ring is deeper (``DECODE_STAGES``). 24 MB
# rather than 16 measured: DeepSeek-V2-Lite T = 1 (18 MB gate_up at k = 4, 23 MB at k = 5)
# 25.6 -> 25.0 us (k = 4), 37.4 -> 29.2 us (k = 5); 32 MB changed nothing more.
_SMALL_LAUNCH_BYTES = 24 << 20
_DECODE_STAGES = 5  # kernels.grouped_gemv.DECODE_STAGES (not imported: keeps cutlass lazy)
_CLUSTER_SPLITS = (2,)  # kernels.grouped_gemv.CLUSTER_SPLITS
# Decode-ring launches of the grid kernel (k <= 4) whose layer's gate_up experts hold at
# least this many bytes look up in the GEMV's 64 KB shared-memory table: 11-17% fewer
# instructions per K tile than register lookups, but 2 CTAs per SM and a table fill per CTA,
# which cost more than they save on the smallest launches. Measured (``python -m perf moe
# --t 1 2 --k 2 3 4``, us, table / register lookups): T = 1 Qwen3-Coder-Next k = 2 14.2 /
# 12.9 (5.9 MiB), GLM-4.7-Flash k = 3 19.4 / 18.0 (9.8 MiB); Qwen k = 4 16.3 / 16.9 (10.6
# MiB), DeepSeek-V2-Lite k = 4 21.8 / 24.3; T = 2 DeepSeek k = 4 30.9 / 44.3, GLM k = 3
# 27.4 / 36.8.
_TABLE_MIN_BYTES = 10 << 20
_TABLE_CTAS_PER_SM = 2  # GroupedGemvKernel(table=True).min_ctas_per_sm on sm_90 (sm_80: 1)
_GRID_TABLE: bool | None = None  # tuning: force the table on or off (None: the rule)


def _layer_bytes(gate_up: bool, slots: int, expert_bytes: int) -> int:
    """The touched bytes of a launch's layer's gate_up experts: a MoE layer's down experts
    hold half its gate/up experts' bytes, and both launches of a layer must agree on the
    choices made by size."""
    return slots * expert_bytes * (1 if gate_up else 2)


def _is_decode_launch(gate_up: bool, slots: int, expert_bytes: int) -> bool:
    """Whether a launch gets the decode treatment (``_SMALL_LAUNCH_BYTES``), judged by its
    layer's gate_up launch. A small down launch after a large gate_up one, prefetching under
    ``overlap``, measured slow (DeepSeek-V2-Lite T = 2, k = 4: 66.8 us against 48.2 without
    overlap)."""
    return _layer_bytes(gate_up, slots, expert_bytes) <= _SMALL_LAUNCH_BYTES


_launchers: dict[tuple, object] = {}
# kernels.grouped_gemv.MAX_SLOTS: the stream kernel's table of (expert, 8-row pass) slots.
_MAX_STREAM_SLOTS = 1024


# Tests set this to "stream" or "grid" to run every launch the kernel can serve on it.
_KERNEL_OVERRIDE: str | None = None


# K tiles a run of the stream kernel keeps at least when it splits strips (4, 8 and 16
# measured within 1% of each other on the three models' experts at T = 4 and 16).
_STREAM_MIN_RUN = 8
# Launches with at least this many busy-expert slots (min(E, rows)) run the stream kernel
# (``stream_serves``): both launches of a MoE layer then get the same kernel.
_STREAM_MIN_SLOTS = 16


# Launches whose rows per busy expert are at least this many on average (R / min(E, R))
# run GroupedGemmKernel (mma tiles of 64 rows per expert) instead of the GEMV kernels, which
# re-stream an expert's weights per 8 rows. Measured (``python -m perf.moe_kernel_check
# --T 64 256 1024 --kernels auto gemm``, k = 4, overlapped gate_up + down, us, GEMV kernels /
# GEMM): 5 rows per expert (Qwen3-Coder-Next T = 256) 392 / 790, 16 (GLM-4.7-Flash T = 256)
# 323 / 316, 20 (Qwen T = 1024) 1421 / 926, 24 (DeepSeek-V2-Lite T = 256) 419 / 301.
_GEMM_MIN_ROWS_PER_EXPERT = 16


def _choose_kernel(k: int, slots: int, busy_bound: int, rows: int = 0, N: int = 0) -> str:
    """GroupedStreamKernel where it serves k (``stream_serves``), up to ``busy_bound`` >= 16
    experts are busy and its slot table holds the launch, else GroupedGemvKernel. Measured
    on the H100
    (``python -m perf.moe_kernel_check --model qwen3-coder-next deepseek-v2-lite
    glm-4.7-flash --T 1 4 16 --kernels stream grid``, overlapped chains, us): k = 4, T = 4 /
    16: Qwen3-Coder-Next 38 / 107 against 45 / 121, DeepSeek-V2-Lite 47 / 103 against 59 /
    120. At T = 1 (4 to 10 experts) the grid kernel wins (Qwen 17.3 against 20.2): its small
    CTAs start while the kernel before runs and prefetch their weights; the stream kernel's
    CTA holds a whole SM's shared memory. The rule depends on the rows, not on bytes, so
    that gate_up and down agree: a grid launch after a stream launch measured slow (GLM
    T = 4, k = 3: 63 against 38 us; its CTAs pile onto the SMs freed first). k = 5: see
    ``stream_serves``."""
    fits = slots <= _MAX_STREAM_SLOTS
    gemm_fits = N % 8 == 0  # (its 16-byte output stores start every expert's rows)
    if _KERNEL_OVERRIDE is not None:  # (tests: one kernel wherever it can serve)
        if _KERNEL_OVERRIDE == "gemm":
            return "gemm" if gemm_fits else "grid"
        return _KERNEL_OVERRIDE if fits else "grid"
    if gemm_fits and rows >= _GEMM_MIN_ROWS_PER_EXPERT * busy_bound:
        return "gemm"
    return "stream" if fits and stream_serves(k) and busy_bound >= _STREAM_MIN_SLOTS else "grid"


def stream_serves(k: int) -> bool:
    """Whether the stream kernel is the one for k's busy launches: with a shared-memory pair
    table. k = 5 has one on sm_90 (128 KB, 3 quads per CTA), where it measured faster than
    the grid kernel (``python -m perf.moe_kernel_check --T 1 4 16 --kernels stream grid
    --time-k 5 --model qwen3-coder-next deepseek-v2-lite glm-4.7-flash``, overlapped chains,
    us, T = 4 / 16: Qwen3-Coder-Next 46.5 / 125.4 against 49.9 / 140.6, DeepSeek-V2-Lite
    58.0 / 122.3 against 67.9 / 138.8, GLM-4.7-Flash 43.9 / 110.0 against 53.9 / 126.0;
    session 28); on sm_80 it looks up by shuffles in CTAs of one quad, which measured equal or
    slower (Qwen T = 4 57 against 53, session 7)."""
    from .kernels.gemv import default_lookup

    return k <= 4 or default_lookup(k) == "pair_table5"


def stream_slots(R: int, E: int) -> int:
    """Bound on the (expert, pass of up to 8 rows) work slots of R rows over E experts: the
    sum over busy experts of ceil(rows / 8). (Not tightened by ``max_rows``: a wrong bound
    must not drop rows.)"""
    busy = min(E, R)
    return min((R + 7 * busy) // 8, busy + R // ROWS_PER_PASS)


def grid_plan(
    k: int,
    gate_up: bool,
    slots: int,
    expert_bytes: int,
    groups: int,
    k_tiles: int,
    sm_count: int,
    stages: int | None = None,
    splits: int | None = None,
) -> tuple[int | None, bool, int]:
    """(ring stages or None for the default, shared-memory table, K splits) of a
    ``GroupedGemvKernel`` launch of ``slots`` experts x ``groups`` column groups; explicit
    ``stages`` / ``splits`` are kept."""
    # The decode ring (and table) also serve launches larger than the prefetch limit that
    # touch few experts (the grid kernel by the busy-expert rule: T = 2, 3): at
    # T = 2, k = 4, GLM-4.7-Flash 37.5 -> 29.4 us, DeepSeek-V2-Lite 49.8 -> 32.9
    # (``python -m perf.moe_kernel_check --T 2 --stages 0 5``); k = 5 (session 28, ``--T 2 3
    # --time-k 5 --kernels grid --stages 0 5``, two passes, us): GLM-4.7-Flash T = 2 39.5 /
    # 40.4 -> 37.5 / 37.7, DeepSeek-V2-Lite T = 2 50.3 / 50.6 -> 48.7 / 49.0, T = 3 55.5 /
    # 55.7 -> 54.0 / 54.5, Qwen3-Coder-Next equal.
    small = _is_decode_launch(gate_up, slots, expert_bytes)
    few = slots < _STREAM_MIN_SLOTS
    stages = stages or (_DECODE_STAGES if small or few else None)
    table = k <= 4 and stages == _DECODE_STAGES
    if _GRID_TABLE is None:
        table = table and _layer_bytes(gate_up, slots, expert_bytes) >= _TABLE_MIN_BYTES
    else:
        table = table and _GRID_TABLE
    if splits is None:
        fit = _TABLE_CTAS_PER_SM if table else 3
        splits = grouped_splits(
            slots * groups, k_tiles, sm_count, fit, pow2=not table, min_run=6 if table else 8
        )
    return stages, table, splits


def _launch(
    gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, max_rows, out, E,
    splits=None, stages=None, overlap=False, kernel=None, min_run=None, cluster=None,
):  # fmt: skip
    from .kernels.gemv import MAX_A_BYTES

    dev = A.get_device()
    props = _device.check_device(dev)
    R = A.shape[0]
    rows_bound = min(max_rows or R, R)
    expert_bytes = (packed.numel() * 4 + absmax.numel()) // E
    stream_slots_bound = stream_slots(R, E)
    if splits is not None:
        kernel = "grid"
    a_bytes = A.numel() * A.element_size()  # the GEMV kernels' offsets are 32-bit
    if kernel is None:
        kernel = _choose_kernel(k, stream_slots_bound, min(E, R), R, N)
        if a_bytes >= MAX_A_BYTES:
            kernel = "gemm"
    elif kernel != "gemm" and a_bytes >= MAX_A_BYTES:
        raise ValueError(
            f"A holds {a_bytes} bytes: the {kernel} kernel addresses at most {MAX_A_BYTES} "
            "(32-bit offsets); use the gemm kernel"
        )
    if kernel == "gemm":
        _launch_gemm(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out, E)
        return
    if kernel == "stream" and stream_slots_bound > _MAX_STREAM_SLOTS:
        raise ValueError(f"{stream_slots_bound} work slots exceed the stream kernel's table")
    if kernel == "stream":
        _launch_stream(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out, E,
                       stream_slots_bound, stages, overlap, expert_bytes, dev, props.sm_count,
                       min_run)  # fmt: skip
        return
    slots = min(E, R)
    groups = -(-(N // 2) // (_CTA_COLS // 2)) if gate_up else -(-N // _CTA_COLS)
    k_tiles = -(-K // 64)
    passes = -(-rows_bound // ROWS_PER_PASS)
    stages, table, splits = grid_plan(
        k, gate_up, slots, expert_bytes, groups, k_tiles, props.sm_count, stages, splits
    )
    per_split = slots * groups * passes * ROWS_PER_PASS * _CTA_COLS
    while splits > 1 and per_split * splits * 4 > _WORKSPACE_LIMIT:
        splits //= 2
    # Decode gate_up launches sum 2 K splits in a cluster (distributed shared memory) rather
    # than through the workspace in L2, where the target has clusters (the kernel decides).
    # Measured (``python -m perf moe --t 1 --k 4``, us, Qwen3-Coder-Next / GLM-4.7-Flash /
    # DeepSeek-V2-Lite): none 17.0 / 19.6 / 25.3, gate_up 16.9 / 19.6 / 24.3, down 17.0 /
    # 21.3 / 27.5, both 17.0 / 21.3 / 23.6; 4 splits in a cluster: Qwen 19.9, GLM 27.7.
    if cluster is None:
        cluster = gate_up and stages == _DECODE_STAGES
    cluster_splits = splits if cluster and splits in _CLUSTER_SPLITS else None
    key = (k, A.dtype, gate_up, stages, cluster_splits, table)
    entry = _launchers.get(key)
    if entry is None:
        from .kernels.gemv import _DTYPES
        from .kernels.grouped_gemv import GroupedGemvKernel, grouped_gemv_spec

        dt = _GEMV_DTYPES[A.dtype]
        kern = GroupedGemvKernel(k, _DTYPES[dt], gate_up, stages, cluster_splits, table)
        in_cluster = kern.cluster
        spec = grouped_gemv_spec(k, dt, gate_up, stages, cluster_splits, table)
        entry = _launchers[key] = (launcher(spec), bool(in_cluster))
    fn, in_cluster = entry
    # The GEMV's split-K scratch of this stream (driver memory, safe to first allocate during
    # a graph capture): kernels on one stream run one after another, and each leaves its
    # counters at zero. A cluster launch sums its splits without it.
    ws_elems = per_split * splits if splits > 1 and not in_cluster else 1
    ws, counters = _split_scratch(dev, current_raw_stream(dev), ws_elems, slots * groups)
    prefetch = overlap and _is_decode_launch(gate_up, slots, expert_bytes)
    fn(A, packed, absmax, codebook, scale, offsets, out, ws, counters,
       R, N, K, E, slots, passes, splits, int(prefetch))  # fmt: skip


def _launch_stream(
    gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out, E, slots, stages,
    overlap, expert_bytes, dev, sm_count, min_run=None,
):  # fmt: skip
    """``GroupedStreamKernel``: one wave of CTAs; the kernel cuts the work into runs."""
    key = ("stream", k, A.dtype, gate_up, stages)
    entry = _launchers.get(key)
    if entry is None:
        from .kernels.gemv import _DTYPES
        from .kernels.grouped_gemv import GroupedStreamKernel, grouped_stream_spec

        dt = _GEMV_DTYPES[A.dtype]
        kern = GroupedStreamKernel(k, _DTYPES[dt], gate_up, stages)
        spec = grouped_stream_spec(k, dt, gate_up, stages)
        entry = _launchers[key] = (launcher(spec), kern.quads, kern.ctas_per_sm)
    fn, quads, ctas_per_sm = entry
    ctas = sm_count * ctas_per_sm
    groups = N // 2 // (_CTA_COLS // 2) if gate_up else -(-N // _CTA_COLS)
    ws, counters = _split_scratch(dev, current_raw_stream(dev),
                                  2 * ctas * quads * ROWS_PER_PASS * _CTA_COLS,
                                  slots * groups * 4)  # fmt: skip
    prefetch = overlap and _is_decode_launch(gate_up, min(E, A.shape[0]), expert_bytes)
    fn(A, packed, absmax, codebook, scale, offsets, out, ws, counters,
       A.shape[0], N, K, E, slots, ctas, min_run or _STREAM_MIN_RUN, int(prefetch))  # fmt: skip


def _launch_gemm(gate_up, A, packed, absmax, codebook, scale, offsets, k, N, K, out, E):
    """``GroupedGemmKernel``: (expert M tile, N tile) work items; gate/up with SiLU(g) * u in
    its epilogue."""
    if N % 8:
        raise ValueError(f"the grouped GEMM needs N % 8 == 0, got N={N}")
    key = ("gemm", k, A.dtype, gate_up)
    entry = _launchers.get(key)
    if entry is None:
        from .kernels.grouped_gemm import CONFIG, grouped_gemm_spec

        spec = grouped_gemm_spec(k, _GEMV_DTYPES[A.dtype], CONFIG, gate_up)
        entry = _launchers[key] = (launcher(spec), CONFIG.tile_m)
    fn, tile_m = entry
    R = A.shape[0]
    slots = min(E, R) + R // tile_m  # >= the sum over experts of ceil(rows / tile_m)
    if slots > 0:
        fn(A, packed, absmax, codebook, scale, offsets, out, R, N, K, E, slots)


def _grouped(
    gate_up, A, ex: KbitExperts, offsets, out, max_rows=0, splits=None, stages=None,
    overlap=False, kernel=None, min_run=None, cluster=None,
):  # fmt: skip
    """The grouped kernel with an explicit split count / ring depth / ``kernel`` ("stream",
    "grid" or "gemm"; an explicit split count means "grid") / stream run floor / ``cluster``
    (False: decode launches sum their splits through the workspace), for checks and
    tuning."""
    E, _ = _check_args(gate_up, A, ex.packed, ex.absmax, ex.codebook, ex.scale, offsets,
                       ex.k, ex.N, ex.K, out)  # fmt: skip
    _launch(gate_up, A, ex.packed, ex.absmax, ex.codebook, ex.scale, offsets, ex.k, ex.N,
            ex.K, max_rows, out, E, splits, stages, overlap, kernel, min_run,
            cluster)  # fmt: skip
    return out


# ---------------------------------------------------------------------------- torch.library


def _define(name: str, gate_up: bool):
    @torch.library.custom_op(f"kbit_cute::{name}", mutates_args=())
    def op(
        A: torch.Tensor,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        codebook: torch.Tensor,
        scale: torch.Tensor,
        expert_offsets: torch.Tensor,
        k: int,
        N: int,
        K: int,
        max_rows: int,
        overlap: bool,
    ) -> torch.Tensor:
        return _impl(gate_up, A, packed, absmax, codebook, scale, expert_offsets, k, N, K,
                     max_rows, overlap)  # fmt: skip

    @op.register_fake
    def _(A, packed, absmax, codebook, scale, expert_offsets, k, N, K, max_rows, overlap):
        _, n_out = _check_args(gate_up, A, packed, absmax, codebook, scale, expert_offsets,
                               k, N, K, None)  # fmt: skip
        return A.new_empty((A.shape[0], n_out))

    @torch.library.custom_op(f"kbit_cute::{name}_out", mutates_args=("out",))
    def op_out(
        A: torch.Tensor,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        codebook: torch.Tensor,
        scale: torch.Tensor,
        expert_offsets: torch.Tensor,
        k: int,
        N: int,
        K: int,
        max_rows: int,
        overlap: bool,
        out: torch.Tensor,
    ) -> None:
        _impl(gate_up, A, packed, absmax, codebook, scale, expert_offsets, k, N, K, max_rows,
              overlap, out)  # fmt: skip

    @op_out.register_fake
    def _(A, packed, absmax, codebook, scale, expert_offsets, k, N, K, max_rows, overlap, out):
        _check_args(gate_up, A, packed, absmax, codebook, scale, expert_offsets, k, N, K, out)

    return op, op_out


_grouped_gemm_op, _grouped_gemm_out_op = _define("grouped_gemm", gate_up=False)
_moe_gate_up_op, _moe_gate_up_out_op = _define("moe_gate_up", gate_up=True)
