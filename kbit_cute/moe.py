"""Mixture-of-experts layer with k-bit experts: routing, sorting tokens by expert, ``KbitMoE``.

A forward pass (T tokens, E routed experts, each token to its top_k of them; the shared
expert, if any, stored as m more experts of the routed shape that every token uses):

1. ``route``: one GEMM gives the router logits and, in one more column, the shared expert's
   gate logit; top-k of the logits, softmax of the chosen ones (``normalize``; fp32 inside).
2. ``sort_by_expert``: the (token, slot) pairs grouped by expert and each expert's row range,
   on the device: no host read, so a layer can be captured in a CUDA graph and replayed with
   any routing.
3. the tokens' rows in that order go through ``grouped_ops.moe_gate_up`` (SiLU(gate) * up)
   and ``grouped_ops.grouped_gemm`` (down): one launch each for every expert, the shared one
   included up to ``KbitMoE.fuse_shared_max_tokens`` tokens (past it: ``kbit_cute.gemm``).
4. ``combine``: rows back in (token, slot) order, then one batched matmul with the weights
   (the shared expert's: sigmoid of its gate, or 1). No atomics: the same result run to run.

Why so few steps: at decode the two expert kernels take ~20 us, and in a CUDA graph any
further kernel costs ~2-3 us however small, so the glue is budgeted in kernels. On CUDA at
T = 1 with a gated shared expert and ``normalize`` (Qwen3-Coder-Next) the forward launches 14:

    router GEMM 1, topk 1, softmax 1, sigmoid 1, cat weights 1, cat ids 1,
    sort 2 (topk of all keys: select + in-place sort), searchsorted 1, row copy 1,
    moe_gate_up 1, grouped_gemm 1, index_copy_ 1, bmm 1

T > 1 gathers rows with a division and an index_select (+1); ``normalize=False`` takes the
softmax of all logits in the compute dtype and a gather (+1); a shared expert without gate:
no sigmoid (-1); no shared expert: neither sigmoid nor cats (-3).
``tests/test_gpu_grouped.py`` counts them with the profiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import grouped_ops
from .experts import KbitExperts, check_experts, quantize_experts
from .format import check_codebook, check_k, normal_float_codebook
from .nn import _fmt_bytes, apply_keeping_format_fp32, check_checkpoint_k
from .ops import linear, tiled_sizes

__all__ = ["KbitExpertWeights", "KbitMoE", "combine", "route", "sort_by_expert"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Buffers that are part of the format and stay float32 whatever the module's dtype.
# Keys up to this many are sorted by torch.topk (one select kernel + torch's one-kernel
# in-place sort of <= 1024 int64 keys); torch.sort runs the same in-place sort but adds an
# arange and three copies. Beyond it both fall back to a segmented radix sort, where
# torch.sort is the cheaper.
_SMALL_SORT = 1024


# --------------------------------------------------------------------------- routing


def _check_top_k(top_k: int, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in 1..num_experts={num_experts}, got {top_k!r}")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    normalize: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Qwen3-MoE / DeepSeek-V2 style).

    router_logits [..., E] -> (weights [T, top_k] in ``dtype``, ids int64 [T, top_k]), T the
    product of the leading dims; a token's slots come in no particular order. The weights are
    the top-k softmax probabilities, rescaled to sum 1 when ``normalize``; the softmax
    accumulates in fp32 whatever ``dtype``. Experts are ranked by their logits: softmax is
    monotone, so these are the top-k probabilities (up to fp32 rounding of near-ties).
    """
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        raise TypeError("router_logits must be a floating point torch.Tensor [..., num_experts]")
    if router_logits.ndim == 0:
        raise ValueError("router_logits must have a last dimension of num_experts")
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    E = router_logits.shape[-1]
    _check_top_k(top_k, E)
    logits = router_logits.reshape(-1, E)
    # Unsorted: the slots are summed, so their order does not matter (sorting is a kernel).
    top, ids = torch.topk(logits, top_k, dim=-1, sorted=False)
    # softmax(dtype=) converts its input first: round only after it when dtype is narrower.
    # One kernel when the logits are in dtype already (the module's case).
    wide = torch.promote_types(logits.dtype, dtype)
    if normalize:
        # Top-k probabilities rescaled to sum 1 = the softmax of the top-k logits.
        return torch.softmax(top, dim=-1, dtype=wide).to(dtype), ids
    return torch.softmax(logits, dim=-1, dtype=wide).gather(-1, ids).to(dtype), ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert and each expert's row range.

    ids int32/int64 [T, slots] in 0..E-1 -> (order int64 [T * slots], offsets int32 [E + 1]):
    sorted row r is flat pair ``order[r]`` (token ``order[r] // slots``); rows
    ``offsets[e]:offsets[e + 1]`` use expert e. Within an expert the rows come in an order
    fixed by the ids (not always token order: the sort need not be stable), so results are
    the same run to run. Device ops only (no ``bincount`` / ``nonzero`` / ``.item()``): it can
    be captured in a CUDA graph. Out-of-range ids are reported for CPU tensors in eager mode
    only (checking CUDA tensors would need a host read).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("ids must be an int32 or int64 torch.Tensor [T, slots]")
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
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    return _group_rows(flat, bounds)


def _group_rows(flat: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort_by_expert`` of flat ids, given ``bounds`` = arange(E + 1) in their dtype (a
    module keeps it as a buffer: no arange kernel per call)."""
    n = flat.numel()
    if n <= _SMALL_SORT:
        keys, order = torch.topk(flat, n, largest=False, sorted=True)
    else:
        keys, order = torch.sort(flat, stable=True)
    return order, torch.searchsorted(keys, bounds, out_int32=True)


def combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert outputs y [T * slots, N] in sorted order -> [T, N] in y's dtype:
    ``out[t] = sum_s weights[t, s] * (row of pair (t, s)) (+ add[t])``.

    The rows go back to (token, slot) order by ``index_copy_`` (a permutation) and one
    batched matmul weights and sums them (fp32 accumulation on CUDA): no atomics, so the
    result is the same run to run. The weights are used in y's dtype, as transformers does.
    """
    if weights.ndim != 2 or y.ndim != 2 or not y.shape[0] == weights.numel() == order.numel():
        raise ValueError(
            f"combine takes y [T * slots, N], weights [T, slots] and order [T * slots]; got "
            f"{_shape(y)}, {_shape(weights)} and {_shape(order)}"
        )
    T, slots = weights.shape
    N = y.shape[-1]
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(T, slots, N)
    w = weights.to(y.dtype).unsqueeze(1)  # [T, 1, slots]
    if add is None:
        return torch.bmm(w, unsorted).view(T, N)
    return torch.baddbmm(add.unsqueeze(1), w, unsorted).view(T, N)


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
        converted = apply_keeping_format_fp32(self, fn, recurse)
        if converted is not None:
            self.dtype = converted
        return self

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        where = prefix.rstrip(".") or type(self).__name__
        check_checkpoint_k(
            state_dict, prefix, self, type(self).__name__, "build the module with k={k}"
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
    routing-weighted sum over a token's top_k experts, plus the shared expert's output (times
    ``sigmoid(gate(x))`` when ``shared_gate``). ``dtype`` is the compute dtype of activations,
    router, routing weights and output (fp16/bf16 on CUDA; any float dtype on the CPU, where
    the grouped ops dequantize and matmul). A fresh module holds zero experts: fill it with
    ``from_experts`` or ``load_state_dict``.

    The shared expert (intermediate size S) is stored as ``shared_experts`` = ceil(S / I)
    more experts of the routed shape, after the E routed ones: piece j holds its gate/up rows
    and down columns jI..(j+1)I (zero-padded past S, which adds exactly 0). Up to
    ``fuse_shared_max_tokens`` tokens every token routes to them with weight 1 (or its gate),
    so they run inside the two grouped launches; more tokens would give one CTA all T rows of
    a piece (ceil(T / 8) passes in a row), so they take the GEMV / GEMM piece by piece.

    Submodules and buffers (the state_dict): ``router`` (nn.Linear [E (+1), H], compute
    dtype; with ``shared_gate`` its last row is the shared expert's gate, transformers'
    ``shared_expert_gate.weight``), ``gate_up`` (experts [2I, H], gate rows then up rows; E
    routed + the shared pieces), ``down`` (experts [H, I], likewise). Constant index tensors
    (``_bounds``, ``_shared_ids``, ``_shared_ones``) are non-persistent buffers.
    """

    # Tokens up to which the shared expert runs in the grouped kernels (see the docstring);
    # an instance may override it (0: always the GEMV / GEMM path).
    fuse_shared_max_tokens = 32

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
        H, inter, E, S = hidden_size, intermediate_size, num_experts, shared_intermediate_size
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
        if S < 0 or (shared_gate and not S):
            raise ValueError(
                "shared_gate needs a shared expert (shared_intermediate_size > 0), got "
                f"shared_intermediate_size={S}"
            )
        self.hidden_size, self.intermediate_size, self.num_experts = H, inter, E
        self.top_k, self.k, self.normalize = top_k, k, bool(normalize)
        self.shared_intermediate_size, self.shared_gate = S, bool(shared_gate)
        self.shared_experts = -(-S // inter)  # pieces of the routed shape
        total = E + self.shared_experts
        self.router = nn.Linear(H, E + self.shared_gate, bias=False, dtype=dtype, device=device)
        self.gate_up = KbitExpertWeights(total, 2 * inter, H, k, codebook, dtype, device)
        self.down = KbitExpertWeights(total, H, inter, k, codebook, dtype, device)
        self._index_buffers(device, dtype)

    def _index_buffers(self, device, dtype) -> None:
        """The forward's constants, so that no kernel makes them per call: bounds =
        arange(E + m + 1) for searchsorted, the shared pieces' expert ids [1, m] and, without
        a gate, their weight 1 [1, m] (compute dtype: it follows .half())."""
        E, m = self.num_experts, self.shared_experts
        self.register_buffer("_bounds", torch.arange(E + m + 1, device=device), persistent=False)
        ids = torch.arange(E, E + m, device=device).view(1, m) if m else None
        self.register_buffer("_shared_ids", ids, persistent=False)
        ones = None
        if m and not self.shared_gate:
            ones = torch.ones(1, m, dtype=dtype, device=device)
        self.register_buffer("_shared_ones", ones, persistent=False)

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
        on the experts' device; their dtype becomes the compute dtype (the router and gate are
        converted to it; the shared expert is quantized from its own dtype).
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
        dtype, device = gate_up_proj.dtype, gate_up_proj.device
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
            if S == 0:
                raise ValueError("the shared expert's intermediate size must be positive")
            shapes = ((S, H), (S, H), (H, S))
            shared = [
                _as_linear(w, f"shared {n}", shape).weight
                for w, n, shape in zip(shared, names, shapes, strict=True)
            ]
        if shared_gate is not None:
            shared_gate = _as_linear(shared_gate, "shared_gate", (1, H)).weight
        has_gate = shared_gate is not None
        m = cls(H, inter, E, top_k, k, normalize, S, has_gate, codebook, dtype, device="meta")
        rw = router_weight.detach()
        if has_gate:
            rw = torch.cat([rw.to(dtype), shared_gate.detach().to(rw.device, dtype)])
        m.router.weight = nn.Parameter(rw.to(dtype, copy=True), router_weight.requires_grad)
        gate_up = quantize_experts(gate_up_proj, k, codebook)
        down = quantize_experts(down_proj, k, codebook)
        if shared is not None:
            gu_s, down_s = _shared_pieces(*shared, inter, device)
            gate_up = _cat_experts(gate_up, quantize_experts(gu_s, k, codebook))
            down = _cat_experts(down, quantize_experts(down_s, k, codebook))
        m.gate_up = KbitExpertWeights.from_experts(gate_up)
        m.down = KbitExpertWeights.from_experts(down)
        m._index_buffers(device, dtype)
        return m

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the router's)."""
        return self.router.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: experts (shared pieces included), router."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] in x's dtype. Device ops only: capturable in a CUDA graph.
        The kernels it launches are listed in the module docstring."""
        H = self.hidden_size
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
        E, m = self.num_experts, self.shared_experts
        logits = self.router(x2)  # [T, E], then the shared gate's logit
        weights, ids = route(logits[:, :E], self.top_k, self.normalize, x.dtype)
        gate = torch.sigmoid(logits[:, E:]) if self.shared_gate else None  # [T, 1]
        fused = m > 0 and T <= self.fuse_shared_max_tokens
        if fused:  # every token also picks the m shared pieces
            shared_w = gate if gate is not None else self._shared_ones
            weights = torch.cat([weights, shared_w.expand(T, m)], dim=1)
            ids = torch.cat([ids, self._shared_ids.expand(T, m)], dim=1)
        slots = ids.shape[1]
        order, offsets = _group_rows(ids.reshape(-1), self._bounds)
        if T == 1:  # every row is the token: one copy, no index arithmetic
            rows = x2.expand(slots, H).contiguous()
        else:
            rows = x2.index_select(0, order // slots)
        # A token picks an expert at most once: no expert has more than T rows.
        # The kernels right before the two expert launches (the row copy, gate_up) write
        # neither the offsets nor the weights: each may start early (``overlap``).
        h = grouped_ops.moe_gate_up(rows, self.gate_up.weight, offsets, max_rows_per_expert=T,
                                    overlap=True)  # fmt: skip
        y = grouped_ops.grouped_gemm(h, self.down.weight, offsets, max_rows_per_expert=T,
                                     overlap=True)  # fmt: skip
        shared = None
        if m and not fused:
            shared = self._shared_mlp(x2)
            if gate is not None:
                shared = shared * gate
        return combine(y, weights, order, shared).view(x.shape)

    def _shared_mlp(self, x2: torch.Tensor) -> torch.Tensor:
        """The shared expert through ``kbit_cute.gemm``, piece by piece: [T, H]."""
        E, inter, H, k = self.num_experts, self.intermediate_size, self.hidden_size, self.k
        gu, dn = self.gate_up, self.down
        out = None
        for e in range(E, E + self.shared_experts):
            h = linear(x2, gu.packed[e], gu.absmax[e], gu.codebook, gu.scale[e : e + 1], k,
                       2 * inter, H)  # fmt: skip
            a = F.silu(h[:, :inter]) * h[:, inter:]
            y = linear(a, dn.packed[e], dn.absmax[e], dn.codebook, dn.scale[e : e + 1], k, H,
                       inter)  # fmt: skip
            out = y if out is None else out + y
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        old = (prefix + "shared_expert.", prefix + "shared_expert_gate.")
        if any(key.startswith(old) for key in state_dict):
            raise ValueError(
                f"{prefix.rstrip('.') or type(self).__name__}: the checkpoint keeps the shared "
                "expert as shared_expert.* / shared_expert_gate.* (an older KbitMoE layout); "
                "this one stores it in gate_up / down and the gate in router.weight: quantize "
                "again with KbitMoE.from_experts"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def extra_repr(self) -> str:
        H, inter, E = self.hidden_size, self.intermediate_size, self.num_experts
        S, m = self.shared_intermediate_size, self.shared_experts
        return (
            f"hidden_size={H}, intermediate_size={inter}, num_experts={E}, top_k={self.top_k}, "
            f"k={self.k}, normalize={self.normalize}, shared_intermediate_size={S} "
            f"({m} pieces), shared_gate={self.shared_gate}, dtype={self.dtype}, "
            f"gate_up=[{E + m}, {2 * inter}, {H}], down=[{E + m}, {H}, {inter}], "
            f"bytes={_fmt_bytes(self.nbytes)}"
        )


def _shared_pieces(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, inter: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP (gate [S, H], up [S, H], down [H, S]) as m = ceil(S / I) experts of the
    routed shape: (gate_up [m, 2I, H], down [m, H, I]), piece j the channels jI..(j+1)I.

    down is linear in the channels, so the pieces' outputs sum to the MLP's; padded channels
    are zero (SiLU(0) * 0 = 0, and zero blocks quantize to exact zeros).
    """
    S, H = gate.shape
    m = -(-S // inter)
    pad = m * inter - S
    dtype = torch.promote_types(torch.promote_types(gate.dtype, up.dtype), down.dtype)
    g, u, d = (t.detach().to(device=device, dtype=dtype) for t in (gate, up, down))
    if pad:
        g, u, d = F.pad(g, (0, 0, 0, pad)), F.pad(u, (0, 0, 0, pad)), F.pad(d, (0, pad))
    gate_up = torch.cat([g.reshape(m, inter, H), u.reshape(m, inter, H)], dim=1)
    return gate_up, d.reshape(H, m, inter).transpose(0, 1).contiguous()


def _cat_experts(a: KbitExperts, b: KbitExperts) -> KbitExperts:
    """The experts of a, then those of b (one shape and codebook)."""
    if (a.k, a.N, a.K) != (b.k, b.N, b.K) or not torch.equal(a.codebook, b.codebook):
        raise ValueError("experts to concatenate need the same k, shape and codebook")
    return KbitExperts(
        torch.cat([a.packed, b.packed]), torch.cat([a.absmax, b.absmax]), a.codebook,
        torch.cat([a.scale, b.scale]), a.k, a.N, a.K, a.dtype,
    )  # fmt: skip


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
