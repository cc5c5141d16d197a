"""``python -m kbit_cute.env``: what this machine has, and whether a kernel compiles and runs.

Prints Python, torch (and its CUDA), the CUDA driver, the GPUs (compute
capability, SMs, L2, shared memory), the cutlass-dsl / tvm-ffi / cuda-python
versions and the JIT cache directory; then compiles the k=4 fp16 dequantize
kernel (or loads it from the cache) and, on a GPU, runs it against the CPU
reference. Exit status 0 when that check passes. Paste the output into bug reports.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
import traceback


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cache_summary() -> str:
    from .compile import cache_dir

    d = cache_dir()
    if not d.is_dir():
        return f"{d} (empty)"
    entries = list(d.glob("*.o"))
    size = sum(e.stat().st_size for e in entries)
    writable = os.access(d, os.W_OK)
    return f"{d} ({len(entries)} entries, {size / 1e6:.1f} MB{'' if writable else ', READ-ONLY'})"


def report() -> list[str]:
    import torch

    import kbit_cute

    lines = [
        f"kbit_cute {kbit_cute.__version__} ({os.path.dirname(kbit_cute.__file__)})",
        f"python {platform.python_version()} on {platform.machine()} {platform.system()}",
        f"torch {torch.__version__} (built for CUDA {torch.version.cuda})",
        "nvidia-cutlass-dsl " + _version("nvidia-cutlass-dsl"),
        "apache-tvm-ffi " + _version("apache-tvm-ffi"),
        "cuda-python " + _version("cuda-python"),
    ]
    if not torch.cuda.is_available():
        lines.append("GPU: none visible to torch (CPU tensors use the reference path)")
    else:
        from .device import device_props, driver_version

        major, minor = driver_version()
        lines.append(f"CUDA driver: {major}.{minor}")
        for i in range(torch.cuda.device_count()):
            p = device_props(i)
            ok = "" if p.capability >= (8, 0) else "  <- below sm_80: not supported"
            lines.append(
                f"GPU {i}: {p.name}, {p.arch}, {p.sm_count} SMs, L2 {p.l2_bytes / 2**20:.0f} MiB, "
                f"smem {p.smem_per_block_optin // 1024} KiB/CTA {p.smem_per_sm // 1024} KiB/SM{ok}"
            )
    lines.append(f"JIT cache: {_cache_summary()} (set KBIT_CUTE_CACHE_DIR to move it)")
    return lines


def kernel_check() -> tuple[bool, str]:
    """Compile (or load) the k=4 fp16 dequantize kernel; on a GPU run it against the reference."""
    import torch

    from . import compile as kc
    from .format import dequantize as reference
    from .format import quantize
    from .kernels.dequantize import dequantize_spec

    if not torch.cuda.is_available() and not os.environ.get("CUTE_DSL_ARCH"):
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"  # compile-only check without a GPU
    spec = dequantize_spec(4, "f16")
    t0 = time.perf_counter()
    try:
        arch = kc.target_arch()
        if not torch.cuda.is_available():
            kc.ffi_function(spec, arch)
            how = "loaded from cache" if kc.stats["disk_hits"] else "compiled"
            took = time.perf_counter() - t0
            return (
                True,
                f"test kernel {spec.name}: {how} for {arch} in {took:.2f} s (no GPU: not run)",
            )
        from .ops import dequantize

        W = torch.randn(300, 256, device="cuda")
        qw = quantize(W, 4)
        got = dequantize(qw, torch.float16)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        ok = torch.equal(got.cpu(), reference(qw.to("cpu"), torch.float16))
        how = "loaded from cache" if kc.stats["disk_hits"] else "compiled"
        verdict = "matches the reference" if ok else "DIFFERS from the reference"
        return ok, f"test kernel {spec.name}: {how} for {arch}, ran in {took:.2f} s, {verdict}"
    except Exception:
        return False, f"test kernel {spec.name}: FAILED\n{traceback.format_exc()}"


def main() -> int:
    for line in report():
        print(line)
    ok, line = kernel_check()
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
