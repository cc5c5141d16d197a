"""kbit_cute: k-bit (k = 2..5) weight-quantized matmul kernels in the CuTe DSL.

Data flows format -> layouts -> kernels -> ops: ``kbit_cute.format`` is the
host definition of the format, ``kbit_cute.layouts`` its CuTe layouts,
``kbit_cute.kernels`` the CuTe DSL kernels, ``kbit_cute.ops`` the torch API.
"""

from __future__ import annotations

from .format import BLOCK, TILE_K, TILE_N, KbitWeight, codebook, quantize
from .ops import dequantize, gemm

__all__ = ["BLOCK", "TILE_K", "TILE_N", "KbitWeight", "codebook", "dequantize", "gemm", "quantize"]
__version__ = "0.1.0"
