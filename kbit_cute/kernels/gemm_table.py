"""Dispatch table of the mma.sync GEMM (``kbit_cute.gemm_dispatch``).

PROVISIONAL: not measured yet. Written by hand from the compile-only SASS (registers,
instructions per weight) and the H100's 132 SMs, so that the dispatcher, the CI compile
gate and the tests have something to use. ``python -m perf.bench_gemm --write-table``
measures every candidate on the H100 and overwrites this file; commit its output.

RULES[k]: rows (m_max, config name, target CTAs per SM, max splits); the first row with
M <= m_max applies. Split-K is used only when the M x N tiles give fewer than the target
CTAs per SM, with at most ``max splits`` and at least 2 K slices per split.
CUBLAS_FROM_M[k]: the smallest M from which dequantize + cuBLAS was measured faster than
the kernel (None: the kernel always wins, or not measured).
"""

PROVISIONAL = True
MEASURED_ON = None
COMMAND = "python -m perf.bench_gemm --write-table"

_SMALL = (16, "m16n128k64s4w1x4", 4, 16)
_M32 = (32, "m32n128k64s4w1x4", 3, 16)
_M64 = (64, "m64n128k64s3w1x4", 2, 8)
_LARGE = (1 << 31, "m128n128k64s3w1x8", 1, 4)

RULES = {k: [_SMALL, _M32, _M64, _LARGE] for k in (2, 3, 4, 5)}
# A guess until measured: at M >= 2048 the GEMM is compute-bound and cuBLAS's sm_90 kernels
# (wgmma) outrun mma.sync by more than the dequantize costs.
CUBLAS_FROM_M = {2: 2048, 3: 2048, 4: 2048, 5: 2048}
