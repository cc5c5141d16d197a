"""Host overhead of an eager call: ``python -m perf.bench_host_overhead``.

Method: a tiny shape (M = 1, K = N = 256) so the GPU finishes each kernel
before the host issues the next; 10,000 back-to-back eager calls timed with
``time.perf_counter`` around the loop (one synchronize after it), median of 5
rounds, microseconds per call. Shown next to ``F.linear`` / ``nn.Linear`` on
the same machine. The target is <= 10 us for ``kbit_cute.gemm``.

``--mock`` runs on a machine without a GPU: the CUDA device, stream and the
FFI launch are stubs (CPU tensors take the CUDA hot path), so it measures only
the Python of the call path, then its parts one by one; ``--mock --profile``
prints a cProfile of ``KbitLinear`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import kbit_cute
from kbit_cute import compile as kc
from kbit_cute import ops

CALLS = 10_000
ROUNDS = 5


def per_call_us(
    fn, sync, clock=time.perf_counter, rounds=ROUNDS, pick=statistics.median, warmup=200
):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(CALLS):
            fn()
        sync()
        times.append((clock() - t0) / CALLS * 1e6)
    return pick(times)


def cpu_us(fn) -> float:
    """The mock's timer: this thread's CPU time (``time.thread_time``; nothing waits on a
    device there), best of 15 rounds, so other processes on a shared machine inflate it
    as little as possible."""
    return per_call_us(fn, lambda: None, time.thread_time, rounds=15, pick=min, warmup=CALLS)


def gpu_rows(K: int, N: int, k: int, dtype: torch.dtype) -> list[tuple[str, float]]:
    from kbit_cute.kernels.gemv import gemv_spec

    A = torch.randn(1, K, device="cuda", dtype=dtype)
    W = torch.randn(N, K, device="cuda", dtype=dtype) * 0.05
    qw = kbit_cute.quantize(W, k)
    out = torch.empty(1, N, device="cuda", dtype=dtype)
    lin = torch.nn.Linear(K, N, device="cuda", dtype=dtype)
    qlin = kbit_cute.KbitLinear.from_linear(lin, k)
    sync = torch.cuda.synchronize
    with torch.inference_mode():
        kbit_cute.gemm(A, qw)  # compile or load before timing
        kbit_cute.gemm(A, qw)  # the hot path from here on
    plan = ops._gemv_plans[(k, N, K, A.get_device(), dtype)]
    ws, cnt = plan.scratch[torch.cuda.current_stream().cuda_stream]
    lookup, stages = plan.variants[(1, 1)]  # the variant the plan launches (its grid is for it)
    dtype_name = "f16" if dtype == torch.float16 else "bf16"
    spec = gemv_spec(k, 1, dtype_name, stages, lookup, crossing=plan.crossing[(1, 1)])
    raw = kc.launcher(spec)
    raw_args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, out, out, ws, cnt)
    raw_args += (1, N, K, *plan.grids[(1, 1)], *ops._cta_args(False, N, *plan.grids[(1, 1)]), 0)
    stream = torch.cuda.current_stream().cuda_stream
    # The bare FFI function with the pointers read beforehand: the floor under any launcher.
    _, ffi = kc._load(spec)
    ptrs = [t.data_ptr() for t in raw_args[:9]]
    ffi_args = (*ptrs, *raw_args[9:], stream)
    rows = [
        ("kbit_cute.gemm(A, qw)", lambda: kbit_cute.gemm(A, qw)),
        ("kbit_cute.gemm(A, qw, out=out)", lambda: kbit_cute.gemm(A, qw, out=out)),
        ("KbitLinear(A)", lambda: qlin(A)),
        ("launcher(spec)(...) only", lambda: raw(*raw_args)),
        ("tvm_ffi function, int args only", lambda: ffi(*ffi_args)),
        ("A.new_empty(1, N) (CUDA)", lambda: A.new_empty(1, N)),
        ("F.linear(A, W)", lambda: F.linear(A, W)),
        ("nn.Linear(A)", lambda: lin(A)),
    ]
    with torch.inference_mode():
        return [(name, per_call_us(fn, sync)) for name, fn in rows]


def install_mock(K: int, N: int, k: int, dtype: torch.dtype, sm_count: int = 132):
    """Stub the device so CPU tensors take the CUDA hot path: device index -1 plays the GPU
    (a plan for it, the current device and stream stubbed, CPU scratch, a stub FFI).
    Returns (A, qw, KbitLinear, launch function)."""
    from kbit_cute import device as kdev
    from kbit_cute.kernels.gemv import gemv_spec

    plan = ops._GemvPlan(k, N, K, dtype, sm_count)
    lookup, stages = plan.variants[(1, 1)]
    crossing = plan.crossing[(1, 1)]  # (M = 1: never CTA groups)
    dtype_name = "f16" if dtype == torch.float16 else "bf16"
    spec = gemv_spec(k, 1, dtype_name, stages, lookup, crossing=crossing)
    params = kc.kernel_params(spec)
    stub = kc.make_launch(spec.name, params, lambda *a: None, stream_arg=True)
    ops._gemv_launchers[(k, 1, dtype, lookup, stages, False, crossing, False)] = stub
    ops._current_device = lambda: -1
    ops._raw_stream = lambda dev: 0
    kdev.scratch_tensor = lambda index, n, dt, fill_byte=None: torch.zeros(n, dtype=dt)
    ops._gemv_plans[(k, N, K, -1, dtype)] = plan
    A = torch.randn(1, K, dtype=dtype)
    qw = kbit_cute.quantize(torch.randn(N, K, dtype=dtype), k)
    qlin = kbit_cute.KbitLinear.from_linear(torch.nn.Linear(K, N, dtype=dtype), k)
    with torch.inference_mode():
        kbit_cute.gemm(A, qw)  # loads the launch function (the stub)
        kbit_cute.gemm(A, qw)  # the hot path from here on: takes the stream's scratch
    return A, qw, qlin, stub


def mock_rows(K: int, N: int, k: int, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The Python of the eager path with a stub device, stream and FFI launch (install_mock),
    then its parts one by one."""
    A, qw, qlin, stub = install_mock(K, N, k, dtype)
    out = torch.empty(1, N, dtype=dtype)
    ws, cnt = ops._gemv_plans[(k, N, K, -1, dtype)].scratch[0]
    # the launcher's arguments: tensors, M, N, K, workers, ctas, per_cta, splits, has_bias,
    # then the stream
    raw_args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, out, out, ws, cnt,
                1, N, K, 1, 1, 1, 0, 0, 0)  # fmt: skip
    wargs = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, k, N, K, None, None)
    key = (k, N, K, -1, dtype)
    rows = [
        ("kbit_cute.gemm(A, qw)", lambda: kbit_cute.gemm(A, qw)),
        ("kbit_cute.gemm(A, qw, out=out)", lambda: kbit_cute.gemm(A, qw, out=out)),
        ("KbitLinear(A)", lambda: qlin(A)),
        ("ops._gemm_impl(...)", lambda: ops._gemm_impl(*wargs)),
        ("launcher, stream given (stub FFI)", lambda: stub(*raw_args)),
        ("  A.new_empty(1, N)", lambda: A.new_empty(1, N)),
        ("  A.new_empty((*A.shape[:-1], N))", lambda: A.new_empty((*A.shape[:-1], N))),
        ("  torch.compiler.is_compiling()", ops._is_compiling),
        ("  torch.is_grad_enabled()", torch.is_grad_enabled),
        ("  plan lookup", lambda: ops._gemv_plans.get(key)),
        ("  _check_gemm_args (first calls only)", lambda: ops._check_gemm_args(*wargs)),
    ]
    with torch.inference_mode():
        return [(name, cpu_us(fn)) for name, fn in rows]


