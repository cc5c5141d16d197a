"""Build kernel variants ahead of time: ``kbit_cute.warmup(...)`` and
``python -m kbit_cute.precompile``.

A cold compile costs 0.2-3 s per variant; the first call of a variant in a new
process with a warm disk cache only loads its object file (tens of ms). Run
``python -m kbit_cute.precompile`` once per machine (or in a Docker build, with
``--arch`` when the build host has no GPU) and every later process starts warm.
Missing variants compile in parallel worker processes, each writing its own
cache entry atomically.

    python -m kbit_cute.precompile                      # all variants, this GPU's arch
    python -m kbit_cute.precompile --arch sm_90a --k 4 --dtypes bf16
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

_DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


def _dtype_name(d) -> str:
    if isinstance(d, torch.dtype):
        return _DTYPE_NAMES[d]
    if d in ("f16", "bf16", "f32"):
        return d
    raise ValueError(f"dtype must be a torch dtype or one of f16, bf16, f32, got {d!r}")


def select_specs(
    k=(2, 3, 4, 5), dtypes=("f16", "bf16"), m=(1, 2, 4, 8, 16), kernels=None, arch=None
):
    """Registered variants for ``arch`` (default: the compile target) whose name tokens
    (``k4``, ``m1``, ``f16`` ...) are in the given sets; a name without such a token (e.g. no
    ``m``) passes that filter, and the GEMV's row-set variants (suffix ``r``, M = 9..64 on
    small weights) pass for any m over 8. ``kernels``: name prefixes (``gemv``,
    ``dequantize`` ...), default all."""
    from .kernels import all_specs
    from .ops import GEMV_MAX_M

    ks = {f"k{int(x)}" for x in ([k] if isinstance(k, int) else k)}
    rows = [int(x) for x in ([m] if isinstance(m, int) else m)]
    ms = {f"m{x}" for x in rows}
    dts = {_dtype_name(d) for d in ([dtypes] if isinstance(dtypes, (str, torch.dtype)) else dtypes)}
    out = []
    for spec in all_specs(arch):
        tokens = spec.name.split("_")
        if kernels is not None and tokens[0] not in kernels:
            continue
        k_tok = [t for t in tokens if re.fullmatch(r"k\d", t)]
        m_tok = [t for t in tokens if re.fullmatch(r"m\d+", t)]
        if tokens[0] == "gemv" and tokens[-1] == "r":  # row sets: they serve M over 8 only
            if not any(x > GEMV_MAX_M for x in rows):
                continue
            m_tok = []
        d_tok = [t for t in tokens if t in ("f16", "bf16", "f32")]
        if all(
            not tok or tok[0] in allowed
            for tok, allowed in ((k_tok, ks), (m_tok, ms), (d_tok, dts))
        ):
            out.append(spec)
    return out


def _compile_into_cache(name: str, arch: str) -> tuple[str, float, str | None]:
    """Worker: compile one variant into the disk cache unless it is there already.
    Returns (name, seconds, error): error None when cached already, "" when compiled."""
    from . import compile as kc
    from .kernels import all_specs
    from .kernels.gemm import gemm_spec_named

    spec = next((s for s in all_specs() if s.name == name), None)
    if spec is None:  # a GEMM tiling outside the table (tune candidates)
        spec = gemm_spec_named(name)
    path = kc.entry_path(spec, arch)
    if path.is_file():
        return name, 0.0, None
    t0 = time.perf_counter()
    try:
        kc.compile_variant(spec, arch, path)
    except Exception as e:  # reported per variant; the others still build
        return name, time.perf_counter() - t0, f"{type(e).__name__}: {str(e).strip()[:300]}"
    return name, time.perf_counter() - t0, ""


def build(specs, arch: str, jobs: int | None = None, verbose: bool = False) -> dict:
    """Compile every missing variant of ``specs`` for ``arch`` into the disk cache."""
    from . import compile as kc

    t0 = time.perf_counter()
    missing = [s.name for s in specs if not kc.entry_path(s, arch).is_file()]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(missing) or 1))
    times: dict[str, float] = {}
    if missing and jobs == 1:
        results = [_compile_into_cache(n, arch) for n in missing]
    elif missing:
        # Workers must not probe the GPU for a target: give them the arch up front.
        saved = os.environ.get("CUTE_DSL_ARCH")
        os.environ["CUTE_DSL_ARCH"] = arch
        try:
            with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
                results = list(pool.map(_compile_into_cache, missing, [arch] * len(missing)))
        finally:
            if saved is None:
                del os.environ["CUTE_DSL_ARCH"]
            else:
                os.environ["CUTE_DSL_ARCH"] = saved
    else:
        results = []
    failed: dict[str, str] = {}
    for name, seconds, error in results:
        if error:
            failed[name] = error
            if verbose:
                print(f"  {name:28s} FAILED: {error}")
        elif error is not None:
            times[name] = seconds
            if verbose:
                print(f"  {name:28s} compiled in {seconds:6.2f} s")
    return {
        "variants": len(specs),
        "compiled": len(times),
        "failed": failed,
        "compile_s": times,
        "wall_s": time.perf_counter() - t0,
    }


def warmup(
    k=(2, 3, 4, 5),
    dtypes=(torch.float16, torch.bfloat16),
    m=(1, 2, 4, 8, 16),
    kernels=None,
    jobs: int | None = None,
) -> dict:
    """Compile (into the disk cache, in parallel) and load (into this process) the variants
    a model will call, so no call pays a JIT. E.g. ``kbit_cute.warmup(k=4, dtypes=torch.bfloat16,
    m=1)`` for batch-1 decode of a k=4 bf16 model. ``m``: the GEMV's rows buckets (1, 2, 4,
    8); any m over 8 adds its row-set variants (M = 9..64 on small weights); the GEMM's
    variants carry no m. Returns counts and timings."""
    from .compile import launcher, target_arch

    specs = select_specs(k, dtypes, m, kernels)
    report = build(specs, target_arch(), jobs)
    if report["failed"]:
        raise RuntimeError(f"kbit_cute.warmup: variants failed to compile: {report['failed']}")
    t0 = time.perf_counter()
    for spec in specs:
        launcher(spec)
    report["load_s"] = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", help="target, e.g. sm_90a (default: this GPU's)")
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--dtypes", nargs="+", default=["f16", "bf16", "f32"])
    p.add_argument(
        "--m",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="rows buckets; any m over 8 takes the GEMV row sets (M = 9..64)",
    )
    p.add_argument("--kernels", nargs="+", help="name prefixes, e.g. gemv dequantize")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--list", action="store_true", help="list the variants and their entries")
    args = p.parse_args(argv)
    from . import compile as kc

    arch = args.arch or kc.target_arch()
    specs = select_specs(args.k, args.dtypes, args.m, args.kernels, arch)
    print(f"kbit_cute.precompile: {len(specs)} variants for {arch} in {kc.cache_dir()}")
    if args.list:
        for s in specs:
            path = kc.entry_path(s, arch)
            print(f"  {s.name:28s} {'cached' if path.is_file() else 'missing'}  {path.name}")
        return 0
    report = build(specs, arch, args.jobs, verbose=True)
    times = sorted(report["compile_s"].values())
    if times:
        print(
            f"compiled {len(times)} (cold compile per variant: min {times[0]:.2f} s, "
            f"median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s; "
            f"wall {report['wall_s']:.1f} s with {args.jobs} jobs)"
        )
    cached = report["variants"] - report["compiled"] - len(report["failed"])
    print(f"{cached} already cached, {len(report['failed'])} failed")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
