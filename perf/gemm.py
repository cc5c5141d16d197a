"""The GEMM sweep: shapes x implementations x M, timed by the method of perf/common.py.

Order: for each shape (K x N), W [N, K] ~ N(0, 1/K) in the run's dtype; for each
implementation (cuBLAS, kbit k = 2..5, peers) its copies are built once, then every M is
timed; copies are freed before the next implementation. Every point is recorded: ok,
failed (with the error), unavailable (library missing) or skipped (time budget or a lost
CUDA context), so a table never silently loses a column.

Cost model (``estimate_seconds``; the defaults are budgeted with it): one point costs about
warm-up (one call per copy) + EAGER_REPEATS eager passes over the copies + capture of
``calls`` launches + (1 + REPEATS) replays of ``calls`` calls, where copies = ceil(4 L2 /
weight bytes) + 1 and calls = max(copies, min(20, 5 ms / call)); plus one-time kbit
compiles (~1.2 s per (k, M bucket)) and gemlite autotuning (~1 s per shape and M bucket,
a guess: its shipped H100 cache may cover some), and a COOLDOWN_S pause before the first small
M after a large one (perf/common.py: out of the power cap). ``--budget-s`` (default 450 s)
is the guard: points past it are recorded as skipped, so a run always finishes and reports.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch

from kbit_cute.gemm_dispatch import weight_bytes
from kbit_cute.ops import _M_BUCKET, GEMV_MAX_M

from . import models
from .common import (
    COOLDOWN_S,
    EAGER_MAX_CALLS,
    EAGER_REPEATS,
    HEAVY_M,
    REPEATS,
    PowerCapPause,
    error_text,
    progress,
)
from .peers import Impl, make_impls

SCHEMA = "kbit_cute.perf/1"
DEFAULT_MODELS = ("llama3-70b", "qwen3-coder-next")
# The default sweep must finish within 8 minutes on the H100: with these 6 M values the two
# default models took 443 s there (2026-11-22, perf/results/h100.json); all 11 M values of
# the grid (pass them with --m) took longer than the budget and left points skipped.
DEFAULT_MS = (1, 4, 16, 64, 256, 4096)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SMOKE_MAX_M = 64


@dataclass
class ShapeSpec:
    K: int
    N: int
    models: dict[str, list[str]] = field(default_factory=dict)  # model -> its layer names

    @property
    def key(self) -> str:
        return f"{self.K}x{self.N}"


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x14336' -> (K, N); K must be a positive multiple of 32 (the kbit block)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"shape must look like KxN (e.g. 4096x14336), got {text!r}")
    K, N = int(m.group(1)), int(m.group(2))
    if K <= 0 or N <= 0 or K % 32:
        raise ValueError(f"shape {text!r}: K and N must be positive and K a multiple of 32")
    return K, N


def resolve_shapes(model_names, shape_texts, smoke: bool = False) -> list[ShapeSpec]:
    """The unique shapes of the asked models (in order) and of --shape, with their layers."""
    specs: dict[tuple[int, int], ShapeSpec] = {}
    for name in model_names:
        cfg = models.get_model(name)
        if smoke:
            cfg = models.tiny(cfg)
        for K, N, layers in cfg.sweep_shapes():
            specs.setdefault((K, N), ShapeSpec(K, N)).models.setdefault(name, []).extend(layers)
    for text in shape_texts:
        K, N = parse_shape(text)
        specs.setdefault((K, N), ShapeSpec(K, N)).models.setdefault("custom", []).append("--shape")
    if not specs:
        raise ValueError("no shapes: pass --model and/or --shape")
    return list(specs.values())


def point_bytes(impl_bytes: int, M: int, K: int, N: int, elem: int = 2) -> int:
    """Weight bytes as stored + activations read + output written."""
    return impl_bytes + elem * M * (K + N)


def derive(results: list[dict], read_gbs: float, tflops: float) -> None:
    """Add GB/s, TFLOP/s, roofline and speedup vs cuBLAS (same shape, M) to each record.

    Roofline time = max(bytes / measured read bandwidth, flops / measured cuBLAS peak);
    % of roofline = roofline / measured time.
    """
    base = {
        (r["shape"], r["M"]): r["graph_us"]
        for r in results
        if r["impl"] == "cublas" and r["graph_us"]
    }
    for r in results:
        t = r.get("graph_us")
        K, N = map(int, r["shape"].split("x"))
        flops = 2 * r["M"] * K * N
        roof = None
        if r.get("bytes"):
            roof = max(r["bytes"] / (read_gbs * 1e3), flops / (tflops * 1e6))
        r["roofline_us"] = roof
        r["gbs"] = r["bytes"] / (t * 1e3) if t and r.get("bytes") else None
        r["tflops"] = flops / (t * 1e6) if t else None
        r["pct_roofline"] = 100 * roof / t if t and roof else None
        b = base.get((r["shape"], r["M"]))
        r["speedup"] = b / t if t and b else None


def _record(spec: ShapeSpec, impl: Impl, M: int, status: str, **kw) -> dict:
    rec = dict(shape=spec.key, M=M, impl=impl.name, k=impl.k, status=status, error=None,
               graph_us=None, eager_us=None, calls=None, copies=len(impl.copies) or None,
               weight_bytes=impl.nbytes or None, bytes=None, warm_s=None)  # fmt: skip
    rec.update(kw)
    return rec


# Rough per-call host cost (us) of an eager launch, for the estimate only.
_HOST_US = {"cublas": 15, "kbit": 90, "tinygemm": 15, "bnb": 40, "gemlite": 60, "floor": 10}


def _weight_bytes(impl: Impl, K: int, N: int) -> float:
    per = {"cublas": 2.0, "tinygemm": 0.5 + 4 / 128, "bnb": 0.5 + 4 / 64, "gemlite": 0.5 + 4 / 64}
    if impl.name in ("kbit", "floor"):  # the floor reads a kbit weight's bytes
        return weight_bytes(N, K, impl.k)
    return K * N * per[impl.name]


def estimate_seconds(shapes, impls, Ms, read_gbs=3000.0, tflops=650.0, l2=50 * 2**20) -> float:
    """The cost model of the module docstring, in seconds (a planning number, +-50%)."""
    total = 0.0
    kbit_ks = {i.k for i in impls if i.name == "kbit"}
    buckets = {_M_BUCKET[M] if M <= GEMV_MAX_M else "gemm" for M in Ms}
    total += 1.2 * len(kbit_ks) * len(buckets)  # kbit compiles
    for spec in shapes:
        K, N = spec.K, spec.N
        for impl in impls:
            total += COOLDOWN_S * (max(Ms) >= HEAVY_M > min(Ms))  # (run_gemm)
            wb = _weight_bytes(impl, K, N)
            n = max(2, math.ceil(4 * l2 / wb) + 1)
            total += n * wb / (read_gbs * 1e9) * 2 + 0.002 * n * (impl.name == "gemlite")
            if impl.name == "gemlite":
                total += 1.0 * len({min(2 ** math.ceil(math.log2(M)), 4096) for M in Ms})
            if impl.name == "floor":  # its prepare times every probe grid once
                total += 1.5
            for M in Ms:
                eff = {"tinygemm": 0.15, "gemlite": 0.6}.get(impl.name, 1.0)
                mem = (wb + 2 * M * (K + N)) / (read_gbs * 1e3)
                if impl.name in ("kbit", "bnb") and M > GEMV_MAX_M:
                    mem += 2 * 2 * K * N / (read_gbs * 1e3)  # dequantize + cuBLAS path
                flops = 0 if impl.name == "floor" else 2 * M * K * N
                gpu = max(mem, flops / (tflops * 1e6 * eff)) + 3
                host = _HOST_US[impl.name]
                calls = max(n, min(20, math.ceil(5000 / max(gpu, host))))
                eager = EAGER_REPEATS * min(n, EAGER_MAX_CALLS) * max(gpu, host)
                us = n * max(gpu, host) + eager + calls * host
                us += (1 + REPEATS) * calls * gpu
                total += us / 1e6
    return total


def run_gemm(args, timer) -> dict:
    """Sweep and return the run's JSON dict (results with derived columns)."""
    from .common import environment, refresh_versions

    smoke = timer.kind == "cpu-smoke"
    dtype = DTYPES[args.dtype]
    Ms = [M for M in args.m if not smoke or M <= SMOKE_MAX_M] or [1]
    model_names = list(args.model or ([] if args.shape else DEFAULT_MODELS))
    shapes = resolve_shapes(model_names, args.shape or [], smoke)
    impls = make_impls(args.k, args.peers)
    device = timer.device
    env = environment(timer)

    read_gbs = timer.read_bandwidth_gbs()
    tflops = timer.tensor_tflops(dtype)
    est = estimate_seconds(shapes, impls, Ms, read_gbs, tflops, timer.l2_bytes)
    print(f"gemm sweep: {len(shapes)} shapes x {len(impls)} implementations x {len(Ms)} M; "
          f"estimated {est / 60:.1f} min (budget {args.budget_s:.0f} s; 0 = none)")  # fmt: skip
    print(f"measured read bandwidth {read_gbs:.0f} GB/s, {args.dtype} matmul {tflops:.0f} TFLOP/s")

    why_not = {impl.key: impl.unavailable() for impl in impls}
    results: list[dict] = []
    t0 = time.perf_counter()
    fatal: str | None = None
    bar = progress(len(shapes) * len(impls) * len(Ms), "gemm")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    power_cap = PowerCapPause(timer.cool_down)
    try:
        for spec in shapes:
            try:
                W = torch.randn(spec.N, spec.K, generator=gen, device=device) / spec.K**0.5
                W = W.to(dtype)
                As = {M: torch.randn(M, spec.K, generator=gen, device=device).to(dtype) for M in Ms}
            except Exception as exc:  # e.g. out of memory: this shape fails, the run goes on
                err = "inputs: " + error_text(exc)
                for impl in impls:
                    for M in Ms:
                        results.append(_record(spec, impl, M, "failed", error=err))
                        bar.update()
                fatal = fatal or _context_lost(timer, err)
                continue
            for impl in impls:
                stop = fatal or _over_budget(args.budget_s, t0)
                if why_not[impl.key] or stop:
                    status = "unavailable" if why_not[impl.key] else "skipped"
                    for M in Ms:
                        results.append(
                            _record(spec, impl, M, status, error=why_not[impl.key] or stop)
                        )
                        bar.update()
                    continue
                try:
                    impl.prepare(W, timer.copies_for)
                except Exception as exc:
                    err = "prepare: " + error_text(exc)
                    fatal = fatal or _context_lost(timer, err)
                    for M in Ms:
                        results.append(_record(spec, impl, M, "failed", error=err))
                        bar.update()
                    impl.release()
                    continue
                for M in Ms:
                    stop = fatal or _over_budget(args.budget_s, t0)
                    if stop:
                        results.append(_record(spec, impl, M, "skipped", error=stop))
                        bar.update()
                        continue
                    power_cap.before(M)
                    results.append(_time_point(spec, impl, M, As[M], timer, dtype))
                    if results[-1]["status"] == "failed":
                        fatal = fatal or _context_lost(timer, results[-1]["error"])
                    bar.update(f"{spec.key} {impl.key} M={M}")
                impl.release()
            del W, As
            if device.type == "cuda" and not fatal:
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        fatal = "interrupted"
    except Exception as exc:  # a bug or a dead context: keep what was measured
        fatal = "sweep error: " + error_text(exc)
    finally:
        bar.close()
    refresh_versions(env)
    derive(results, read_gbs, tflops)
    return {
        "schema": SCHEMA,
        "kind": "gemm",
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "env": env,
        "method": _method(timer),
        "roofline": {"read_gbs": read_gbs, "tflops": tflops},
        "config": {
            "dtype": args.dtype,
            "ks": list(args.k),
            "ms": Ms,
            "models": model_names + (["custom"] if args.shape else []),
            "impls": [
                dict(key=i.key, impl=i.name, k=i.k, label=i.label, note=i.note) for i in impls
            ],
            "shapes": [dict(shape=s.key, K=s.K, N=s.N, models=s.models) for s in shapes],
            "budget_s": args.budget_s,
            "seed": args.seed,
        },
        "estimate_s": est,
        "elapsed_s": time.perf_counter() - t0,
        "aborted": fatal,
        "results": results,
    }


