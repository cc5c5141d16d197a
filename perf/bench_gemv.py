"""GEMV (M = 1..4) vs cuBLAS fp16 and torch int4 tinygemm: ``python -m perf.bench_gemv``.

Method: weights rotated over > 4x the L2 so every call reads HBM; CUDA-graph
replays timed with CUDA events; median of >= 7 replays; the read bandwidth
roofline measured in the same run (a large ``.sum()``). Shapes are K x N.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import kbit_cute
from kbit_cute import ops

from .common import copies_for, graph_time_us, read_bandwidth_gbs

LARGE = [(8192, 28672), (4096, 14336), (14336, 4096)]
QWEN3_CODER_NEXT = [
    (2048, 5120),
    (5120, 2048),
    (2048, 4096),
    (4096, 2048),
    (2048, 2048),
    (2048, 512),
    (512, 2048),
]


def bench_shape(K: int, N: int, ks, Ms, worker_options, bw: float, rows: list, records: list):
    dtype = torch.float16
    W = torch.randn(N, K, device="cuda", dtype=dtype) * 0.02
    # cuBLAS fp16
    nc = copies_for(W.numel() * 2)
    Ws = [W.clone() for _ in range(nc)]
    for M in Ms:
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        t_cublas = graph_time_us(lambda i: lambda: torch.matmul(A, Ws[i].T, out=out), nc)
        # tinygemm int4, group 128 (bf16 activations, as the op requires)
        try:
            Wi = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.int32)
            w_u8 = ((Wi[:, ::2] << 4) | Wi[:, 1::2]).to(torch.uint8)  # [N, K/2] nibbles
            packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
            sz = torch.randn(K // 128, N, 2, device="cuda", dtype=torch.bfloat16)
            nt = copies_for(packed.numel() * packed.element_size())
            Ps = [packed.clone() for _ in range(nt)]
            Ab = A.to(torch.bfloat16)
            t_tiny = graph_time_us(
                lambda i: lambda: torch.ops.aten._weight_int4pack_mm(Ab, Ps[i], 128, sz), nt
            )
            tiny = f"{t_tiny:.1f}"
        except Exception as exc:  # reported, not dropped
            tiny = f"failed: {type(exc).__name__}"
        for k in ks:
            qw = kbit_cute.quantize(W, k)
            nq = copies_for(qw.nbytes)
            qws = [
                kbit_cute.KbitWeight(
                    qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.scale, k, N, K, dtype
                )
                for _ in range(nq)
            ]
            for workers in worker_options:  # 0: the dispatch rule's grid
                t = graph_time_us(lambda i: lambda: ops._gemv(A, qws[i], None, out, M, workers), nq)
                floor_us = qw.nbytes / (bw * 1e3)
                gbs = qw.nbytes / (t * 1e3)
                rec = dict(K=K, N=N, k=k, M=M, workers=workers, us=t, gbs=gbs,
                           pct_bw=100 * gbs / bw, floor_us=floor_us, cublas_us=t_cublas, tinygemm=tiny,
                           speedup=t_cublas / t)  # fmt: skip
                records.append(rec)
                rows.append([f"{K}x{N}", k, M, workers or "rule", f"{t:.1f}", f"{floor_us:.1f}", f"{gbs:.0f}",
                             f"{100 * gbs / bw:.0f}%", f"{t_cublas:.1f}", tiny, f"{t_cublas / t:.2f}x"])  # fmt: skip


def host_overhead_us() -> tuple[float, float]:
    qw = kbit_cute.quantize(torch.randn(256, 256, device="cuda"), 4)
    A = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    out = torch.empty(1, 256, device="cuda", dtype=torch.float16)
    Wd = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    res = []
    for fn in (lambda: kbit_cute.gemm(A, qw, out=out), lambda: F.linear(A, Wd)):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10000):
            fn()
        res.append((time.perf_counter() - t) / 10000 * 1e6)
        torch.cuda.synchronize()
    return res[0], res[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4])
    p.add_argument("--workers", type=int, nargs="+", default=[0],
                   help="stream-K workers to time (default 0: the dispatch rule's choice)")  # fmt: skip
    p.add_argument("--shapes", default="all", choices=["all", "large", "qwen"])
    p.add_argument("--json", default=os.environ.get("OUT", ".") + "/bench_gemv.json")
    args = p.parse_args()
    bw = read_bandwidth_gbs()
    shapes = {"all": LARGE + QWEN3_CODER_NEXT, "large": LARGE, "qwen": QWEN3_CODER_NEXT}[
        args.shapes
    ]
    rows, records = [], []
    for K, N in shapes:
        bench_shape(K, N, args.k, args.m, args.workers, bw, rows, records)
    host, host_linear = host_overhead_us()
    with open(args.json, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), read_gbs=bw, host_us=host,
                       host_linear_us=host_linear, records=records), f, indent=1)  # fmt: skip
    print(
        f"{torch.cuda.get_device_name()}  measured read bandwidth {bw:.0f} GB/s  fp16 activations"
    )
    print(
        f"host time per eager call (M=1, tiny shape): kbit_cute.gemm {host:.1f} us, F.linear {host_linear:.1f} us"
    )
    print(tabulate(rows, tablefmt="github", headers=["KxN", "k", "M", "workers", "us", "floor us",
                                                     "GB/s", "% BW", "cuBLAS us", "tinygemm us", "vs cuBLAS"]))  # fmt: skip


if __name__ == "__main__":
    main()
