"""CuTe DSL kernels: one kernel family per module, shared device helpers in ``device_helpers``."""

from __future__ import annotations


def all_specs():
    """Every compiled variant the library ships (the inspect report and precompile walk this)."""
    from . import dequantize, gemm, gemv, grouped_gemm, grouped_gemv

    return [
        *dequantize.specs(), *gemv.specs(), *gemm.table_specs(), *grouped_gemv.specs(),
        *grouped_gemm.specs(),
    ]  # fmt: skip
