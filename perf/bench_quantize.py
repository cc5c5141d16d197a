"""Time CUDA quantize + repack and dequantize of a large weight: `python -m perf.bench_quantize`.

The format issue asks for quantize + repack of an 8192 x 28672 weight in under 1 s on the GPU.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import kbit_cute


def cuda_time_ms(fn, repeats: int = 5) -> float:
    """Median of `repeats` runs timed with CUDA events (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="28672x8192", help="N x K of the weight")
    args = p.parse_args()
    N, K = (int(v) for v in args.shape.split("x"))
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    rows = []
    for k in (2, 3, 4, 5):
        qw = kbit_cute.quantize(W, k)
        q_ms = cuda_time_ms(lambda k=k: kbit_cute.quantize(W, k))
        d_ms = cuda_time_ms(lambda qw=qw: kbit_cute.dequantize(qw, torch.float16))
        gbs = (W.numel() * 2 + qw.nbytes) / d_ms / 1e6
        rows.append([k, f"{q_ms:.1f}", f"{d_ms:.3f}", f"{gbs:.0f}"])
    print(f"{torch.cuda.get_device_name()}  W [{N}, {K}] fp16")
    print(
        tabulate(
            rows,
            headers=["k", "quantize ms", "dequantize ms", "dequantize GB/s"],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
