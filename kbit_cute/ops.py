"""Torch-facing operations: the public functions, the ``torch.library`` ops, dispatch.

Public functions (``kbit_cute.quantize / dequantize / gemm``) take and return
``KbitWeight``s. Each is also a ``torch.library`` op in the ``kbit_cute``
namespace over plain tensors (the weight as packed, absmax, codebook, scale
and the ints k, N, K), with a fake implementation for torch.compile and an
``_out`` variant that writes into a caller's buffer (declared as mutated):

    kbit_cute::quantize(W, k, codebook?) -> (packed, absmax, codebook, scale)
    kbit_cute::dequantize(packed, absmax, codebook, scale, k, N, K, dtype) -> W
    kbit_cute::dequantize_out(..., dtype, out!) -> ()
    kbit_cute::gemm(A, packed, absmax, codebook, scale, k, N, K, bias?) -> out
    kbit_cute::gemm_out(..., bias?, out!) -> ()

Eager calls skip the dispatcher (a few microseconds per call) and run the
implementation directly; under ``torch.compile`` and when autograd must record
the call, the public functions go through ``torch.ops.kbit_cute``. On CUDA the
implementations launch the CuTe DSL kernels; on the CPU they use the host
reference in ``kbit_cute.format`` (bit-identical results).
"""

from __future__ import annotations

import torch

from . import device as _device
from .compile import MisalignedError, current_device, current_raw_stream, launcher, stream_launcher
from .format import (
    BLOCK,
    K_BITS,
    TILE_K,
    TILE_N,
    KbitWeight,
    decode_e4m4,
    dequantize_kbit,
    encode_e4m4,
    quantize_kbit,
    repack_kbit,
    unrepack_kbit,
)
from .format import dequantize as _dequantize_reference
from .format import quantize as _quantize_reference

__all__ = [
    "decode_e4m4",
    "dequantize",
    "dequantize_kbit",
    "encode_e4m4",
    "gemm",
    "linear",
    "quantize",
    "quantize_kbit",
    "repack_kbit",
    "unrepack_kbit",
]

_OUT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_GEMV_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
# Module globals (tests and the --mock benchmark stub them): torch's C entry points.
_current_device = current_device
_raw_stream = current_raw_stream


