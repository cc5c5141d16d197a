"""torch integration on the GPU: opcheck on CUDA, torch.compile(fullgraph=True) and CUDA
graph capture of a KbitLinear MLP against eager, the warm disk cache in a fresh process,
host overhead, and the CUDA error messages."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import kbit_cute
from kbit_cute import compile as kc
from kbit_cute import device as kdev
from kbit_cute import gemm_dispatch, ops
from kbit_cute.nn import KbitLinear, quantize_model

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16)
ROOT = Path(__file__).resolve().parents[1]


def wargs(qw):
    return (qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K)


def mlp(k: int, dtype, width=1024, depth=4, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers += [nn.Linear(width, width, bias=i % 2 == 0), nn.SiLU()]
    m = nn.Sequential(*layers[:-1]).to("cuda", dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    return quantize_model(m, k=k, progress=False)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_on_cuda(k, dtype, gen):
    W = torch.randn(300, 256, generator=gen).to("cuda", dtype)
    qw = kbit_cute.quantize(W, k)
    bias = torch.randn(300, device="cuda", dtype=dtype)
    for M in (1, 3, 37):  # GEMV buckets and the large-M path
        A = torch.randn(M, 256, device="cuda", dtype=dtype)
        torch.library.opcheck(torch.ops.kbit_cute.gemm, (A, *wargs(qw), bias))
        out = torch.full((M, 300), float("nan"), device="cuda", dtype=dtype)
        torch.library.opcheck(torch.ops.kbit_cute.gemm_out, (A, *wargs(qw), None, out))
    torch.library.opcheck(torch.ops.kbit_cute.dequantize, (*wargs(qw), dtype))
    out = torch.full((300, 256), float("nan"), device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.kbit_cute.dequantize_out, (*wargs(qw), dtype, out))
    torch.library.opcheck(torch.ops.kbit_cute.quantize, (W, k, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", (1, 16))  # the GEMV and the large-M path; one inductor compile each
def test_compile_fullgraph_mlp_matches_eager(dtype, M):
    model = mlp(4, dtype)
    x = torch.randn(M, 1024, device="cuda", dtype=dtype)
    with torch.inference_mode():
        eager = model(x)
        torch._dynamo.reset()
        explain = torch._dynamo.explain(model)(x)
        assert explain.graph_break_count == 0, explain.break_reasons
        compiled = torch.compile(model, fullgraph=True)(x)
    assert not torch.isnan(eager).any()
    # Inductor may fuse SiLU differently from eager (rounding); the kbit ops are the same.
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


@pytest.fixture
def no_scratch(monkeypatch):
    """No plan and no split-K scratch yet for any stream: the next call allocates them."""
    monkeypatch.setattr(ops, "_gemv_plans", {})
    monkeypatch.setattr(ops, "_split_states", {})
    monkeypatch.setattr(gemm_dispatch, "_buffers", {})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", (1, 16))  # the GEMV and the mma GEMM, both with split-K
def test_compile_reduce_overhead_matches_eager(dtype, M, no_scratch):
    """Inductor's CUDA graphs: the split-K scratch is first allocated inside its warm-up,
    whose allocations go to the graph pool; it must come from the driver instead (it used
    to fail with 'tensors in the cudagraph pool not tracked as outputs')."""
    model = mlp(4, dtype)
    x = torch.randn(M, 1024, device="cuda", dtype=dtype)
    with torch.inference_mode():
        torch._dynamo.reset()
        f = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        got = [f(x).clone() for _ in range(4)]  # warm-up, record, replays
        eager = model(x)
    assert not torch.isnan(eager).any()
    for g in got:
        torch.testing.assert_close(g, eager, rtol=2e-2, atol=2e-2)


def test_scratch_tensor_is_driver_memory():
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    c = kdev.scratch_tensor(dev, 5000, torch.int32, fill_byte=0)
    w = kdev.scratch_tensor(dev, 7, torch.float32)
    assert torch.cuda.memory_allocated(dev) == before  # not torch's caching allocator
    assert c.shape == (5000,) and c.dtype == torch.int32 and c.get_device() == dev
    assert w.shape == (7,) and w.dtype == torch.float32 and w.is_contiguous()
    assert not c.any()
    c.fill_(3)
    w.fill_(1.5)
    assert c.sum().item() == 15000 and w.sum().item() == 10.5


def test_scratch_tensor_inside_graph_capture():
    """Allocated and zeroed at once during a capture: nothing of it enters the graph."""
    dev = torch.cuda.current_device()
    x = torch.ones(4096, device="cuda", dtype=torch.int32)
    x + 1  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = kdev.scratch_tensor(dev, 4096, torch.int32, fill_byte=0)
        y = x + c
    assert not c.any()  # zero now, before any replay
    c.fill_(5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(y == 6)


@pytest.mark.parametrize("k", KS)
def test_first_gemv_of_a_shape_inside_graph_capture(k, gen, no_scratch):
    """The capture stream's scratch and a new shape's plan are made during the capture."""
    dtype = torch.float16
    warm = kbit_cute.quantize(torch.randn(256, 512, generator=gen).to("cuda", dtype), k)
    kbit_cute.gemm(torch.randn(1, 512, device="cuda", dtype=dtype), warm)  # loads the kernel
    qw = kbit_cute.quantize(torch.randn(384, 8192, generator=gen).to("cuda", dtype), k)
    static_x = torch.randn(1, 8192, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g):
        static_y = kbit_cute.gemm(static_x, qw)
    plan = ops._gemv_plans[(k, 384, 8192, static_x.get_device(), dtype)]
    assert plan.grids[(1, 1)][0] > 3  # workers > column tiles: partial strips, the reduction runs
    with torch.inference_mode():
        for _ in range(3):
            static_x.copy_(torch.randn(1, 8192, generator=gen).to("cuda", dtype))
            g.replay()
            assert torch.equal(static_y, kbit_cute.gemm(static_x, qw))


def test_two_streams_run_gemvs_at_once(gen, no_scratch):
    """Per-stream split-K counters: GEMVs on two streams at once stay correct."""
    dtype, dev = torch.bfloat16, torch.cuda.current_device()
    qw = kbit_cute.quantize(torch.randn(256, 8192, generator=gen).to("cuda", dtype), 4)
    xs = [torch.randn(M, 8192, generator=gen).to("cuda", dtype) for M in (1, 3)]
    with torch.inference_mode():
        expect = [kbit_cute.gemm(x, qw) for x in xs]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        torch.cuda.synchronize()
        outs = [[], []]
        for _ in range(50):
            for i, (s, x) in enumerate(zip(streams, xs, strict=True)):
                with torch.cuda.stream(s):
                    outs[i].append(kbit_cute.gemm(x, qw))
        torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, expect[i]) for o in outs[i])
    a, b = (ops._split_states[(dev, s.cuda_stream)] for s in streams)
    assert a.counters.data_ptr() != b.counters.data_ptr()
    assert not a.counters.any() and not b.counters.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", (1, 3, 16))
def test_cuda_graph_capture_and_replay_match_eager(dtype, M):
    model = mlp(3, dtype, depth=6)
    static_x = torch.randn(M, 1024, device="cuda", dtype=dtype)
    with torch.inference_mode():
        model(static_x)  # warm-up: load the kernels, size the split-K workspace
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = model(static_x)
        for _ in range(3):
            x = torch.randn(M, 1024, device="cuda", dtype=dtype)
            static_x.copy_(x)
            g.replay()
            expect = model(x)  # eager, after the replay (same stream: ordered)
            assert torch.equal(static_y, expect)


def test_grad_through_kbit_linear_on_cuda():
    q = KbitLinear.from_linear(nn.Linear(256, 96, device="cuda", dtype=torch.float16), k=4)
    x = torch.randn(5, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    q(x).float().sum().backward()
    W = kbit_cute.dequantize(q.weight, torch.float32)
    torch.testing.assert_close(x.grad.float(), W.sum(0).expand(5, -1), rtol=1e-2, atol=1e-2)
    assert q.bias.grad is not None and torch.all(q.bias.grad == 5)


def test_misaligned_activation_view_is_handled():
    qw = kbit_cute.quantize(torch.randn(128, 256, device="cuda", dtype=torch.float16), 4)
    base = torch.randn(257 * 2, device="cuda", dtype=torch.float16)
    A = base[1:257].view(1, 256)  # 2 bytes past a 16-byte boundary
    assert A.data_ptr() % 16
    expect = kbit_cute.gemm(A.clone(), qw)
    assert torch.equal(kbit_cute.gemm(A, qw), expect)


def test_cuda_errors_name_the_fix(monkeypatch):
    qw = kbit_cute.quantize(torch.randn(64, 64, device="cuda", dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="move one"):
        kbit_cute.gemm(torch.randn(1, 64, dtype=torch.float16), qw)
    with pytest.raises(TypeError, match="float16 or bfloat16.*model.half"):
        kbit_cute.gemm(torch.randn(1, 64, device="cuda"), qw)
    old = kdev.DeviceProps(0, "Tesla T4", (7, 5), 40, 4 << 20, 64 << 10, 64 << 10)
    with pytest.raises(RuntimeError, match=r"need compute capability >= 8\.0; this GPU is 7\.5"):
        kdev.check_capability(old)


def test_device_props_from_the_driver():
    p = kdev.device_props(torch.cuda.current_device())
    tp = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert p.capability == (tp.major, tp.minor)
    assert p.sm_count == tp.multi_processor_count
    assert p.l2_bytes > 0 and p.smem_per_block_optin >= 48 << 10
    assert p.memory_gbs > 100  # (peak DRAM bandwidth: every sm_80+ GPU streams more)
    assert kc.target_arch() == os.environ.get("CUTE_DSL_ARCH", p.arch)


def run_fresh(code: str, cache_dir: Path) -> dict:
    env = {**os.environ, kc.CACHE_ENV: str(cache_dir)}
    env.pop("CUTE_DSL_ARCH", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


FIRST_CALL = """
    import json, time
    t0 = time.perf_counter()
    import torch, kbit_cute
    from kbit_cute import compile as kc
    from torch import nn
    t_import = time.perf_counter() - t0
    torch.manual_seed(0)
    layers = [nn.Linear(1024, 1024, device="cuda", dtype=torch.float16) for _ in range({n})]
    model = kbit_cute.quantize_model(nn.Sequential(*layers), k=4, progress=False)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    print(json.dumps(dict(import_s=t_import, first_s=first, second_s=second, **kc.stats)))
