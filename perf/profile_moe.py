"""A few launches of the grouped expert kernels on one Qwen3-Coder-Next routing, for
profilers (each launch a fresh routing, so the touched experts come from DRAM):

    ncu --clock-control none -k regex:Grouped --launch-skip 4 --launch-count 2 \
        python -m perf.profile_moe --k 4 --T 1
"""

from __future__ import annotations

import argparse

import torch

from kbit_cute.experts import quantize_experts
from kbit_cute.grouped_ops import _grouped
from kbit_cute.moe import sort_by_expert
from perf.moe_kernel_check import random_routing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--T", type=int, default=1)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--shape", default="2048x512", help="hidden x expert intermediate")
    p.add_argument("--splits", type=int, default=None)
    p.add_argument("--launches", type=int, default=4, help="(gate_up, down) pairs")
    args = p.parse_args()
    H, inter = (int(x) for x in args.shape.split("x"))
    E, top_k, T = args.experts, args.top_k, args.T
    gate_up = quantize_experts(torch.randn(E, 2 * inter, H, device="cuda") * 0.05, args.k)
    down = quantize_experts(torch.randn(E, H, inter, device="cuda") * 0.05, args.k)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(args.launches):
        order, offsets = sort_by_expert(random_routing(T, E, top_k, gen), E)
        A = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)[order // top_k]
        h = torch.empty(T * top_k, inter, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(T * top_k, H, device="cuda", dtype=torch.bfloat16)
        _grouped(True, A, gate_up, offsets, h, T, args.splits)
        _grouped(False, h, down, offsets, y, T, args.splits)
    torch.cuda.synchronize()
    print(f"profile_moe: k={args.k} T={T} E={E} top-{top_k} {H}x{inter} done")


if __name__ == "__main__":
    main()
