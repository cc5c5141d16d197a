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
# Measured on the H100 for k = 4 (``python -m perf.bench_gemm --k 4``, 2026-11-22, five shapes):
# from M = 256 dequantize + cuBLAS beat the kernel on every shape (8192x28672: 458 vs 609 us);
# at M = 128 the kernel won on 8192x28672 (310 vs 437 us) and lost on 2048x10240 / 10240x2048
# (61 vs 44 us, 59 vs 50 us). k = 2, 3, 5 reuse the k = 4 crossover until tuned.
CUBLAS_FROM_M = {2: 256, 3: 256, 4: 256, 5: 256}