"""


def test_first_call_with_a_warm_disk_cache(tmp_path):
    """Cold: a fresh cache compiles. Warm: a new process only loads (goal <= 0.2 s for the
    first call of one layer and of a 32-layer model)."""
    cold = run_fresh(FIRST_CALL.format(n=1), tmp_path)
    warm = run_fresh(FIRST_CALL.format(n=1), tmp_path)
    warm32 = run_fresh(FIRST_CALL.format(n=32), tmp_path)
    print(
        f"\ncold first call {cold['first_s']:.2f} s (compile {cold['compile_s']:.2f} s); "
        f"warm first call {warm['first_s'] * 1e3:.0f} ms (load {warm['load_s'] * 1e3:.0f} ms); "
        f"warm 32-layer model first call {warm32['first_s'] * 1e3:.0f} ms; "
        f"second call {warm32['second_s'] * 1e3:.1f} ms; import {warm['import_s']:.2f} s"
    )
    assert cold["compiled"] >= 1
    assert warm["compiled"] == 0 and warm["disk_hits"] >= 1
    assert warm32["compiled"] == 0
    assert warm["first_s"] < 1.0 and warm32["first_s"] < 1.5  # goal 0.2 s; generous bound


def test_host_overhead_per_eager_call():
    """perf_counter over 10k calls, tiny shape, M=1 (perf/bench_host_overhead.py has more)."""
    K = N = 256
    A = torch.randn(1, K, device="cuda", dtype=torch.float16)
    W = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.05
    qw = kbit_cute.quantize(W, 4)

    def per_call(fn, n=10_000):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    lin = torch.nn.Linear(K, N, device="cuda", dtype=torch.float16)
    qlin = KbitLinear.from_linear(lin, 4)
    with torch.inference_mode():
        ours = min(per_call(lambda: kbit_cute.gemm(A, qw)) for _ in range(3))
        ref = min(per_call(lambda: torch.nn.functional.linear(A, W)) for _ in range(3))
        mod = min(per_call(lambda: qlin(A)) for _ in range(3))
        ref_mod = min(per_call(lambda: lin(A)) for _ in range(3))
    print(
        f"\nhost time per call: kbit_cute.gemm {ours:.1f} us, F.linear {ref:.1f} us; "
        f"KbitLinear {mod:.1f} us, nn.Linear {ref_mod:.1f} us"
    )
    # The 10 us target is the benchmark's (python -m perf.bench_host_overhead), not a timed
    # test's: back-to-back timings on a shared host move by several us. Here only a bound
    # that catches a lost fast path (the dispatcher path costs ~40 us more).
    assert ours < 2 * ref + 10 and mod < 2 * ref_mod + 10


def test_warmup_loads_every_requested_variant(tmp_path, monkeypatch):
    """k = 4, M = 1, fp16 GEMV: its default variant and, on sm_90, the deeper ring's and
    those whose runs cross strips (the even grids of fast-memory devices)."""
    from kbit_cute.kernels.device_helpers import target_arch_family
    from kbit_cute.precompile import select_specs

    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path))
    want = {s.name for s in select_specs(k=4, dtypes="f16", m=1, kernels=["gemv"])}
    assert "gemv_k4_m1_f16" in want
    sm90 = target_arch_family() == "sm_90"
    assert ("gemv_k4_m1_f16_s4" in want) == sm90
    assert ("gemv_k4_m1_f16_x" in want) == ("gemv_k4_m1_f16_s4_x" in want) == sm90
    report = kbit_cute.warmup(k=4, dtypes=torch.float16, m=1, kernels=("gemv",))
    assert report["variants"] == report["compiled"] == len(want)
    again = kbit_cute.warmup(k=4, dtypes=torch.float16, m=1, kernels=("gemv",))
    assert again["compiled"] == 0
    assert want <= set(kc._launchers)
