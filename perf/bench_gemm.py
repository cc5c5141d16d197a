"""mma.sync GEMM (M >= 5) vs cuBLAS fp16 and dequantize + cuBLAS: ``python -m perf.bench_gemm``.

Two jobs, one method (perf/common.py: weights rotated over > 4x the L2 so every call reads
HBM, CUDA-graph replays timed with CUDA events, median of >= 7 replays, read bandwidth and
cuBLAS matmul peak measured in the same run):

* report (default): for each shape (K x N), k and M, the dispatched kernel (table config and
  workers) against cuBLAS fp16 ``F.linear`` and dequantize + cuBLAS; us, TFLOP/s, weight GB/s
  and speedups. Qwen3-Coder-Next shapes at M = 16, 32 too.
* ``--tune``: every candidate tiling x worker density (CTAs per SM, ``plan_workers``) per
  M bucket and shape (``--candidates table``: only the table's tiling per bucket; ``--with
  NAME ...``: these tilings too, in every bucket tuned), then
  ``--write-table`` turns the measurements into ``kbit_cute/kernels/gemm_table.py``
  (the fastest candidate per (k, M bucket) by geometric mean over the shapes; where
  dequantize + cuBLAS is faster, CUBLAS_FROM_M). Shapes whose weight is larger than the
  L2 make their own rows (RULES_OVER_L2, CUBLAS_FROM_M_OVER_L2), and so do small weights
  (RULES_SMALL, ``gemm_dispatch.small_weight``: tune them with ``--shapes`` and ``--buckets
  16 32 64``; a row of theirs applies to its own bucket only); the default
  tune shapes (TUNE_SHAPES) hold two weights over the L2 and four that fit, none small.
  Tune one k per command to stay within 10 minutes, then merge:
  ``--write-table-from tune_k2.json tune_k3.json ...``.
* ``--write-small-from report.json ...``: from reports on weights smaller than the tune's
  (``--shapes``, M of 64 and more), the sizes up to which dequantize + cuBLAS wins from a
  smaller M than CUBLAS_FROM_M (CUBLAS_FROM_M_SMALL).

    python -m perf.bench_gemm --tune --k 4 --json $OUT/tune_k4.json
    python -m perf.bench_gemm --write-table-from tune_k*.json
    python -m perf.bench_gemm --k 2 3 4 5           # the report, with the new table
    python -m perf.bench_gemm --shapes 2048x512 4096x2048 --m 64 128 256 512 --no-qwen \
        --json $OUT/small.json; python -m perf.bench_gemm --write-small-from small.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tabulate import tabulate

import kbit_cute
from kbit_cute import gemm_dispatch as gd
from kbit_cute.device import device_props
from kbit_cute.kernels.gemm import GemmConfig, GemmKernel, gemm_spec, table_rows

from .common import PowerCapPause, copies_for, graph_time_us, read_bandwidth_gbs, tensor_tflops

SHAPES = [(4096, 14336), (14336, 4096), (8192, 28672), (2048, 10240), (10240, 2048)]
# --tune's default: the issue's shapes plus a second weight larger than the L2, so that the
# general rows and RULES_OVER_L2 are tuned on more than one shape (RULES_SMALL: ``--shapes``).
TUNE_SHAPES = [*SHAPES, (28672, 8192)]
MS = [5, 8, 16, 32, 64, 128, 256, 1024, 4096]
QWEN_MS = [16, 32]
TABLE_PATH = Path(__file__).resolve().parent.parent / "kbit_cute" / "kernels" / "gemm_table.py"

# Tuning: (bucket's m_max, representative M, candidate configs). The last bucket covers all
# larger M; its representatives are 1024 and 4096.
# Names ending in "l" use the lane-replicated pair table (GemmConfig.table "lane"), in "r"
# the row table ("row", k <= 4; the others skip those names), in "h" the half-row table
# ("half", k = 4 only: the lane table's memory at the row table's cost, session 33). Warp
# tiles stop at 64 x 32: 64 x 64 ones (m64n256 w1x4, m128n128 w2x2) reach 255 registers
# and spill at some k or on sm_80, which the compile gate refuses.
_LARGE_TILES = [
    "m64n128k64s3w1x4",
    "m64n128k64s3w1x4l",
    "m64n128k64s3w1x4r",
    "m128n128k64s3w2x4r",
    "m64n256k64s3w1x8r",
    "m128n128k64s3w2x4",
    "m128n128k64s3w2x4l",
    "m64n256k64s3w1x8",
    "m64n256k64s3w1x8l",
]
# Warpgroup MMA (suffix "g", sm_90a): the weight tile is wgmma's register operand; M tiles
# of up to 256 rows (wgmma's N). k = 5 takes the compact-table "g" names.
_WGMMA_64 = [
    "m64n256k64s4w1x8rg", "m64n256k64s6w1x8rg", "m64n128k64s4w1x4rg", "m64n256k64s4w1x8g",
    # a copy-producer warpgroup (suffix "c", session 32)
    "m64n256k64s6w1x8rgc", "m64n256k64s6w1x8gc",
]  # fmt: skip
# TILE_K = 128 tilings: half the K slices per tile (a barrier round per 128 of K). Session
# 23's tune (table rows + these, M = 128..512) took them for four rows, 1-5% by geomean
# (k = 5 M = 128 10240x2048 38.1 -> 31.4 us, 4096x14336 58.5 -> 60.2).
_WGMMA_LARGE = [
    "m128n256k64s4w1x8rg", "m128n256k64s5w1x8rg", "m128n128k64s4w1x8rg", "m256n128k64s4w1x8rg",
    "m256n128k64s5w1x8lg", "m128n256k64s4w1x8g", "m256n128k64s4w1x8g",
    "m128n256k128s3w1x8rg", "m128n128k128s3w1x8rg", "m128n256k128s3w1x8g", "m128n128k128s3w1x8g",
    "m128n256k64s4w1x8rgc", "m128n256k64s4w1x8gc", "m128n128k64s4w1x8rgc", "m128n128k128s3w1x8gc",
    "m256n128k64s4w1x8gc",
]  # fmt: skip
BUCKETS = [
    (16, [16], ["m16n128k64s4w1x4", "m16n128k128s4w1x4", "m16n256k64s4w1x4",
                "m16n128k64s4w1x4l", "m16n128k128s4w1x4l", "m16n256k64s4w1x8l",
                "m16n128k64s3w1x4l", "m16n128k128s3w1x4l", "m16n256k128s3w1x8l",
                "m16n128k64s3w1x4r", "m16n128k128s3w1x4r", "m16n256k64s3w1x8r",
                "m16n256k128s3w1x8r", "m16n128k64s4w1x4r", "m16n128k128s3w1x4h",
                "m16n128k64s4w1x4h"]),
    (32, [32], ["m32n128k64s4w1x4", "m32n128k64s4w1x2", "m32n256k64s4w1x4",
                "m32n128k64s4w1x4l", "m32n128k64s4w1x2l", "m32n256k64s4w1x8l",
                "m32n128k64s3w1x4l", "m32n128k128s3w1x4l", "m32n128k64s3w1x4r",
                "m32n128k128s3w1x4r", "m32n256k64s4w1x8r", "m32n128k64s4w1x4r",
                "m32n128k64s4w1x4rg", "m32n128k64s4w1x4g", "m32n128k64s4w1x4hg",
                "m32n128k64s4w1x4h"]),
    (64, [64], ["m64n128k64s3w1x4", "m64n128k64s3w1x4l", "m64n256k64s3w1x8l",
                "m32n128k64s4w1x4l", "m64n128k64s3w1x4r", "m64n256k64s3w1x8r",
                "m32n128k64s4w1x4r", *_WGMMA_64]),
    (128, [128], _LARGE_TILES + _WGMMA_LARGE),
    (256, [256], _LARGE_TILES + _WGMMA_LARGE),
    (512, [512], _LARGE_TILES + _WGMMA_LARGE),
    (1 << 31, [1024, 4096], _LARGE_TILES + _WGMMA_LARGE),
]  # fmt: skip
CTAS_PER_SM = [1, 2, 3, 4, 6]
MAX_SPLITS = 16
REUSE_SLACK = 1.03  # prefer a config another bucket already uses when within 3%


def qwen_shapes() -> list[tuple[int, int]]:
    try:
        from . import models

        return [(K, N) for K, N, _ in models.get_model("qwen3-coder-next").sweep_shapes()]
    except Exception:  # the model list moved: the shapes as of this writing
        return [(2048, 8192), (2048, 512), (4096, 2048), (2048, 12288), (512, 2048)]


class Bench:
    """Weights and copies of one shape; times the implementations at one M."""

    def __init__(self, K: int, N: int, ks):
        self.K, self.N = K, N
        self.W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        self.nc = copies_for(self.W.numel() * 2)
        self.Ws = [self.W.clone() for _ in range(self.nc)]
        self.qws = {}
        for k in ks:
            qw = kbit_cute.quantize(self.W, k)
            n = copies_for(qw.nbytes)
            self.qws[k] = [
                kbit_cute.KbitWeight(
                    qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.scale, k, N, K,
                    torch.float16,
                )
                for _ in range(n)
            ]  # fmt: skip
        self.Wbuf = torch.empty(N, K, device="cuda", dtype=torch.float16)

    def inputs(self, M: int):
        A = torch.randn(M, self.K, device="cuda", dtype=torch.float16)
        return A, torch.empty(M, self.N, device="cuda", dtype=torch.float16)

    def cublas(self, M: int) -> float:
        A, _ = self.inputs(M)
        return graph_time_us(lambda i: lambda: F.linear(A, self.Ws[i]), self.nc)

    def dequant_cublas(self, M: int, k: int) -> float:
        A, _ = self.inputs(M)
        qws, Wb = self.qws[k], self.Wbuf

        def call(i):
            return lambda: F.linear(A, kbit_cute.dequantize(qws[i], torch.float16, out=Wb))

        return graph_time_us(call, len(qws))

    def kernel(
        self, M: int, k: int, config=None, splits=None, workers=None, deterministic=False
    ) -> float:
        A, out = self.inputs(M)
        qws = self.qws[k]

        def call(i):
            return lambda: gd.gemm_mma(
                A, qws[i], None, out, config=config, splits=splits, workers=workers,
                deterministic=deterministic,
            )  # fmt: skip

        return graph_time_us(call, len(qws))

    def weight_bytes(self, k: int) -> int:
        return self.qws[k][0].nbytes


# ----------------------------------------------------------------------------- tune


def tune(
    ks,
    shapes,
    sm_count: int,
    log,
    table_only: bool = False,
    buckets=None,
    jobs: int = 1,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    """Timings of the candidates of every bucket (or of the buckets whose m_max is listed
    in ``buckets``) on ``shapes``; ``extra`` tilings are candidates of every bucket tuned
    (with ``table_only``: the table's row and these). The candidates are compiled first,
    ``jobs`` at a time (into the disk cache: one compile each takes 1-8 s, the tune's timing
    far less)."""
    from kbit_cute.kernels import gemm_table

    props = device_props(torch.cuda.current_device())
    compile_candidates(ks, [] if table_only else buckets, props, jobs, log, extra)
    records = []
    # (each k starts again at small M after the largest: the first candidates timed there
    # would run under the power cap, and the tune would pick against them)
    power_cap = PowerCapPause()
    for K, N in shapes:
        b = Bench(K, N, ks)
        for k in ks:
            for m_max, Ms, names in BUCKETS:
                if buckets is not None and m_max not in buckets:
                    continue
                over_l2 = gd.weight_over_l2(N, K, k, props.l2_bytes)
                small = gd.small_weight(N, K, over_l2)  # (``table_from`` classes by size)
                for M in Ms:
                    power_cap.before(M)
                    t_dq = b.dequant_cublas(M, k)
                    base = dict(K=K, N=N, k=k, M=M, m_max=m_max, over_l2=over_l2)
                    records.append(dict(base, impl="dequant_cublas", us=t_dq))
                    timed: dict[tuple[str, int], float] = {}  # densities giving one grid
                    # (candidate, tiling timed): the table's row runs what the dispatcher
                    # runs (a weight over the L2 may take a larger tile: ``gd.table_rule``).
                    cands = [(name, name) for name in names]
                    if table_only:
                        own = gemm_table.RULES_OVER_L2.get(k, ()) if over_l2 else ()
                        if small:  # (small rows by bucket: ``gd.table_rule``)
                            own = [r for r in gemm_table.RULES_SMALL.get(k, ()) if r[0] == m_max]
                        row = next((r[1] for r in own if r[0] >= m_max), None) or next(
                            r[1] for r in gemm_table.RULES[k] if r[0] >= m_max
                        )
                        cands = [(row, gd.table_rule(k, M, over_l2, small)[0])]
                    cands += [(n, n) for n in extra if (n, n) not in cands]
                    for name, ran in cands:
                        cfg = GemmConfig.parse(ran)
                        if not GemmKernel.can_implement(k, "f16", cfg, props.smem_per_block_optin):
                            continue
                        resident = gd.resident_ctas(cfg, k, props.smem_per_sm)
                        for ctas in CTAS_PER_SM:
                            workers = gd.plan_workers(
                                M, N, K, cfg, sm_count, ctas, MAX_SPLITS, resident
                            )
                            if (ran, workers) not in timed:
                                try:
                                    timed[(ran, workers)] = b.kernel(
                                        M, k, ran, workers=workers, deterministic=True
                                    )  # what kbit_cute.gemm runs
                                except Exception as exc:  # recorded, never silently dropped
                                    log(f"  {K}x{N} k={k} M={M} {ran}: {type(exc).__name__}: {exc}")
                                    timed[(ran, workers)] = math.inf
                            records.append(dict(base, impl="kernel", config=name, ran=ran,
                                                ctas_per_sm=ctas, workers=workers,
                                                us=timed[(ran, workers)]))  # fmt: skip
                    best = min(timed.values())
                    log(
                        f"{K}x{N} k={k} M={M}: best kernel {best:.1f} us, dequant+cuBLAS {t_dq:.1f} us"
                    )
        del b
        torch.cuda.empty_cache()
    return records


def compile_candidates(ks, buckets, props, jobs: int, log, extra=()) -> None:
    """Every fp16 candidate tiling of the tuned buckets (``buckets`` None: all) and the
    ``extra`` ones, compiled in parallel processes."""
    from kbit_cute import precompile

    names = sorted({n for m_max, _, ns in BUCKETS if buckets is None or m_max in buckets
                    for n in ns} | set(extra))  # fmt: skip
    specs = [
        gemm_spec(k, "f16", GemmConfig.parse(n)) for k in ks for n in names
        if GemmKernel.can_implement(k, "f16", GemmConfig.parse(n), props.smem_per_block_optin)
    ]  # fmt: skip
    got = precompile.build(specs, props.arch, jobs)
    log(f"candidates: {got['variants']}, compiled {got['compiled']} in {got['wall_s']:.0f} s")
    for name, error in got["failed"].items():  # the tune records these as inf
        log(f"  {name}: {error}")


def _geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


class TableUpdate(NamedTuple):
    """What a tune measured, per k: rows and cuBLAS thresholds of the general table (weights
    that fit the L2), of the weights over the L2, and rows of small weights (their cuBLAS
    thresholds are ``cublas_from_small``, from reports). A class or bucket without records
    is left out (``write_table`` keeps what the table had)."""

    rules: dict
    cublas_from: dict
    rules_over_l2: dict
    cublas_from_over_l2: dict
    cublas_from_small: list | None = None  # None: the table's rows stay
    rules_small: dict | None = None  # rows of small weights (``gd.small_weight``)


def compile_gate():
    """(k, config name) -> whether that variant passes the compile gate CI enforces on the
    table's rows (``tests/test_inspect.py``: no spills, its instruction classes present),
    fp16 and bf16, for this process's target (``CUTE_DSL_ARCH=sm_90a`` without a GPU). A
    tuned row can be fast and still spill (session 32: k = 5's m128n256k64s4w1x8gc)."""
    from kbit_cute.inspect import inspect_spec

    verdicts: dict[tuple[int, str], bool] = {}

    def passes(k: int, name: str) -> bool:
        if (k, name) not in verdicts:
            cfg = GemmConfig.parse(name)
            rows = [inspect_spec(gemm_spec(k, dt, cfg)) for dt in ("f16", "bf16")]
            verdicts[(k, name)] = all(r["ok"] for r in rows)
        return verdicts[(k, name)]

    return passes


def table_from(records: list[dict], keep_tilings: bool = False, gate=None) -> TableUpdate:
    """The table's rows and cuBLAS thresholds from tune records (any subset of k, buckets
    and shapes). Records of weights over the L2 (``over_l2``, set by ``tune``) make that
    class's rows, those of small weights (``gd.small_weight``, by size) RULES_SMALL (without
    the buckets where they chose the general row itself), the others the general rows.
    ``keep_tilings``: choose only among the tilings the table already has for that k (a
    re-tune of densities and rows that adds no variant to compile and validate). ``gate``:
    (k, config name) -> bool (``compile_gate``); a row is the best candidate that passes."""
    from kbit_cute.kernels import gemm_table

    if keep_tilings:
        tabled = {k: {r[1] for r in table_rows(k)} for k in gemm_table.RULES}
        records = [
            r for r in records if r["impl"] != "kernel" or r["config"] in tabled.get(r["k"], ())
        ]
    general, over, small = [], [], []
    for r in records:  # small weights by size (also in tunes from before their class)
        if r.get("over_l2", False):
            over.append(r)
        elif gd.small_weight(r["N"], r["K"], False):
            small.append(r)
        else:
            general.append(r)
    rules, cublas_from = _class_table(general, gemm_table.CUBLAS_FROM_M, gate)
    old_over = {**gemm_table.CUBLAS_FROM_M, **gemm_table.CUBLAS_FROM_M_OVER_L2}
    rules_over, cublas_over = _class_table(over, old_over, gate)
    # Small weights' cuBLAS thresholds are CUBLAS_FROM_M_SMALL's (``--write-small-from``).
    # A bucket whose winner is the general row itself gets no row: it follows that row.
    rules_small, _ = _class_table(small, {}, gate)
    merged_general, _ = _merged(gemm_table.RULES, rules)
    for k in list(rules_small):
        general_row = {r[0]: r for r in merged_general.get(k, ())}
        rules_small[k] = [r for r in rules_small[k] if general_row.get(r[0]) != r]
        if not rules_small[k]:
            del rules_small[k]
    return TableUpdate(rules, cublas_from, rules_over, cublas_over, rules_small=rules_small)


def small_weight_rows(records: list[dict]) -> list[tuple[int, dict]]:
    """CUBLAS_FROM_M_SMALL from report records (``kernel_us`` and ``dequant_cublas_us`` per
    shape, k and M): per weight size (N x K elements; shapes of one size together) and k,
    the smallest measured M from which dequantize + cuBLAS wins at every larger measured M
    (geometric mean over the shapes of kernel / dequantize + cuBLAS; None: the kernel won
    at the largest M). Rows by size (sizes with the same thresholds as the next larger one
    left to its row), up to the largest size with a threshold."""
    ratios: dict[int, dict[int, dict[int, list]]] = {}
    for r in records:
        by_k = ratios.setdefault(r["K"] * r["N"], {}).setdefault(r["k"], {})
        by_k.setdefault(r["M"], []).append(r["kernel_us"] / r["dequant_cublas_us"])
    rows = []
    for size in sorted(ratios):
        from_m = {}
        for k, by_m in sorted(ratios[size].items()):
            from_m[k] = None
            for M in sorted(by_m, reverse=True):
                if _geomean(by_m[M]) <= 1.0:
                    break
                from_m[k] = M
        if rows and rows[-1][1] == from_m:
            rows.pop()  # the larger size's row covers the smaller one
        rows.append((size, from_m))
    while rows and all(m is None for m in rows[-1][1].values()):
        rows.pop()
    return rows


def _class_table(records: list[dict], old_cublas_from: dict, gate=None) -> tuple[dict, dict]:
    """(rules, cuBLAS thresholds) per k from one class's records: per bucket the candidate
    (tiling, CTAs per SM) with the smallest geometric mean of time / the point's best, among
    those whose tiling passes ``gate`` (checked best first: a gate compiles)."""

    rules, cublas_from = {}, {}
    for k in sorted({r["k"] for r in records}):
        rk = [r for r in records if r["k"] == k]
        chosen: dict[int, tuple] = {}
        scores: dict[int, dict] = {}
        for m_max, _, _ in BUCKETS:
            rb = [r for r in rk if r["m_max"] == m_max and r["impl"] == "kernel"]
            if not rb:
                continue
            points = {(r["K"], r["N"], r["M"]) for r in rb}
            best = {p: min(r["us"] for r in rb if (r["K"], r["N"], r["M"]) == p) for p in points}
            cands: dict[tuple, list] = {}
            for r in rb:
                cands.setdefault((r["config"], r["ctas_per_sm"]), []).append(
                    r["us"] / best[(r["K"], r["N"], r["M"])]
                )
            sc = {c: _geomean(v) for c, v in cands.items() if len(v) == len(points)}
            if gate is not None:  # drop failing candidates down to the best that passes
                # (the slower ones stay unchecked: the reuse below only takes tilings the
                # table or another bucket already has, which passed)
                for c in sorted(sc, key=sc.get):
                    if gate(k, c[0]):
                        break
                    del sc[c]
            if not sc:  # no candidate timed at every point (JSONs of different candidates)
                continue
            scores[m_max] = sc
            chosen[m_max] = min(sc, key=sc.get)
        # Fewer distinct tilings (CI compiles each): reuse one another bucket or the table
        # already has if close.
        used = {c[0] for c in chosen.values()} | {r[1] for r in table_rows(k)}
        for m_max, sc in scores.items():
            best_score = sc[chosen[m_max]]
            alts = [c for c in sc if c[0] in used and sc[c] <= best_score * REUSE_SLACK]
            if alts:
                chosen[m_max] = min(alts, key=sc.get)
        if chosen:
            rules[k] = [(m_max, c[0], c[1], MAX_SPLITS) for m_max, c in sorted(chosen.items())]
        if not any(r["impl"] == "dequant_cublas" for r in rk):
            continue  # nothing to compare with: the cuBLAS threshold stays
        # dequantize + cuBLAS from the smallest representative M where it wins at every M above
        # (Ms with kernel timings: --keep-tilings may have left a bucket none).
        Ms = sorted({r["M"] for r in rk if r["impl"] == "kernel"})
        if not Ms:
            continue
        wins = {}
        for M in Ms:
            rm = [r for r in rk if r["M"] == M]
            shapes = {(r["K"], r["N"]) for r in rm}
            ratio = _geomean(
                [min(r["us"] for r in rm if (r["K"], r["N"]) == s and r["impl"] == "kernel")
                 / next(r["us"] for r in rm if (r["K"], r["N"]) == s and r["impl"] == "dequant_cublas")
                 for s in shapes]
            )  # fmt: skip
            wins[M] = ratio > 1.0
        # Where the largest bucket was not measured, its verdict is the table's threshold:
        # if the largest measured M goes to cuBLAS, the threshold moves down to where that
        # starts; if the kernel won at or above the old threshold, it moves past the
        # measured Ms; else it stays.
        old, top = old_cublas_from.get(k), Ms[-1]
        if any(r["m_max"] == BUCKETS[-1][0] for r in rk) or wins[top]:
            cublas_from[k] = None
            for M in reversed(Ms):
                if not wins[M]:
                    break
                cublas_from[k] = M
        elif old is not None and old <= top:
            cublas_from[k] = next(m for _, reps, _ in BUCKETS for m in reps if m > top)
    return rules, cublas_from


def _wrapped(text: str, width: int) -> list[str]:
    """``text`` cut at spaces into pieces of at most ``width`` characters that concatenate
    back to it (each piece but the last keeps its trailing space)."""
    pieces = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)
    return [p + " " for p in pieces[:-1]] + pieces[-1:]


def write_table(update: TableUpdate, gpu: str, command: str, path: Path = TABLE_PATH):
    """Overwrite gemm_table.py with measured rules: rows of the buckets measured replace
    theirs, the other rows (and k) stay; likewise the over-L2 and small-weight rows."""
    from kbit_cute.kernels import gemm_table

    all_rules, kept = _merged(gemm_table.RULES, update.rules)
    all_over, kept_over = _merged(gemm_table.RULES_OVER_L2, update.rules_over_l2)
    all_small, kept_small = _merged(gemm_table.RULES_SMALL, update.rules_small or {})
    cublas_small = update.cublas_from_small
    if cublas_small is None:
        cublas_small = gemm_table.CUBLAS_FROM_M_SMALL
    if kept or kept_over or kept_small:  # the kept rows were measured by the commands before
        command = f"{gemm_table.COMMAND}; then {command}"
    all_cublas = {**gemm_table.CUBLAS_FROM_M, **update.cublas_from}
    all_cublas_over = {**gemm_table.CUBLAS_FROM_M_OVER_L2, **update.cublas_from_over_l2}
    # k whose general rows were never measured (an over-L2 or partial tune measures none).
    partial = sorted(set(gemm_table.RULES) - set(update.rules)) if gemm_table.PROVISIONAL else []
    lines = [
        '"""Dispatch table of the mma.sync GEMM (``kbit_cute.gemm_dispatch``).',
        "",
        "Measured: written by perf/bench_gemm.py from L2-cold CUDA-graph timings of every",
        "candidate tiling x worker density on the shapes its command names (default: TUNE_SHAPES;",
        "geometric mean per (k, M bucket)); regenerate with the command below and commit it.",
        "",
        "RULES[k]: rows (m_max, config name, CTAs per SM, max splits: ``plan_workers``); the",
        "first row with M <= m_max applies. CUBLAS_FROM_M[k]: smallest M from which dequantize",
        "+ cuBLAS was measured faster than the kernel (None: the kernel always won).",
        "RULES_OVER_L2 / CUBLAS_FROM_M_OVER_L2: the same for weights larger than the L2, tuned",
        "on such weights only; where they have no row for M, RULES applies.",
        "CUBLAS_FROM_M_SMALL: rows (N x K elements, {k: M}) for weights that fit the L2: the",
        "first row whose size holds the weight lowers k's threshold to M (a small weight",
        "dequantizes in a few microseconds; the kernel's few tiles leave the GPU idle).",
        "RULES_SMALL: rows like RULES for weights of at most SMALL_WEIGHT_ELEMENTS (N x K) that",
        "fit the L2, tuned on such weights only; where they have no row for M, RULES applies.",
        '"""',
        "",
        f"PROVISIONAL = {bool(partial)}" + (f"  # k = {partial} not measured" if partial else ""),
        f"MEASURED_ON = {json.dumps(gpu)}",
        "COMMAND = (",
        *[f"    {json.dumps(piece)}" for piece in _wrapped(command, 88)],
        ")",
        "",
        *_rules_lines("RULES", all_rules),
        f"CUBLAS_FROM_M = {dict(sorted(all_cublas.items()))!r}",
        *_rules_lines("RULES_OVER_L2", all_over),
        f"CUBLAS_FROM_M_OVER_L2 = {dict(sorted(all_cublas_over.items()))!r}",
        "CUBLAS_FROM_M_SMALL = [",
        *[f"    ({size}, {dict(sorted(by_k.items()))!r})," for size, by_k in cublas_small],
        "]",
        f"SMALL_WEIGHT_ELEMENTS = {gemm_table.SMALL_WEIGHT_ELEMENTS}",
        *_rules_lines("RULES_SMALL", all_small),
        "",
    ]
    path.write_text("\n".join(lines))


def _merged(old: dict, new: dict) -> tuple[dict, bool]:
    """``old`` rules with the buckets of ``new`` replaced, and whether any row of ``old``
    was kept (then the commands that measured it stay in the table's history)."""
    merged = dict(old)
    for k, rows in new.items():
        by_bucket = {row[0]: row for row in merged.get(k, [])}
        by_bucket.update({row[0]: row for row in rows})
        merged[k] = [by_bucket[m] for m in sorted(by_bucket)]
    fresh = {(k, row) for k, rows in new.items() for row in rows}
    return merged, any((k, row) not in fresh for k, rows in merged.items() for row in rows)


def _rules_lines(name: str, rules: dict) -> list[str]:
    if not rules:
        return [f"{name} = {{}}"]
    lines = [f"{name} = {{"]
    for k in sorted(rules):
        lines.append(f"    {k}: [")
        lines += [f"        ({m}, {json.dumps(n)}, {c}, {s})," for m, n, c, s in rules[k]]
        lines.append("    ],")
    return [*lines, "}"]


# ----------------------------------------------------------------------------- report


def report(ks, shapes, Ms, bw: float, tflops: float, sm_count: int, log, atomic_too: bool):
    rows, records = [], []
    for K, N in shapes:
        b = Bench(K, N, ks)
        for M in Ms:
            t_cb = b.cublas(M)
            flops = 2 * M * K * N
            for k in ks:
                cfg, workers = gd.dispatch_plan(M, N, K, k, torch.cuda.current_device())
                t = b.kernel(M, k, deterministic=True)  # kbit_cute.gemm's reduction
                t_atomic = t
                if atomic_too and gd.hands_over(M, N, cfg, workers):
                    t_atomic = b.kernel(M, k)
                t_dq = b.dequant_cublas(M, k)
                cublas = gd.use_cublas(M, N, K, k, torch.cuda.current_device())
                path = "dequant+cuBLAS" if cublas else "kernel"
                t_path = t_dq if path != "kernel" else t
                wb = b.weight_bytes(k)
                rec = dict(K=K, N=N, k=k, M=M, config=cfg.name, workers=workers, kernel_us=t,
                           kernel_atomic_us=t_atomic, dequant_cublas_us=t_dq, cublas_us=t_cb,
                           dispatched=path, dispatched_us=t_path, tflops=flops / (t * 1e6),
                           weight_gbs=wb / (t * 1e3), floor_us=wb / (bw * 1e3),
                           speedup=t_cb / t_path)  # fmt: skip
                records.append(rec)
                rows.append([f"{K}x{N}", k, M, cfg.name, workers, f"{t:.1f}", f"{t_atomic:.1f}",
                             f"{flops / (t * 1e6):.0f}", f"{wb / (t * 1e3):.0f}",
                             f"{100 * wb / (t * 1e3) / bw:.0f}%", f"{t_dq:.1f}", f"{t_cb:.1f}",
                             f"{t_cb / t:.2f}x", path, f"{t_cb / t_path:.2f}x"])  # fmt: skip
                log(f"{K}x{N} k={k} M={M}: {t:.1f} us ({cfg.name}, {workers} CTAs), "
                    f"cuBLAS {t_cb:.1f}, dequant+cuBLAS {t_dq:.1f}")  # fmt: skip
        del b
        torch.cuda.empty_cache()
    headers = ["KxN", "k", "M", "config", "CTAs", "kernel us", "atomic us", "TFLOP/s",
               "weight GB/s", "% read BW", "dequant+cuBLAS us", "cuBLAS us", "kernel vs cuBLAS",
               "dispatched", "dispatched vs cuBLAS"]  # fmt: skip
    return rows, headers, records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5], choices=[2, 3, 4, 5])
    p.add_argument("--m", type=int, nargs="+", default=MS, help="report: M values")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="KxN (default: the issue's five; --tune: TUNE_SHAPES)",
    )
    p.add_argument("--no-qwen", action="store_true", help="report: skip Qwen3-Coder-Next shapes")
    p.add_argument("--tune", action="store_true", help="sweep candidate configs (see above)")
    p.add_argument(
        "--candidates",
        choices=["all", "table"],
        default="all",
        help="--tune: every candidate tiling, or the table's per bucket",
    )
    p.add_argument("--with", dest="extra", nargs="+", default=[], metavar="CONFIG",
                   help="--tune: also these tilings in every bucket tuned")  # fmt: skip
    p.add_argument("--buckets", type=int, nargs="+", default=None,
                   help="--tune: only the buckets of these m_max (default: all)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="--tune: parallel compiles of the candidates")  # fmt: skip
    p.add_argument("--write-table", action="store_true", help="with --tune: write the table")
    p.add_argument("--write-table-from", nargs="+", type=Path, help="tune JSONs -> the table")
    p.add_argument("--write-small-from", nargs="+", type=Path,
                   help="report JSONs (kernel and dequantize + cuBLAS per point) -> the "
                        "table's CUBLAS_FROM_M_SMALL")  # fmt: skip
    p.add_argument("--no-gate", action="store_true",
                   help="table writes: take rows without the compile gate (no spills)")  # fmt: skip
    p.add_argument("--keep-tilings", action="store_true",
                   help="--write-table-from: only tilings the table already has")  # fmt: skip
    p.add_argument("--atomic", action="store_true",
                   help="report: also time the atomic hand-over where CTAs share tiles")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    command = "python -m perf.bench_gemm " + " ".join(argv if argv is not None else sys.argv[1:])

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.write_table_from:
        recs, gpu, command = _measured(args.write_table_from, command)
        update = table_from(recs, args.keep_tilings, None if args.no_gate else compile_gate())
        write_table(update, gpu, command)
        print(f"wrote {TABLE_PATH}: k = {sorted(update.rules)}, "
              f"over the L2 k = {sorted(update.rules_over_l2)}, "
              f"small weights k = {sorted(update.rules_small or {})}")  # fmt: skip
        return

    if args.write_small_from:
        recs, gpu, command = _measured(args.write_small_from, command)
        rows = small_weight_rows(recs)
        write_table(TableUpdate({}, {}, {}, {}, rows), gpu, command)
        print(f"wrote {TABLE_PATH}: CUBLAS_FROM_M_SMALL = {rows}")
        return

    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm measures on a CUDA GPU; none is visible")
    shapes = TUNE_SHAPES if args.tune else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    dev = torch.cuda.current_device()
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    gpu = torch.cuda.get_device_name(dev)
    out_dir = Path(os.environ.get("OUT", "."))
    t0 = time.time()
    if args.tune:
        for name in args.extra:
            GemmConfig.parse(name)  # a misspelt tiling fails here, not after the compiles
        records = tune(
            args.k,
            shapes,
            sm_count,
            log,
            args.candidates == "table",
            args.buckets,
            args.jobs,
            tuple(args.extra),
        )
        path = args.json or out_dir / f"tune_gemm_k{''.join(map(str, args.k))}.json"
        path.write_text(json.dumps(dict(gpu=gpu, sm_count=sm_count, command=command,
                                        records=records), indent=1))  # fmt: skip
        print(f"{len(records)} measurements in {time.time() - t0:.0f} s -> {path}")
        if args.write_table:
            write_table(table_from(records, gate=None if args.no_gate else compile_gate()),
                        gpu, command)  # fmt: skip
            print(f"wrote {TABLE_PATH}")
        return

    bw, tf = read_bandwidth_gbs(), tensor_tflops(torch.float16)
    rows, headers, records = report(args.k, shapes, args.m, bw, tf, sm_count, log, args.atomic)
    if not args.no_qwen:
        q_rows, _, q_records = report(args.k, qwen_shapes(), QWEN_MS, bw, tf, sm_count, log,
                                      args.atomic)  # fmt: skip
        rows += q_rows
        records += q_records
    path = args.json or out_dir / "bench_gemm.json"
    path.write_text(json.dumps(dict(gpu=gpu, read_gbs=bw, tflops=tf, command=command,
                                    records=records), indent=1))  # fmt: skip
    print(f"{gpu}: read bandwidth {bw:.0f} GB/s, cuBLAS fp16 {tf:.0f} TFLOP/s, fp16 activations; "
          f"table {'PROVISIONAL' if _provisional() else 'measured'}; {time.time() - t0:.0f} s")  # fmt: skip
    print(tabulate(rows, headers=headers, tablefmt="github"))


def _measured(paths: list[Path], command: str) -> tuple[list, str, str]:
    """(records, GPU names, the commands that measured them and then ``command``) of JSONs
    written by this script."""
    recs, gpus, commands = [], set(), []
    for path in paths:
        data = json.loads(path.read_text())
        recs += data["records"]
        gpus.add(data["gpu"])
        commands.append(data["command"])
    return recs, " / ".join(sorted(gpus)), "; ".join([*commands, command])


def _provisional() -> bool:
    from kbit_cute.kernels import gemm_table

    return gemm_table.PROVISIONAL


if __name__ == "__main__":
    main()
