"""Correctness and L2-cold timing of the GEMV kernel alone, with explicit split counts, ring
depths and lookup variants (no dispatch rule): ``python -m perf.gemv_kernel_check``.

For kernel work: it checks every k x dtype x M on a few shapes (odd ones included, with
and without split-K) against the float32 reference, then times the large shapes for a
list of split counts next to cuBLAS fp16 in the same run. ``--passes N`` times every
configuration of a (shape, k, M) N times round robin and reports the median, so that a
drift of the clock or the power state hits each alike (a ring-depth or variant A/B in one
process). Its defaults are the kernel's (e.g. k = 4's 3-stage ring, k = 5's 128 KB table),
not the library's per-shape choices (``ops.gemv_variant``): the library's own times come from
``python -m perf gemm``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from tabulate import tabulate

from kbit_cute.compile import launcher
from kbit_cute.device import device_props
from kbit_cute.format import dequantize as dequantize_reference
from kbit_cute.format import quantize
from kbit_cute.kernels.device_helpers import EMPTY_SLOT
from kbit_cute.kernels.gemv import _DTYPES, COLS_PER_GROUP, GemvKernel, gemv_spec
from kbit_cute.ops import (
    _M_BUCKET,
    GEMV_MAX_M,
    gemv_crossing,
    gemv_cta_groups,
    has_fast_memory,
    kernel_grid,
)
from perf.common import copies_for, graph_time_us, read_bandwidth_gbs

_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_ws = torch.empty(0)
_counters = torch.empty(0)
# The variants with CTA groups (``GemvKernel.cta_groups``): "auto" (the library's rule,
# ``ops.gemv_cta_groups``), "on" (wherever the rows bucket has them), "off".
CTA_GROUPS = "auto"


def grid_for(qw, M, dtype, workers, stages=None, lookup=None, quads=None) -> tuple[int, int]:
    """(workers, CTAs) of a variant: ``workers`` an int, "auto" (the library's rule), "sN"
    (column tiles x N: an N-way split-K) or "fF" (F x the variant's resident quads)."""
    kern = GemvKernel(qw.k, _M_BUCKET[M], _DTYPES[_NAMES[dtype]], stages, lookup, quads)
    props = device_props(torch.cuda.current_device())
    sm_count = props.sm_count
    w = str(workers)
    if w == "auto":
        n = None
    elif w.startswith("s"):
        n = -(-qw.N // COLS_PER_GROUP) * int(w[1:])
    elif w.startswith("f"):
        n = max(1, int(float(w[1:]) * sm_count * kern.ctas_per_sm * kern.quads))
    else:
        n = int(w)
    return kernel_grid(kern, qw.N, qw.K, sm_count, n, has_fast_memory(props))


def run_gemv(A, qw, out, workers="auto", stages=None, lookup=None, quads=None, crossing=None):
    """One GEMV launch with an explicit stream-K grid (``grid_for``) and kernel variant (ring
    depth, lookup, quads per CTA; ``crossing``: the variant for runs across strips, None:
    the library's choice, ``ops.gemv_crossing``) through the library's launcher; the
    workspace is this script's own."""
    global _ws, _counters
    M = A.shape[0]
    m = _M_BUCKET[M]
    n, ctas = grid_for(qw, M, A.dtype, workers, stages, lookup, quads)
    groups = m >= GemvKernel.CTA_GROUPS_FROM_M and CTA_GROUPS == "on"
    if CTA_GROUPS == "auto":
        groups = gemv_cta_groups(m, qw.N, (n, ctas), (lookup, stages))
    if crossing is None:
        fast = has_fast_memory(device_props(torch.cuda.current_device()))
        crossing = gemv_crossing(m, qw.k, qw.N, (n, ctas), groups, fast)
    fn = launcher(gemv_spec(qw.k, m, _NAMES[A.dtype], stages, lookup, quads, groups, crossing))
    need = 2 * n * m * COLS_PER_GROUP
    if _ws.numel() < need or _ws.device.type != "cuda":
        slots = torch.full((max(need, 1 << 22),), EMPTY_SLOT, dtype=torch.int32, device="cuda")
        _ws = slots.view(torch.float32)
        _counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    fn(A, qw.packed, qw.absmax, qw.codebook, qw.scale, out, out, _ws, _counters,
       M, qw.N, qw.K, n, ctas, *GemvKernel.cta_args(groups, qw.N, n, ctas), 0)  # fmt: skip


def check(variants=((None, None),)) -> list:
    rows, bad = [], 0
    for K, N in [(2048, 512), (512, 2048), (1056, 1000), (4096, 2048), (160, 200)]:
        for k in (2, 3, 4, 5):
            qw = quantize(torch.randn(N, K, device="cuda") * 0.05, k)
            W = dequantize_reference(qw, torch.float32)
            for dtype in (torch.float16, torch.bfloat16):
                for M in (1, 2, 3, 4, 5, 8):
                    for splits, (lk, wk) in [
                        (s, v) for s in ("s1", "s3", "auto", 7) for v in variants
                    ]:
                        if lk and not GemvKernel.lookup_fits(lk, k):
                            continue
                        A = torch.randn(M, K, device="cuda", dtype=dtype)
                        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                        run_gemv(A, qw, out, splits, None, lk, wk)
                        ref = A.float() @ W.T
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        nan = torch.isnan(out).any().item()
                        tol = 1e-3 if dtype == torch.float16 else 8e-3
                        ok = not nan and err < tol
                        bad += not ok
                        if not ok or (M == 4 and splits == "s3" and K == 1056):
                            rows.append(
                                [
                                    f"{K}x{N}",
                                    k,
                                    _NAMES[dtype],
                                    M,
                                    splits,
                                    lk,
                                    wk,
                                    f"{err:.2e}",
                                    nan,
                                    ok,
                                ]
                            )
    print(tabulate(rows, headers=["KxN", "k", "dtype", "M", "workers", "lookup", "quads", "rel err", "nan", "ok"],
                   tablefmt="github"))  # fmt: skip
    print(f"correctness: {bad} failures")
    return rows


def round_robin(configs, time_one, passes: int) -> dict:
    """{config: [us of each pass]}: every config timed once per pass, the passes one after
    the other, so that a drift of the GPU's clock or power state reaches every config."""
    times = {c: [] for c in configs}
    for _ in range(passes):
        for c in configs:
            times[c].append(time_one(c))
    return times


def bench(
    split_options, ks, Ms, shapes, stage_options=(None,), variants=((None, None),), passes=1
) -> list:
    bw = read_bandwidth_gbs()
    rows, recs = [], []
    for K, N in shapes:
        W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        nc = copies_for(W.numel() * 2)
        Ws = [W.clone() for _ in range(nc)]
        t_cublas = {}
        for M in Ms:
            A = torch.randn(M, K, device="cuda", dtype=torch.float16)
            o = torch.empty(M, N, device="cuda", dtype=torch.float16)
            t_cublas[M] = graph_time_us(
                lambda i, A=A, o=o: lambda: torch.matmul(A, Ws[i].T, out=o), nc
            )

        for k in ks:
            qw = quantize(W, k)
            nq = copies_for(qw.nbytes)
            qws = [type(qw)(qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.scale, k, N, K,
                            qw.dtype) for _ in range(nq)]  # fmt: skip
            for M in Ms:
                A = torch.randn(M, K, device="cuda", dtype=torch.float16)
                out = torch.empty(M, N, device="cuda", dtype=torch.float16)
                combos = [
                    (s, st, v)
                    for s in split_options
                    for st in stage_options
                    for v in variants
                    if not v[0] or GemvKernel.lookup_fits(v[0], k)
                ]

                def time_one(combo, A=A, out=out, qws=qws, nq=nq):
                    s, st, (lk, wk) = combo
                    return graph_time_us(
                        lambda i: lambda: run_gemv(A, qws[i], out, s, st, lk, wk), nq
                    )

                for (splits, st, (lk, wk)), ts in round_robin(combos, time_one, passes).items():
                    t = statistics.median(ts)
                    gbs = qw.nbytes / (t * 1e3)
                    recs.append(dict(K=K, N=N, k=k, M=M, workers=splits, stages=st, lookup=lk,
                                     quads=wk, us=t, us_passes=ts, pct=100 * gbs / bw,
                                     cublas=t_cublas[M]))  # fmt: skip
                    rows.append([f"{K}x{N}", k, M, splits, st, f"{lk or ''}/{wk or ''}", f"{t:.2f}", f"{qw.nbytes / bw / 1e3:.1f}",
                                 f"{100 * gbs / bw:.0f}%", f"{t_cublas[M]:.1f}", f"{t_cublas[M] / t:.2f}x"]
                                + ([f"{min(ts):.2f}-{max(ts):.2f}"] if passes > 1 else []))  # fmt: skip

    print(f"read bandwidth {bw:.0f} GB/s")
    print(tabulate(rows, headers=["KxN", "k", "M", "workers", "stages", "lookup/quads", "us", "floor us", "% BW", "cuBLAS us",
                                  "vs cuBLAS"] + (["passes min-max us"] if passes > 1 else []),
                   tablefmt="github"))  # fmt: skip
    return recs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", nargs="+", default=["auto"],
                   help="stream-K workers: N, auto, sN (N-way split-K), fF (F x slots)")  # fmt: skip
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4])
    p.add_argument("--shapes", default="8192x28672,4096x14336,14336x4096")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--stages", type=int, nargs="+", default=[None])
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="lookup/quads pairs, e.g. pair_table/8 shuffle/1 default")  # fmt: skip
    p.add_argument("--passes", type=int, default=1,
                   help="time each configuration this many times, round robin; us = the median")  # fmt: skip
    p.add_argument("--cta-groups", choices=["auto", "on", "off"], default="auto",
                   help="GEMV variants with CTA groups: the library's rule, always, never")  # fmt: skip
    args = p.parse_args()
    if not all(1 <= M <= GEMV_MAX_M for M in args.m):
        p.error(f"--m: this tool times the GEMV's rows buckets, M = 1..{GEMV_MAX_M}")
    global CTA_GROUPS
    CTA_GROUPS = args.cta_groups
    variants = []
    for v in args.variants:
        lk, _, wk = v.partition("/")
        variants.append((None if lk == "default" else lk, int(wk) if wk else None))
    if not args.no_check:
        check(variants)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    if args.passes < 1:
        p.error("--passes: at least 1")
    recs = bench(args.workers, args.k, args.m, shapes, args.stages, variants, args.passes)
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_kernel_check.json"), "w") as f:
        json.dump(recs, f)


if __name__ == "__main__":
    main()
