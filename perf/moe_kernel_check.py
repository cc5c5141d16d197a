"""Correctness and L2-cold timing of the grouped expert kernels alone, with explicit split
counts: ``python -m perf.moe_kernel_check``.

For kernel work: checks ``grouped_gemm`` and ``moe_gate_up`` against a per-expert float32
reference on routings with idle experts, one crowded expert and rows past 8 per expert, then
times the Qwen3-Coder-Next expert shapes at T tokens for a list of split counts (each graph
replay a different routing, so the touched experts are not in L2), next to the bytes /
bandwidth floor.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from tabulate import tabulate

from kbit_cute import grouped_ops
from kbit_cute.experts import dequantize_experts, quantize_experts
from kbit_cute.grouped_ops import _grouped
from kbit_cute.moe import sort_by_expert
from perf.common import graph_time_us, read_bandwidth_gbs
from perf.models import MOE_MODELS, get_model


def random_routing(T: int, E: int, top_k: int, gen: torch.Generator, crowd: bool = False):
    """ids [T, top_k] of distinct experts per token (``crowd``: expert 0 in every token)."""
    if crowd:
        rest = 1 + torch.rand(T, E - 1, generator=gen, device="cuda").argsort(dim=1)
        return torch.cat([torch.zeros(T, 1, dtype=rest.dtype, device="cuda"),
                          rest[:, : top_k - 1]], dim=1)  # fmt: skip
    return torch.rand(T, E, generator=gen, device="cuda").argsort(dim=1)[:, :top_k]


def reference(A, W, offsets, gate_up):
    bounds = offsets.tolist()
    out = torch.zeros(A.shape[0], W.shape[1] // (2 if gate_up else 1), device="cuda")
    for e in range(W.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y = A[lo:hi].float() @ W[e].T
            if gate_up:
                g, u = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(g) * u
            out[lo:hi] = y
    return out


def check(ks) -> list:
    rows, bad = [], 0
    gen = torch.Generator(device="cuda").manual_seed(1)
    # (E, top_k, H, I): small Qwen-like and DeepSeek-like expert sets
    for E, top_k, H, inter in [(64, 6, 256, 192), (512, 10, 256, 128)]:
        for k in ks:
            gate_up = quantize_experts(torch.randn(E, 2 * inter, H, device="cuda") * 0.05, k)
            down = quantize_experts(torch.randn(E, H, inter, device="cuda") * 0.05, k)
            Wgu = dequantize_experts(gate_up, torch.float32)
            Wd = dequantize_experts(down, torch.float32)
            for dtype in (torch.float16, torch.bfloat16):
                for T, crowd in [(1, False), (4, False), (16, True), (64, False), (40, True)]:
                    ids = random_routing(T, E, top_k, gen, crowd)
                    order, offsets = sort_by_expert(ids, E)
                    A = torch.randn(T, H, device="cuda", dtype=dtype)[order // top_k]
                    for splits in (1, 2, None):
                        for gu, ex, W, x in ((True, gate_up, Wgu, A), (False, down, Wd, None)):
                            x = (
                                x
                                if x is not None
                                else torch.randn(A.shape[0], inter, device="cuda", dtype=dtype)
                            )
                            out = torch.full(
                                (x.shape[0], W.shape[1] // (2 if gu else 1)), float("nan"),
                                device="cuda", dtype=dtype,
                            )  # fmt: skip
                            _grouped(gu, x, ex, offsets, out, max_rows=T, splits=splits)
                            ref = reference(x, W, offsets, gu)
                            err = ((out.float() - ref).norm() / ref.norm()).item()
                            nan = torch.isnan(out).any().item()
                            tol = 2e-3 if dtype == torch.float16 else 1e-2
                            ok = not nan and err < tol
                            bad += not ok
                            if not ok or T == 64:
                                rows.append([E, top_k, k, str(dtype)[6:], T, crowd, splits,
                                             "gate_up" if gu else "down", f"{err:.1e}", nan, ok])  # fmt: skip
    print(f"check: {bad} failures")
    return rows


def timing(ks, Ts, split_list, stage_list, dtype, kernels=(None,), model="qwen3-coder-next",
           min_runs=(None,)) -> list:  # fmt: skip
    """A model's experts (default Qwen3-Coder-Next: E=512, top-10, H=2048, I=512): gate_up
    and down per T."""
    cfg = get_model(model)
    E, top_k, H, inter = cfg.experts, cfg.top_k, cfg.hidden, cfg.moe_intermediate
    bw = read_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for k in ks:
        gate_up = quantize_experts(torch.randn(E, 2 * inter, H, device="cuda") * 0.05, k)
        down = quantize_experts(torch.randn(E, H, inter, device="cuda") * 0.05, k)
        for T in Ts:
            routings = []
            for _ in range(16):  # a fresh routing per call: the touched experts are L2-cold
                ids = random_routing(T, E, top_k, gen)
                order, offsets = sort_by_expert(ids, E)
                touched = int((offsets[1:] > offsets[:-1]).sum())
                A = torch.randn(T, H, device="cuda", dtype=dtype)[order // top_k].contiguous()
                h = torch.empty(T * top_k, inter, device="cuda", dtype=dtype)
                y = torch.empty(T * top_k, H, device="cuda", dtype=dtype)
                routings.append((offsets, A, h, y, touched))
            touched = sum(r[4] for r in routings) / len(routings)
            nbytes = touched * (gate_up.nbytes_per_expert + down.nbytes_per_expert)
            combos = [
                (s, st, kn, mr)
                for s in split_list for st in stage_list for kn in kernels for mr in min_runs
            ]  # fmt: skip
            for splits, stages, kern, min_run in combos:
                if splits is not None and kern in ("stream", "gemm"):
                    continue
                if min_run is not None and kern != "stream":
                    continue

                def make(i, which, s=splits, st=stages, kn=kern, mr=min_run):
                    off, A, h, y, _ = routings[i % len(routings)]
                    up = lambda ov: _grouped(True, A, gate_up, off, h, T, s, st, ov, kn, mr)  # noqa: E731
                    dn = lambda ov: _grouped(False, h, down, off, y, T, s, st, ov, kn, mr)  # noqa: E731
                    if which == "gate_up":
                        return lambda: up(False)
                    if which == "down":
                        return lambda: dn(False)
                    ov = which == "chain overlap"  # both launches, as KbitMoE makes them
                    return lambda: (up(ov), dn(ov))

                us = {w: graph_time_us(lambda i, w=w: make(i, w), len(routings)) for w in
                      ("gate_up", "down", "chain", "chain overlap")}  # fmt: skip
                total = us["chain overlap"]
                floor = nbytes / bw / 1e3
                rows.append([model, k, T, kern or "auto", min_run or "-", splits or "auto", stages or "default", round(touched, 1), f"{us['gate_up']:.1f}",
                             f"{us['down']:.1f}", f"{us['chain']:.1f}", f"{total:.1f}",
                             f"{floor:.1f}", f"{total / (floor + 5):.2f}"])  # fmt: skip
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--T", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[0])
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--time-k", type=int, nargs="+", default=[4])
    p.add_argument("--model", nargs="+", default=["qwen3-coder-next"], choices=MOE_MODELS)
    p.add_argument("--min-run", type=int, nargs="+", default=[0],
                   help="stream kernel: K tiles per run at least (0: the library's)")  # fmt: skip
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", "stream", "grid", "gemm"],
        help="grouped kernel: the dispatch's choice, or GroupedStreamKernel / "
        "GroupedGemvKernel / GroupedGemmKernel (explicit split counts run the grid kernel)",
    )
    p.add_argument("--grid-table", choices=["auto", "on", "off"], default="auto",
                   help="decode launches of the grid kernel look up in the shared-memory "
                   "table: the library's rule, always, never")  # fmt: skip
    args = p.parse_args()
    grouped_ops._GRID_TABLE = {"auto": None, "on": True, "off": False}[args.grid_table]
    out = {}
    if not args.no_check:
        rows = check(args.k)
        out["check"] = rows
        print(tabulate(rows, headers=["E", "topk", "k", "dtype", "T", "crowd", "splits", "kernel",
                                      "rel err", "nan", "ok"]))  # fmt: skip
    splits = [s or None for s in args.splits]
    stages = [s or None for s in args.stages]
    kernels = [None if kn == "auto" else kn for kn in args.kernels]
    min_runs = [m or None for m in args.min_run]
    rows = [
        row
        for model in args.model
        for row in timing(
            args.time_k, args.T, splits, stages, torch.bfloat16, kernels, model, min_runs
        )  # fmt: skip
    ]
    out["timing"] = rows
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_kernel_check.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(tabulate(rows, headers=["model", "k", "T", "kernel", "min run", "splits", "stages", "experts", "gate_up us", "down us",
                                  "both us", "overlap us", "floor us", "overlap/(floor+5)"]))  # fmt: skip


if __name__ == "__main__":
    main()
