"""Modules: ``KbitLinear``, a drop-in for ``nn.Linear`` with a k-bit weight, and
``quantize_model``, which swaps every ``nn.Linear`` of a model for one.

The quantized weight lives in registered buffers (``packed`` int32 words,
``absmax`` uint8, ``codebook`` and ``scale`` float32), so ``state_dict()``,
``load_state_dict`` and safetensors carry it bit-exactly. ``bias`` stays a
parameter in the compute dtype. Forward runs ``kbit_cute.gemm`` (CUDA kernels
for fp16/bf16; dequantize + matmul on the CPU).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from .format import KbitWeight, check_codebook, check_k, normal_float_codebook
from .format import quantize as _quantize
from .ops import linear, tiled_sizes

__all__ = ["KbitLinear", "quantize_model"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Buffers that are part of the format and stay float32 whatever the module's dtype.
_FP32_BUFFERS = ("codebook", "scale")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class KbitLinear(nn.Module):
    """y = x @ W^T + b with W [out_features, in_features] stored at k bits per weight.

    ``dtype`` is the compute dtype (activations, bias, output); on CUDA it must be
    float16 or bfloat16. ``in_features`` must be a multiple of 32. A fresh
    module holds a zero weight: fill it with ``from_linear`` or ``load_state_dict``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        k: int = 4,
        codebook: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_k(k)
        if in_features <= 0 or out_features <= 0 or in_features % 32:
            raise ValueError(
                "KbitLinear needs in_features a positive multiple of 32 (the quantization "
                f"block) and out_features > 0, got in_features={in_features}, "
                f"out_features={out_features}; keep such a layer as nn.Linear"
            )
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        self.in_features, self.out_features, self.k, self.dtype = (
            in_features,
            out_features,
            k,
            dtype,
        )
        words, blocks = tiled_sizes(k, out_features, in_features)
        cb = check_codebook(normal_float_codebook(k) if codebook is None else codebook, k)
        self.register_buffer("packed", torch.zeros(words, dtype=torch.int32, device=device))
        self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("codebook", cb.to(device=device, copy=True))
        self.register_buffer("scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, k: int = 4, codebook: torch.Tensor | None = None
    ) -> KbitLinear:
        """Quantize an ``nn.Linear`` (on its device; the weight's dtype becomes the compute
        dtype). The original module is left untouched."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        W = linear.weight.detach()
        if W.dtype not in _DTYPES:
            raise TypeError(f"the weight must be float16, bfloat16 or float32, got {W.dtype}")
        N, K = W.shape
        # Build on the meta device (no zero-filled buffers), then take the quantized tensors.
        m = cls(K, N, linear.bias is not None, k, codebook, W.dtype, device="meta")
        qw = _quantize(W, k, codebook)
        m.packed, m.absmax, m.scale = qw.packed, qw.absmax, qw.scale
        m.codebook = qw.codebook.clone()  # never shared between layers (safetensors refuses)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), linear.bias.requires_grad)
        return m

    @property
    def weight(self) -> KbitWeight:
        """The quantized weight as a ``KbitWeight`` (views of the buffers, not a copy)."""
        return KbitWeight(
            self.packed, self.absmax, self.codebook, self.scale,
            self.k, self.out_features, self.in_features, self.dtype,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized weight (with codebook and scale) and the bias."""
        tensors = [self.packed, self.absmax, self.codebook, self.scale]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dicts directly: ``self.packed`` goes through Module.__getattr__ (~0.4 us each).
        b = self._buffers
        return linear(
            x, b["packed"], b["absmax"], b["codebook"], b["scale"],
            self.k, self.out_features, self.in_features, self._parameters["bias"],
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, k={self.k}, dtype={self.dtype}, "
            f"bytes={_fmt_bytes(self.nbytes)}"
        )

    def _apply(self, fn, recurse=True):
        """``.half()`` / ``.to(dtype)`` convert every float tensor; the codebook and scale are
        float32 by the format, so they only follow device moves."""
        converted = apply_keeping_format_fp32(self, fn, recurse)
        if self.bias is not None:
            self.dtype = self.bias.dtype
        elif converted is not None:
            self.dtype = converted
        return self

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        check_checkpoint_k(
            state_dict, prefix, self, "KbitLinear",
            "build the model with quantize_model(model, k={k}) (or KbitLinear(..., k={k}))",
        )  # fmt: skip
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )


def apply_keeping_format_fp32(module: nn.Module, fn, recurse: bool) -> torch.dtype | None:
    """``nn.Module._apply`` for a module holding a kbit weight's buffers: the ``codebook``
    and ``scale`` are float32 by the format, so a dtype conversion leaves them float32 (they
    follow device moves only). Returns the dtype a conversion asked for, or None."""
    kept = {n: module._buffers[n] for n in _FP32_BUFFERS}
    nn.Module._apply(module, fn, recurse)
    converted = None
    for name, old in kept.items():
        new = module._buffers[name]
        if new.dtype != torch.float32:
            converted = new.dtype
            module._buffers[name] = (
                torch.empty_like(old, device=new.device)
                if old.is_meta or new.is_meta
                else old.to(new.device)
            )
    return converted


def check_checkpoint_k(state_dict, prefix: str, module: nn.Module, kind: str, fix: str) -> None:
    """A checkpoint's codebook size gives its k: loading another k's weights into ``module``
    fails with the k to use (``fix`` is formatted with ``k=``)."""
    cb = state_dict.get(prefix + "codebook")
    if cb is not None and cb.numel() != module.codebook.numel():
        k_ckpt = cb.numel().bit_length() - 1
        where = prefix.rstrip(".") or kind
        raise ValueError(
            f"{where}: the checkpoint was quantized with k={k_ckpt} but this layer has "
            f"k={module.k}; {fix.format(k=k_ckpt)} before load_state_dict"
        )


def _model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes() if t.device.type != "meta" else t.nbytes
    return total


def _skipped(name: str, skip: Iterable[str]) -> bool:
    """A skip entry matches a module's qualified name, a dotted component of it, or is a
    glob over the name: "lm_head" skips "lm_head" and "model.lm_head"."""
    parts = name.split(".")
    return any(s == name or s in parts or fnmatch.fnmatchcase(name, s) for s in skip)


def quantize_model(
    model: nn.Module,
    k: int = 4,
    skip: Iterable[str] = ("lm_head",),
    progress: bool = True,
    codebook: torch.Tensor | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``KbitLinear`` at k bits.

    Layers named in ``skip`` and layers whose in_features is not a multiple of 32
    stay ``nn.Linear``. Quantization runs on each layer's device. Prints the
    model's bytes before and after; shows a tqdm bar when ``progress``.
    """
    check_k(k)
    skip = tuple([skip] if isinstance(skip, str) else skip)
    targets, unfit = [], []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not _skipped(name, skip):
            (targets if module.in_features % 32 == 0 else unfit).append(name)
    before = _model_bytes(model)
    bar = targets
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(targets, desc=f"kbit_cute: quantizing to k={k}", unit="layer")
        except ImportError:
            pass
    for name in bar:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, KbitLinear.from_linear(getattr(parent, child), k, codebook))
    after = _model_bytes(model)
    note = f"; kept {len(unfit)} nn.Linear with in_features not a multiple of 32" if unfit else ""
    print(
        f"kbit_cute.quantize_model: {len(targets)} nn.Linear -> KbitLinear(k={k}); "
        f"model {_fmt_bytes(before)} -> {_fmt_bytes(after)} "
        f"({before / max(after, 1):.2f}x smaller){note}"
    )
    return model
