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
from .compile import MisalignedError, current_raw_stream, launcher
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
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=packed.device)
    elif out.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned (a fresh tensor is)")
    from .kernels.dequantize import dequantize_spec

    launcher(dequantize_spec(k, _OUT_NAMES[dtype]))(packed, absmax, codebook, scale, out, N, K)
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

GEMV_MAX_M = 4
_COLS_PER_GROUP = 64


def gemv_splits(N: int, K: int, sm_count: int, m: int = 1) -> int:
    """K splits for the GEMV's 128-column CTAs (a power of two, at most 16).

    From an H100 sweep of splits 1..16 (``python -m perf.gemv_kernel_check --splits 1 2 4 8
    16``, 2026-11-22): shapes with many column tiles want long CTAs (>= 16 K tiles each)
    and about 6 CTAs per SM in all; shapes with few column tiles are latency-bound and
    want up to 16 splits of >= 4 K tiles. With M > 2 the split-K reduction costs more, and
    half as many splits measured best where the split count comes from few column tiles.
    """
    n_tiles = -(-N // 128)
    k_tiles = -(-K // 64)
    min_kt = 16 if n_tiles >= 64 else 4
    want = min(-(-6 * sm_count // n_tiles), k_tiles // min_kt, 16)
    if m > 2 and n_tiles < 64:
        want //= 2
    return 1 << (max(want, 1).bit_length() - 1)


class _SplitKState:
    """Per (device, stream) fp32 workspace and zeroed counters for split-K; grown, never
    shrunk. The kernel leaves the counters at zero, so nothing is cleared per call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = torch.empty(1 << 16, dtype=torch.float32, device=device)
        self.counters = torch.zeros(4096, dtype=torch.int32, device=device)

    def get(self, ws_elems: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.workspace.numel() < ws_elems:
            self.workspace = torch.empty(ws_elems, dtype=torch.float32, device=self.device)
        if self.counters.numel() < groups:
            self.counters = torch.zeros(groups, dtype=torch.int32, device=self.device)
        return self.workspace, self.counters


_split_states: dict[tuple[int, int], _SplitKState] = {}
# (k, N, K, device) -> (K splits, int32 words of the weight): one dict lookup per call
_gemv_plans: dict[tuple[int, int, int, int], tuple[int, int, int]] = {}
# (k, m bucket, dtype) -> launch function
_gemv_launchers: dict[tuple[int, int, torch.dtype], object] = {}


def gemm(
    A: torch.Tensor,
    qw: KbitWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[..., N] = A[..., K] @ W^T (+ bias), W a ``KbitWeight``; output in A's dtype.

    M = product of A's leading dims. On CUDA (fp16/bf16) M <= 4 runs the GEMV
    kernel; larger M dequantizes and calls cuBLAS until the GEMM kernel lands.
    On the CPU: dequantize + matmul.
    """
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"gemm takes A (torch.Tensor) and qw (KbitWeight), got {type(qw).__name__}")
    return linear(A, qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, bias, out)


def linear(A, packed, absmax, codebook, scale, k: int, N: int, K: int, bias=None, out=None):
    """``gemm`` over the weight's tensors (what ``KbitLinear`` calls: no KbitWeight per call)."""
    if _is_compiling() or (
        torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))
    ):
        if out is None:
            return torch.ops.kbit_cute.gemm(A, packed, absmax, codebook, scale, k, N, K, bias)
        torch.ops.kbit_cute.gemm_out(A, packed, absmax, codebook, scale, k, N, K, bias, out)
        return out
    return _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias, out)