def _method(timer) -> dict:
    return {
        "timer": timer.kind,
        "l2_bytes": timer.l2_bytes,
        "rotation": "weight copies spanning > 4x L2, rotated call to call",
        "graph": "calls = max(copies, min(20, 5 ms / call)) per CUDA graph; median of "
        f"{timer.repeats} replays / calls",
        "eager": f"same calls launched from Python, CUDA events, median of {timer.eager_repeats}",
        "roofline": "max(bytes / read GB/s of a 1 GiB .sum(), flops / cuBLAS 8192^3 TFLOP/s)",
    }


def _time_point(spec: ShapeSpec, impl: Impl, M: int, A, timer, dtype) -> dict:
    nbytes = point_bytes(impl.nbytes, M, spec.K, spec.N, torch.finfo(dtype).bits // 8)
    try:
        fns = [impl.make_call(i, A) for i in range(len(impl.copies))]
        t = timer.time_calls(fns)
    except Exception as exc:
        return _record(spec, impl, M, "failed", error=error_text(exc), bytes=nbytes)
    status = "ok" if t.graph_us is not None else "failed"
    return _record(spec, impl, M, status, error=t.error, graph_us=t.graph_us,
                   eager_us=t.eager_us, calls=t.calls, bytes=nbytes, warm_s=t.warm_s)  # fmt: skip


def _over_budget(budget_s: float, t0: float) -> str | None:
    if budget_s and time.perf_counter() - t0 > budget_s:
        return f"time budget reached (--budget-s {budget_s:g})"
    return None


def _context_lost(timer, err: str) -> str | None:
    """After a failure, check that the CUDA context still works; if not, stop the sweep."""
    try:
        timer.synchronize()
    except Exception as exc:
        return f"CUDA context lost after: {err[:120]} ({error_text(exc, 120)})"
    return None
