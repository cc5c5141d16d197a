"""A few launches of one GEMV kernel configuration, for profilers:

    ncu --clock-control none -k regex:Gemv --launch-skip 3 --launch-count 1 \
        python -m perf.profile_gemv --k 4 --m 1 --shape 8192x28672 --workers auto
"""

from __future__ import annotations

import argparse

import torch

from kbit_cute.format import quantize
from perf.gemv_kernel_check import run_gemv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--shape", default="8192x28672", help="KxN")
    p.add_argument("--workers", default="auto", help="see perf.gemv_kernel_check.grid_for")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--lookup", default=None, help="GemvKernel lookup override")
    p.add_argument("--quads", type=int, default=None)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--launches", type=int, default=6)
    args = p.parse_args()
    K, N = (int(x) for x in args.shape.split("x"))
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    qw = quantize(torch.randn(N, K, device="cuda") * 0.02, args.k)
    A = torch.randn(args.m, K, device="cuda", dtype=dtype)
    out = torch.empty(args.m, N, device="cuda", dtype=dtype)
    for _ in range(args.launches):
        run_gemv(A, qw, out, args.workers, args.stages, args.lookup, args.quads)
    torch.cuda.synchronize()
    print(f"profile_gemv: k={args.k} M={args.m} {K}x{N} {args.launches} launches done")


if __name__ == "__main__":
    main()
