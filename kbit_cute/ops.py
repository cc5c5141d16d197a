"""Torch-facing operations: the format's functions, and dispatch to the GPU kernels.

The format functions (``encode_e4m4``, ``quantize_kbit``, ``repack_kbit`` ...)
are the host reference in ``kbit_cute.format``, re-exported here as the public
op surface. ``dequantize`` runs the CuTe DSL kernel on CUDA and the torch
reference on the CPU; both give bit-identical results.
"""

from __future__ import annotations

import torch

from .compile import compile_spec, driver_stream, ptr
from .format import (
    KbitWeight,
    decode_e4m4,
    dequantize_kbit,
    encode_e4m4,
    quantize_kbit,
    repack_kbit,
    unrepack_kbit,
)
from .format import dequantize as dequantize_reference
from .format import quantize as quantize  # noqa: PLC0414  (public re-export)

__all__ = [
    "decode_e4m4",
    "dequantize",
    "gemm",
    "dequantize_kbit",
    "encode_e4m4",
    "quantize",
    "quantize_kbit",
    "repack_kbit",
    "unrepack_kbit",
]

_OUT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MIN_CAPABILITY = (8, 0)


_checked_devices: set[int] = set()


def check_cuda_device(device: torch.device) -> None:
    """Kernels need sm_80+; say so clearly instead of failing inside the driver (checked
    once per device: not on the hot path)."""
    if device.index in _checked_devices:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"kbit_cute kernels need compute capability >= 8.0; this GPU is {major}.{minor}"
        )
    _checked_devices.add(device.index)


def dequantize(qw: KbitWeight, dtype: torch.dtype | None = None, out: torch.Tensor | None = None):
    """Dense W [N, K] from a ``KbitWeight``; on CUDA by the dequantize kernel."""
    dtype = dtype or qw.dtype
    if dtype not in _OUT_NAMES:
        raise TypeError(f"dequantize supports float32, float16 and bfloat16, got {dtype}")
    if qw.packed.device.type != "cuda":
        w = dequantize_reference(qw, dtype)
        return w if out is None else out.copy_(w)
    check_cuda_device(qw.packed.device)
    if out is None:
        out = torch.empty(qw.N, qw.K, dtype=dtype, device=qw.packed.device)
    elif out.shape != (qw.N, qw.K) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {(qw.N, qw.K)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned")
    from .kernels.dequantize import dequantize_spec

    fn = compile_spec(dequantize_spec(qw.k, _OUT_NAMES[dtype]))
    fn(
        ptr(qw.packed), ptr(qw.absmax), ptr(qw.codebook), ptr(qw.scale, 4), ptr(out),
        qw.N, qw.K, driver_stream(torch.cuda.current_stream(qw.packed.device)),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- gemm

_GEMV_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
GEMV_MAX_M = 4
# Target CTAs per SM when choosing K splits for the GEMV (4 warps each).
GEMV_CTAS_PER_SM = 8
_COLS_PER_GROUP = 64


class _SplitKState:
    """Per (device, stream) fp32 workspace and zeroed counters for split-K; grown, never
    shrunk. The kernel leaves the counters at zero, so nothing is cleared per call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)

    def get(self, ws_elems: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.workspace.numel() < ws_elems:
            self.workspace = torch.empty(
                max(ws_elems, 1 << 16), dtype=torch.float32, device=self.device
            )
        if self.counters.numel() < groups:
            self.counters = torch.zeros(max(groups, 4096), dtype=torch.int32, device=self.device)
        return self.workspace, self.counters


_split_states: dict[tuple[int, int], _SplitKState] = {}
_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    n = _sm_counts.get(device.index)
    if n is None:
        n = _sm_counts[device.index] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return n


def gemv_splits(N: int, K: int, sm_count: int, ctas_per_sm: int = GEMV_CTAS_PER_SM) -> int:
    """K splits so that (column groups x splits) CTAs fill the GPU, each warp >= 2 K tiles."""
    groups = -(-N // 128) * 2
    k_tiles = -(-K // 64)
    want = -(-sm_count * ctas_per_sm // groups)
    return max(1, min(want, k_tiles // 8, 64))


def _check_gemm_args(A: torch.Tensor, qw: KbitWeight, bias, out):
    if not isinstance(A, torch.Tensor) or not isinstance(qw, KbitWeight):
        raise TypeError("gemm takes A (torch.Tensor) and qw (KbitWeight)")
    if A.shape[-1] != qw.K:
        raise ValueError(f"A's last dimension is {A.shape[-1]}, the weight's K is {qw.K}")
    if A.device != qw.packed.device:
        raise ValueError(f"A is on {A.device} but the weight is on {qw.packed.device}; move one")
    if bias is not None and (bias.shape != (qw.N,) or bias.device != A.device):
        raise ValueError(f"bias must be a tensor of shape ({qw.N},) on {A.device}")
    if A.is_cuda and A.dtype not in _GEMV_DTYPES:
        raise TypeError(f"on CUDA, A must be float16 or bfloat16, got {A.dtype}")
    out_shape = (*A.shape[:-1], qw.N)
    if out is not None and (
        tuple(out.shape) != out_shape or out.dtype != A.dtype or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous {A.dtype} tensor of shape {out_shape}")
    return out_shape


def gemm(
    A: torch.Tensor,
    qw: KbitWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[..., N] = A[..., K] @ W^T (+ bias), W a ``KbitWeight``; output in A's dtype.

    M = product of A's leading dims. M <= 4 runs the GEMV kernel. Larger M
    dequantizes to A's dtype and calls cuBLAS (the mma.sync GEMM will replace it).
    On the CPU: dequantize + matmul.
    """
    out_shape = _check_gemm_args(A, qw, bias, out)
    M = A.numel() // qw.K if qw.K else 0
    if not A.is_cuda:
        r = torch.nn.functional.linear(A, dequantize_reference(qw, A.dtype), bias)
        return r if out is None else out.copy_(r)
    if out is None:
        out = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    if M == 0:
        return out
    if M > GEMV_MAX_M:
        W = dequantize(qw, A.dtype)
        return out.copy_(torch.nn.functional.linear(A, W, bias))
    return _gemv(A, qw, bias, out, M)


def _gemv(A, qw, bias, out, M: int, splits: int | None = None):
    from .kernels.gemv import gemv_spec

    device = A.device
    if not A.is_contiguous() or A.data_ptr() % 16:
        A = A.clone(memory_format=torch.contiguous_format)  # fresh storage: 16-byte aligned
    m_bucket = 1 if M == 1 else 2 if M == 2 else 4
    if splits is None:
        splits = gemv_splits(qw.N, qw.K, _sm_count(device))
    groups = -(-qw.N // 128) * 2
    stream = torch.cuda.current_stream(device)
    state = _split_states.get((device.index, stream.cuda_stream))
    if state is None:
        check_cuda_device(device)
        state = _split_states[(device.index, stream.cuda_stream)] = _SplitKState(device)
    ws, counters = state.get(splits * m_bucket * groups * _COLS_PER_GROUP, groups)
    fn = compile_spec(gemv_spec(qw.k, m_bucket, _GEMV_DTYPES[A.dtype]))
    fn(
        ptr(A), ptr(qw.packed), ptr(qw.absmax), ptr(qw.codebook), ptr(qw.scale, 4),
        ptr(bias if bias is not None else out, 2), ptr(out, 2), ptr(ws), ptr(counters, 4),
        M, qw.N, qw.K, splits, int(bias is not None), driver_stream(stream),
    )  # fmt: skip
    return out
