"""One GEMV call per k (stream-K runs that end inside column tiles, so the split-K slots
and the owners' polling are exercised; CTA groups; runs across strips on the ``crossing``
variants, k = 3's skewed runs; row sets at M = 9..64; k = 4's deeper ring), for
``compute-sanitizer --tool memcheck|racecheck python -m perf.sanitize_gemv``."""

from __future__ import annotations

import torch

import kbit_cute
from kbit_cute import ops
from kbit_cute.kernels.gemv import DEEP_RING_M, DEEP_RING_STAGES, LOOKUP
from perf.gemv_kernel_check import run_gemv


def main() -> None:
    K, N = 1056, 1000  # odd shape: N and K padded inside the tiles
    for k in (2, 3, 4, 5):
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
        for M, dtype in ((1, torch.float16), (3, torch.bfloat16), (8, torch.float16)):
            A = torch.randn(M, K, device="cuda", dtype=dtype)
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            ops._gemv(A, qw, None, out, M, workers=13)  # partial strips: the reduction runs
            kbit_cute.dequantize(qw, dtype)
            if k <= 4:  # the register lookup of single-quad CTAs (the grouped kernel's)
                run_gemv(A, qw, out, 13, None, LOOKUP[k], 1)
            else:  # sm_90's 128 KB table of large k = 5 weights (this small one takes shuffles)
                run_gemv(A, qw, out, 13, None, "pair_table5")
    # The variants with CTA groups (``GemvKernel.cta_groups``): 1000 columns over 64 K tiles
    # in 64-way splits, 512 workers on 132 CTAs: groups of 3-4 quads, strips over 17 CTAs.
    from perf import gemv_kernel_check

    gemv_kernel_check.CTA_GROUPS = "on"
    K, N = 4096, 1000
    for k in (2, 3, 4, 5):
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
        for M, dtype in ((2, torch.float16), (3, torch.bfloat16), (8, torch.float16)):
            A = torch.randn(M, K, device="cuda", dtype=dtype)
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            run_gemv(A, qw, out, "s64")
            if k in DEEP_RING_STAGES and ops._M_BUCKET[M] in DEEP_RING_M:  # (``ops.gemv_variant``)
                run_gemv(A, qw, out, "s64", DEEP_RING_STAGES[k])
    gemv_kernel_check.CTA_GROUPS = "auto"
    # The ``crossing`` variants (the ring runs on across a strip's end; k = 4's deeper ring
    # too): runs of 3-4 K tiles over strips of 17 (37 workers), strips of one K tile (every
    # step a crossing), and CTAs of 2-3 consecutive workers (300 runs of 3-4 K tiles on 132
    # CTAs).
    for k in (2, 3, 4, 5):
        for K, N, workers in ((1056, 1000, 37), (64, 1000, 5), (4096, 2048, 300)):
            qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
            A = torch.randn(1, K, device="cuda", dtype=torch.float16)
            out = torch.empty(1, N, device="cuda", dtype=torch.float16)
            run_gemv(A, qw, out, workers, crossing=True)
            if k in DEEP_RING_STAGES and 1 in DEEP_RING_M:  # (k = 4 on fast-memory devices)
                run_gemv(A, qw, out, workers, DEEP_RING_STAGES[k], crossing=True)
    # k = 3's runs skewed by quad (``gemv.QUAD_SKEW``): runs of ~20 K tiles, 7 quads a CTA,
    # shifts of up to 2 tiles.
    qw = kbit_cute.quantize(torch.randn(18944, 8192, device="cuda"), 3)
    A = torch.randn(1, 8192, device="cuda", dtype=torch.float16)
    run_gemv(A, qw, torch.empty(1, 18944, device="cuda", dtype=torch.float16), 924, crossing=True)
    # Row sets (M = 9..64 on small weights): partial strips in every set (13 workers), the
    # library's grids with CTA groups (2048x5120) and without (1056x1000), a partial last set.
    for k in (2, 3, 4, 5):
        for K, N, M in ((1056, 1000, 12), (1056, 1000, 48), (2048, 5120, 24)):
            qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
            A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ops._gemv(A, qw, None, out, M, workers=13)
            kbit_cute.gemm(A, qw, out=out)
    # The library's own grid where ``ops.balanced_splits`` raises the split count (896x896,
    # M = 2: 2 -> 3 splits of 14 K tiles).
    K = N = 896
    for k in (2, 3, 4, 5):
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
        A = torch.randn(2, K, device="cuda", dtype=torch.float16)
        kbit_cute.gemm(A, qw)
    torch.cuda.synchronize()
    print("sanitize_gemv: done")


if __name__ == "__main__":
    main()
