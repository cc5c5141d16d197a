"""Read floor: the fastest L2-cold read of a weight's bytes that this harness measures.

    python -m perf.read_floor [--shapes KxN ...] [--k 2 3 4 5] [--m 1 4] [--cublas]

The GEMV targets are fractions of the read bandwidth of a 1 GiB ``.sum()``. A 10-40 MB
weight is read in 4-15 us, where a kernel also pays its launch, the first DRAM latency and
its tail, so a fraction of the large-copy bandwidth can ask more than any kernel reaches.
This probe measures what is reachable: a kernel that only reads (16-byte loads, several
in flight per thread, a grid-stride loop; the xor of what it read is stored only if it
equals a value it never has), timed exactly as the GEMV is (``perf.common``: weight-sized
copies rotated over > 4x the L2, CUDA-graph replays, median), over a few grid shapes with
and without programmatic dependent launch; the best is what a kernel that must read those
bytes, and do work besides, can hope for. It prints the floor next to ``kbit_cute.gemm`` at
the asked M (and cuBLAS fp16 with ``--cublas``) in the same run, with issue 3's targets.
``python -m perf gemm`` shows it as a column too (peer ``floor``, ``perf/peers.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from tabulate import tabulate

from kbit_cute.kernels.device_helpers import let_next_kernel_start, wait_previous_kernel

_MAGIC = 0x2545F491  # what the xor of the bytes read is compared with (never stored)
VECTOR_WORDS = 4  # one 16-byte load

# (threads per CTA, loads in flight per thread, CTAs per SM); each with and without PDL.
CONFIGS = [(512, 4, 2), (512, 8, 2), (256, 8, 4), (1024, 4, 1), (256, 4, 8), (1024, 8, 2)]
# The same for the GEMV's pattern, a contiguous run per warp (896 threads: its 7 quads).
RUN_CONFIGS = [(896, 4, 1), (896, 8, 1), (256, 8, 4)]

ISSUE_SHAPES = ["8192x28672", "4096x14336", "14336x4096"]
QWEN_SHAPES = ["2048x5120", "5120x2048", "2048x4096", "4096x2048", "2048x2048", "2048x512",
               "512x2048"]  # fmt: skip


class ReadProbeKernel:
    """Reads n 16-byte vectors; writes nothing (see the module docstring)."""

    def __init__(self, threads: int, unroll: int, pdl: bool, runs: bool = False):
        self.threads, self.unroll, self.pdl, self.runs = threads, unroll, pdl, runs

    @cute.jit
    def __call__(self, pSrc: cute.Pointer, pOut: cute.Pointer, n_vec: Int32, ctas: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        mSrc = cute.make_tensor(pSrc, cute.make_layout((VECTOR_WORDS, n_vec), stride=(1, 4)))
        self.kernel(mSrc, pOut, n_vec).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, pOut: cute.Pointer, n_vec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        wait_previous_kernel(self.pdl)
        frag = cute.make_rmem_tensor((VECTOR_WORDS, self.unroll), Int32)
        frag.fill(0)
        acc = Int32(0)
        if cutlass.const_expr(self.runs):
            # Each warp reads one contiguous run (as a GEMV split worker streams its K
            # tiles), the lanes side by side.
            warps = ctas * (self.threads // 32)
            warp = bidx * (self.threads // 32) + tidx // 32
            run = (n_vec + warps - 1) // warps
            first = warp * run + tidx % 32
            end = cutlass.min(first - tidx % 32 + run, n_vec)
            stride = 32
        else:
            # Grid-stride: consecutive threads read consecutive vectors, all over the buffer.
            first = bidx * self.threads + tidx
            end = n_vec
            stride = ctas * self.threads
        step = stride * self.unroll
        rounds = (end - first + step - 1) // step
        for r in cutlass.range(rounds, unroll=1):
            base = first + r * step
            for u in cutlass.range_constexpr(self.unroll):
                if base + u * stride < end:
                    cute.autovec_copy(mSrc[None, base + u * stride], frag[None, u])
            for u in cutlass.range_constexpr(self.unroll):
                if base + u * stride < end:  # (a slot not loaded holds the last round's)
                    for w in cutlass.range_constexpr(VECTOR_WORDS):
                        acc = acc ^ frag[w, u]
        let_next_kernel_start(self.pdl)
        if acc == Int32(_MAGIC):
            cute.make_tensor(pOut, cute.make_layout(1))[0] = acc


def probe_spec(threads: int, unroll: int, pdl: bool, runs: bool = False):
    from kbit_cute.compile import KernelSpec, fake_ptr, fake_stream

    def build():
        kernel = ReadProbeKernel(threads, unroll, pdl, runs)
        args = (fake_ptr(Int32), fake_ptr(Int32, 4), Int32(1), Int32(1), fake_stream())
        return kernel, args

    name = f"read_probe_t{threads}_u{unroll}{'_pdl' if pdl else ''}{'_runs' if runs else ''}"
    return KernelSpec(name, build, expect=("LDG.E.128",))


def probe_call(config: tuple, src: torch.Tensor, sink: torch.Tensor, sm_count: int):
    """A zero-argument launch of the probe ``config`` = (threads, unroll, CTAs per SM, pdl,
    runs) reading all of ``src`` (int32, a multiple of 4 words)."""
    from kbit_cute.compile import launcher

    threads, unroll, per_sm, pdl, runs = config
    fn = launcher(probe_spec(threads, unroll, pdl, runs))
    n_vec, ctas = src.numel() // VECTOR_WORDS, per_sm * sm_count
    return lambda: fn(src, sink, n_vec, ctas)


def config_label(config: tuple) -> str:
    threads, unroll, per_sm, pdl, _ = config
    return f"t{threads} u{unroll} x{per_sm}{' pdl' if pdl else ''}"


def probe_copies(nbytes: int, n: int, device="cuda") -> list[torch.Tensor]:
    """``n`` random int32 buffers of ``nbytes`` rounded up to whole 16-byte vectors."""
    words = -(-nbytes // 16) * VECTOR_WORDS
    return [torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=device)
            for _ in range(n)]  # fmt: skip


def best_probe(copies: list, sm_count: int, runs: bool = False) -> tuple[float, tuple]:
    """(per-call us, config) of the fastest probe configuration reading ``copies`` in turn
    (``probe_copies``, spanning > 4x the L2); ``runs``: among the contiguous-run ones
    instead of the grid-stride ones."""
    from perf.common import graph_time_us

    sink = torch.zeros(4, dtype=torch.int32, device=copies[0].device)
    best = (float("inf"), ())
    for threads, unroll, per_sm in RUN_CONFIGS if runs else CONFIGS:
        for pdl in (False, True):
            config = (threads, unroll, per_sm, pdl, runs)

            def make(i, config=config):
                return probe_call(config, copies[i], sink, sm_count)

            best = min(best, (graph_time_us(make, len(copies)), config))
    return best


def floor_us(nbytes: int, sm_count: int, runs: bool = False) -> tuple[float, str]:
    """``best_probe`` of ``nbytes`` as (us, its configuration's label)."""
    from perf.common import copies_for

    us, config = best_probe(probe_copies(nbytes, copies_for(nbytes)), sm_count, runs)
    return us, config_label(config)


def impl_us(impl, A) -> float:
    """Per-call us of a prepared ``perf.peers`` implementation on A, L2-cold (its copies in
    turn), as ``python -m perf gemm`` times it."""
    from perf.common import graph_time_us

    return graph_time_us(lambda i: impl.make_call(i, A), len(impl.copies))


def main(argv: list[str] | None = None) -> int:
    from perf.common import CudaTimer, copies_for, environment, read_bandwidth_gbs
    from perf.peers import Cublas, Kbit

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=ISSUE_SHAPES + QWEN_SHAPES, help="KxN")
    p.add_argument("--k", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--m", nargs="+", type=int, default=[1, 4])
    p.add_argument("--cublas", action="store_true", help="time cuBLAS fp16 at each M too")
    p.add_argument("--json", help="write every number here (default: $OUT/read_floor.json)")
    args = p.parse_args(argv)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    bw = read_bandwidth_gbs()
    rows, records = [], []
    for shape in args.shapes:
        K, N = (int(x) for x in shape.split("x"))
        W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        As = {M: torch.randn(M, K, device="cuda", dtype=torch.float16) for M in args.m}
        cublas = {}
        if args.cublas:
            base = Cublas()
            base.prepare(W, copies_for)
            cublas = {M: impl_us(base, As[M]) for M in args.m}
            base.release()
        for k in args.k:
            kbit = Kbit(k)
            kbit.prepare(W, copies_for)
            nbytes = kbit.nbytes
            ideal = nbytes / bw / 1e3  # us at the read bandwidth
            floor, cfg = floor_us(nbytes, sm_count)
            runs, _ = floor_us(nbytes, sm_count, runs=True)
            rec = {"shape": shape, "k": k, "bytes": nbytes, "ideal_us": ideal, "floor_us": floor,
                   "floor_config": cfg, "runs_us": runs}  # fmt: skip
            row = [shape, k, f"{nbytes / 1e6:.1f}", f"{ideal:.2f}", f"{floor:.2f}",
                   f"{ideal / floor:.0%}", cfg, f"{runs:.2f}"]  # fmt: skip
            for M in args.m:
                us = impl_us(kbit, As[M])
                rec[f"m{M}_us"] = us
                row += [f"{us:.2f}", f"{us / floor:.2f}"]
                if args.cublas:
                    rec[f"m{M}_cublas_us"] = cublas[M]
                    row += [
                        f"{cublas[M]:.1f}",
                        f"{cublas[M] / us:.2f}x",
                        f"{cublas[M] / floor:.2f}x",
                    ]
            # GEMV targets (M = 1): the big shapes 90% of the read bandwidth, the Qwen shapes
            # bytes/BW + 2.5 us; either is reachable only if the floor is within it.
            target = ideal / 0.9 if shape in ISSUE_SHAPES else ideal + 2.5
            rec["gemv_target_us"] = target
            row += [f"{target:.2f}", "yes" if floor <= target else "no"]
            kbit.release()
            rows.append(row)
            records.append(rec)
            print(" | ".join(str(c) for c in row), flush=True)
    heads = ["KxN", "k", "MB", "at BW us", "floor us", "floor % BW", "probe", "runs us"]
    for M in args.m:
        heads += [f"M={M} us", f"M={M} / floor"]
        if args.cublas:
            heads += [f"M={M} cuBLAS us", f"M={M} x cuBLAS", "floor x cuBLAS"]
    heads += ["GEMV target us", "floor within"]
    print(f"\nread bandwidth (1 GiB .sum()) {bw:.0f} GB/s; {torch.cuda.get_device_name()}")
    print(tabulate(rows, headers=heads, tablefmt="github"))
    out = args.json or (os.path.join(os.environ["OUT"], "read_floor.json") if "OUT" in os.environ
                        else None)  # fmt: skip
    if out:
        env = environment(CudaTimer())
        with open(out, "w") as f:
            command = "python -m perf.read_floor " + shlex.join(
                sys.argv[1:] if argv is None else argv
            )
            json.dump(
                {"env": env, "command": command, "read_gbs": bw, "rows": records}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
