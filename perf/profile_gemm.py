"""A few launches of one mma.sync GEMM configuration, for profilers:

    ncu --clock-control none -k regex:Gemm --launch-skip 3 --launch-count 1 \
        python -m perf.profile_gemm --k 4 --m 16 --shape 8192x28672 --config m16n128k64s4w1x4
"""

from __future__ import annotations

import argparse

import torch

from kbit_cute import gemm_dispatch as gd
from kbit_cute.format import quantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--shape", default="8192x28672", help="KxN")
    p.add_argument("--config", default=None, help="GemmConfig name (default: the table's)")
    p.add_argument("--splits", type=int, default=None, help="a split-K grid (default: table)")
    p.add_argument("--workers", type=int, default=None, help="stream-K CTAs (default: table)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--launches", type=int, default=6)
    args = p.parse_args()
    K, N = (int(x) for x in args.shape.split("x"))
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    qw = quantize(torch.randn(N, K, device="cuda") * 0.02, args.k)
    A = torch.randn(args.m, K, device="cuda", dtype=dtype)
    out = torch.empty(args.m, N, device="cuda", dtype=dtype)
    for _ in range(args.launches):
        gd.gemm_mma(A, qw, None, out, config=args.config, splits=args.splits, workers=args.workers)
    torch.cuda.synchronize()
    print(f"profile_gemm: k={args.k} M={args.m} {K}x{N} {args.config} {args.launches} launches")


if __name__ == "__main__":
    main()