def _check_gemm_args(A, packed, absmax, codebook, scale, k, N, K, bias, out):
    """Everything but the weight's own consistency, in the cheapest order (hot path)."""
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"A must be a torch.Tensor, got {type(A).__name__}")
    if A.ndim == 0 or A.shape[-1] != K:
        raise ValueError(f"A's last dimension must be the weight's K={K}, got shape {A.shape}")
    dev = A.get_device()
    if packed.get_device() != dev:
        raise ValueError(f"A is on {A.device} but the weight is on {packed.device}; move one")
    if dev >= 0 and A.dtype not in _GEMV_DTYPES:
        raise TypeError(
            f"on CUDA, A must be float16 or bfloat16, got {A.dtype}; convert the input "
            "(and the model: model.half() or model.to(torch.bfloat16))"
        )
    if bias is not None and (
        bias.shape != (N,) or bias.get_device() != dev or bias.dtype != A.dtype
    ):
        raise ValueError(
            f"bias must be a {A.dtype} tensor of shape ({N},) on {A.device}, "
            f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}"
        )
    if out is not None and (
        out.shape[:-1] != A.shape[:-1]
        or out.shape[-1] != N
        or out.dtype != A.dtype
        or out.get_device() != dev
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {A.dtype} tensor of shape {(*A.shape[:-1], N)} on "
            f"{A.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return dev


def _gemm_impl(A, packed, absmax, codebook, scale, k, N, K, bias=None, out=None):
    dev = _check_gemm_args(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    plan = _gemv_plans.get((k, N, K, dev))
    if plan is None or packed.numel() != plan[1] or codebook.numel() != 1 << k:
        # First call for this shape (or a weight whose tensors disagree with its k, N, K).
        plan = _plan(packed, absmax, codebook, scale, k, N, K, dev)
    if dev < 0:
        if A.device != packed.device:  # CPU vs meta, say: both report device index -1
            raise ValueError(f"A is on {A.device} but the weight is on {packed.device}; move one")
        W = _dequantize_reference(_as_weight(packed, absmax, codebook, scale, k, N, K), A.dtype)
        r = torch.nn.functional.linear(A, W, bias)
        return r if out is None else out.copy_(r)
    if out is None:
        out = A.new_empty((*A.shape[:-1], N))
    M = A.numel() // K
    if M == 0:
        return out
    if M > GEMV_MAX_M:
        return _gemm_large_m(A, packed, absmax, codebook, scale, k, N, K, bias, out)
    splits = plan[2] if M > 2 else plan[0]
    return _gemv_launch(A, packed, absmax, codebook, scale, k, N, K, bias, out, M, splits, dev)


def _plan(packed, absmax, codebook, scale, k, N, K, dev) -> tuple[int, int]:
    """First call for a weight shape on a device: check the weight, choose the splits."""
    check_weight(packed, absmax, codebook, scale, k, N, K)
    if dev < 0:
        return 1, 0  # CPU: nothing to plan; not cached, so every CPU call is checked
    props = _device.check_device(dev)
    sms = props.sm_count
    plan = (gemv_splits(N, K, sms), packed.numel(), gemv_splits(N, K, sms, m=4))
    _gemv_plans[(k, N, K, dev)] = plan
    return plan


def _gemv_launch(A, packed, absmax, codebook, scale, k, N, K, bias, out, M, splits, dev):
    if not A.is_contiguous():
        A = A.contiguous()
    m_bucket = 1 if M == 1 else 2 if M == 2 else 4
    fn = _gemv_launchers.get((k, m_bucket, A.dtype))
    if fn is None:
        from .kernels.gemv import gemv_spec

        fn = launcher(gemv_spec(k, m_bucket, _GEMV_DTYPES[A.dtype]))
        _gemv_launchers[(k, m_bucket, A.dtype)] = fn
    stream = _raw_stream(dev)
    state = _split_states.get((dev, stream))
    if state is None:
        state = _split_states[(dev, stream)] = _SplitKState(A.device)
    groups = -(-N // 128) * 2
    ws, counters = state.workspace, state.counters
    if ws.numel() < splits * m_bucket * groups * _COLS_PER_GROUP or counters.numel() < groups:
        ws, counters = state.get(splits * m_bucket * groups * _COLS_PER_GROUP, groups)
    has_bias = bias is not None
    args = [
        A, packed, absmax, codebook, scale, bias if has_bias else out, out, ws, counters,
        M, N, K, splits, int(has_bias),
    ]  # fmt: skip
    try:
        fn(*args)
    except MisalignedError:
        # A view that does not start on a 16-byte boundary (the other pointers are ours or
        # only need element alignment): copy it to fresh storage and launch again.
        args[0] = A.clone(memory_format=torch.contiguous_format)
        fn(*args)
    return out


def _gemv(A, qw: KbitWeight, bias, out, M: int, splits: int | None = None):
    """The GEMV on CUDA tensors with an explicit split count (benchmarks, tests)."""
    dev = A.get_device()
    _plan(qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, dev)
    if splits is None:
        plan = _gemv_plans[(qw.k, qw.N, qw.K, dev)]
        splits = plan[2] if M > 2 else plan[0]
    args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K, bias, out, M)
    return _gemv_launch(*args, splits, dev)


def _gemm_large_m(A, packed, absmax, codebook, scale, k, N, K, bias, out):
    """M > 4: the mma.sync GEMM (deterministic split-K), or from the measured crossover
    (``gemm_table.CUBLAS_FROM_M``) dequantize to A's dtype and call cuBLAS."""
    from . import gemm_dispatch

    M = A.numel() // K
    if gemm_dispatch.prefer_cublas(M, k):
        W = _dequantize_impl(packed, absmax, codebook, scale, k, N, K, A.dtype)
        return out.copy_(torch.nn.functional.linear(A, W, bias))
    gemm_dispatch.launch(
        A.reshape(M, K), packed, absmax, codebook, scale, k, N, K, bias, out.view(M, N),
        deterministic=True,
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