def tiled_sizes(k: int, N: int, K: int) -> tuple[int, int]:
    """(int32 words, absmax bytes) of the tiled format of W [N, K] at k bits."""
    blocks = -(-K // TILE_K) * -(-N // TILE_N) * TILE_N * (TILE_K // BLOCK)
    return blocks * k, blocks


def check_weight(packed, absmax, codebook, scale, k: int, N: int, K: int) -> None:
    """The tensors of a tiled kbit weight agree with (k, N, K): dtypes, sizes, one device."""
    if k not in K_BITS:
        raise ValueError(f"k must be one of 2, 3, 4, 5 (bits per weight), got {k}")
    if N <= 0 or K <= 0 or K % BLOCK:
        raise ValueError(f"K must be a positive multiple of {BLOCK} and N positive; got {N=}, {K=}")
    words, blocks = tiled_sizes(k, N, K)
    for t, name, dtype, numel in (
        (packed, "packed", torch.int32, words),
        (absmax, "absmax", torch.uint8, blocks),
        (codebook, "codebook", torch.float32, 1 << k),
        (scale, "scale", torch.float32, 1),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(
                f"{name} of a k={k} weight [N={N}, K={K}] must be a contiguous {dtype} tensor of "
                f"{numel} elements, got {t.dtype} with {t.numel()}"
                + ("" if name != "codebook" else f" (was it quantized with k={k}?)")
            )
        if t.device != packed.device:
            raise ValueError(f"{name} is on {t.device} but packed is on {packed.device}")


def _as_weight(packed, absmax, codebook, scale, k, N, K, dtype=torch.float16) -> KbitWeight:
    return KbitWeight(packed, absmax, codebook, scale, k, N, K, dtype)


# ============================================================================ quantize


def quantize(W: torch.Tensor, k: int = 4, codebook: torch.Tensor | None = None) -> KbitWeight:
    """Quantize W [N, K] (fp32/fp16/bf16, CPU or CUDA, K a multiple of 32) to a ``KbitWeight``."""
    if not _is_compiling():
        return _quantize_reference(W, k, codebook)
    packed, absmax, cb, scale = torch.ops.kbit_cute.quantize(W, k, codebook)
    return KbitWeight(packed, absmax, cb, scale, k, W.shape[0], W.shape[1], W.dtype)


@torch.library.custom_op("kbit_cute::quantize", mutates_args=())
def _quantize_op(
    W: torch.Tensor, k: int, codebook: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qw = _quantize_reference(W, k, codebook)
    # Outputs may not alias inputs: the codebook is returned as a copy.
    return qw.packed, qw.absmax, qw.codebook.clone(), qw.scale


@_quantize_op.register_fake
def _(W, k, codebook):
    if W.ndim != 2 or W.dtype not in _OUT_NAMES:
        raise ValueError(f"W must be a 2-D float32/float16/bfloat16 tensor, got {W.dtype}")
    if k not in K_BITS:
        raise ValueError(f"k must be one of 2, 3, 4, 5 (bits per weight), got {k}")
    N, K = W.shape
    torch._check(K % BLOCK == 0, lambda: f"W's K must be a multiple of {BLOCK}, got {K}")
    if codebook is not None and codebook.numel() != 1 << k:
        raise ValueError(f"codebook for k={k} must have {1 << k} entries")
    words, blocks = tiled_sizes(k, N, K)
    return (
        W.new_empty(words, dtype=torch.int32),
        W.new_empty(blocks, dtype=torch.uint8),
        W.new_empty(1 << k, dtype=torch.float32),
        W.new_empty(1, dtype=torch.float32),
    )


# ============================================================================ dequantize


def dequantize(qw: KbitWeight, dtype: torch.dtype | None = None, out: torch.Tensor | None = None):
    """Dense W [N, K] from a ``KbitWeight``; on CUDA by the dequantize kernel."""
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"dequantize takes a KbitWeight, got {type(qw).__name__}")
    dtype = dtype or qw.dtype
    args = (qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, dtype)
    if _is_compiling():
        if out is None:
            return torch.ops.kbit_cute.dequantize(*args)
        torch.ops.kbit_cute.dequantize_out(*args, out)
        return out
    return _dequantize_impl(*args, out)


def _dequantize_impl(packed, absmax, codebook, scale, k, N, K, dtype, out=None):
    if dtype not in _OUT_NAMES:
        raise TypeError(f"dequantize supports float32, float16 and bfloat16, got {dtype}")
    check_weight(packed, absmax, codebook, scale, k, N, K)
    if out is not None and (
        tuple(out.shape) != (N, K) or out.dtype != dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {(N, K)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out is not None and out.device != packed.device:
        raise ValueError(f"out is on {out.device} but the weight is on {packed.device}")
    if packed.device.type != "cuda":
        w = _dequantize_reference(_as_weight(packed, absmax, codebook, scale, k, N, K), dtype)
        return w if out is None else out.copy_(w)
    _device.check_device(packed.device.index)
    from .kernels.dequantize import MAX_ROWS

    if N > MAX_ROWS:
        raise ValueError(f"the dequantize kernel takes at most {MAX_ROWS} rows (N), got {N}")
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=packed.device)
    elif out.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned (a fresh tensor is)")
    return _launch_dequantize(packed, absmax, codebook, scale, k, N, K, out)


def _launch_dequantize(packed, absmax, codebook, scale, k, N, K, out):
    """The dequantize kernel into ``out`` (a 16-byte aligned [N, K] CUDA tensor; the caller
    has checked the weight and N <= ``MAX_ROWS``)."""
    from .kernels.dequantize import dequantize_spec

    launcher(dequantize_spec(k, _OUT_NAMES[out.dtype]))(packed, absmax, codebook, scale, out, N, K)
    return out


@torch.library.custom_op("kbit_cute::dequantize", mutates_args=())
def _dequantize_op(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    scale: torch.Tensor,
    k: int,
    N: int,
    K: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return _dequantize_impl(packed, absmax, codebook, scale, k, N, K, dtype)


@_dequantize_op.register_fake
def _(packed, absmax, codebook, scale, k, N, K, dtype):
    check_weight(packed, absmax, codebook, scale, k, N, K)
    if dtype not in _OUT_NAMES:
        raise TypeError(f"dequantize supports float32, float16 and bfloat16, got {dtype}")
    return packed.new_empty(N, K, dtype=dtype)


@torch.library.custom_op("kbit_cute::dequantize_out", mutates_args=("out",))
def _dequantize_out_op(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    scale: torch.Tensor,
    k: int,
    N: int,
    K: int,
    dtype: torch.dtype,
    out: torch.Tensor,
) -> None:
    _dequantize_impl(packed, absmax, codebook, scale, k, N, K, dtype, out)


@_dequantize_out_op.register_fake
def _(packed, absmax, codebook, scale, k, N, K, dtype, out):
    check_weight(packed, absmax, codebook, scale, k, N, K)
    if tuple(out.shape) != (N, K) or out.dtype != dtype:
        raise ValueError(f"out must be a {dtype} tensor of shape {(N, K)}")


# ============================================================================ gemm

GEMV_MAX_M = 8  # the GEMV's mma has 8 activation columns; larger M goes to the GEMM,
_M_BUCKET = (0, 1, 2, 4, 4, 8, 8, 8, 8)  # M -> the compiled rows bucket of the GEMV
# except on small weights, where the GEMV's rows bucket 8 serves up to 64 rows in sets of 8
# (``GemvKernel.row_sets``), each set a grid of its own on 1 / sets of the SMs. (weight
# elements, largest k, most rows): up to that size and k, that many rows. Measured on the
# H100 against the previous dispatch (GEMM or dequantize + cuBLAS), k = 2..5 (session 38,
# perf/NOTES.md): at M = 9..32 on nine weights of 1M-25M elements row sets 1.02-1.77x faster
# up to 8.4M elements at M <= 32 and 10.5M at M <= 24, 1.06-1.35x on 16.8M (2048 x 8192) at
# M <= 16; 25M (2048 x 12288) ties at M <= 16 and loses beyond, as does every larger weight
# (4096 x 14336 at M = 16: 0.75-0.80x); at M = 40, 48, 64 on six weights of 1M-4.2M elements
# 1.00-1.75x up to M = 48, at M = 64 1.07-1.38x for k <= 4 but 0.93-1.15x for k = 5.
GEMV_ROW_SETS = (
    (1 << 22, 4, 64),
    (1 << 22, 5, 48),
    (1 << 23, 5, 32),
    (10 << 20, 5, 24),
    (1 << 24, 5, 16),
)


# The k whose GEMV at M = 1 is bound by issuing its K loop rather than by the DRAM stream
# (``issue_bound_k``): there an SM with more K tiles than others finishes that much later,
# and even grids pay (``even_workers``). On the H100 (3.35 TB/s over 132 SMs, 25 GB/s per SM)
# k = 4 streams at 98% of the measured read bandwidth on 8192x28672 and an even grid measured
# slower (4096x14336 13.27 -> 13.46 us); on the H200 (4.8 TB/s, 37 GB/s per SM) its K loop
# binds too: 8192x28672 37.8 us against k = 3's 37.2 (the same loop of 194 instructions per K
# tile), ncu issue slots ~70% busy with "not selected" the largest stall, and even grids
# 0.90-0.91x where they move the busiest SM most (4096x14336 12.69 -> 11.56, 18944x3584 14.79
# -> 13.39; session 41, perf/NOTES.md).
ISSUE_BOUND_K = (2, 3, 5)
ISSUE_BOUND_K_FAST_MEMORY = (2, 3, 4, 5)
FAST_MEMORY_GBS_PER_SM = 30.0


def gemv_max_m(N: int, K: int, k: int) -> int:
    """The most rows M the GEMV serves for a k-bit weight [N, K] (``GEMV_ROW_SETS``); larger
    M goes to the GEMM."""
    for elements, largest_k, rows in GEMV_ROW_SETS:
        if N * K <= elements and k <= largest_k:
            return rows
    return GEMV_MAX_M


def gemv_rows(M: int) -> tuple[int, int]:
    """(rows bucket, row sets) of the GEMV launch for M rows: sets of the largest bucket
    past GEMV_MAX_M."""
    if M <= GEMV_MAX_M:
        return _M_BUCKET[M], 1
    return GEMV_MAX_M, -(-M // GEMV_MAX_M)


def gemv_max_splits(m_bucket: int) -> int:
    """The most splits per column tile of the GEMV at rows bucket m (``gemv_splits``'s cap;
    ``balanced_splits`` keeps within it)."""
    return 16 if m_bucket < 8 else 8


def gemv_splits(N: int, K: int, sm_count: int, m_bucket: int = 1) -> int:
    """Stream-K workers per column tile of the GEMV (a power of two, at most 16): each
    tile's K range in that many equal runs, so that no run crosses a column tile (a run
    that does pays a pipeline drain and refill at the crossing: slower, measured; the
    ``crossing`` variants of ``even_workers``' grids do not).

    From an H100 sweep of splits 1..16 (``python -m perf.gemv_kernel_check``, 2026-11-22):
    shapes with many column tiles want long runs (>= 16 K tiles each) and about 6 runs per
    SM in all; shapes with few column tiles are latency-bound and want up to 16 runs of
    >= 4 K tiles. With the counter hand-over the same for every rows bucket (M = 1..8), since
    its reduction loaded 32 partials per lane per round: halving the splits at M = 4
    measured slower (``--workers auto s4 s8 s16``: 2048x2048 7.0 vs 6.0 us, 14336x4096 k = 4
    17.9 vs 17.1); at M = 8 this rule was within noise of the best fixed count on six shapes.
    Refined from a sweep of 1, 2, 4, 8 and 16 splits on 16 smaller shapes (2026-11-23, us at
    M = 1, k = 2 / 4 / 5, the earlier rule -> this one): a split's reduction costs about a
    microsecond, so K of <= 4 tiles is not split (256x2048 4.9-5.1 with 2 splits against
    3.7-3.9); short K (<= 8 tiles) or few columns (<= 4 tiles) took runs of 2 tiles, as few
    columns still do (2048x512 5.80 / 5.64 / 5.94 -> 5.13 / 5.05 / 4.94, 512x2048 5.64 / 5.47
    / 5.82 -> 5.08 / 4.86 / 4.96, 512x4096 5.64 / 5.54 / 5.89 -> 5.20 / 5.10 / 5.31); many
    columns over K <= 32 tiles take 4 splits, not 2 (2048x8192 9.62 / 10.09 / 12.61 -> 7.86
    / 8.53 / 10.75, 2048x12288 10.43 / 11.66 / 15.74 -> 8.75 / 9.80 / 12.48, 1024x8192 7.04 /
    7.12 / 8.15 -> 6.31 / 6.64 / 7.54). In the model (``python -m perf decode --model
    qwen3-coder-next``, alternating with the earlier rule) the linears of a k = 4 step took
    2.6% less time.
    Short K (5..8 tiles) over 5..63 column tiles: about one run per SM, of one K tile or
    more (sweep of 2, 4, 8 splits on 8 shapes, 2026-11-23, us at M = 1, k = 2 / 4 / 5, runs
    of 2 tiles -> this: 384x2048 4.18 / 4.03 / 4.34 -> 3.78 / 3.72 / 3.90, 448x4096 4.48 /
    4.37 / 4.85 -> 3.96 / 3.83 / 4.10, 320x4096 4.15 / 4.04 / 4.39 -> 3.89 / 3.84 / 4.07,
    512x1024 3.82 / 3.68 / 3.92 -> 3.61 / 3.35 / 3.55; 512x4096 keeps 4). With >= 64
    column tiles K < 16 tiles stays unsplit (512x8192, 512x12288: best for k = 2, 4; k = 5
    wanted 4 splits at 512x8192, 4.85 against 5.51; since session 29 ``balanced_splits``
    splits such shapes where that evens out the SMs: 512x8192 2 splits, 1.1-1.2x).
    With the polled hand-over (``kernels.gemv.GemvKernel.gather_strip``, 2026-11-26) an
    owner loads a few slots per round (``POLL_WORKERS``): from M = 2 (``m_bucket``) short K
    takes runs of >= 2 tiles (512x2048, us, k = 2 / 4 / 5, 8 -> 4 splits: M = 2 3.10 / 2.83 /
    3.10 -> 2.85 / 2.70 / 3.02, M = 8 4.55 / 4.12 / 4.35 -> 3.76 / 3.49 / 3.66; M = 1 keeps 8:
    2.77 / 2.50 / 2.83 against 2.81 / 2.58 / 2.92), and M = 8 at most 8 splits (14336x4096
    16.22 / 17.60 / 25.34 -> 14.83 / 17.60 / 24.67, 4096x2048 7.79 / 7.67 / 9.08 -> 6.56 /
    6.55 / 7.91, 2048x512 6.23 / 5.89 / 6.18 -> 5.15 / 4.93 / 5.30; at M = 4 16 splits stay
    best or equal on 4 of these 5 shapes). At M = 1, up to 16 column tiles over K > 8 tiles
    take runs of >= 2 tiles, not 4 (k = 2 / 3 / 4 / 5, us: 2048x2048 8 -> 16 splits 3.70 /
    3.55 / 3.50 / 4.19 -> 3.54 / 3.40 / 3.45 / 4.12, 1024x2048 4 -> 8 3.42 / 3.28 / 3.19 /
    3.79 -> 3.05 / 2.93 / 2.84 / 3.25, 3072x1024 8 -> 16 4.12 / 4.05 / 4.02 / 4.67 -> 3.43 /
    3.26 / 3.25 / 3.71, 1536x2048 4 -> 8 4.04 / 3.96 / 3.88 / 4.62 -> 3.37 / 3.21 / 3.17 /
    3.67; 2048x5120, 40 column tiles, wants 8, not 16; M = 2 at 2048x2048 8, not 16).
    At M = 2, 4 (the wider split-K gather, session 23) >= 32 column tiles over < 128 K tiles
    take at most 8 splits (us, M = 4, k = 2 / 4 / 5, 16 -> 8: 4096x4096 7.01 / 7.34 / 9.40 ->
    5.92 / 6.47 / 8.50, 4096x6144 9.51 / 10.07 / 13.10 -> 6.85 / 7.64 / 10.68, 4096x5120 8.29 /
    8.87 / 11.28 -> 6.93 / 7.69 / 10.79, 6144x4096 8.05 / 8.70 / 11.69 -> 7.30 / 8.15 / 11.20;
    M = 2 0.91-1.01x); 8192x4096 (8: 0.97-1.03x) and 14336x4096 (1.02-1.08x) keep 16.
    M = 1 caps at 8 from 48 column tiles over <= 128 K tiles (``--workers auto s8 s16``,
    session 24, us, k = 2 / 3 / 4 / 5, 16 -> 8: 4096x6144 7.12 / 7.56 / 7.65 / 10.63 -> 6.32 /
    6.81 / 7.07 / 10.10; 3072x6144, 5120x6144, 6144x6144, 4096x7168, 6144x7168, 8192x6144 2-13%
    faster but for single points within 2%; 4096x7680, 60 tiles, whose 960 runs overflow one
    wave: 14.16 / 14.77 / 15.19 / 20.39 -> 7.65 / 8.18 / 8.27 / 12.48) but keeps 16 below
    (4096x5120, 40 tiles: equal, k = 5 9.27 -> 9.93; 4096x4096, 6144x4096, 5120x5120,
    8192x4096 1-8% slower with 8).
    """
    n_tiles = -(-N // 128)
    k_tiles = -(-K // 64)
    if k_tiles <= 4:
        return 1
    max_splits = gemv_max_splits(m_bucket)
    if n_tiles >= 64:
        if k_tiles < 16:
            return 1
        min_kt, max_splits = (16, max_splits) if k_tiles > 32 else (4, 4)
    elif n_tiles <= 4:
        min_kt = 2
    elif k_tiles <= 8:
        want = min(-(-sm_count // n_tiles), k_tiles // (1 if m_bucket == 1 else 2))
        return 1 << (want.bit_length() - 1)
    else:
        min_kt = 2 if m_bucket == 1 and n_tiles <= 16 else 4
        # At most 8 splits where 8 still give ~3 runs per SM (M = 1: from 48 column tiles;
        # 32 tiles x 8 splits, 2 runs per SM, measured slower) or, at M = 2, 4, where the
        # gather's longer rounds make each split dearer (from 32 tiles).
        few_runs = n_tiles >= 48 and k_tiles <= 128
        if m_bucket > 1:
            few_runs = n_tiles >= 32 and k_tiles < 128
        if few_runs:
            max_splits = 8  # (m_bucket 8's cap already)
    want = min(-(-6 * sm_count // n_tiles), k_tiles // min_kt, max_splits)
    splits = 1 << (max(want, 1).bit_length() - 1)
    # >= 64 column tiles over >= 64 K tiles at M <= 4: twice the splits (runs of >= 8 K
    # tiles) where they still make at most 4 runs per SM, which every variant of those
    # buckets holds in one wave (k = 5 at M = 4: 4 quads per SM; at M = 8 3, not measured;
    # K of 33..63 tiles not measured). Session 28 (``python -m perf.gemv_kernel_check
    # --workers auto s2 s4 s8 --k 2 4 5 --m 1 4``, best of two passes, us, k = 2 / 4 / 5,
    # 4 -> 8 splits): 4096x8192 M = 1 8.13 / 9.09 / 11.13 -> 7.45 / 8.58 / 10.81, M = 4
    # 8.29 / 9.46 / 11.24 -> 8.14 / 9.06 / 11.86; 6144x8192 M = 1 10.78 / 12.36 / 15.45 ->
    # 9.51 / 11.48 / 14.66, M = 4 10.94 / 12.85 / 15.69 -> 10.43 / 12.04 / 15.41. Where
    # doubling passes 4 per SM it lost: 4096x11008 (86 tiles) k = 2 M = 1 9.45 -> 9.93,
    # 4096x14336 (112 tiles, session 27) k = 4 M = 1 13.26 -> 13.51; 4096x16384 and
    # 8192x8192 keep theirs.
    long_k = n_tiles >= 64 and k_tiles >= 64 and m_bucket <= 4
    if long_k and 2 * splits <= max_splits and 2 * splits * n_tiles <= 4 * sm_count:
        splits *= 2
    return splits


def gemv_grid(
    k: int, m_bucket: int, dtype: torch.dtype, N: int, K: int, sm_count: int,
    workers: int | None = None, variant: tuple | None = None,
    fast_memory: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """(workers, CTAs) of the GEMV variant (k, m bucket, dtype) on a weight [N, K];
    ``variant``: its (lookup, stages) if already known (else ``gemv_variant``'s);
    ``fast_memory``: the device's ``has_fast_memory``."""
    from .kernels.gemv import _DTYPES, GemvKernel

    lookup, stages = variant or gemv_variant(k, m_bucket, N, K, sm_count, fast_memory)
    kernel = GemvKernel(k, m_bucket, _DTYPES[_GEMV_DTYPES[dtype]], stages, lookup)
    return kernel_grid(kernel, N, K, sm_count, workers, fast_memory)


def gemv_variant(
    k: int, m_bucket: int, N: int, K: int, sm_count: int,
    fast_memory: bool = False,
):  # fmt: skip
    """(lookup, stages) of the GEMV variant for a weight [N, K] at rows bucket m (None: the
    kernel's default): the lookup by the weight's size (``gemv.gemv_lookup``); k = 5's table
    kernel with a shallower ring, which holds more quads per CTA (``gemv.MORE_QUADS_STAGES``),
    at the rows buckets ``MORE_QUADS_M`` where the split rule wants more than
    ``MORE_QUADS_FROM`` workers per SM or, with ``fast_memory``, on weights of more than
    ``MORE_QUADS_FAST_ELEMS`` elements; k = 4 on sm_90 with a deeper ring
    (``gemv.DEEP_RING_STAGES``) where the default variant's grid has few, short runs per SM
    (both measured)."""
    from .kernels.device_helpers import target_arch_family
    from .kernels.gemv import (
        _DTYPES,
        DEEP_RING_M,
        DEEP_RING_MAX_RUN,
        DEEP_RING_MAX_WORKERS,
        DEEP_RING_STAGES,
        MORE_QUADS_FAST_ELEMS,
        MORE_QUADS_FROM,
        MORE_QUADS_M,
        MORE_QUADS_STAGES,
        GemvKernel,
        default_lookup,
        gemv_lookup,
    )  # fmt: skip

    lookup = gemv_lookup(k, N, K)
    table5 = (lookup or default_lookup(k)) == "pair_table5"
    if table5 and m_bucket in MORE_QUADS_M and k in MORE_QUADS_STAGES:
        want = -(-N // 128) * gemv_splits(N, K, sm_count, m_bucket)
        if want > sm_count * MORE_QUADS_FROM or (fast_memory and N * K > MORE_QUADS_FAST_ELEMS):
            return lookup, MORE_QUADS_STAGES[k]
    deep = k in DEEP_RING_STAGES and m_bucket in DEEP_RING_M and lookup is None
    if deep and target_arch_family() == "sm_90":
        # (the grid does not depend on the dtype)
        kernel = GemvKernel(k, m_bucket, _DTYPES["f16"])
        workers, _ = kernel_grid(kernel, N, K, sm_count, fast_memory=fast_memory)
        run = -(-N // TILE_N) * -(-K // TILE_K) / workers  # K tiles per worker
        if workers <= DEEP_RING_MAX_WORKERS * sm_count and run <= DEEP_RING_MAX_RUN:
            return lookup, DEEP_RING_STAGES[k]
    return lookup, None


def busiest_sm_tiles(n_tiles: int, k_tiles: int, splits: int, sm_count: int) -> int:
    """K tiles the busiest SM streams with ``splits`` runs per column tile: its quads (the
    workers spread over the SMs) times the longest run."""
    return -(-n_tiles * splits // sm_count) * -(-k_tiles // splits)


# A split count above the rule's is taken where it cuts the busiest SM's K tiles
# (``busiest_sm_tiles``) to this share or less, with runs of at least BALANCE_MIN_RUN tiles
# (longer where it makes more than BALANCE_CROWDED_RUNS runs per SM) and at most
# BALANCE_MAX_RUNS runs per SM.
BALANCE_GAIN = 0.92
BALANCE_MIN_RUN = 4
BALANCE_CROWDED_RUNS = 3
BALANCE_MAX_RUNS = 5
# M = 5..8 (rows bucket 8): its owners poll 2 slots per round, so each split past 2 adds a
# round; there a larger count must cut the busiest SM's tiles to this share, within this
# many runs per SM and the bucket's 8 splits.
BALANCE_GAIN_M8 = 0.85
BALANCE_MAX_RUNS_M8 = 4


def balanced_splits(
    n_tiles: int, k_tiles: int, splits: int, sm_count: int, resident: int, m_bucket: int
) -> int:
    """``gemv_splits``'s count, or a larger one (not a power of two) that spreads the K tiles
    more evenly over the SMs: the powers of two leave some shapes a wave of few or uneven
    runs, e.g. 72-80 column tiles over 40-48 K tiles took 2 splits (runs of >= 16 tiles).

    Session 29 (``.dev`` scripts over the library's variants, the rule's count and this one
    in one process, two passes alternating, us). M <= 4, 25 shapes (Qwen2.5 0.5B-14B,
    Qwen3-4B, Llama-2 / -3.2, Phi-3, Gemma-2 and others) x k = 2..5 x M = 1 / 2 / 4: 217
    changed points, geomean 1.157x, the slowest 0.99x; e.g. k = 4 M = 1 3072x9216 (2 -> 7
    splits) 11.13 -> 7.70, 2560x9728 (2 -> 5) 9.58 -> 7.02, 896x9728 (1 -> 3) 5.96 -> 4.26,
    3584x18944 (2 -> 4) 16.68 -> 15.09, 4096x11008 (4 -> 6) 11.16 -> 10.66, 3584x3584 (8 -> 14)
    5.40 -> 5.05. Bounds, measured: at most 5 runs per SM (4096x14336 at 8 splits, 6.8 per SM,
    lost 1.5-4% at k = 4 though its busiest SM streams 56 tiles instead of 64), one polling
    round of the rows bucket (``POLL_WORKERS``: 3584x3584 at M = 4 lost 4-5% to a second round
    at 14 splits), one wave of ``resident`` quads (k = 5 at M = 4 holds 4 per SM: 3584x18944
    takes 3 splits, 22.59 -> 21.20), runs of >= ``BALANCE_MIN_RUN`` tiles, and of more than
    that past 3 runs per SM (runs of 4 tiles gained at 3 per SM or fewer, 1536x1536 M = 2
    4 -> 6 splits 3.95 -> 3.32, but lost 0-6% at 3.6 and 4.8 per SM: 3072x5120 8 -> 12,
    2048x10240 4 -> 8).
    M = 5..8 (rows bucket 8; 70 points of 10 shapes with the bounds above but 8 splits at
    most: geomean 1.05x, 0.80-1.40x): every count that made more than 4 runs per SM lost
    (2560x10240 2 -> 8 0.80-0.88x, 3584x18944 2 -> 4, 5120x13824 4 -> 6, 2560x19456 2 -> 4,
    5120x10240 4 -> 8) and so did 4096x11008 4 -> 6 (busiest SM 0.92 of the rule's: 0.86-0.89x);
    the others gained 12-40% (k = 4 M = 8 3072x9216 2 -> 7 12.65 -> 10.56, 2560x9728 2 -> 5
    11.26 -> 8.80; 1536x8960 4 -> 5, 896x9728 1 -> 3, 2560x10240 k = 5 2 -> 3): hence
    ``BALANCE_GAIN_M8`` and ``BALANCE_MAX_RUNS_M8``, under which 2560x10240 takes 3 at every k
    (then measured: 1.17-1.25x, k = 4 M = 8 11.36 -> 9.17).
    Short K over many columns, which ``gemv_splits`` leaves unsplit below 16 K tiles (session
    11's measurement, with an older gather): now 1.1-1.5x with the balanced count (k = 2..4,
    M = 1 / 4 / 8, ``--workers s1 s2 s3``): 512x8192 1 -> 2 k = 4 M = 1 4.04 -> 3.38, M = 8
    4.33 -> 3.77; 640x8192 1 -> 2 4.60 -> 3.72; 768x4096 2 -> 3 3.83 -> 3.25; 960x9728 1 -> 3
    6.11 -> 4.24 (768x8192 takes 2, 5.16 -> 4.03; its 3, 3.72, has a worse busiest SM)."""
    from .kernels.gemv import POLL_WORKERS

    if m_bucket > 4:
        gain, max_runs, most = BALANCE_GAIN_M8, BALANCE_MAX_RUNS_M8, gemv_max_splits(m_bucket)
    else:
        gain, max_runs, most = BALANCE_GAIN, BALANCE_MAX_RUNS, POLL_WORKERS[m_bucket]
    limit = min(most, min(resident, max_runs * sm_count) // n_tiles, k_tiles // BALANCE_MIN_RUN)
    bound = gain * busiest_sm_tiles(n_tiles, k_tiles, splits, sm_count)
    best, best_tiles = splits, None
    # The lowest busiest-SM count within the bound; the fewest splits among equals.
    for s in range(splits + 1, limit + 1):
        tiles = busiest_sm_tiles(n_tiles, k_tiles, s, sm_count)
        crowded = n_tiles * s > BALANCE_CROWDED_RUNS * sm_count
        if crowded and k_tiles // s <= BALANCE_MIN_RUN:
            continue
        if tiles <= bound and (best_tiles is None or tiles < best_tiles):
            best, best_tiles = s, tiles
    return best


# Split counts of launches with CTA groups (``grouped_splits``): about this many workers per SM.
GROUPED_WORKERS_PER_SM = 3


def grouped_splits(kernel, N: int, k_tiles: int, sm_count: int) -> int:
    """A split count for the GEMV variant with CTA groups (``gemv_cta_groups``: rows bucket
    m >= 2, the default lookup), 0 where none applies: about ``GROUPED_WORKERS_PER_SM``
    workers per SM in runs of >= ``BALANCE_MIN_RUN`` K tiles, if that makes the launch
    grouped (``gemv_cta_groups``, with a CTA per SM). ``kernel_grid`` takes it
    where it is larger than ``balanced_splits``' count: that count's bound of one polling
    round of per-worker slots (``POLL_WORKERS``) does not hold once an owner polls a slot per
    CTA. Session 31 (``perf.gemv_kernel_check --workers auto s4 .. s32``, M = 2 / 4 / 8, 18
    shapes, best of two, us, the rule's count -> this one): 10240x2048 16 -> 24 k = 4 7.74 /
    8.00 / 10.10 -> 6.61 / 7.19 / 8.54; 5120x2048 16 -> 20; 14336x4096 M = 8 8 -> 12 16.65 ->
    15.28; 2048x8192 4 -> 6 k = 2 5.08 / 5.21 / 6.45 -> 4.88 / 5.01 / 5.73; 2048x4096 8 -> 12
    k = 2 M = 8 5.46 -> 5.03; shapes of >= 96 column tiles keep the rule's (4096x14336,
    8192x28672, 2048x12288), as do those whose count would not make groups (4096x2048 M = 8:
    16 splits, 1.94 workers per CTA, were 14% slower than 8)."""
    n_tiles = -(-N // 128)
    splits = min(GROUPED_WORKERS_PER_SM * sm_count // n_tiles, k_tiles // BALANCE_MIN_RUN)
    grouped = gemv_cta_groups(kernel.m, N, (n_tiles * splits, sm_count), (_lookup_arg(kernel),))
    return splits if grouped else 0


# ``kernel_grid`` takes the fewest (full) CTAs where they fill at least this share of the slots.
FULL_CTAS_FILL = 0.95
# ``even_workers``: an even grid where it cuts the busiest SM's K tiles to EVEN_GRID_GAIN of
# the rule's or less, or, at k = 2, 3, saves it at least EVEN_GRID_MIN_SAVED tiles.
EVEN_GRID_GAIN = 0.88
EVEN_GRID_MIN_SAVED = 6
# ... with runs of at least this many K tiles (2048x5120's 396 runs of 3.2: 10-19% slower).
EVEN_GRID_MIN_RUN = 6


def has_fast_memory(props) -> bool:
    """Whether a device (``device.DeviceProps``) streams ``FAST_MEMORY_GBS_PER_SM`` or more of
    DRAM bandwidth per SM (the H200, not the H100): there the GEMV is issue-bound at every k
    (``issue_bound_k``) and k = 5 takes its shallow ring at M = 5..8 on more weights
    (``gemv_variant``). An unknown bandwidth (0) counts as slow."""
    return props.memory_gbs >= FAST_MEMORY_GBS_PER_SM * props.sm_count


def issue_bound_k(fast_memory: bool) -> tuple[int, ...]:
    """The k whose M = 1 GEMV is bound by issuing its K loop, not by the DRAM stream."""
    return ISSUE_BOUND_K_FAST_MEMORY if fast_memory else ISSUE_BOUND_K


def even_grid_applies(m_bucket: int, k: int, fast_memory: bool = False) -> bool:
    """Whether ``even_workers`` may give launches of this rows bucket and k a grid across
    strips (and so the ``crossing`` variant, which sm_90 ships for M = 1 only): M = 1 and
    k issue-bound on the device (``issue_bound_k``). At M = 2, 4 (k = 2, 3) the crossing
    variants are correct but their even grids of 4-7 quads per SM ran 0.96-1.05x of the CTA
    groups' grids, within the 5% the same grid moves call to call (session 37): not taken."""
    from .kernels.device_helpers import target_arch_family

    issue_bound = k in issue_bound_k(fast_memory)
    return m_bucket == 1 and issue_bound and target_arch_family() == "sm_90"


def even_workers(
    kernel, workers: int, tiles: tuple[int, int], sm_count: int, resident: int,
    fast_memory: bool = False,
) -> int:  # fmt: skip
    """``workers``, or as many runs of equal length on every SM (``q`` x SMs, runs across
    strips: the ``crossing`` variant, whose ring runs on at a strip's end), where the split
    rule leaves some SMs a quad more than others: M = 1, k issue-bound on the device
    (``issue_bound_k`` of ``has_fast_memory``), sm_90 (measured there; on sm_80 the crossing
    variants of k = 2, 3 spill).

    The GEMV of the issue-bound k at M = 1 is bound by each SM's issue slots or shared-memory
    pipe, so an SM with a quad more finishes that much later: 4096x14336 (448 runs of 16 K tiles:
    52 SMs hold 4, 80 hold 3) ran its 3-quad SMs' K loops out at 8.5-9.3 us, the 4-quad
    ones' at 10.9-11.2 (k = 3, per-warp ``%globaltimer`` stamps, session 34). Each crossing
    adds a partial to gather and a segment to the run (~0.3 us), so the even grid pays where
    it cuts the busiest SM's K tiles (``cta_busiest_tiles``: the rule's workers interleave
    over the CTAs, the crossing variants' lie in consecutive blocks) to EVEN_GRID_GAIN of the
    rule's or less or, at k = 2, 3 (the issue-bound ones), saves it EVEN_GRID_MIN_SAVED tiles
    or more; in runs of EVEN_GRID_MIN_RUN tiles or more. Sessions 34-35 (``python -m
    perf.gemv_kernel_check --no-check --workers auto W``, M = 1, us, k = 2 / 3 / 5, rule ->
    even, the busiest SM's K tiles): 4096x14336 (64 -> 55) 10.95 / 12.78 / 17.20 -> 10.40 /
    12.02 / 16.54; 18944x3584 (76 -> 64) 12.69 / 15.02 / 20.98 -> 11.59 / 13.45 / 19.17;
    2048x10240 (24 -> 20) 5.86 / 6.53 / 8.94 -> 5.89 / 6.64 / 8.25; 8960x1536 5.51 / 6.07 / 7.64
    -> 5.51 / 5.93 / 7.06; saving 6-7 tiles: 8192x28672 (224 -> 218) 31.32 / 38.00 -> 30.56 /
    37.46, 28672x8192 (the same) 30.97 / 37.68 -> 30.35 / 38.19 (k = 5 53.78 -> 53.96),
    3584x18944 (70 -> 63) 11.89 / 14.02 / 19.31 -> 11.60 / 13.68 / 19.49; fewer: 5120x13824
    (70 -> 66) within 1%, 11008x4096 (44 -> 42) 8.55 / 9.82 / 13.11 -> 8.97 / 10.32 / 13.43,
    14336x4096 (56 -> 55) 1-3% slower; k = 4, bound by the DRAM stream on the H100,
    4096x14336 13.27 -> 13.46 (on the H200 12.69 -> 11.56: ``has_fast_memory``); 2048x5120
    (12 -> 10, runs of 3 K tiles) 4.24 / 4.64 / 5.77 -> 5.05 / 5.45 / 6.37."""
    if not even_grid_applies(kernel.m, kernel.k, fast_memory) or workers <= sm_count:
        return workers
    q = -(-workers // sm_count)  # the rule's most quads on one SM
    if q * sm_count > resident:
        return workers
    even = q * sm_count
    if tiles[0] * tiles[1] < EVEN_GRID_MIN_RUN * even:  # (short runs pay more for crossings)
        return workers
    slots = sm_count * kernel.ctas_per_sm
    rule = cta_busiest_tiles(
        *tiles, workers, grid_ctas(kernel, workers, slots), sm_count, interleaved=True
    )
    even_tiles = cta_busiest_tiles(*tiles, even, grid_ctas(kernel, even, slots), sm_count)
    if even_tiles <= EVEN_GRID_GAIN * rule:
        return even
    saves = kernel.k <= 3 and rule - even_tiles >= EVEN_GRID_MIN_SAVED
    return even if saves else workers


def cta_busiest_tiles(
    n_tiles: int, k_tiles: int, workers: int, ctas: int, sm_count: int, interleaved: bool = False
) -> int:
    """K tiles the busiest SM streams when ``workers`` equal runs of the column tiles' K tiles
    (``device_helpers.run_start``) are dealt to ``ctas`` CTAs in consecutive blocks
    (``device_helpers.cta_first``: the first workers % ctas CTAs hold one more; CTA groups and
    the ``crossing`` variants) or, ``interleaved``, worker w to CTA w % ctas (the others), CTA
    c on SM c % sm_count. Exact where ``busiest_sm_tiles`` rounds every run up."""
    units = n_tiles * k_tiles
    sm_tiles = [0] * sm_count
    if interleaved:
        for w in range(workers):
            sm_tiles[w % ctas % sm_count] += (w + 1) * units // workers - w * units // workers
    else:
        per_cta, longer = divmod(workers, ctas)
        first = 0
        for c in range(ctas):
            end = (c + 1) * per_cta + min(c + 1, longer)  # (``cta_first`` of CTA c + 1)
            sm_tiles[c % sm_count] += end * units // workers - first * units // workers
            first = end
    return max(sm_tiles)


# ``even_grouped_splits``: a larger split count for a launch with CTA groups where it cuts the
# busiest SM's K tiles (``cta_busiest_tiles``) to this share or less.
GROUPED_EVEN_GAIN = 0.92


def even_grouped_splits(kernel, n_tiles: int, k_tiles: int, splits: int, sm_count: int) -> int:
    """``splits``, or more where the launch takes CTA groups (``gemv_cta_groups``: M >= 2)
    and its CTAs would stream uneven shares of the K tiles: the CTAs hold consecutive
    workers, so e.g. 4096x14336's 448 runs of 16 K tiles on 132 CTAs give 52 SMs 64 tiles and
    80 SMs 48; 7 splits (784 runs of 9-10 tiles) give every SM 54-55. The count (up to one
    wave of quads, runs of >= ``BALANCE_MIN_RUN`` tiles) with the fewest tiles on the busiest
    SM, the fewest splits among equals, if that cuts them to ``GROUPED_EVEN_GAIN`` of
    ``splits``' or less."""
    slots = sm_count * kernel.ctas_per_sm

    def busiest(s: int) -> int | None:
        workers = n_tiles * s
        ctas = grid_ctas(kernel, workers, slots)
        if not gemv_cta_groups(kernel.m, n_tiles * 128, (workers, ctas), (_lookup_arg(kernel),)):
            return None
        return cta_busiest_tiles(n_tiles, k_tiles, workers, ctas, sm_count)

    rule = busiest(splits)
    if rule is None:
        return splits
    limit = min(slots * kernel.quads // n_tiles, k_tiles // BALANCE_MIN_RUN)
    best, best_tiles = splits, GROUPED_EVEN_GAIN * rule
    for s in range(splits + 1, limit + 1):
        tiles = busiest(s)
        if tiles is not None and tiles <= best_tiles and (best == splits or tiles < best_tiles):
            best, best_tiles = s, tiles
    return best


def _lookup_arg(kernel) -> str | None:
    """The kernel's lookup as ``gemv_variant`` gives it: None for its k's default."""
    from .kernels.gemv import default_lookup

    return None if kernel.lookup == default_lookup(kernel.k) else kernel.lookup


def grid_ctas(kernel, workers: int, slots: int) -> int:
    """CTAs of a ``GemvKernel`` launch of ``workers`` on ``slots`` CTA slots (SMs x CTAs per
    SM): one CTA per slot, or as few as hold them all (each CTA's quads take its workers:
    ``cta_busiest_tiles`` says which)."""
    fewest = -(-workers // kernel.quads)
    if kernel.quads > 1 and kernel.k >= 3 and fewest >= FULL_CTAS_FILL * slots:
        # Workers that nearly fill every slot (e.g. 896 quads: 128 CTAs of 7, or 132 of
        # which 28 hold 6): fewer, full CTAs. A CTA with a quad less leaves its SM idle
        # early, and the kernels of k >= 3 are bound by the DRAM stream there, not by the
        # SM count (8192x28672 k = 4: 48.3 -> 46.1 us; k = 3 equal; k = 2, bound by the
        # shared-memory pipe of each SM, 1-2% slower: not taken).
        return fewest
    return max(fewest, min(workers, slots))


def kernel_grid(
    kernel, N: int, K: int, sm_count: int, workers: int | None = None,
    fast_memory: bool = False,
):  # fmt: skip
    """(workers, CTAs) of a ``GemvKernel``: column tiles x ``gemv_splits`` workers (evened
    out by ``balanced_splits``, with CTA groups over the CTAs by ``even_grouped_splits``, at
    M = 1 perhaps equal runs across strips: ``even_workers``, by ``fast_memory``)
    unless given, as many splits as fit the resident quads (one
    wave; the kernel's CTAs per SM come from its CTA size, registers and shared memory)."""
    from .kernels.device_helpers import check_run_bounds
    from .kernels.gemv import MAX_A_BYTES

    slots = sm_count * kernel.ctas_per_sm
    n_tiles, k_tiles = -(-N // 128), -(-K // 64)
    units = n_tiles * k_tiles
    if not workers:
        resident = slots * kernel.quads  # quads of one wave
        splits = gemv_splits(N, K, sm_count, kernel.m)
        splits = balanced_splits(n_tiles, k_tiles, splits, sm_count, resident, kernel.m)
        splits = max(splits, grouped_splits(kernel, N, k_tiles, sm_count))
        splits = max(1, min(splits, resident // n_tiles))
        splits = even_grouped_splits(kernel, n_tiles, k_tiles, splits, sm_count)
        workers = n_tiles * splits
        tiles = (n_tiles, k_tiles)
        workers = even_workers(kernel, workers, tiles, sm_count, resident, fast_memory)
    workers = min(workers, units)
    ctas = grid_ctas(kernel, workers, slots)
    # Every quad computes its run bounds, idle ones too (worker index up to ctas x quads).
    check_run_bounds(units, ctas * kernel.quads)
    if kernel.m * K * 2 >= MAX_A_BYTES:
        raise ValueError(f"K={K}: {kernel.m} activation rows exceed the GEMV's 32-bit offsets")
    return workers, ctas


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class _SplitKState:
    """Split-K scratch of one (device, stream): an fp32 workspace and int32 counters that the
    kernel leaves at zero, so nothing is cleared per call; and the GEMV's partial slots, all
    ones (``EMPTY_SLOT``) between calls, which its polled hand-over leaves so. Per stream, so
    GEMVs on two streams never share them. Driver memory (``device.scratch_tensor``),
    outside torch's caching allocator: a first call inside a CUDA-graph capture or
    inductor's graph pool (``mode="reduce-overhead"``) allocates nothing there. Grows to
    powers of two; an outgrown buffer stays allocated, since plans and captured graphs may
    still use it."""

    def __init__(self, dev: int):
        self.dev = dev
        self.workspace: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None

    def get(
        self, ws_elems: int, groups: int, empty_slots: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(workspace, counters); ``empty_slots``: the slots as the workspace."""
        if empty_slots:
            if self.slots is None or self.slots.numel() < ws_elems:
                n = _pow2(max(ws_elems, 1 << 16))
                self.slots = _device.scratch_tensor(self.dev, n, torch.float32, fill_byte=0xFF)
        elif self.workspace is None or self.workspace.numel() < ws_elems:
            n = _pow2(max(ws_elems, 1 << 16))
            self.workspace = _device.scratch_tensor(self.dev, n, torch.float32)
        if self.counters is None or self.counters.numel() < groups:
            n = _pow2(max(groups, 4096))
            self.counters = _device.scratch_tensor(self.dev, n, torch.int32, fill_byte=0)
        return (self.slots if empty_slots else self.workspace), self.counters


_split_states: dict[tuple[int, int], _SplitKState] = {}


def _split_scratch(dev: int, stream: int, ws_elems: int, groups: int, empty_slots: bool = False):
    """(workspace, counters) of a (device, stream), at least ws_elems and groups long;
    ``empty_slots``: the GEMV's slots as the workspace (``_SplitKState``)."""
    state = _split_states.get((dev, stream))
    if state is None:
        state = _split_states[(dev, stream)] = _SplitKState(dev)
    return state.get(ws_elems, groups, empty_slots)


class _GemvPlan:
    """One weight shape (k, N, K) for one activation dtype on one CUDA device, made by the
    first call (which checks the weight's tensors in full): the sizes the hot path re-checks,
    the most rows the GEMV serves (``gemv_max_m``), per M up to that the launch function (on
    first use of that M) and stream-K grid, and per stream split-K scratch big enough for
    every M."""

    __slots__ = ("k", "N", "K", "dtype", "variants", "words", "codes", "bias_shape")
    __slots__ += ("max_m", "grids", "groups", "crossing", "counters")
    __slots__ += ("ws_elems", "by_m", "scratch")

    def __init__(
        self, k: int, N: int, K: int, dtype: torch.dtype, sm_count: int,
        fast_memory: bool = False,
    ):  # fmt: skip
        self.k, self.N, self.K, self.dtype = k, N, K, dtype
        self.max_m = gemv_max_m(N, K, k)
        # launch forms (rows bucket, row sets), each set's grid on 1 / sets of the SMs
        forms = {gemv_rows(M) for M in range(1, self.max_m + 1)}
        sms = {f: sm_count // f[1] for f in forms}
        # (lookup, stages) per form (None: the kernel's defaults)
        self.variants = {f: gemv_variant(k, f[0], N, K, sms[f], fast_memory) for f in forms}
        self.words = tiled_sizes(k, N, K)[0]
        self.codes = 1 << k
        self.bias_shape = torch.Size((N,))
        # split-K counters: one per warp strip (WARPS per column tile) and row set
        # (``GemvKernel.row_set_views``)
        from .kernels.gemv import WARPS

        self.counters = -(-N // TILE_N) * WARPS * max(sets for _, sets in forms)
        # (workers, ctas) per form
        self.grids = {
            f: gemv_grid(k, f[0], dtype, N, K, sms[f], None, self.variants[f], fast_memory)
            for f in forms
        }
        # whether each form takes the variant with CTA groups
        self.groups = {f: gemv_cta_groups(f[0], N, self.grids[f], self.variants[f]) for f in forms}
        # whether its runs cross strips (``even_workers``): the variant whose ring runs on
        self.crossing = {
            f: gemv_crossing(f[0], k, N, self.grids[f], self.groups[f], fast_memory) for f in forms
        }
        self.ws_elems = max(sets * _ws_elems(w, m) for (m, sets), (w, _) in self.grids.items())
        self.by_m: list[tuple[object, int, int, int, int] | None] = [None] * (self.max_m + 1)
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def entry(self, M: int) -> tuple[object, int, int, int, int]:
        """(launch function, workers, CTAs, ``_cta_args``) for M rows, loading the variant
        on first use."""
        got = self.by_m[M]
        if got is None:
            f = gemv_rows(M)
            fn = _gemv_launcher(
                self.k, f[0], self.dtype, *self.variants[f], self.groups[f], self.crossing[f],
                f[1] > 1,
            )  # fmt: skip
            workers, ctas = self.grids[f]
            cta_args = _cta_args(self.groups[f], self.N, workers, ctas)
            got = self.by_m[M] = (fn, workers, ctas, *cta_args)
        return got


def _cta_args(cta_groups: bool, N: int, workers: int, ctas: int) -> tuple[int, int]:
    """The GEMV's (per_cta, splits) launch arguments (``GemvKernel.cta_args``)."""
    from .kernels.gemv import GemvKernel

    return GemvKernel.cta_args(cta_groups, N, workers, ctas)


def gemv_cta_groups(m_bucket: int, N: int, grid: tuple[int, int], variant: tuple) -> bool:
    """Whether the GEMV of rows bucket m on a weight [N, K] takes the variant with CTA groups
    (``GemvKernel.CTA_GROUPS_MIN_WORKERS``): the default lookup, runs that lie in one strip
    each, and more than that many workers per CTA on average."""
    from .kernels.gemv import GemvKernel

    workers, ctas = grid
    return (
        m_bucket >= GemvKernel.CTA_GROUPS_FROM_M
        and variant[0] is None
        and workers % -(-N // 128) == 0
        and workers > GemvKernel.CTA_GROUPS_MIN_WORKERS * ctas
    )


def gemv_crossing(
    m_bucket: int, k: int, N: int, grid: tuple[int, int], cta_groups: bool,
    fast_memory: bool = False,
) -> bool:  # fmt: skip
    """Whether a GEMV launch takes the ``crossing`` variant (whose ring runs on across a
    strip's end): its grid's runs cross strips (workers not a multiple of the column tiles,
    no CTA groups) where ``even_workers`` makes such grids. Elsewhere a grid across strips
    (an explicit worker count) runs on the variant that drains the ring at each crossing."""
    crosses = not cta_groups and grid[0] % -(-N // 128) != 0
    return crosses and even_grid_applies(m_bucket, k, fast_memory)


def _ws_elems(workers: int, m_bucket: int) -> int:
    """fp32 workspace of the GEMV: two partial strips (128 columns x m rows) per worker."""
    return 2 * workers * m_bucket * 128


# (k, N, K, device, A's dtype) -> plan; made only for CUDA devices and fp16/bf16
_gemv_plans: dict[tuple[int, int, int, int, torch.dtype], _GemvPlan] = {}
# (k, m bucket, dtype, lookup, stages, CTA groups, crossing, row sets) -> launch function
# taking the stream last (compile.stream_launcher)
_gemv_launchers: dict[tuple, object] = {}


def _gemv_launcher(
    k: int, m_bucket: int, dtype: torch.dtype, lookup=None, stages=None, cta_groups=False,
    crossing=False, row_sets=False,
):  # fmt: skip
    key = (k, m_bucket, dtype, lookup, stages, cta_groups, crossing, row_sets)
    fn = _gemv_launchers.get(key)
    if fn is None:
        from .kernels.gemv import gemv_spec

        spec = gemv_spec(
            k, m_bucket, _GEMV_DTYPES[dtype], stages, lookup, cta_groups=cta_groups,
            crossing=crossing, row_sets=row_sets,
        )  # fmt: skip
        fn = stream_launcher(spec)
        _gemv_launchers[key] = fn
    return fn


def gemm(
    A: torch.Tensor,
    qw: KbitWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[..., N] = A[..., K] @ W^T (+ bias), W a ``KbitWeight``; output in A's dtype.

    M = product of A's leading dims. On CUDA (fp16/bf16) M <= 8 runs the GEMV
    kernel (on small weights up to M = 64, in row sets: ``gemv_max_m``); larger M the
    mma.sync GEMM (or dequantize + cuBLAS from the measured crossover). On the CPU:
    dequantize + matmul. ``out``: a contiguous [..., N] tensor of A's dtype that shares no
    memory with A or bias.
    """
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"gemm takes A (torch.Tensor) and qw (KbitWeight), got {type(qw).__name__}")
    return linear(A, qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, bias, out)


def linear(A, packed, absmax, codebook, scale, k: int, N: int, K: int, bias=None, out=None):
    """``gemm`` over the weight's tensors (what ``KbitLinear`` calls: no KbitWeight per call)."""
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"A must be a torch.Tensor, got {type(A).__name__}")
    if _is_compiling() or (
        _grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))
    ):
        if out is None:
            return torch.ops.kbit_cute.gemm(A, packed, absmax, codebook, scale, k, N, K, bias)
        torch.ops.kbit_cute.gemm_out(A, packed, absmax, codebook, scale, k, N, K, bias, out)
        return out
    return _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias, out)


def _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias=None, out=None):
    """Eager gemm. Inline: the hot path, a planned weight shape on CUDA, with the per-call
    checks in the cheapest order (A's K, dtype and device; the weight's device and sizes;
    bias and out). First calls, every error, the CPU and another current device go through
    ``_gemm_general``; M past what the GEMV serves (``gemv_max_m``) through ``_gemm_large_m``."""
    dev = A.get_device()
    plan = _gemv_plans.get((k, N, K, dev, A.dtype))  # none for the CPU or other dtypes
    shape = A.shape
    if (
        plan is None
        or not shape
        or shape[-1] != K
        or packed.get_device() != dev
        or packed.numel() != plan.words
        or codebook.numel() != plan.codes
        or (
            bias is not None
            and (
                bias.shape != plan.bias_shape
                or bias.dtype != plan.dtype
                or bias.get_device() != dev
                or not bias.is_contiguous()
            )
        )
    ):
        return _gemm_general(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    if out is None:
        out = A.new_empty(*shape[:-1], N)  # ints: ~1 us cheaper than a shape tuple
    else:
        _check_out(A, N, out, dev, bias)
    M = shape[0] if len(shape) == 2 else A.numel() // K
    if M == 0:
        return out
    if M > plan.max_m:
        return _gemm_large_m(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    entry = plan.by_m[M]
    if entry is None or dev != _current_device():
        return _gemv_launch(A, packed, absmax, codebook, scale, k, N, K, bias, out, M, None, dev)
    stream = _raw_stream(dev)
    scratch = plan.scratch.get(stream)
    if scratch is None:
        scratch = plan.scratch[stream] = _split_scratch(
            dev, stream, plan.ws_elems, plan.counters, empty_slots=True
        )
    if not A.is_contiguous():
        A = A.contiguous()
    fn, workers, ctas, per_cta, splits = entry
    try:
        fn(
            A, packed, absmax, codebook, scale, out if bias is None else bias, out, scratch[0],
            scratch[1], M, N, K, workers, ctas, per_cta, splits, 0 if bias is None else 1, stream,
        )  # fmt: skip
    except MisalignedError:
        grid = (workers, ctas, per_cta, splits)
        args = (packed, absmax, codebook, scale, bias, out, scratch, M, N, K, grid, stream)
        _launch_gemv(fn, A.clone(memory_format=torch.contiguous_format), *args)
    return out


def _check_gemm_args(A, packed, absmax, codebook, scale, k, N, K, bias, out):
    """Everything but the weight's own consistency (``check_weight``); the device index."""
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"A must be a torch.Tensor, got {type(A).__name__}")
    if A.ndim == 0 or A.shape[-1] != K:
        raise ValueError(f"A's last dimension must be the weight's K={K}, got shape {A.shape}")
    dev = A.get_device()
    if not isinstance(packed, torch.Tensor) or packed.get_device() != dev:
        where = packed.device if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"A is on {A.device} but the weight is on {where}; move one")
    if dev >= 0 and A.dtype not in _GEMV_DTYPES:
        raise TypeError(
            f"on CUDA, A must be float16 or bfloat16, got {A.dtype}; convert the input "
            "(and the model: model.half() or model.to(torch.bfloat16))"
        )
    if bias is not None and (
        not isinstance(bias, torch.Tensor)
        or bias.shape != (N,)
        or bias.get_device() != dev
        or bias.dtype != A.dtype
    ):
        got = (
            f"{bias.dtype} {tuple(bias.shape)} on {bias.device}"
            if isinstance(bias, torch.Tensor)
            else type(bias).__name__
        )
        raise ValueError(
            f"bias must be a {A.dtype} tensor of shape ({N},) on {A.device}, got {got}"
        )
    if out is not None:
        _check_out(A, N, out, dev, bias)
    return dev


def _check_out(A, N, out, dev, bias=None):
    if not isinstance(out, torch.Tensor) or (
        out.shape[:-1] != A.shape[:-1]
        or out.shape[-1:] != (N,)
        or out.dtype != A.dtype
        or out.get_device() != dev
        or not out.is_contiguous()
    ):
        got = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ValueError(
            f"out must be a contiguous {A.dtype} tensor of shape {(*A.shape[:-1], N)} on "
            f"{A.device}, got {got}"
        )
    # Every path reads A (and bias) while it writes out: they must not overlap (views of
    # one buffer that do not are fine; the storage test keeps the common case cheap).
    storage = out.untyped_storage().data_ptr()
    for name, t in (("A", A), ("bias", bias)):
        if t is not None and t.untyped_storage().data_ptr() == storage and _overlaps(t, out):
            raise ValueError(f"out shares memory with {name}; pass a separate output tensor")


def _overlaps(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the bytes t spans (first to last element) meet those of contiguous ``out``."""
    lo, hi = out.data_ptr(), out.data_ptr() + out.nbytes
    start = t.data_ptr()
    if t.is_contiguous():
        end = start + t.nbytes
    elif t.numel() == 0:
        return False
    else:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        end = start + (last + 1) * t.element_size()
    return start < hi and lo < end


def _gemm_general(A, packed, absmax, codebook, scale, k, N, K, bias=None, out=None):
    """Every case of eager gemm, with every check: the first call for a weight shape (which
    plans it), the CPU, errors."""
    dev = _check_gemm_args(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    if dev < 0:
        if A.device != packed.device:  # CPU vs meta, say: both report device index -1
            raise ValueError(f"A is on {A.device} but the weight is on {packed.device}; move one")
        check_weight(packed, absmax, codebook, scale, k, N, K)  # no plan: every CPU call
        W = _dequantize_reference(_as_weight(packed, absmax, codebook, scale, k, N, K), A.dtype)
        r = torch.nn.functional.linear(A, W, bias)
        return r if out is None else out.copy_(r)
    plan = _plan(packed, absmax, codebook, scale, k, N, K, dev, A.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # the kernels read bias[n] at n
    if out is None:
        out = A.new_empty(*A.shape[:-1], N)
    M = A.numel() // K
    if M == 0:
        return out
    if M > plan.max_m:
        return _gemm_large_m(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    return _gemv_launch(A, packed, absmax, codebook, scale, k, N, K, bias, out, M, None, dev)


def _plan(packed, absmax, codebook, scale, k, N, K, dev: int, dtype) -> _GemvPlan:
    """The plan of a weight shape on a CUDA device: made on first use after checking the
    weight's tensors and the GPU; remade when the tensors disagree with it."""
    plan = _gemv_plans.get((k, N, K, dev, dtype))
    if plan is None or packed.numel() != plan.words or codebook.numel() != plan.codes:
        check_weight(packed, absmax, codebook, scale, k, N, K)
        props = _device.check_device(dev)
        if plan is None:
            plan = _GemvPlan(k, N, K, dtype, props.sm_count, has_fast_memory(props))
            _gemv_plans[(k, N, K, dev, dtype)] = plan
    return plan


def _gemv_launch(A, packed, absmax, codebook, scale, k, N, K, bias, out, M, workers, dev):
    """The GEMV on checked CUDA arguments with a plan, off the hot path: the first launch
    of an M, a device other than the current one, an explicit worker count."""
    if dev != _current_device():
        with torch.cuda.device(dev):
            return _gemv_launch(
                A, packed, absmax, codebook, scale, k, N, K, bias, out, M, workers, dev
            )
    plan = _gemv_plans[(k, N, K, dev, A.dtype)]
    fn, plan_workers, ctas, _, _ = plan.entry(M)
    grid = (plan_workers, ctas)
    m, sets = gemv_rows(M)
    if workers:
        sm_count = _device.check_device(dev).sm_count
        variant = plan.variants[(m, sets)]
        grid = gemv_grid(k, m, A.dtype, N, K, sm_count // sets, workers, variant)
    stream = _raw_stream(dev)
    # (at least the plan's: what the hot path will ask of this stream for any M)
    ws_elems = max(sets * _ws_elems(grid[0], m), plan.ws_elems)
    scratch = _split_scratch(dev, stream, ws_elems, plan.counters, empty_slots=True)
    if not A.is_contiguous():
        A = A.contiguous()
    grid = (*grid, *_cta_args(plan.groups[(m, sets)], N, *grid))
    try:
        _launch_gemv(
            fn, A, packed, absmax, codebook, scale, bias, out, scratch, M, N, K, grid, stream
        )
    except MisalignedError:
        # A view that does not start on a 16-byte boundary (the other pointers are ours or
        # only need element alignment): copy it to fresh storage and launch again.
        A = A.clone(memory_format=torch.contiguous_format)
        _launch_gemv(
            fn, A, packed, absmax, codebook, scale, bias, out, scratch, M, N, K, grid, stream
        )
    return out


def _launch_gemv(fn, A, packed, absmax, codebook, scale, bias, out, scratch, M, N, K, grid, stream):
    has_bias = bias is not None
    fn(
        A, packed, absmax, codebook, scale, bias if has_bias else out, out, scratch[0],
        scratch[1], M, N, K, *grid, int(has_bias), stream,
    )  # fmt: skip


def _gemv(A, qw: KbitWeight, bias, out, M: int, workers: int | None = None):
    """The GEMV on CUDA tensors with an explicit stream-K worker count (benchmarks, tests)."""
    dev = A.get_device()
    plan = _plan(qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, dev, A.dtype)
    if not 1 <= M <= plan.max_m:
        raise ValueError(f"the GEMV serves 1..{plan.max_m} rows of this weight, got M={M}")
    args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, bias, out, M)
    return _gemv_launch(*args, workers, dev)


def _gemm_large_m(A, packed, absmax, codebook, scale, k, N, K, bias, out):
    """M past the GEMV (``gemv_max_m``): the mma.sync GEMM (deterministic split-K), or from
    the measured crossover (``gemm_table.CUBLAS_FROM_M``, for weights over the L2
    ``CUBLAS_FROM_M_OVER_L2``, for small weights ``CUBLAS_FROM_M_SMALL``) dequantize to A's
    dtype and call cuBLAS."""
    from . import gemm_dispatch

    M = A.numel() // K
    A2d, out2d = A.reshape(M, K), out.view(M, N)
    if gemm_dispatch.use_cublas(M, N, K, k, A.get_device()):
        # (the weight was checked when its shape was planned: no second check per call)
        W = torch.empty(N, K, dtype=A.dtype, device=A.device)
        _launch_dequantize(packed, absmax, codebook, scale, k, N, K, W)
        # cuBLAS writes out itself (what F.linear computes, without its M x N result and a
        # copy kernel: 1.4 us per call on Qwen-sized weights at M = 32..64, measured)
        if bias is None:
            torch.mm(A2d, W.t(), out=out2d)
        else:
            torch.addmm(bias, A2d, W.t(), out=out2d)
        return out
    gemm_dispatch.launch(
        A2d, packed, absmax, codebook, scale, k, N, K, bias, out2d, deterministic=True
    )  # fmt: skip
    return out


@torch.library.custom_op("kbit_cute::gemm", mutates_args=())
def _gemm_op(
    A: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    scale: torch.Tensor,
    k: int,
    N: int,
    K: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias)


def _fake_gemm_checks(A, packed, absmax, codebook, scale, k, N, K, bias):
    check_weight(packed, absmax, codebook, scale, k, N, K)
    if A.shape[-1] != K:
        raise ValueError(f"A's last dimension must be the weight's K={K}, got shape {A.shape}")
    if A.device != packed.device:
        raise ValueError(f"A is on {A.device} but the weight is on {packed.device}; move one")
    if A.is_cuda and A.dtype not in _GEMV_DTYPES:
        raise TypeError(f"on CUDA, A must be float16 or bfloat16, got {A.dtype}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype != A.dtype):
        raise ValueError(f"bias must be a {A.dtype} tensor of shape ({N},)")


@_gemm_op.register_fake
def _(A, packed, absmax, codebook, scale, k, N, K, bias):
    _fake_gemm_checks(A, packed, absmax, codebook, scale, k, N, K, bias)
    return A.new_empty((*A.shape[:-1], N))


def _gemm_setup_context(ctx, inputs, output):
    A, packed, absmax, codebook, scale, k, N, K, bias = inputs
    ctx.save_for_backward(packed, absmax, codebook, scale)
    ctx.weight = (k, N, K)
    ctx.bias_needs_grad = bias is not None and bias.requires_grad


def _gemm_backward(ctx, grad):
    """dA = grad @ W (W dequantized to grad's dtype); dbias = grad summed over rows. The
    quantized weight itself is frozen (no gradient)."""
    packed, absmax, codebook, scale = ctx.saved_tensors
    k, N, K = ctx.weight
    dt = grad.dtype if grad.dtype in _OUT_NAMES else torch.float32  # e.g. float64 (gradcheck)
    W = torch.ops.kbit_cute.dequantize(packed, absmax, codebook, scale, k, N, K, dt).to(grad.dtype)
    grad_A = grad @ W if ctx.needs_input_grad[0] else None
    grad_bias = grad.reshape(-1, N).sum(0) if ctx.bias_needs_grad else None
    return grad_A, None, None, None, None, None, None, None, grad_bias


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


@torch.library.custom_op("kbit_cute::gemm_out", mutates_args=("out",))
def _gemm_out_op(
    A: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    scale: torch.Tensor,
    k: int,
    N: int,
    K: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias, out)


@_gemm_out_op.register_fake
def _(A, packed, absmax, codebook, scale, k, N, K, bias, out):
    _fake_gemm_checks(A, packed, absmax, codebook, scale, k, N, K, bias)
    if tuple(out.shape) != (*A.shape[:-1], N) or out.dtype != A.dtype:
        raise ValueError(f"out must be a {A.dtype} tensor of shape {(*A.shape[:-1], N)}")


# ============================================================================ grouped_gemm
# MoE (issue 7) adds ``kbit_cute::grouped_gemm`` here, following gemm: a public function that
# calls ``_grouped_gemm_impl`` directly unless compiling, a custom_op over plain tensors (the
# experts' packed/absmax stacked, per-expert scales, the token offsets) with a fake that checks
# shapes, and a ``grouped_gemm_out`` variant with ``mutates_args=("out",)``.
