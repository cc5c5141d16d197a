"""The measuring method of the perf suite (the only one accepted for published numbers).

- **L2-cold.** Each implementation's weights are copied until the copies span more than
  4x the GPU's L2 (``copies_for``); consecutive calls rotate over the copies, so every call
  reads its weights from HBM. Activations stay hot, as in a real decode step.
- **CUDA graphs.** ``calls`` back-to-back calls (at least one per copy, so a replay touches
  every copy, and at least ``CALLS_PER_GRAPH`` unless each call is long) are captured in
  one graph; per-call time = replay time / calls; the median of ``REPEATS`` (>= 7) timed
  replays, measured with CUDA events, is the reported number.
- **Eager time** (host overhead included): the same calls launched from Python, CUDA events
  around the whole loop, median of ``EAGER_REPEATS`` loops.
- **Rooflines in the same run**: read bandwidth from a 1 GiB fp32 ``.sum()``, tensor-core
  throughput from an 8192^3 cuBLAS matmul in the run's dtype.

``CudaTimer`` implements it; ``CpuSmokeTimer`` runs every call once on the CPU with host
clocks so the whole pipeline can be exercised without a GPU (``--cpu-smoke``; the numbers
mean nothing).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

L2_BYTES = 50 * 2**20  # H100 default; CudaTimer reads the device's own value
CALLS_PER_GRAPH = 20  # minimum calls per graph for short calls (amortizes the replay launch)
TARGET_GRAPH_US = 5000.0  # long calls: enough calls for ~5 ms per replay
REPEATS = 9
EAGER_REPEATS = 5
EAGER_MAX_CALLS = 200  # eager passes are host-bound for small weights: cap their length
ROTATION = 4  # copies span > ROTATION x L2
# Compute-bound points (large M) drive the H100 into its 700 W power cap: the SM clock falls to
# ~1.2-1.4 GHz and stays there ~0.5 s after they end. Issue-bound points timed in that window
# (the GEMV at k = 2, 3, 5) ran up to 40% slow (perf/NOTES.md, session 18), so a sweep pauses
# COOLDOWN_S before a point of M < HEAVY_M rows that follows one of M >= HEAVY_M
# (``PowerCapPause``).
COOLDOWN_S = 1.0
HEAVY_M = 256

REPO_ROOT = Path(__file__).resolve().parent.parent


def copies_for(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Copies of an nbytes weight so that together they span more than 4x the L2."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    return max(2, -(-ROTATION * l2_bytes // nbytes) + 1)


def calls_for(n_copies: int, est_us: float) -> int:
    """Calls per graph: every copy at least once; >= CALLS_PER_GRAPH unless calls are long."""
    by_time = math.ceil(TARGET_GRAPH_US / max(est_us, 1e-3))
    return max(n_copies, min(CALLS_PER_GRAPH, by_time))


def error_text(exc: BaseException, limit: int = 240) -> str:
    """One line naming the exception: what a failed peer or point records."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}"[:limit]


@dataclass
class Timing:
    graph_us: float | None
    eager_us: float | None
    calls: int
    error: str | None = None  # set when the graph could not be captured/replayed
    warm_s: float | None = None  # wall time of the first call of every copy (compile, autotune)


# ----------------------------------------------------------------------------- CUDA


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def cuda_loop_us(fns: Sequence[Callable[[], object]], repeats: int, max_calls: int = 0) -> float:
    """Median over ``repeats`` of (CUDA-event time of an eager pass) / calls in the pass.

    A pass is all of fns, or ``max_calls`` of them continuing round-robin from where the
    previous pass stopped (so passes still rotate over every weight copy).
    """
    n = len(fns)
    per = n if not max_calls else min(n, max_calls)
    times = []
    for r in range(repeats):
        seq = [fns[(r * per + j) % n] for j in range(per)]
        s, e = _events()
        s.record()
        for fn in seq:
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / per)
    return statistics.median(times)


