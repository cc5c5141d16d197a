"""Stacked quantized expert weights for MoE layers: ``KbitExperts``, ``quantize_experts``,
``dequantize_experts``.

E weights W_e [N, K] of one shape share one codebook; each keeps its own per-tensor scale.
Row e of ``packed`` / ``absmax`` holds exactly the tiled words / absmax bytes that
``kbit_cute.quantize(W_e)`` gives, so a grouped kernel finds expert e at ``e * P`` words and
``e * Q`` bytes, and ``KbitExperts.expert(e)`` is a plain ``KbitWeight`` view of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .format import (
    BLOCK,
    KbitWeight,
    _quantize_flat,
    check_codebook,
    check_k,
    normal_float_codebook,
    repack_kbit,
    tensor_scale,
)

__all__ = ["KbitExperts", "check_experts", "dequantize_experts", "quantize_experts"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Weights converted to float32 at once by quantize_experts (256 MB): a Qwen3-Coder-Next
# gate_up stack (512 x 1024 x 2048) would otherwise need 4 GB of float32 temporaries.
_CHUNK_ELEMS = 1 << 26


@dataclass
class KbitExperts:
    """E stacked quantized weights W_e [N, K] of one shape and one codebook.

    Plain tensors and ints, like ``KbitWeight``: ``packed`` int32 [E, P] and ``absmax``
    uint8 [E, Q] (row e = expert e's tiled format, P and Q as for one ``KbitWeight``),
    ``codebook`` float32 [2^k] shared by all experts, ``scale`` float32 [E] (expert e's
    ``format.tensor_scale``). N and K are the true sizes of one expert's weight.
    """

    packed: torch.Tensor  # int32 [E, P]
    absmax: torch.Tensor  # uint8 [E, Q]
    codebook: torch.Tensor  # float32 [2^k]
    scale: torch.Tensor  # float32 [E]
    k: int
    N: int
    K: int
    dtype: torch.dtype  # dtype of the original weights

    @property
    def E(self) -> int:
        return self.packed.shape[0]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes of all experts' words and absmax bytes (what the kernels stream, at most)."""
        return self.packed.numel() * 4 + self.absmax.numel()

    @property
    def nbytes_per_expert(self) -> int:
        """Bytes a kernel streams for one expert it touches."""
        return self.packed.shape[1] * 4 + self.absmax.shape[1]

    def expert(self, e: int) -> KbitWeight:
        """Expert e as a ``KbitWeight`` (views of the stacked tensors, not a copy)."""
        E = self.E
        if isinstance(e, bool) or not isinstance(e, int):
            raise TypeError(f"expert index must be an int, got {type(e).__name__}")
        if not -E <= e < E:
            raise IndexError(f"expert index {e} out of range for {E} experts")
        e %= E  # a negative e would make scale[e:e+1] empty
        return KbitWeight(
            self.packed[e], self.absmax[e], self.codebook, self.scale[e : e + 1],
            self.k, self.N, self.K, self.dtype,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> KbitExperts:
        return KbitExperts(
            self.packed.to(device), self.absmax.to(device), self.codebook.to(device),
            self.scale.to(device), self.k, self.N, self.K, self.dtype,
        )  # fmt: skip


def check_experts(packed, absmax, codebook, scale, k: int, N: int, K: int) -> int:
    """The tensors of stacked experts agree with (k, N, K): dtypes, shapes, one device.

    Returns E. Raises ValueError / TypeError naming the tensor that is wrong.
    """
    check_k(k)
    if N <= 0 or K <= 0 or K % BLOCK:
        raise ValueError(f"K must be a positive multiple of {BLOCK} and N positive; got {N=}, {K=}")
    named = {"packed": packed, "absmax": absmax, "codebook": codebook, "scale": scale}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    E = packed.shape[0] if packed.ndim == 2 else -1
    words, blocks = ops.tiled_sizes(k, N, K)
    for t, name, dtype, shape, want in (
        # The codebook first: its size gives away a wrong k.
        (codebook, "codebook", torch.float32, (1 << k,), f"[{1 << k}]"),
        (packed, "packed", torch.int32, (E, words), f"[E, {words}]"),
        (absmax, "absmax", torch.uint8, (E, blocks), f"[E, {blocks}]"),
        (scale, "scale", torch.float32, (E,), "[E]"),
    ):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(
                f"{name} of k={k} experts [E, N={N}, K={K}] must be a contiguous {dtype} tensor "
                f"of shape {want}, got {t.dtype} {tuple(t.shape)}"
                + (f" (was it quantized with k={k}?)" if name == "codebook" else "")
            )
        if t.device != packed.device:
            raise ValueError(f"{name} is on {t.device} but packed is on {packed.device}")
    if E == 0:
        raise ValueError("experts must hold at least one expert, got E=0")
    return E


def _check_finite(w: torch.Tensor, first_expert: int) -> None:
    """float32 [c, N, K]: name the first expert and row holding a NaN or Inf."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        e, n = bad.any(dim=2).nonzero()[0].tolist()
        raise ValueError(
            f"W has NaN or Inf values; the first is in expert {first_expert + e}, row {n}"
        )


def quantize_experts(
    W: torch.Tensor, k: int = 4, codebook: torch.Tensor | None = None
) -> KbitExperts:
    """Quantize stacked experts W [E, N, K] (fp32/fp16/bf16, CPU or CUDA, K a multiple of 32).

    Bit-identical to ``kbit_cute.quantize(W[e], k, codebook)`` for every e. Works on a few
    experts at a time (bounded float32 temporaries); one host read of the experts' absmax
    per group (the tensor scales are chosen on the host, as in ``format.tensor_scale``).
    """
    check_k(k)
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"W must be a torch.Tensor, got {type(W).__name__}")
    if W.ndim != 3:
        raise ValueError(f"W must be 3-D [E, N, K] (stacked experts), got shape {tuple(W.shape)}")
    if W.dtype not in _DTYPES:
        raise TypeError(f"W must be float32, float16 or bfloat16, got {W.dtype}")
    E, N, K = W.shape
    if E == 0 or N == 0 or K == 0 or K % BLOCK:
        raise ValueError(
            f"W [E, N, K] needs E, N > 0 and K (columns) a positive multiple of {BLOCK}, "
            f"got shape {(E, N, K)}"
        )
    cb = check_codebook(normal_float_codebook(k) if codebook is None else codebook, k)
    words, blocks = ops.tiled_sizes(k, N, K)
    packed = torch.empty(E, words, dtype=torch.int32, device=W.device)
    absmax = torch.empty(E, blocks, dtype=torch.uint8, device=W.device)
    scales = []
    step = max(1, _CHUNK_ELEMS // (N * K))
    for e0 in range(0, E, step):
        # Contiguous: a transposed or sliced stack must still view as blocks of 32.
        w = (
            W[e0 : e0 + step]
            .detach()
            .to(torch.float32, memory_format=torch.contiguous_format)
            .contiguous()
        )
        _check_finite(w, e0)
        # format.tensor_scale of each expert, from one host read of the group's absmax.
        amax = w.abs().amax(dim=(1, 2)).cpu()
        scale = torch.cat([tensor_scale(a.view(1)) for a in amax]).to(W.device)
        flat, codes = _quantize_flat((w / scale.view(-1, 1, 1)).view(-1, BLOCK), cb, k)
        flat, codes = flat.view(w.shape[0], -1), codes.view(w.shape[0], -1)
        for i in range(w.shape[0]):
            packed[e0 + i], absmax[e0 + i] = repack_kbit(flat[i], codes[i], K, N, k)
        scales.append(scale)
    return KbitExperts(packed, absmax, cb.to(W.device), torch.cat(scales), k, N, K, W.dtype)


def dequantize_experts(ex: KbitExperts, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense [E, N, K] in ``dtype`` (default: the original dtype); expert e equals
    ``kbit_cute.dequantize(ex.expert(e), dtype)`` (the CUDA kernel on CUDA tensors)."""
    if not isinstance(ex, KbitExperts):
        raise TypeError(f"dequantize_experts takes KbitExperts, got {type(ex).__name__}")
    dtype = dtype or ex.dtype
    if dtype not in _DTYPES:
        raise TypeError(f"dequantize_experts supports float32, float16 and bfloat16, got {dtype}")
    check_experts(ex.packed, ex.absmax, ex.codebook, ex.scale, ex.k, ex.N, ex.K)
    out = torch.empty(ex.E, ex.N, ex.K, dtype=dtype, device=ex.device)
    for e in range(ex.E):
        ops.dequantize(ex.expert(e), dtype, out=out[e])
    return out
