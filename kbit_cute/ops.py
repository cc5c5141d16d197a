"""Torch-facing operations: the format's functions, and dispatch to the GPU kernels.

The format functions (``encode_e4m4``, ``quantize_kbit``, ``repack_kbit`` ...)
are the host reference in ``kbit_cute.format``, re-exported here as the public
op surface. ``dequantize`` runs the CuTe DSL kernel on CUDA and the torch
reference on the CPU; both give bit-identical results.
"""

from __future__ import annotations

import torch

from .compile import compile_spec, current_stream, ptr
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
    "dequantize_kbit",
    "encode_e4m4",
    "quantize",
    "quantize_kbit",
    "repack_kbit",
    "unrepack_kbit",
]

_OUT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MIN_CAPABILITY = (8, 0)


def check_cuda_device(device: torch.device) -> None:
    """Kernels need sm_80+; say so clearly instead of failing inside the driver."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"kbit_cute kernels need compute capability >= 8.0; this GPU is {major}.{minor}"
        )


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
        qw.N, qw.K, current_stream(qw.packed.device),
    )  # fmt: skip
    return out