def profile_mock(K: int, N: int, k: int, dtype: torch.dtype, calls: int = 100_000) -> None:
    """cProfile of the mocked eager call (call counts and relative cost; cProfile's own
    overhead inflates every function call, so read it next to the timings)."""
    import cProfile
    import pstats

    A, qw, qlin, _ = install_mock(K, N, k, dtype)
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.enable()
        for _ in range(calls):
            qlin(A)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--K", type=int, default=256)
    p.add_argument("--N", type=int, default=256)
    p.add_argument("--dtype", choices=["f16", "bf16"], default="f16")
    p.add_argument("--mock", action="store_true", help="no GPU: time the Python path only")
    p.add_argument("--profile", action="store_true", help="with --mock: cProfile KbitLinear")
    p.add_argument("--json", default=os.environ.get("OUT", ".") + "/bench_host_overhead.json")
    args = p.parse_args(argv)
    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    if args.mock:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        if args.profile:
            profile_mock(args.K, args.N, args.k, dtype)
            return 0
        rows = mock_rows(args.K, args.N, args.k, dtype)
        where = "CPU only, stubbed launch, thread CPU time, best of 15 rounds"
    else:
        rows = gpu_rows(args.K, args.N, args.k, dtype)
        where = torch.cuda.get_device_name()
    print(
        f"host time per eager call, M=1, K={args.K}, N={args.N}, k={args.k}, {args.dtype}, {where}"
    )
    if not args.mock:
        print(f"({CALLS} calls per round, median of {ROUNDS} rounds, perf_counter)")
    print(
        tabulate(
            [(n, f"{us:.2f}") for n, us in rows], headers=["call", "us/call"], tablefmt="github"
        )
    )
    with open(args.json, "w") as f:
        json.dump({"where": where, "rows": dict(rows), **vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
