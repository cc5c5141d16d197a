"""Mixture-of-experts layer with k-bit experts: routing, sorting tokens by expert, ``KbitMoE``.

A forward pass (T tokens, E experts, each token to its top_k experts):

1. ``route``: router logits -> softmax in fp32 -> top-k weights and expert ids [T, top_k].
2. ``sort_by_expert``: the T * top_k (token, slot) pairs in expert order (stable argsort)
   and the row offsets of every expert (``searchsorted``): no host read, so a whole layer can
   be captured in a CUDA graph and replayed with any routing.
3. the tokens' rows gathered in that order go through ``grouped_ops.moe_gate_up`` (SiLU(gate)
   * up of every row's expert) and ``grouped_ops.grouped_gemm`` (the down projection), one
   launch each for all experts.
4. ``combine``: each row scaled by its routing weight, put back in (token, slot) order and
   summed over the slots in fp32 (deterministic: no atomics), plus the shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import grouped_ops
from .experts import KbitExperts, check_experts, quantize_experts
from .format import check_codebook, check_k, normal_float_codebook
from .nn import KbitLinear, _fmt_bytes
from .ops import tiled_sizes

__all__ = ["KbitExpertWeights", "KbitGatedMLP", "KbitMoE", "combine", "route", "sort_by_expert"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Buffers that are part of the format and stay float32 whatever the module's dtype.
_FP32_BUFFERS = ("codebook", "scale")


# --------------------------------------------------------------------------- routing


def _check_top_k(top_k: int, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in 1..num_experts={num_experts}, got {top_k!r}")


def route(
    router_logits: torch.Tensor, top_k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in fp32) over the experts, then top-k (Qwen3-MoE / DeepSeek-V2 style).

    router_logits [..., E] -> (weights float32 [T, top_k], ids int64 [T, top_k]) with T the
    product of the leading dims; ``normalize`` rescales each token's top-k weights to sum 1.
    """
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        raise TypeError("router_logits must be a floating point torch.Tensor [..., num_experts]")
    if router_logits.ndim == 0:
        raise ValueError("router_logits must have a last dimension of num_experts")
    E = router_logits.shape[-1]
    _check_top_k(top_k, E)
    probs = torch.softmax(router_logits.reshape(-1, E), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted order of the (token, slot) pairs and each expert's row range.

    ids int32/int64 [T, top_k] in 0..E-1 -> (order int64 [T * top_k], offsets int32 [E + 1]):
    sorted row r is flat pair ``order[r]`` (token ``order[r] // top_k``); rows
    ``offsets[e]:offsets[e + 1]`` use expert e, in token order. Device ops only (a stable
    argsort and ``searchsorted``; no ``bincount`` / ``nonzero`` / ``.item()``), so it can be
    captured in a CUDA graph. Out-of-range ids are reported for CPU tensors in eager mode only
    (checking CUDA tensors would need a host read).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("ids must be an int32 or int64 torch.Tensor [T, top_k]")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    flat = ids.reshape(-1)
    if (
        flat.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and flat.numel()
        and not (0 <= int(flat.min()) and int(flat.max()) < num_experts)
    ):
        raise ValueError(f"ids must lie in 0..{num_experts - 1} (num_experts={num_experts})")
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], bounds, out_int32=True)


def combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Expert outputs y [T * top_k, N] in sorted order -> float32 [T, N]: each row times its
    routing weight, summed over a token's slots.

    Rows are put back in (token, slot) order and summed in slot order instead of
    ``index_add_`` (float atomics on CUDA), so the result is the same run to run.
    """
    T, top_k = weights.shape
    scaled = y * weights.reshape(-1)[order].unsqueeze(1)  # float32 by type promotion
    unsorted = torch.empty_like(scaled).index_copy_(0, order, scaled)
    return unsorted.view(T, top_k, -1).sum(dim=1)


# --------------------------------------------------------------------------- modules


class KbitExpertWeights(nn.Module):
    """The buffers of one ``KbitExperts`` (E stacked weights [N, K]): ``packed`` int32 [E, P],
    ``absmax`` uint8 [E, Q], ``codebook`` float32 [2^k], ``scale`` float32 [E].

    As in ``KbitLinear``, they round-trip through ``state_dict`` and safetensors bit-exactly,
    dtype conversions leave the float32 ones alone, and loading a checkpoint of another k
    fails with the k to use. A fresh module holds zero weights.
    """

    def __init__(
        self,
        num_experts: int,
        N: int,
        K: int,
        k: int = 4,
        codebook: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_k(k)
        if num_experts <= 0 or N <= 0 or K <= 0 or K % 32:
            raise ValueError(
                "expert weights need num_experts > 0, N > 0 and K a positive multiple of 32, "
                f"got num_experts={num_experts}, N={N}, K={K}"
            )
        self.num_experts, self.N, self.K, self.k, self.dtype = num_experts, N, K, k, dtype
        words, blocks = tiled_sizes(k, N, K)
        cb = check_codebook(normal_float_codebook(k) if codebook is None else codebook, k)
        E = num_experts
        self.register_buffer("packed", torch.zeros(E, words, dtype=torch.int32, device=device))
        self.register_buffer("absmax", torch.zeros(E, blocks, dtype=torch.uint8, device=device))
        self.register_buffer("codebook", cb.to(device=device, copy=True))
        self.register_buffer("scale", torch.ones(E, dtype=torch.float32, device=device))

    @classmethod
    def from_experts(cls, ex: KbitExperts) -> KbitExpertWeights:
        """A module holding ``ex``'s tensors (the codebook copied: safetensors refuses shared
        storage between modules)."""
        if not isinstance(ex, KbitExperts):
            raise TypeError(f"from_experts takes KbitExperts, got {type(ex).__name__}")
        check_experts(ex.packed, ex.absmax, ex.codebook, ex.scale, ex.k, ex.N, ex.K)
        m = cls(ex.E, ex.N, ex.K, ex.k, ex.codebook, ex.dtype, device="meta")
        m.packed, m.absmax, m.scale = ex.packed, ex.absmax, ex.scale
        m.codebook = ex.codebook.clone()
        return m

    @property
    def weight(self) -> KbitExperts:
        """The experts as ``KbitExperts`` (views of the buffers, not a copy)."""
        return KbitExperts(
            self.packed, self.absmax, self.codebook, self.scale, self.k, self.N, self.K, self.dtype
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, N={self.N}, K={self.K}, k={self.k}, "
            f"bytes={_fmt_bytes(self.nbytes)}"
        )

    def _apply(self, fn, recurse=True):
        """``.half()`` / ``.to(dtype)``: the codebook and scale are float32 by the format, so
        they only follow device moves; ``dtype`` follows the conversion."""
        kept = {n: self._buffers[n] for n in _FP32_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self.dtype = new.dtype
                self._buffers[name] = (
                    torch.empty_like(old, device=new.device)
                    if old.is_meta or new.is_meta
                    else old.to(new.device)
                )
        return self

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        where = prefix.rstrip(".") or type(self).__name__
        cb = state_dict.get(prefix + "codebook")
        if cb is not None and cb.numel() != self.codebook.numel():
            k_ckpt = cb.numel().bit_length() - 1
            raise ValueError(
                f"{where}: the checkpoint was quantized with k={k_ckpt} but this layer has "
                f"k={self.k}; build the module with k={k_ckpt} before load_state_dict"
            )
        scale = state_dict.get(prefix + "scale")
        if scale is not None and scale.shape != self.scale.shape:
            raise ValueError(
                f"{where}: the checkpoint holds {scale.numel()} experts but this layer has "
                f"{self.num_experts}"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )


class KbitGatedMLP(nn.Module):
    """down_proj(SiLU(gate_proj(x)) * up_proj(x)) with bias-free ``KbitLinear`` layers: a
    shared expert (Qwen3-Next ``shared_expert``, DeepSeek ``shared_experts``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        k: int = 4,
        codebook: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        H, S = hidden_size, intermediate_size
        self.gate_proj = KbitLinear(H, S, False, k, codebook, dtype, device)
        self.up_proj = KbitLinear(H, S, False, k, codebook, dtype, device)
        self.down_proj = KbitLinear(S, H, False, k, codebook, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _as_linear(w, name: str, shape: tuple[int, int]) -> nn.Linear:
    """A bias-free nn.Linear with weight ``shape`` from an nn.Linear or a 2-D weight tensor."""
    if isinstance(w, torch.Tensor) and w.ndim == 2:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w.detach(), requires_grad=False)
        w = lin
    if not isinstance(w, nn.Linear):
        raise TypeError(f"{name} must be an nn.Linear or a 2-D weight tensor, got {_shape(w)}")
    if w.bias is not None:
        raise ValueError(f"{name} has a bias; KbitMoE's shared expert and its gate are bias-free")
    if tuple(w.weight.shape) != shape:
        raise ValueError(f"{name} must have weight shape {shape}, got {tuple(w.weight.shape)}")
    return w


class KbitMoE(nn.Module):
    """A sparse MoE block with k-bit experts: softmax top-k router, routed gated experts in
    two grouped launches, optional shared expert (with optional sigmoid gate, Qwen3-Next).

    Routed expert e computes ``down_e(SiLU(gate_e(x)) * up_e(x))``; the output is the
    routing-weighted sum over a token's top_k experts, plus ``shared_expert(x)`` (times
    ``sigmoid(shared_expert_gate(x))`` when ``shared_gate``). ``dtype`` is the compute dtype
    of activations, router and output (fp16/bf16 on CUDA; any float dtype on the CPU, where
    the grouped ops dequantize and matmul). A fresh module holds zero experts: fill it with
    ``from_experts`` or ``load_state_dict``.

    Submodules and buffers: ``router`` (nn.Linear [E, H], compute dtype), ``gate_up``
    (experts [2I, H], gate rows then up rows), ``down`` (experts [H, I]), ``shared_expert``
    (``KbitGatedMLP``, or None), ``shared_expert_gate`` (nn.Linear [1, H], or None).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        k: int = 4,
        normalize: bool = True,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        codebook: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_k(k)
        H, inter, E = hidden_size, intermediate_size, num_experts
        if H <= 0 or H % 32:
            raise ValueError(f"hidden_size must be a positive multiple of 32, got {H}")
        if inter <= 0 or inter % 64:
            raise ValueError(
                f"intermediate_size must be a positive multiple of 64 (the fused gate/up "
                f"kernel's tile), got {inter}"
            )
        if E <= 0:
            raise ValueError(f"num_experts must be positive, got {E}")
        _check_top_k(top_k, E)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if shared_intermediate_size < 0 or (shared_gate and not shared_intermediate_size):
            raise ValueError(
                "shared_gate needs a shared expert (shared_intermediate_size > 0), got "
                f"shared_intermediate_size={shared_intermediate_size}"
            )
        self.hidden_size, self.intermediate_size, self.num_experts = H, inter, E
        self.top_k, self.k, self.normalize = top_k, k, bool(normalize)
        self.shared_intermediate_size = shared_intermediate_size
        self.router = nn.Linear(H, E, bias=False, dtype=dtype, device=device)
        self.gate_up = KbitExpertWeights(E, 2 * inter, H, k, codebook, dtype, device)
        self.down = KbitExpertWeights(E, H, inter, k, codebook, dtype, device)
        self.shared_expert = (
            KbitGatedMLP(H, shared_intermediate_size, k, codebook, dtype, device)
            if shared_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(H, 1, bias=False, dtype=dtype, device=device) if shared_gate else None
        )

    @classmethod
    def from_experts(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        router_weight: torch.Tensor,
        top_k: int,
        k: int = 4,
        normalize: bool = True,
        shared: nn.Module | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        shared_gate: nn.Linear | torch.Tensor | None = None,
        codebook: torch.Tensor | None = None,
    ) -> KbitMoE:
        """Quantize a MoE block given in the transformers v5 fused-expert layout.

        gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), down_proj [E, H, I],
        router_weight [E, H]; ``shared``: a module with ``gate_proj`` / ``up_proj`` /
        ``down_proj`` nn.Linear (e.g. Qwen3NextMLP) or their weights (gate [S, H], up [S, H],
        down [H, S]); ``shared_gate``: nn.Linear(H, 1) or its weight [1, H]. Quantization runs
        on the experts' device; their dtype becomes the compute dtype (the router and shared
        expert are converted to it).
        """
        for t, name in ((gate_up_proj, "gate_up_proj"), (down_proj, "down_proj")):
            if not isinstance(t, torch.Tensor) or t.ndim != 3:
                raise ValueError(f"{name} must be a 3-D tensor [E, N, K], got {_shape(t)}")
        E, I2, H = gate_up_proj.shape
        inter = I2 // 2
        if I2 % 2 or tuple(down_proj.shape) != (E, H, inter):
            raise ValueError(
                f"expected gate_up_proj [E, 2I, H] and down_proj [E, H, I]; got "
                f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
            )
        if not isinstance(router_weight, torch.Tensor) or tuple(router_weight.shape) != (E, H):
            raise ValueError(f"router_weight must be [E={E}, H={H}], got {_shape(router_weight)}")
        dtype = gate_up_proj.dtype
        if dtype not in _DTYPES:
            raise TypeError(f"the expert weights must be fp16, bf16 or fp32, got {dtype}")
        S = 0
        if shared is not None:
            names = ("gate_proj", "up_proj", "down_proj")
            if isinstance(shared, nn.Module) and all(hasattr(shared, n) for n in names):
                shared = tuple(getattr(shared, n) for n in names)
            if not isinstance(shared, (tuple, list)) or len(shared) != 3:
                raise TypeError(
                    "shared must be a module with gate_proj / up_proj / down_proj or a tuple of "
                    f"their three weights, got {_shape(shared)}"
                )
            g = shared[0]
            S = g.shape[0] if isinstance(g, torch.Tensor) else getattr(g, "out_features", 0)
            shapes = ((S, H), (S, H), (H, S))
            shared = [
                _as_linear(w, f"shared {n}", shape)
                for w, n, shape in zip(shared, names, shapes, strict=True)
            ]
            if S == 0 or S % 32:
                raise ValueError(
                    f"the shared expert's intermediate size must be a positive multiple of 32, "
                    f"got {S}"
                )
        if shared_gate is not None:
            shared_gate = _as_linear(shared_gate, "shared_gate", (1, H))
        has_gate = shared_gate is not None
        m = cls(H, inter, E, top_k, k, normalize, S, has_gate, codebook, dtype, device="meta")
        m.router.weight = nn.Parameter(
            router_weight.detach().to(dtype, copy=True), router_weight.requires_grad
        )
        m.gate_up = KbitExpertWeights.from_experts(quantize_experts(gate_up_proj, k, codebook))
        m.down = KbitExpertWeights.from_experts(quantize_experts(down_proj, k, codebook))
        if shared is not None:
            mlp = m.shared_expert
            for name, lin in zip(("gate_proj", "up_proj", "down_proj"), shared, strict=True):
                setattr(mlp, name, KbitLinear.from_linear(lin, k, codebook).to(dtype))
        if shared_gate is not None:
            w = shared_gate.weight
            m.shared_expert_gate.weight = nn.Parameter(
                w.detach().to(dtype, copy=True), w.requires_grad
            )
        return m

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the router's)."""
        return self.router.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: experts, router, shared expert."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] in x's dtype. Device ops only: capturable in a CUDA graph."""
        H, top_k = self.hidden_size, self.top_k
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[-1] != H:
            raise ValueError(f"x's last dimension must be hidden_size={H}, got {_shape(x)}")
        if x.dtype != self.dtype:
            raise TypeError(
                f"x is {x.dtype} but the module computes in {self.dtype}; convert one "
                "(x.to(dtype) or module.to(dtype))"
            )
        if x.device != self.router.weight.device:
            raise ValueError(
                f"x is on {x.device} but the module is on {self.router.weight.device}; move one"
            )
        x2 = x.reshape(-1, H)
        T = x2.shape[0]
        if T == 0:
            return x.new_zeros(x.shape)
        weights, ids = route(self.router(x2), top_k, self.normalize)
        order, offsets = sort_by_expert(ids, self.num_experts)
        rows = x2.index_select(0, order // top_k)  # [T * top_k, H], expert-sorted
        # A token picks an expert at most once: no expert has more than T rows.
        h = grouped_ops.moe_gate_up(rows, self.gate_up.weight, offsets, max_rows_per_expert=T)
        y = grouped_ops.grouped_gemm(h, self.down.weight, offsets, max_rows_per_expert=T)
        out = combine(y, weights, order)
        if self.shared_expert is not None:
            shared = self.shared_expert(x2).float()
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x2).float())
            out = out + shared
        return out.to(x.dtype).view(x.shape)

    def extra_repr(self) -> str:
        H, inter, E = self.hidden_size, self.intermediate_size, self.num_experts
        S = self.shared_intermediate_size
        return (
            f"hidden_size={H}, intermediate_size={inter}, num_experts={E}, top_k={self.top_k}, "
            f"k={self.k}, normalize={self.normalize}, shared_intermediate_size={S}, "
            f"dtype={self.dtype}, gate_up=[{E}, {2 * inter}, {H}], down=[{E}, {H}, {inter}], "
            f"bytes={_fmt_bytes(self.nbytes)}"
        )


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
