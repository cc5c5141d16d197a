"""Tensor-free compilation of the kernels and the in-memory cache of compiled variants.

Kernels take raw pointers and int sizes, so one compile serves every shape and
a call costs a few pointer wrappers (no DLPack conversion on the hot path).
Compile arguments are fake pointers (address 0, the alignment the kernel may
assume) and placeholder ints; no GPU is needed to compile (set
``CUTE_DSL_ARCH=sm_90a`` on a machine without one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass.base_dsl.enums import AddressSpace
from cutlass.cute.runtime import make_fake_stream, make_ptr

TORCH_TO_CUTLASS = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.uint8: cutlass.Uint8,
}


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: a name, how to build it, and what its SASS must contain.

    ``build()`` returns (jit callable, compile arguments); ``expect`` lists SASS
    instruction classes (e.g. "SHFL", "LDG.E.128") that ``kbit_cute.inspect``
    requires, so a refactor that loses vector loads or shuffles fails CI.
    """

    name: str
    build: Callable[[], tuple[Callable, tuple]]
    expect: tuple[str, ...]


def fake_ptr(dtype: type[cutlass.Numeric], align: int = 16):
    return make_ptr(dtype, 0, AddressSpace.gmem, assumed_align=align)


def fake_stream():
    return make_fake_stream()


def ptr(t: torch.Tensor, align: int = 16):
    """A kernel pointer to a tensor's data (the alignment must hold: callers check it)."""
    return make_ptr(TORCH_TO_CUTLASS[t.dtype], t.data_ptr(), AddressSpace.gmem, assumed_align=align)


_driver_streams: dict[int, Any] = {}


def driver_stream(stream: torch.cuda.Stream):
    """The cuda-python handle of a torch stream, made once per stream (not per call)."""
    handle = stream.cuda_stream
    cu = _driver_streams.get(handle)
    if cu is None:
        from cuda.bindings import driver

        cu = _driver_streams[handle] = driver.CUstream(handle)
    return cu


_compiled: dict[str, Any] = {}
_lock = threading.Lock()


def compile_spec(spec: KernelSpec) -> Any:
    """Compile a variant once per process (keyed by its name, which encodes its config)."""
    fn = _compiled.get(spec.name)
    if fn is None:
        with _lock:
            fn = _compiled.get(spec.name)
            if fn is None:
                jit_fn, args = spec.build()
                fn = _compiled[spec.name] = cute.compile(jit_fn, *args)
    return fn
