"""Host overhead of an eager call: ``python -m perf.bench_host_overhead``.

Method: a tiny shape (M = 1, K = N = 256) so the GPU finishes each kernel
before the host issues the next; 10,000 back-to-back eager calls timed with
``time.perf_counter`` around the loop (one synchronize after it), median of 5
rounds, microseconds per call. Shown next to ``F.linear`` / ``nn.Linear`` on
the same machine. The target is <= 10 us for ``kbit_cute.gemm``.

``--mock`` runs on a machine without a GPU: the CUDA device, stream and the
FFI launch are stubs, so it measures only the Python of the call path.
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


def per_call_us(fn, sync) -> float:
    for _ in range(200):
        fn()
    sync()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(times)


def gpu_rows(K: int, N: int, k: int, dtype: torch.dtype) -> list[tuple[str, float]]:
    A = torch.randn(1, K, device="cuda", dtype=dtype)
    W = torch.randn(N, K, device="cuda", dtype=dtype) * 0.05
    qw = kbit_cute.quantize(W, k)
    out = torch.empty(1, N, device="cuda", dtype=dtype)
    lin = torch.nn.Linear(K, N, device="cuda", dtype=dtype)
    qlin = kbit_cute.KbitLinear.from_linear(lin, k)
    sync = torch.cuda.synchronize
    kbit_cute.gemm(A, qw)  # compile or load before timing
    splits = ops.gemv_splits(N, K, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = torch.empty(1 << 16, device="cuda")
    cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
    from kbit_cute.kernels.gemv import gemv_spec

    raw = kc.launcher(gemv_spec(k, 1, "f16" if dtype == torch.float16 else "bf16"))
    raw_args = (
        A,
        qw.packed,
        qw.absmax,
        qw.codebook,
        qw.scale,
        out,
        out,
        ws,
        cnt,
        1,
        N,
        K,
        splits,
        0,
    )
    with torch.inference_mode():
        return [
            ("kbit_cute.gemm(A, qw)", per_call_us(lambda: kbit_cute.gemm(A, qw), sync)),
            (
                "kbit_cute.gemm(A, qw, out=out)",
                per_call_us(lambda: kbit_cute.gemm(A, qw, out=out), sync),
            ),
            ("KbitLinear(A)", per_call_us(lambda: qlin(A), sync)),
            ("launcher(spec)(...) only", per_call_us(lambda: raw(*raw_args), sync)),
            ("F.linear(A, W)", per_call_us(lambda: F.linear(A, W), sync)),
            ("nn.Linear(A)", per_call_us(lambda: lin(A), sync)),
        ]


def mock_rows(K: int, N: int, k: int, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The Python of the eager path with a stub device (index -1), stream and FFI launch."""
    from kbit_cute.kernels.gemv import gemv_spec

    name = "f16" if dtype == torch.float16 else "bf16"
    spec = gemv_spec(k, 1, name)
    params = kc.kernel_params(spec)
    stub = kc.make_launch(spec.name, params, lambda *a: None, lambda: -1, lambda d: 0)
    # Route the CUDA branch to the stubs: device index -1 plays the GPU.
    ops._gemv_launchers[(k, 1, dtype)] = stub
    ops._raw_stream = lambda dev: 0
    A = torch.randn(1, K, dtype=dtype)
    qw = kbit_cute.quantize(torch.randn(N, K, dtype=dtype), k)
    out = torch.empty(1, N, dtype=dtype)
    ops._gemv_plans[(k, N, K, -1)] = (1, qw.packed.numel(), 1)
    args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, k, N, K, None, out, 1, 1, -1)
    ws, cnt = torch.empty(1 << 16), torch.zeros(4096, dtype=torch.int32)
    raw_args = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, out, out, ws, cnt, 1, N, K, 1, 0)
    wargs = (A, qw.packed, qw.absmax, qw.codebook, qw.scale, k, N, K, None, None)

    def nosync():
        pass

    return [
        ("checks (_check_gemm_args)", per_call_us(lambda: ops._check_gemm_args(*wargs), nosync)),
        ("output allocation", per_call_us(lambda: A.new_empty((*A.shape[:-1], N)), nosync)),
        ("_gemv_launch (stub FFI)", per_call_us(lambda: ops._gemv_launch(*args), nosync)),
        ("launcher only (stub FFI)", per_call_us(lambda: stub(*raw_args), nosync)),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--K", type=int, default=256)
    p.add_argument("--N", type=int, default=256)
    p.add_argument("--dtype", choices=["f16", "bf16"], default="f16")
    p.add_argument("--mock", action="store_true", help="no GPU: time the Python path only")
    p.add_argument("--json", default=os.environ.get("OUT", ".") + "/bench_host_overhead.json")
    args = p.parse_args(argv)
    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    if args.mock:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        rows = mock_rows(args.K, args.N, args.k, dtype)
        where = "CPU only, stubbed launch"
    else:
        rows = gpu_rows(args.K, args.N, args.k, dtype)
        where = torch.cuda.get_device_name()
    print(
        f"host time per eager call, M=1, K={args.K}, N={args.N}, k={args.k}, {args.dtype}, {where}"
    )
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
