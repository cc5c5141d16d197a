"""kbit_cute: k-bit (k = 2..5) weight-quantized matmul kernels in the CuTe DSL.

Data flows format -> layouts -> kernels -> ops -> nn: ``kbit_cute.format`` is the
host definition of the format, ``kbit_cute.layouts`` its CuTe layouts,
``kbit_cute.kernels`` the CuTe DSL kernels, ``kbit_cute.compile`` how they are
compiled, cached and launched, ``kbit_cute.ops`` the torch API and
``torch.ops.kbit_cute`` ops, ``kbit_cute.nn`` the modules.
"""

from __future__ import annotations

from .format import BLOCK, TILE_K, TILE_N, KbitWeight, codebook
from .nn import KbitLinear, quantize_model
from .ops import dequantize, gemm, quantize
from .precompile import warmup

__all__ = [
    "BLOCK",
    "TILE_K",
    "TILE_N",
    "KbitLinear",
    "KbitWeight",
    "codebook",
    "dequantize",
    "gemm",
    "quantize",
    "quantize_model",
    "warmup",
]
__version__ = "0.1.0"
