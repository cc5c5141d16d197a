"""GEMM calls for ``compute-sanitizer --tool memcheck|racecheck python -m perf.sanitize_gemm``:
per k, each config of the dispatch table on an odd shape (partial tiles in M, N and K), with
whole tiles per CTA, split-K, and stream-K runs that end inside tiles (both reduction
modes), plus the lane- and row-table variants the table does not use for that k.
``--only NAME ...``: these tilings instead (e.g. the warp-specialized ones, not in the
table)."""

from __future__ import annotations

import argparse

import torch

import kbit_cute
from kbit_cute import gemm_dispatch as gd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, metavar="CONFIG")
    args = p.parse_args()
    K, N = 1056, 1000
    for k in (2, 3, 4, 5):
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda"), k)
        if args.only:
            names = set(args.only)
        else:
            names = {c.name for c in gd.table_configs(k)} | {
                "m16n128k64s4w1x4l",
                "m64n128k64s3w1x4",
            }
            if k <= 4:
                names.add("m32n128k64s4w1x4r")
        for i, name in enumerate(sorted(names)):
            dtype = (torch.float16, torch.bfloat16)[(i + k) % 2]  # (one name: both over k)
            A = torch.randn(37, K, device="cuda", dtype=dtype)
            out = torch.empty(37, N, device="cuda", dtype=dtype)
            for splits, workers, det in ((1, None, True), (3, None, True), (3, None, False),
                                         (None, 23, True), (None, 23, False)):  # fmt: skip
                gd.gemm_mma(
                    A, qw, None, out, config=name, splits=splits, workers=workers,
                    deterministic=det,
                )  # fmt: skip
    torch.cuda.synchronize()
    print("sanitize_gemm: done")


if __name__ == "__main__":
    main()
