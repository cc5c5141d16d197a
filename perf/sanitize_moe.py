"""Grouped expert kernel calls per k that exercise every path (idle experts, an expert with
more than 8 rows, split-K with several passes, the fused gate/up epilogue, launches that
overlap the kernel before them, with and without the shared-memory
table; GroupedGemvKernel, GroupedStreamKernel and GroupedGemmKernel), for
``compute-sanitizer --tool memcheck|racecheck python -m perf.sanitize_moe``."""

from __future__ import annotations

import torch

from kbit_cute import grouped_ops
from kbit_cute.experts import quantize_experts
from kbit_cute.grouped_ops import _grouped
from kbit_cute.moe import sort_by_expert
from perf.moe_kernel_check import random_routing


def main() -> None:
    E, top_k, H, inter = 16, 4, 320, 192  # K = 320: a partial K tile
    wide = 256  # gate/up of whole repack tiles (I = 192: the up half tiles start mid-tile)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k in (2, 3, 4, 5):
        gate_up = quantize_experts(torch.randn(E, 2 * inter, H, device="cuda"), k)
        down = quantize_experts(torch.randn(E, H, inter, device="cuda"), k)
        gate_up_wide = quantize_experts(torch.randn(E, 2 * wide, H, device="cuda"), k)
        for T, crowd, dtype in ((1, False, torch.float16), (20, True, torch.bfloat16)):
            order, offsets = sort_by_expert(random_routing(T, E, top_k, gen, crowd), E)
            A = torch.randn(T, H, device="cuda", dtype=dtype)[order // top_k]
            h = torch.empty(T * top_k, inter, device="cuda", dtype=dtype)
            y = torch.empty(T * top_k, H, device="cuda", dtype=dtype)
            # overlap: the down launch finds its experts and prefetches before it waits;
            # stages: these launches are small (the decode ring), 3 = the default ring
            # (decode launches: splits 2 summed in a cluster, 4 in the workspace; stages 3:
            # the workspace)
            # table: the decode ring's shared-memory lookup table (k <= 4) on or off
            for splits, overlap, stages, table in (
                (1, False, None, False), (2, True, None, False), (4, False, None, False),
                (2, False, 3, False), (1, True, None, True), (2, True, None, True),
                (4, False, None, True),
            ):  # fmt: skip
                grouped_ops._GRID_TABLE = table
                _grouped(True, A, gate_up, offsets, h, T, splits, stages, overlap, "grid")
                _grouped(False, h, down, offsets, y, T, splits, stages, overlap, "grid")
            grouped_ops._GRID_TABLE = None
            # GroupedStreamKernel: split strips (T = 1) and runs that cross strips (T = 20)
            for overlap in (False, True):
                _grouped(True, A, gate_up, offsets, h, T, overlap=overlap, kernel="stream")
                _grouped(False, h, down, offsets, y, T, overlap=overlap, kernel="stream")
            # GroupedGemmKernel: M tiles of one row (T = 1) and of a crowded expert (T = 20);
            # gate/up with I = 192 and I = 256
            _grouped(True, A, gate_up, offsets, h, T, kernel="gemm")
            h_wide = torch.empty(T * top_k, wide, device="cuda", dtype=dtype)
            _grouped(True, A, gate_up_wide, offsets, h_wide, T, kernel="gemm")
            _grouped(False, h, down, offsets, y, T, kernel="gemm")
    torch.cuda.synchronize()
    print("sanitize_moe: done")


if __name__ == "__main__":
    main()