def cuda_graph_us(fns: Sequence[Callable[[], object]], repeats: int = REPEATS) -> float:
    """Capture fns (already warmed up) in one graph; median per-call time of timed replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()  # first replay uploads the graph
    times = []
    for _ in range(repeats):
        s, e = _events()
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / len(fns))
    del graph
    return statistics.median(times)


def graph_time_us(make_call, n_copies: int, repeats: int = REPEATS) -> float:
    """Median per-call time of one graph of calls rotating over ``n_copies`` weight copies.

    The graph holds max(CALLS_PER_GRAPH, n_copies) calls so that one replay reads every copy:
    with fewer calls than copies, the copies it does read can fit in L2 and stay hot.
    """
    calls = [make_call(i % n_copies) for i in range(max(CALLS_PER_GRAPH, n_copies))]
    for c in calls[:n_copies]:
        c()  # warm: compile, workspaces
    torch.cuda.synchronize()
    return cuda_graph_us(calls, repeats)


def cool_down() -> None:
    """Let the GPU leave its power cap before a memory-bound point (``COOLDOWN_S``)."""
    torch.cuda.synchronize()
    time.sleep(COOLDOWN_S)


class PowerCapPause:
    """Call ``before(rows)`` before timing each point of a sweep: it pauses (``pause``, e.g. a
    timer's ``cool_down``) when a point of fewer than HEAVY_M rows follows one of more."""

    def __init__(self, pause: Callable[[], None] = cool_down):
        self.pause, self.last = pause, 0

    def before(self, rows: int) -> None:
        if self.last >= HEAVY_M > rows:
            self.pause()
        self.last = rows


def read_bandwidth_gbs() -> float:
    """Measured HBM read bandwidth: a 1 GiB fp32 ``.sum()``, median of 7."""
    x = torch.randn(2**28, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    us = cuda_loop_us([x.sum], 7)
    del x
    return 2**30 / (us * 1e3)


def tensor_tflops(dtype: torch.dtype = torch.float16, n: int = 8192) -> float:
    """Measured dense matmul throughput of cuBLAS (n^3, graph replays) in TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    fn = lambda: torch.matmul(a, b)
    fn()
    torch.cuda.synchronize()
    us = cuda_graph_us([fn] * 5, 7)
    return 2 * n**3 / (us * 1e6)


class CudaTimer:
    """The published method (module docstring) on the current CUDA device."""

    kind = "cuda"
    device = torch.device("cuda")

    def __init__(self, repeats: int = REPEATS, eager_repeats: int = EAGER_REPEATS):
        if repeats < 7:
            raise ValueError(f"the method needs >= 7 timed replays, got {repeats}")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or L2_BYTES)
        self.repeats = repeats
        self.eager_repeats = eager_repeats

    def copies_for(self, nbytes: int) -> int:
        return copies_for(nbytes, self.l2_bytes)

    def time_calls(self, fns: Sequence[Callable[[], object]]) -> Timing:
        """fns: one call per weight copy. Warm each, time eager, then the graph."""
        t = time.perf_counter()
        for fn in fns:
            fn()  # compile, autotune, workspaces, first touch of every copy
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t
        eager = cuda_loop_us(fns, self.eager_repeats, EAGER_MAX_CALLS)
        calls = calls_for(len(fns), eager)
        seq = [fns[i % len(fns)] for i in range(calls)]
        try:
            graph = cuda_graph_us(seq, self.repeats)
        except Exception as exc:  # reported with the eager time, not dropped
            torch.cuda.synchronize()
            return Timing(None, eager, calls, "graph: " + error_text(exc), warm_s)
        return Timing(graph, eager, calls, None, warm_s)

    def time_graph(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        """One callable (e.g. a whole decode step) captured once, median replay time in us."""
        fn()
        torch.cuda.synchronize()
        return cuda_graph_us([fn], repeats or self.repeats)

    def time_eager(self, fn: Callable[[], object], repeats: int = 3) -> float:
        """Python-launched calls of fn (host overhead included), median of repeats, in us."""
        return cuda_loop_us([fn], repeats)

    def read_bandwidth_gbs(self) -> float:
        return read_bandwidth_gbs()

    def tensor_tflops(self, dtype: torch.dtype) -> float:
        return tensor_tflops(dtype)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def cool_down(self) -> None:
        cool_down()


# ----------------------------------------------------------------------------- CPU smoke


class CpuSmokeTimer:
    """Runs every call once on the CPU and times it with host clocks: a pipeline test only."""

    kind = "cpu-smoke"
    device = torch.device("cpu")
    l2_bytes = 4096  # a few copies per weight, so the rotation code runs
    repeats = 1
    eager_repeats = 1

    def copies_for(self, nbytes: int) -> int:
        return min(copies_for(nbytes, self.l2_bytes), 4)

    def time_calls(self, fns: Sequence[Callable[[], object]]) -> Timing:
        t = time.perf_counter()
        for fn in fns:
            fn()
        dt = time.perf_counter() - t
        return Timing(dt * 1e6 / len(fns), dt * 1e6 / len(fns), len(fns), None, dt)

    def time_graph(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6

    def time_eager(self, fn: Callable[[], object], repeats: int = 1) -> float:
        return self.time_graph(fn)

    def read_bandwidth_gbs(self) -> float:
        x = torch.randn(2**20)
        t = time.perf_counter()
        x.sum()
        return x.numel() * 4 / max(time.perf_counter() - t, 1e-9) / 1e9

    def tensor_tflops(self, dtype: torch.dtype) -> float:
        a = torch.randn(256, 256)
        t = time.perf_counter()
        a @ a
        return 2 * 256**3 / max(time.perf_counter() - t, 1e-9) / 1e12

    def synchronize(self) -> None:
        pass

    def cool_down(self) -> None:
        pass


def make_timer(cpu_smoke: bool, repeats: int = REPEATS):
    if cpu_smoke:
        return CpuSmokeTimer()
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the perf suite measures on a CUDA GPU; none is visible here. "
            "Use --cpu-smoke to exercise the pipeline on the CPU (numbers are meaningless)."
        )
    return CudaTimer(repeats)


# ----------------------------------------------------------------------------- environment


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(module or dist)
        return getattr(mod, "__version__", None) if mod is not None else None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def nvidia_smi() -> dict:
    """Name, driver and clocks of the visible GPU as nvidia-smi reports them (strings)."""
    fields = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm"
    out = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"])
    if not out:
        return {"error": "nvidia-smi unavailable"}
    lines = out.splitlines()
    keys = [k.strip() for k in lines[0].split(",")]
    idx = 0
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if vis.isdigit() and int(vis) + 1 < len(lines):
        idx = int(vis)
    vals = [v.strip() for v in lines[1 + idx].split(",")]
    return dict(zip(keys, vals, strict=False))


def environment(timer) -> dict:
    """Everything needed to reproduce and compare a run."""
    commit = _run(["git", "rev-parse", "HEAD"], REPO_ROOT)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    env = {
        "timer": timer.kind,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "cuda_python": _version("cuda-python"),
        "kbit_cute": _version("kbit_cute"),
        "git_commit": None if commit is None else commit + ("-dirty" if dirty else ""),
        "bitsandbytes": _version("bitsandbytes"),
        "gemlite": _version("gemlite"),
        "triton": _version("triton"),
    }
    if timer.kind == "cuda":
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        env.update(
            gpu=torch.cuda.get_device_name(dev),
            capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
            sm_count=props.multi_processor_count,
            l2_bytes=timer.l2_bytes,
            memory_gib=round(props.total_memory / 2**30, 1),
            nvidia_smi=nvidia_smi(),
        )
    else:
        env.update(gpu="none (cpu smoke run)", l2_bytes=timer.l2_bytes)
    return env


def refresh_versions(env: dict) -> None:
    """Peers import lazily; fill in versions known only after their import."""
    for key, dist in (
        ("bitsandbytes", "bitsandbytes"),
        ("gemlite", "gemlite"),
        ("triton", "triton"),
    ):
        env[key] = env.get(key) or _version(dist)


# ----------------------------------------------------------------------------- output


def default_out_dir(kind: str) -> Path:
    """$OUT when set (the GPU host's result folder), else perf/results/run-<date>-<kind>."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return REPO_ROOT / "perf" / "results" / f"run-{stamp}-{kind}"


def round_floats(obj, digits: int = 4):
    """Floats to `digits` significant digits (keeps committed JSON small and diffable)."""
    if isinstance(obj, float):
        if not math.isfinite(obj) or obj == 0.0:
            return obj if math.isfinite(obj) else None
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [round_floats(v, digits) for v in obj]
    return obj


def dump_json(obj: dict, path: Path) -> None:
    """JSON with one list element per line for lists of records (small, diff-friendly)."""
    obj = round_floats(obj)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(obj, 0) + "\n")


def _dumps(obj, indent: int) -> str:
    pad = " " * indent
    if isinstance(obj, dict) and obj:
        items = [f"{pad} {json.dumps(k)}: {_dumps(v, indent + 1).lstrip()}" for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        if all(not any(isinstance(x, dict | list) for x in v.values()) for v in obj):
            rows = [pad + " " + json.dumps(v, separators=(",", ":")) for v in obj]
        else:
            rows = [_dumps(v, indent + 1) for v in obj]
        return pad + "[\n" + ",\n".join(rows) + "\n" + pad + "]"
    return pad + json.dumps(obj)


class _Progress:
    """tqdm when installed; otherwise a line to stderr every 10%."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self._next = total, desc, 0, 0.1
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="pt", dynamic_ncols=True, mininterval=2.0)
        except ImportError:
            self._bar = None
            print(f"{desc}: {total} points", file=sys.stderr)

    def update(self, note: str = "") -> None:
        self.n += 1
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        elif self.total and self.n / self.total >= self._next:
            print(f"{self.desc}: {self.n}/{self.total} {note}", file=sys.stderr)
            self._next += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress(total: int, desc: str) -> _Progress:
    return _Progress(total, desc)
