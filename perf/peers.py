"""The implementations a GEMM sweep times: kbit_cute.gemm, cuBLAS and the peers.

Each ``Impl`` builds its weight copies from the same fp16/bf16 W [N, K] (``prepare``),
says how many bytes one call streams (``nbytes``: the weight as stored, the activations
and the output are added by the sweep), and returns a zero-argument call for copy i
and activations A (``make_call``). A peer whose library is missing is reported
``unavailable`` and one that raises is reported ``failed`` with its error, never dropped.

Peers, as the issue fixes them:
- cuBLAS ``F.linear`` in the run's dtype (the baseline of every speedup);
- torch int4 tinygemm ``torch.ops.aten._weight_int4pack_mm``, group 128; its CUDA kernel
  takes bf16 activations, so fp16 runs give it a bf16 copy of A (made outside the timing);
- bitsandbytes NF4: ``bnb.functional.quantize_4bit(W, blocksize=64, quant_type="nf4")``,
  ``bnb.matmul_4bit(A, qB.t(), quant_state=state)`` (the call ``bnb.nn.Linear4bit`` makes);
- gemlite W4, group 64: ``GemLiteLinear(4, group_size=64, ...)``, ``.pack(W_q, scales, zeros)``
  (HQQ-style asymmetric int4), forward by calling the module (gemlite's default kernel
  choice and its shipped autotune cache).

Not a peer but a ceiling: ``floor``, the fastest read of the k = 4 weight's bytes
(``perf.read_floor``'s probe, which computes nothing, at its best grid for the size): the
speedup over cuBLAS of a k = 4 kernel that took no longer than reading its weight.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kbit_cute

PEER_NAMES = ("tinygemm", "bnb", "gemlite", "floor")


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


class Impl:
    """One implementation of out = A @ W^T; subclasses fill in the three methods."""

    name = ""
    label = ""
    k: int | None = None
    module: str | None = None  # the library it needs, imported lazily
    note = ""

    def __init__(self) -> None:
        self.copies: list = []
        self.nbytes = 0

    @property
    def key(self) -> str:
        return self.name if self.k is None else f"{self.name}{self.k}"

    def unavailable(self) -> str | None:
        """Why this peer cannot run here (its library does not import), or None."""
        if self.module is None:
            return None
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # any import failure, e.g. no GPU at import time
            return f"{type(exc).__name__}: {exc}"[:240]
        return None

    def prepare(self, W: torch.Tensor, n_copies: Callable[[int], int]) -> None:
        raise NotImplementedError

    def make_call(self, i: int, A: torch.Tensor) -> Callable[[], object]:
        raise NotImplementedError

    def release(self) -> None:
        self.copies = []


class Cublas(Impl):
    name, label = "cublas", "cuBLAS F.linear"

    def prepare(self, W, n_copies):
        self.nbytes = tensor_bytes(W)
        self.copies = [W.clone() for _ in range(n_copies(self.nbytes))]

    def make_call(self, i, A):
        w = self.copies[i]
        return lambda: F.linear(A, w)


class Kbit(Impl):
    """kbit_cute.quantize + kbit_cute.gemm: whatever path gemm dispatches to for this M."""

    name = "kbit"

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.label = f"kbit k={k}"

    def prepare(self, W, n_copies):
        qw = kbit_cute.quantize(W, self.k)
        self.nbytes = qw.nbytes
        n = n_copies(self.nbytes)
        if dataclasses.is_dataclass(qw):
            self.copies = [qw] + [
                dataclasses.replace(qw, packed=qw.packed.clone(), absmax=qw.absmax.clone())
                for _ in range(n - 1)
            ]
        else:  # the format may stop being a dataclass: fall back on the public API
            self.copies = [qw] + [kbit_cute.quantize(W, self.k) for _ in range(n - 1)]

    def make_call(self, i, A):
        qw = self.copies[i]
        return lambda: kbit_cute.gemm(A, qw)


class Tinygemm(Impl):
    name, label = "tinygemm", "tinygemm int4 g128"
    note = "bf16 activations (the dtype of its CUDA kernel)"
    group = 128

    def prepare(self, W, n_copies):
        N, K = W.shape
        if K % self.group:
            raise ValueError(f"tinygemm group {self.group} needs K % {self.group} == 0, K = {K}")
        # Random 4-bit codes: the kernel's speed does not depend on the values.
        codes = torch.randint(0, 16, (N, K), device=W.device, dtype=torch.int32)
        w_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # [N, K/2] nibbles
        packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
        sz = torch.randn(K // self.group, N, 2, device=W.device, dtype=torch.bfloat16) * 0.01
        self.nbytes = tensor_bytes(packed, sz)
        self.copies = [(packed.clone(), sz.clone()) for _ in range(n_copies(self.nbytes))]

    def make_call(self, i, A):
        packed, sz = self.copies[i]
        # The CUDA kernel's activation dtype; converted once per A, outside the timing.
        if getattr(self, "_a", (None,))[0] is not A:
            self._a = (A, A.to(torch.bfloat16))
        Ab = self._a[1]
        return lambda: torch.ops.aten._weight_int4pack_mm(Ab, packed, self.group, sz)

    def release(self):
        super().release()
        self._a = (None,)


class BnbNF4(Impl):
    name, label, module = "bnb", "bnb NF4 b64", "bitsandbytes"
    blocksize = 64

    def prepare(self, W, n_copies):
        import bitsandbytes as bnb

        q, state = bnb.functional.quantize_4bit(
            W, blocksize=self.blocksize, quant_type="nf4", compress_statistics=False
        )
        self.nbytes = tensor_bytes(q, state.absmax)
        n = n_copies(self.nbytes)
        self.copies = [(q, state)] + [
            bnb.functional.quantize_4bit(
                W, blocksize=self.blocksize, quant_type="nf4", compress_statistics=False
            )
            for _ in range(n - 1)
        ]

    def make_call(self, i, A):
        import bitsandbytes as bnb

        q, state = self.copies[i]
        qt = q.t()
        return lambda: bnb.matmul_4bit(A, qt, quant_state=state)


class GemliteW4(Impl):
    name, label, module = "gemlite", "gemlite W4 g64", "gemlite"
    group = 64

    def prepare(self, W, n_copies):
        from gemlite import DType, GemLiteLinear

        N, K = W.shape
        dt = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}[W.dtype]
        W_q = torch.randint(0, 16, (N, K), device=W.device, dtype=torch.uint8)
        scales = (torch.rand(N, K // self.group, device=W.device) * 0.01 + 1e-3).to(W.dtype)
        zeros = torch.full((N, K // self.group), 8.0, device=W.device, dtype=W.dtype)

        def build():
            m = GemLiteLinear(4, group_size=self.group, in_features=K, out_features=N,
                              input_dtype=dt, output_dtype=dt)  # fmt: skip
            m.pack(W_q, scales.clone(), zeros, bias=None)  # own scales: no L2-hot sharing
            return m

        first = build()
        self.nbytes = tensor_bytes(first.W_q, first.scales, first.zeros)
        self.copies = [first] + [build() for _ in range(n_copies(self.nbytes) - 1)]

    def make_call(self, i, A):
        m = self.copies[i]
        return lambda: m(A)


class ReadFloor(Impl):
    """Reads a kbit weight's bytes and computes nothing (the module docstring)."""

    name = "floor"

    def __init__(self, k: int = 4):
        super().__init__()
        self.k = k
        self.label = f"read floor k={k}"
        self.note = f"reads the k = {k} weight's bytes, computes nothing (perf/read_floor.py)"

    def prepare(self, W, n_copies):
        from kbit_cute.gemm_dispatch import weight_bytes

        from . import read_floor

        N, K = W.shape
        self.nbytes = weight_bytes(N, K, self.k)
        self.copies = read_floor.probe_copies(self.nbytes, n_copies(self.nbytes), W.device)
        self.sink = torch.zeros(4, dtype=torch.int32, device=W.device)
        self.config = None
        if W.is_cuda:  # the probe's grid: the fastest for this size, timed on these copies
            self.sm_count = torch.cuda.get_device_properties(W.device).multi_processor_count
            self.config = read_floor.best_probe(self.copies, self.sm_count)[1]

    def make_call(self, i, A):
        if self.config is None:  # CPU smoke runs: a plain read of the same bytes
            return self.copies[i].sum
        from .read_floor import probe_call

        return probe_call(self.config, self.copies[i], self.sink, self.sm_count)


PEERS: dict[str, type[Impl]] = {
    "tinygemm": Tinygemm, "bnb": BnbNF4, "gemlite": GemliteW4, "floor": ReadFloor,
}  # fmt: skip


def make_impls(ks, peers) -> list[Impl]:
    """cuBLAS first (every speedup's baseline), then kbit per k, then the peers."""
    return [Cublas(), *(Kbit(k) for k in ks), *(PEERS[p]() for p in peers)]
