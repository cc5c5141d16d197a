"""CuTe DSL kernels: one kernel family per module, shared device helpers in ``device_helpers``."""

from __future__ import annotations


def all_specs(arch: str | None = None):
    """Every compiled variant the library ships on ``arch`` (default: the compile target;
    the inspect report and precompile walk this)."""
    from ..compile import target_arch
    from . import dequantize, gemm, gemv, grouped_gemm, grouped_gemv

    arch = arch or target_arch()
    return [
        *dequantize.specs(), *gemv.specs(arch), *gemm.table_specs(arch), *grouped_gemv.specs(),
        *grouped_gemm.specs(),
    ]  # fmt: skip
