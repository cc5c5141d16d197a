"""kbit_cute: k-bit (k = 2..5) weight-quantized matmul kernels in the CuTe DSL.

Data flows format -> layouts -> kernels -> ops -> nn: ``kbit_cute.format`` is the
host definition of the format, ``kbit_cute.layouts`` its CuTe layouts,
``kbit_cute.kernels`` the CuTe DSL kernels, ``kbit_cute.compile`` how they are
compiled, cached and launched, ``kbit_cute.ops`` the torch API and
``torch.ops.kbit_cute`` ops, ``kbit_cute.nn`` the modules. MoE: ``kbit_cute.experts``
(stacked expert weights), ``kbit_cute.grouped_ops`` (grouped expert matmuls, one launch for
all experts), ``kbit_cute.moe`` (routing and the ``KbitMoE`` module).
"""

from __future__ import annotations

from .experts import KbitExperts, dequantize_experts, quantize_experts
from .format import BLOCK, TILE_K, TILE_N, KbitWeight, codebook
from .grouped_ops import grouped_gemm, moe_gate_up
from .moe import KbitMoE
from .nn import KbitLinear, quantize_model
from .ops import dequantize, gemm, quantize
from .precompile import warmup

__all__ = [
    "BLOCK",
    "TILE_K",
    "TILE_N",
    "KbitExperts",
    "KbitLinear",
    "KbitMoE",
    "KbitWeight",
    "codebook",
    "dequantize",
    "dequantize_experts",
    "gemm",
    "grouped_gemm",
    "moe_gate_up",
    "quantize",
    "quantize_experts",
    "quantize_model",
    "warmup",
]
__version__ = "0.1.0"
