"""The torch.library ops on the CPU: opcheck, eager == op, torch.compile tracing without
graph breaks, autograd, and the error messages."""

import itertools

import pytest
import torch

import kbit_cute
from kbit_cute import ops

KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def opcheck(op, args, dtype):
    """Every opcheck test for fp16; the slow AOT-dispatch one is left out for the others."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if dtype == torch.float16:
        utils += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(op, args, test_utils=utils)


def weight(gen, N, K, k, dtype=torch.float32):
    return kbit_cute.quantize((torch.randn(N, K, generator=gen) * 0.1).to(dtype), k)


def wargs(qw):
    return (qw.packed, qw.absmax, qw.codebook, qw.scale, qw.k, qw.N, qw.K)


def reference(A, qw, bias=None):
    r = A.double() @ kbit_cute.dequantize(qw, torch.float32).double().T
    return r if bias is None else r + bias.double()


def test_ops_are_registered():
    for name in ("quantize", "dequantize", "dequantize_out", "gemm", "gemm_out"):
        assert hasattr(torch.ops.kbit_cute, name), name
    for name in ("gemm_out", "dequantize_out"):
        schema = getattr(torch.ops.kbit_cute, name).default._schema
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == ["out"], (name, str(schema))
    for name in ("quantize", "dequantize", "gemm"):
        schema = getattr(torch.ops.kbit_cute, name).default._schema
        assert not any(a.alias_info for a in schema.arguments), str(schema)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_gemm(k, dtype, gen):
    qw = weight(gen, 130, 96, k)
    A = torch.randn(3, 96, generator=gen).to(dtype)
    bias = torch.randn(130, generator=gen).to(dtype)
    opcheck(torch.ops.kbit_cute.gemm, (A, *wargs(qw), bias), dtype)
    opcheck(torch.ops.kbit_cute.gemm, (A[:1], *wargs(qw), None), dtype)
    out = torch.full((3, 130), float("nan"), dtype=dtype)
    opcheck(torch.ops.kbit_cute.gemm_out, (A, *wargs(qw), bias, out), dtype)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_dequantize_and_quantize(k, dtype, gen):
    W = (torch.randn(70, 64, generator=gen) * 3).to(dtype)
    opcheck(torch.ops.kbit_cute.quantize, (W, k, None), dtype)
    opcheck(torch.ops.kbit_cute.quantize, (W, k, kbit_cute.codebook(k) * 0.5), dtype)
    qw = kbit_cute.quantize(W, k)
    opcheck(torch.ops.kbit_cute.dequantize, (*wargs(qw), dtype), dtype)
    out = torch.full((70, 64), float("nan"), dtype=dtype)
    opcheck(torch.ops.kbit_cute.dequantize_out, (*wargs(qw), dtype, out), dtype)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_and_op_paths_agree_bitwise(k, dtype, gen):
    qw = weight(gen, 200, 128, k, dtype)
    A = torch.randn(2, 5, 128, generator=gen).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype)
    eager = kbit_cute.gemm(A, qw, bias)
    op = torch.ops.kbit_cute.gemm(A, *wargs(qw), bias)
    assert eager.shape == (2, 5, 200) and eager.dtype == dtype
    assert torch.equal(eager, op)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    ref = reference(A, qw, bias)
    assert ((eager.double() - ref).norm() / ref.norm()).item() < tol
    out = torch.full_like(eager, float("nan"))
    assert kbit_cute.gemm(A, qw, bias, out=out) is out and torch.equal(out, eager)
    W = kbit_cute.dequantize(qw, dtype)
    assert torch.equal(W, torch.ops.kbit_cute.dequantize(*wargs(qw), dtype))
    qw2 = torch.ops.kbit_cute.quantize(
        W.float() * 0 + kbit_cute.dequantize(qw, torch.float32), k, None
    )
    assert all(isinstance(t, torch.Tensor) for t in qw2)


def test_empty_rows(gen):
    qw = weight(gen, 64, 64, 4)
    out = kbit_cute.gemm(torch.empty(0, 64), qw)
    assert out.shape == (0, 64)


@pytest.mark.parametrize("k", (2, 5))
def test_torch_compile_fullgraph_traces_the_ops(k, gen):
    """Dynamo traces the public functions into the registered ops (no graph break), and the
    compiled result is the eager result. aot_eager: no C++ compiler needed on the CPU."""
    qw = weight(gen, 96, 64, k)
    bias = torch.randn(96, generator=gen)
    A = torch.randn(4, 64, generator=gen)

    def f(A):
        y = kbit_cute.gemm(A, qw, bias)
        return y + kbit_cute.dequantize(qw, torch.float32).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(A), f(A))
    explain = torch._dynamo.explain(f)(A)
    assert explain.graph_break_count == 0
    ops_in_graph = {
        getattr(n.target, "_qualified_op_name", "").replace("::", ".")
        for g in explain.graphs
        for n in g.graph.nodes
    }
    assert {"kbit_cute.gemm", "kbit_cute.dequantize"} <= ops_in_graph, ops_in_graph


def test_autograd_through_gemm_matches_dense(gen):
    qw = weight(gen, 48, 64, 3)
    A = torch.randn(5, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(48, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: kbit_cute.gemm(a, qw, b), (A, bias))
    W = kbit_cute.dequantize(qw, torch.float32).double()
    g = torch.randn(5, 48, generator=gen, dtype=torch.float64)
    kbit_cute.gemm(A, qw, bias).backward(g)
    assert torch.allclose(A.grad, g @ W) and torch.allclose(bias.grad, g.sum(0))


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda A, qw: kbit_cute.gemm(A[:, :32], qw), ValueError, "last dimension must be"),
        (lambda A, qw: kbit_cute.gemm(A.to("meta"), qw), ValueError, "move one"),
        (lambda A, qw: kbit_cute.gemm(A, qw.packed), TypeError, "KbitWeight"),
        (lambda A, qw: kbit_cute.gemm(A, qw, torch.zeros(3)), ValueError, "bias must be"),
        (
            lambda A, qw: kbit_cute.gemm(A, qw, torch.zeros(64, dtype=torch.float64)),
            ValueError,
            "bias must be a torch.float32",
        ),
        (lambda A, qw: kbit_cute.gemm(A, qw, out=torch.empty(2, 63)), ValueError, "out must"),
        (
            lambda A, qw: kbit_cute.gemm(
                A, ops.KbitWeight(qw.packed[:-1], *wargs(qw)[1:], A.dtype)
            ),
            ValueError,
            "packed of a k=4 weight",
        ),
        (
            lambda A, qw: kbit_cute.gemm(
                A,
                ops.KbitWeight(
                    qw.packed, qw.absmax, kbit_cute.codebook(3), qw.scale, 4, 64, 64, A.dtype
                ),
            ),
            ValueError,
            "quantized with k=4",
        ),
        (lambda A, qw: kbit_cute.dequantize(qw, torch.int32), TypeError, "dequantize supports"),
    ],
)
def test_errors_name_the_problem(make, exc, match, gen):
    qw = weight(gen, 64, 64, 4)
    A = torch.randn(2, 64, generator=gen)
    with pytest.raises(exc, match=match):
        make(A, qw)


def test_fake_impl_validates_under_compile(gen):
    qw = weight(gen, 64, 64, 4)
    torch._dynamo.reset()
    f = torch.compile(lambda A: kbit_cute.gemm(A, qw), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="last dimension must be"):
        f(torch.randn(2, 32))


def test_kbit_linear_compiles_fullgraph_into_the_op(gen):
    """KbitLinear.forward reads its buffers from the module's dicts (hot path): dynamo still
    traces it into ``kbit_cute::gemm`` without a graph break."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32))
    q = kbit_cute.quantize_model(m, k=3, progress=False)
    x = torch.randn(3, 64, generator=gen)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(q)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    ops_in_graph = {
        getattr(n.target, "_qualified_op_name", "") for g in explain.graphs for n in g.graph.nodes
    }
    assert "kbit_cute::gemm" in ops_in_graph, ops_in_graph
    assert torch.equal(torch.compile(q, fullgraph=True, backend="aot_eager")(x), q(x))


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports CUDA device index 7: drives the CUDA branch of the dispatch
    on a machine without a GPU (the kernel launch itself is a stub). Its torch function
    handling is off, so its results are plain tensors (device index -1)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def get_device(self):
        return 7


def fake(t):
    return t.as_subclass(FakeCuda)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Device 7 of 132 SMs behind stubs: the current device and stream (``streams[0]``, which
    a test may change), scratch memory (CPU zeros, poisoned where not zeroed), and a stub
    launch function per (k, m bucket, dtype) that records its arguments in ``calls``."""
    from kbit_cute import compile as kc
    from kbit_cute import device as kdev
    from kbit_cute.kernels.gemv import gemv_spec

    calls, streams = [], [1234]
    specs = []  # the names of the variants loaded, in order
    props = kdev.DeviceProps(7, "stub", (9, 0), 132, 50 << 20, 227 << 10, 228 << 10)

    def scratch(index, n, dtype, fill_byte=None):
        assert index == 7
        if fill_byte is not None:
            return fake(torch.full((n * dtype.itemsize,), fill_byte, dtype=torch.uint8).view(dtype))
        return fake(torch.full((n,), -7, dtype=dtype))

    def launcher(
        k, m_bucket, dtype, lookup=None, stages=None, cta_groups=False, crossing=False,
        row_sets=False,
    ):  # fmt: skip
        spec = gemv_spec(
            k, m_bucket, ops._GEMV_DTYPES[dtype], stages, lookup, None, cta_groups, crossing,
            row_sets,
        )  # fmt: skip
        specs.append(spec.name)
        params = kc.kernel_params(spec)
        return kc.make_launch("stub", params, lambda *a: calls.append(a), stream_arg=True)

    monkeypatch.setattr(kdev, "check_device", lambda index: props)
    monkeypatch.setattr(kdev, "scratch_tensor", scratch)
    monkeypatch.setattr(ops, "_current_device", lambda: 7)
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: streams[0])
    monkeypatch.setattr(ops, "_gemv_launcher", launcher)
    monkeypatch.setattr(ops, "_gemv_plans", {})
    monkeypatch.setattr(ops, "_split_states", {})
    monkeypatch.setattr(ops, "_fake_gpu_specs", specs, raising=False)
    return calls, streams


@pytest.fixture
def loaded_variants(fake_gpu, monkeypatch):
    """The key of each GEMV launcher the plans load, in order: (k, m bucket, dtype, lookup,
    stages, CTA groups, crossing, row sets); the launchers stay ``fake_gpu``'s."""
    loaded = []
    fake_launcher = ops._gemv_launcher

    def recording_launcher(*key):
        loaded.append(key)
        return fake_launcher(*key)

    monkeypatch.setattr(ops, "_gemv_launcher", recording_launcher)
    return loaded


def fake_weight(gen, N, K, k, dtype):
    qw = weight(gen, N, K, k, dtype)
    return ops.KbitWeight(*(fake(t) for t in wargs(qw)[:4]), k, N, K, dtype)


@pytest.mark.parametrize("M,bias", [(1, True), (3, False), (2, True)])
def test_cuda_dispatch_passes_the_kernel_arguments_in_order(M, bias, fake_gpu, gen):
    """First call (full checks, plan) and hot-path calls launch the same arguments."""
    calls, _ = fake_gpu
    K, N, k, dtype = 2048, 256, 4, torch.float16
    w = fake_weight(gen, N, K, k, dtype)
    base = torch.randn(M * K + 8, generator=gen).to(dtype)
    A = fake(base[1 : 1 + M * K].view(M, K))  # misaligned: copied before the launch
    b = fake(torch.randn(N, generator=gen).to(dtype)) if bias else None
    m_bucket = {1: 1, 2: 2, 3: 4}[M]
    workers, ctas = ops.gemv_grid(k, m_bucket, dtype, N, K, 132)
    assert workers > N // 128  # partial strips: workspace and counters in use

    for _ in range(3):  # the first call plans; then the hot path
        calls.clear()
        out = kbit_cute.gemm(A, w, b)
        assert out.shape == (M, N) and out.dtype == dtype
        (args,) = calls  # one launch (the misaligned first try launched nothing)
        assert args[0] % 16 == 0 and args[0] != A.data_ptr()
        assert args[1:5] == tuple(t.data_ptr() for t in wargs(w)[:4])
        assert args[5] == (b.data_ptr() if bias else out.data_ptr()) and args[6] == out.data_ptr()
        per_cta, splits = workers // ctas, 0  # no CTA groups for so few workers
        assert not ops._gemv_plans[(k, N, K, 7, dtype)].groups[(m_bucket, 1)]
        assert args[9:] == (M, N, K, workers, ctas, per_cta, splits, int(bias), 1234)
        state = ops._split_states[(7, 1234)]
        assert args[7] == state.slots.data_ptr() and args[8] == state.counters.data_ptr()
        assert state.slots.numel() >= 2 * workers * m_bucket * 128
        assert (state.slots.view(torch.int32) == -1).all()  # EMPTY_SLOT: what the owner polls
        assert state.counters.numel() >= N // 32 and not state.counters.any()
    assert list(ops._gemv_plans) == [(k, N, K, 7, dtype)]


@pytest.mark.parametrize(
    "N, K, M, variant, quads",
    [
        (2048, 4096, 1, (None, None, False), 5),  # the 128 KB table, 3 stages: 5 quads per CTA
        (1024, 2048, 1, (None, None, False), 5),  # SMALL_WEIGHT: the table
        (2048, 512, 1, ("shuffle", None, False), 7),  # under SMALL_WEIGHT: shuffles
        (28672, 8192, 1, (None, None, False), 5),  # 224 x 4 workers wanted: still 3 stages
        (28672, 8192, 2, (None, None, True), 5),  # (from M = 2 CTA groups: 5 workers a CTA)
        (28672, 8192, 4, (None, None, True), 4),  # M = 4 keeps 3 stages (measured)
        (28672, 8192, 5, (None, 2, True), 5),  # M = 5..8: 2 stages, 5 quads (3 stages hold 3)
        (14336, 4096, 8, (None, None, True), 3),  # 112 x 4 workers: 3 stages, 3 quads
        (512, 2048, 8, ("shuffle", None, False), 7),  # under SMALL_WEIGHT: shuffles at every M
    ],
)
def test_k5_plans_take_the_variant_of_their_weight(
    N, K, M, variant, quads, fake_gpu, loaded_variants, gen
):
    """k = 5 (``ops.gemv_variant``): weights of at least ``SMALL_WEIGHT`` elements get the
    128 KB pair table, smaller ones the shuffles; at M = 5..8 a weight whose split-K workers
    exceed 5 per SM a 2-stage ring (more quads per CTA; M = 1, 2 keep 3 stages); from M = 2
    the table variant with CTA groups where the CTAs hold more than two workers
    (``ops.gemv_cta_groups``). The plan launches that variant with its grid (at M = 1 perhaps
    an even one, across strips: ``ops.even_workers``)."""
    import cutlass

    from kbit_cute.kernels.gemv import SMALL_WEIGHT, GemvKernel

    calls, _ = fake_gpu
    assert (N * K >= SMALL_WEIGHT) == (variant[0] is None)
    w = fake_weight(gen, N, K, 5, torch.float16)
    kbit_cute.gemm(fake(torch.randn(M, K, generator=gen).half()), w)
    m = {1: 1, 2: 2, 4: 4, 5: 8, 8: 8}[M]
    # (one row set; runs across strips only from the even grid at M = 1)
    grid = ops._gemv_plans[(5, N, K, 7, torch.float16)].grids[(m, 1)]
    crossing = ops.gemv_crossing(m, 5, N, grid, variant[2])
    assert loaded_variants == [(5, m, torch.float16, *variant, crossing, False)]
    kernel = GemvKernel(5, m, cutlass.Float16, variant[1], variant[0], cta_groups=variant[2])
    assert kernel.quads == quads
    (args,) = calls  # launched with the grid of that variant
    grid = ops.kernel_grid(kernel, N, K, 132)
    assert args[12:16] == (*grid, *GemvKernel.cta_args(variant[2], N, *grid))
    assert variant[2] == (args[15] != 0)  # the variant with CTA groups takes them


def test_hot_path_keeps_every_check(fake_gpu, gen):
    """After the plan exists, a wrong A, weight, bias or out still fails with the error of
    the first call (the hot path falls back to the full checks)."""
    K, N, k, dtype = 256, 128, 4, torch.float16
    w = fake_weight(gen, N, K, k, dtype)
    A = fake(torch.randn(1, K, generator=gen).to(dtype))
    bias = fake(torch.randn(N, generator=gen).to(dtype))
    kbit_cute.gemm(A, w)
    kbit_cute.gemm(A, w)
    assert ops._gemv_plans[(k, N, K, 7, dtype)].scratch  # the hot path ran
    bad = [
        (lambda: kbit_cute.gemm(A[:, :64], w), ValueError, "last dimension must be"),
        (lambda: kbit_cute.gemm(fake(torch.randn(K).to(dtype))[None, None, :32], w),
         ValueError, "last dimension"),
        (lambda: kbit_cute.gemm(fake(torch.randn(1, K)), w), TypeError, "float16 or bfloat16"),
        (lambda: kbit_cute.gemm(A.as_subclass(torch.Tensor), w), ValueError, "move one"),
        (lambda: kbit_cute.gemm(A, ops.KbitWeight(fake(w.packed[:-1]), *wargs(w)[1:], dtype)),
         ValueError, "packed of a k=4 weight"),
        (lambda: kbit_cute.gemm(A, ops.KbitWeight(
            w.packed, w.absmax, fake(kbit_cute.codebook(3)), w.scale, k, N, K, dtype)),
         ValueError, "quantized with k=4"),
        (lambda: kbit_cute.gemm(A, w, fake(torch.zeros(N - 1, dtype=dtype))),
         ValueError, "bias must be"),
        (lambda: kbit_cute.gemm(A, w, fake(torch.zeros(N))), ValueError, "bias must be"),
        (lambda: kbit_cute.gemm(A, w, torch.zeros(N, dtype=dtype)), ValueError, "bias must be"),
        (lambda: kbit_cute.gemm(A, w, out=fake(torch.empty(1, N))), ValueError, "out must be"),
        (lambda: kbit_cute.gemm(A, w, out=fake(torch.empty(2, N, dtype=dtype))),
         ValueError, "out must be"),
        (lambda: kbit_cute.gemm(A, w, out=fake(torch.empty(1, 2 * N, dtype=dtype)[:, ::2])),
         ValueError, "out must be"),
        (lambda: kbit_cute.gemm(A, w, out=torch.empty(1, N, dtype=dtype)),
         ValueError, "out must be"),
        (lambda: kbit_cute.gemm(A, w, out=fake(A.view(-1)[:N].view(1, N))),
         ValueError, "out shares memory with A"),
        (lambda: kbit_cute.gemm(A, w, bias, out=fake(bias.view(1, N))),
         ValueError, "out shares memory with bias"),
    ]  # fmt: skip
    for make, exc, match in bad:
        with pytest.raises(exc, match=match):
            make()
    # views of one buffer that do not overlap are fine
    buf = torch.randn(K + N, generator=gen).to(dtype)
    A2, out2 = fake(buf[:K].view(1, K)), fake(buf[K:].view(1, N))
    assert kbit_cute.gemm(A2, w, out=out2).data_ptr() == out2.data_ptr()


def test_hot_path_shapes_out_and_empty_rows(fake_gpu, gen):
    calls, _ = fake_gpu
    K, N, k, dtype = 256, 192, 5, torch.bfloat16
    w = fake_weight(gen, N, K, k, dtype)
    for shape in ((1, K), (1, 1, K), (2, 1, K), (K,), (4, K)):
        A = fake(torch.randn(*shape, generator=gen).to(dtype))
        for _ in range(2):
            calls.clear()
            out = kbit_cute.gemm(A, w)
            assert out.shape == (*shape[:-1], N)
            assert [c[9] for c in calls] == [A.numel() // K]
            given = torch.full((*shape[:-1], N), float("nan"), dtype=dtype)
            assert kbit_cute.gemm(A, w, out=fake(given)).data_ptr() == given.data_ptr()
    assert kbit_cute.gemm(fake(torch.empty(0, K, dtype=dtype)), w).shape == (0, N)


def test_strided_bias_is_copied_before_the_launch(fake_gpu, gen):
    """The kernel reads bias[n] at n: a strided bias must not reach it as is."""
    calls, _ = fake_gpu
    K, N, k, dtype = 256, 128, 3, torch.float16
    w = fake_weight(gen, N, K, k, dtype)
    A = fake(torch.randn(1, K, generator=gen).to(dtype))
    bias = fake(torch.randn(2 * N, generator=gen).to(dtype)[::2])
    assert bias.shape == (N,) and not bias.is_contiguous()
    for _ in range(3):
        calls.clear()
        kbit_cute.gemm(A, w, bias)
        (args,) = calls
        assert args[5] != bias.data_ptr() and args[13] == 1


def test_each_stream_gets_its_own_zeroed_counters(fake_gpu, gen):
    """Two streams may run GEMVs at once: their split-K counters must never be shared."""
    calls, streams = fake_gpu
    K, N, k, dtype = 4096, 256, 2, torch.float16
    w = fake_weight(gen, N, K, k, dtype)
    A = fake(torch.randn(2, K, generator=gen).to(dtype))
    used = {}
    for stream in (11, 22, 11, 22):
        streams[0] = stream
        calls.clear()
        kbit_cute.gemm(A, w)
        kbit_cute.gemm(A, w)
        assert {c[-1] for c in calls} == {stream}
        used.setdefault(stream, set()).update((c[7], c[8]) for c in calls)
    assert all(len(v) == 1 for v in used.values())  # one buffer pair per stream, kept
    (ws11, cnt11), (ws22, cnt22) = used[11].pop(), used[22].pop()
    assert ws11 != ws22 and cnt11 != cnt22
    for stream in (11, 22):
        assert not ops._split_states[(7, stream)].counters.any()


def test_rows_over_8_on_small_weights_run_the_gemv_in_row_sets(fake_gpu, gen):
    """M = 9..64 on a k = 4 weight of at most 2^22 elements: the GEMV's rows bucket 8 in ceil(M / 8)
    row sets (the variant with ``row_sets``), each set's grid that of 132 / sets SMs, the
    scratch holding every set's slots and counters."""
    calls, _ = fake_gpu
    k, dtype, N, K = 4, torch.float16, 512, 2048
    w = fake_weight(gen, N, K, k, dtype)
    for M, sets in ((9, 2), (16, 2), (17, 3), (32, 4), (48, 6), (64, 8), (8, 1)):
        for _ in range(2):  # the first call plans; then the hot path
            calls.clear()
            ops._fake_gpu_specs.clear()
            out = kbit_cute.gemm(fake(torch.randn(M, K, generator=gen).to(dtype)), w)
            assert out.shape == (M, N)
            (args,) = calls
            workers, ctas = ops.gemv_grid(k, 8, dtype, N, K, 132 // sets)
            assert args[9:14] == (M, N, K, workers, ctas), M
            state = ops._split_states[(7, 1234)]
            assert state.slots.numel() >= sets * 2 * workers * 8 * 128
            assert state.counters.numel() >= sets * N // 32
        if sets > 1:  # (loaded on the plan's first call of this M)
            plan = ops._gemv_plans[(k, N, K, 7, dtype)]
            assert plan.by_m[M][0] is not None and plan.max_m == 64


def test_gemv_row_set_rule():
    """The most rows the GEMV serves by weight size (``ops.GEMV_ROW_SETS``), and the launch
    form of each M."""
    assert ops.gemv_max_m(512, 2048, 4) == 64 and ops.gemv_max_m(2048, 2048, 2) == 64
    assert ops.gemv_max_m(512, 2048, 5) == 48 and ops.gemv_max_m(2048, 2048, 5) == 48
    assert ops.gemv_max_m(4096, 2048, 2) == 32 == ops.gemv_max_m(4096, 2048, 5)
    assert ops.gemv_max_m(5120, 2048, 3) == 24 and ops.gemv_max_m(8192, 2048, 4) == 16
    assert ops.gemv_max_m(12288, 2048, 2) == ops.GEMV_MAX_M == 8
    assert [ops.gemv_rows(M) for M in (1, 3, 8, 9, 16, 17, 32, 48)] == [
        (1, 1), (4, 1), (8, 1), (8, 2), (8, 2), (8, 3), (8, 4), (8, 6)
    ]  # fmt: skip
    import cutlass

    from kbit_cute.kernels.gemv import GemvKernel, gemv_spec

    assert GemvKernel.ROW_SETS_M == ops.GEMV_MAX_M  # the bucket whose sets ``gemv_rows`` counts
    assert gemv_spec(4, 8, "f16", row_sets=True).name == "gemv_k4_m8_f16_r"
    with pytest.raises(ValueError, match="row sets"):
        GemvKernel(4, 4, cutlass.Float16, row_sets=True)


def test_scratch_grows_and_keeps_outgrown_buffers(fake_gpu, gen):
    """A bigger shape grows the stream's scratch; the smaller shape's plan keeps its (still
    allocated) buffers, and an explicit split count takes the grown ones."""
    calls, _ = fake_gpu
    k, dtype = 4, torch.float16
    small = fake_weight(gen, 128, 256, k, dtype)
    big = fake_weight(gen, 4096, 8192, k, dtype)
    A1 = fake(torch.randn(4, 256, generator=gen).to(dtype))
    A2 = fake(torch.randn(4, 8192, generator=gen).to(dtype))
    for _ in range(2):
        kbit_cute.gemm(A1, small)
    first = calls[-1][7]
    for _ in range(2):
        kbit_cute.gemm(A2, big)
    state = ops._split_states[(7, 1234)]
    plan = ops._gemv_plans[(k, 4096, 8192, 7, dtype)]
    assert state.slots.numel() >= plan.ws_elems and calls[-1][7] == state.slots.data_ptr()
    assert calls[-1][7] != first
    calls.clear()
    kbit_cute.gemm(A1, small)
    assert calls[-1][7] == first  # the outgrown buffer: device memory is never freed
    calls.clear()
    ops._gemv(A2, big, None, fake(torch.empty(4, 4096, dtype=dtype)), 4, workers=3000)
    assert calls[-1][12:14] == ops.gemv_grid(k, 4, dtype, 4096, 8192, 132, 3000)
    assert calls[-1][12] == 3000 and state.slots.numel() >= 2 * 3000 * 4 * 128


def test_kbit_linear_takes_the_hot_path(fake_gpu, gen):
    calls, _ = fake_gpu
    q = kbit_cute.KbitLinear.from_linear(torch.nn.Linear(256, 64, dtype=torch.float16), k=3)
    for name in ("packed", "absmax", "codebook", "scale"):
        q._buffers[name] = fake(q._buffers[name])
    q._parameters["bias"] = fake(q.bias.detach())  # a stand-in: Parameter refuses FakeCuda
    x = fake(torch.randn(1, 1, 256, generator=gen).to(torch.float16))
    with torch.inference_mode():
        for _ in range(3):
            calls.clear()
            assert q(x).shape == (1, 1, 64)
            (args,) = calls
            assert args[5] == q.bias.data_ptr() and args[13] == 1


@pytest.mark.parametrize(
    "K,N,splits",
    [
        (256, 2048, 1),  # K of 4 tiles: no split
        (512, 2048, 8),  # short K: about one run (>= 1 K tile) per SM
        (512, 4096, 4),
        (384, 2048, 4),  # 6 K tiles: the power of two below
        (512, 8192, 1),  # short K, many columns: unsplit
        (2048, 512, 16),  # few columns: runs of 2 tiles
        (2048, 2048, 16),  # <= 16 column tiles at M = 1: runs of >= 2 tiles
        (1024, 2048, 8),
        (3072, 1024, 16),
        (2048, 5120, 8),  # 40 column tiles: runs of >= 4 tiles
        (2048, 8192, 4),  # many columns, K <= 32 tiles: 4 splits
        (8192, 28672, 4),  # many columns, long K: runs of >= 16 tiles, ~6 runs per SM
        (4096, 8192, 8),  # runs of >= 8 tiles where that makes <= 4 runs per SM (512)
        (6144, 8192, 8),
        (4096, 11008, 4),  # (8 splits: 688 runs, 5.2 per SM)
        (8192, 8192, 8),
        (4096, 14336, 4),
        (14336, 4096, 16),
    ],
)
def test_gemv_splits_rule(K, N, splits):
    """The measured split rule of the GEMV (``ops.gemv_splits``) on a 132-SM H100."""
    assert ops.gemv_splits(N, K, 132) == splits


@pytest.mark.parametrize(
    "K,N,m_bucket,splits",
    [
        (2048, 2048, 2, 8),  # from M = 2: runs of >= 4 tiles
        (512, 2048, 2, 4),  # short K from M = 2: runs of >= 2 tiles
        (512, 2048, 8, 4),
        (14336, 4096, 4, 16),
        (4096, 4096, 4, 8),  # M = 2, 4: >= 32 column tiles over < 128 K tiles: at most 8
        (6144, 4096, 2, 8),
        (4096, 4096, 1, 16),  # (M = 1: from 48 column tiles)
        (4096, 6144, 1, 8),
        (4096, 5120, 1, 16),
        (4096, 7680, 1, 8),  # (16 splits: 960 runs, past one wave)
        (8192, 6144, 1, 8),
        (14336, 6144, 1, 16),  # (M = 1: nor over > 128 K tiles)
        (8192, 4096, 4, 16),  # (nor over >= 128 K tiles)
        (4096, 3072, 4, 16),  # (nor over 24 column tiles)
        (14336, 4096, 8, 8),  # M = 8: at most 8 (the owner's rounds hold 2 slots)
        (2048, 512, 8, 8),
        (4096, 14336, 8, 4),
        (4096, 8192, 4, 8),
        (4096, 8192, 8, 4),  # M = 8 (3 quads per SM at k = 5): runs of 16 tiles
    ],
)
def test_gemv_splits_by_rows(K, N, m_bucket, splits):
    """The rule's rows-bucket terms (measured with the polled hand-over)."""
    assert ops.gemv_splits(N, K, 132, m_bucket) == splits


@pytest.mark.parametrize(
    "K,N,k,m_bucket,splits",
    [
        (3584, 18944, 4, 1, 4),  # 148 column tiles over 56 K tiles: 2 -> 4
        (3584, 18944, 5, 4, 3),  # (k = 5 at M = 4: 4 quads per SM, 528 in a wave)
        (2560, 9728, 4, 1, 5),
        (3072, 9216, 2, 4, 7),
        (3584, 3584, 4, 1, 14),
        (3584, 3584, 4, 4, 14),  # (M = 4 with CTA groups: ``grouped_splits``)
        (10240, 2048, 4, 1, 16),  # (M = 1: no CTA groups, the rule's)
        (10240, 2048, 4, 4, 24),  # M >= 2 with CTA groups: about 3 workers per SM
        (10240, 2048, 5, 8, 24),
        (2048, 8192, 4, 2, 6),  # (64 column tiles over 32 K tiles: 4 -> 6)
        (14336, 4096, 4, 8, 12),  # (M = 8: the rule's 8)
        (4096, 2048, 4, 8, 8),  # (16 splits: 1.94 workers per CTA, no groups: the rule's)
        (4096, 11008, 4, 4, 6),
        (4096, 14336, 4, 1, 4),  # (8 splits: 6.8 runs per SM, measured slower)
        (14336, 4096, 4, 1, 16),  # (the rule's cap)
        (28672, 8192, 4, 1, 8),  # (14 splits: the busiest SM streams as many tiles)
        (8192, 28672, 4, 1, 4),
        (3584, 18944, 4, 8, 5),  # (M = 8: the rule's 2; CTA groups: ``even_grouped_splits``)
        (3072, 9216, 4, 8, 7),  # M = 8: 2 -> 7 (3.8 runs per SM)
        (4096, 11008, 4, 8, 6),  # (M = 8: ``balanced_splits``' 4; ``even_grouped_splits``' 6)
        (2048, 10240, 4, 1, 4),  # (8 splits: runs of 4 tiles at 4.8 per SM, measured slower)
        (3072, 5120, 4, 1, 8),  # (12: runs of 4 at 3.6 per SM)
        (3584, 4608, 4, 1, 10),  # (14: runs of 4 at 3.8 per SM)
        (512, 8192, 4, 1, 2),  # short K over 64 column tiles: 1 -> 2
        (960, 9728, 4, 8, 3),
        (8192, 28672, 5, 4, 2),  # (the rule's 4: past one wave of k = 5's 528 quads at M = 4)
        (12800, 7168, 4, 1, 9),  # (boundary: the busiest SM at exactly 0.92 of the rule's)
        (2816, 4608, 4, 1, 11),  # (boundary: exactly 3 runs per SM, so runs of 4 tiles)
    ],
)
def test_gemv_grid_balances_splits(K, N, k, m_bucket, splits):
    """``ops.balanced_splits`` on a 132-SM H100: the measured shapes whose power-of-two count
    left a wave of few or uneven runs take more splits; the others keep the rule's."""
    workers, _ = ops.gemv_grid(k, m_bucket, torch.float16, N, K, 132)
    assert workers == -(-N // 128) * splits


def test_cta_busiest_tiles_counts_each_sms_ctas():
    """Runs of 2 K tiles (2 column tiles x 3 K tiles in 3 runs): 2 CTAs hold workers {0, 1}
    and {2}; 3 CTAs on 2 SMs put CTAs 0 and 2 on SM 0."""
    assert ops.cta_busiest_tiles(2, 3, 3, 2, 2) == 4
    assert ops.cta_busiest_tiles(2, 3, 3, 3, 2) == 4
    assert ops.cta_busiest_tiles(2, 3, 3, 3, 3) == 2
    # 4096x14336: 448 runs of 16 tiles, 52 CTAs of 4; 784 runs of 9-10 tiles, 5-6 per CTA
    assert ops.cta_busiest_tiles(112, 64, 448, 132, 132) == 64
    assert ops.cta_busiest_tiles(112, 64, 784, 132, 132) == 55
    # 8192x28672, 924 runs over 28672 units: the 28 runs one tile longer come 33 workers
    # apart, so interleaved over 132 CTAs they all land on the same SMs
    assert ops.cta_busiest_tiles(224, 128, 924, 132, 132, interleaved=True) == 224
    assert ops.cta_busiest_tiles(224, 128, 924, 132, 132) == 218
    assert ops.cta_busiest_tiles(2, 3, 3, 2, 2, interleaved=True) == 4  # (workers 0, 2 on SM 0)


@pytest.mark.parametrize(
    "K, N, k, m_bucket, splits",
    [
        (4096, 14336, 3, 4, 7),  # 448 runs on 132 CTAs (52 hold 4) -> 784 (5-6 each)
        (4096, 14336, 3, 2, 7),
        (18944, 3584, 3, 4, 33),  # 28 column tiles x 16 -> 924 runs, 7 per CTA
        (18944, 3584, 5, 4, 18),  # (k = 5: 4 quads per SM)
        (2048, 10240, 4, 4, 8),
        (4096, 14336, 5, 4, 4),  # (k = 5: 528 quads in a wave, 4 splits at most)
        (14336, 4096, 3, 4, 16),  # (116 CTAs hold 4 runs, 16 hold 3: even enough)
        (8192, 28672, 4, 4, 4),
        (4096, 14336, 3, 1, None),  # (M = 1: no CTA groups; ``even_workers``)
    ],
)
def test_even_grouped_splits(K, N, k, m_bucket, splits):
    """``ops.even_grouped_splits`` on a 132-SM H100 (sm_90a): launches with CTA groups whose
    CTAs stream uneven shares of the K tiles take the split count that evens them out."""
    workers, ctas = ops.gemv_grid(k, m_bucket, torch.float16, N, K, 132)
    if splits is None:
        assert workers == 528
        return
    assert workers == -(-N // 128) * splits
    assert ops.gemv_cta_groups(m_bucket, N, (workers, ctas), (None,))


def test_even_grouped_splits_bounds():
    """Over a sweep of shapes, rows buckets and k: a moved count keeps CTA groups, one wave of
    quads and runs of >= ``BALANCE_MIN_RUN`` K tiles, and cuts the busiest SM's K tiles to
    ``GROUPED_EVEN_GAIN`` of the count it was given or less."""
    from kbit_cute.kernels.gemv import _DTYPES, GemvKernel

    moved = 0
    for n_tiles in range(3, 240, 13):
        for k_tiles in (16, 28, 40, 56, 64, 112, 224, 296):
            for m in (2, 4, 8):
                for k in (3, 5):
                    kernel = GemvKernel(k, m, _DTYPES["f16"])
                    slots = 132 * kernel.ctas_per_sm
                    rule = min(ops.gemv_splits(n_tiles * 128, k_tiles * 64, 132, m),
                               slots * kernel.quads // n_tiles)  # fmt: skip
                    if rule < 1:
                        continue
                    got = ops.even_grouped_splits(kernel, n_tiles, k_tiles, rule, 132)
                    assert got >= rule
                    if got == rule:
                        continue
                    moved += 1
                    workers = n_tiles * got
                    ctas = ops.grid_ctas(kernel, workers, slots)
                    assert workers <= slots * kernel.quads
                    assert k_tiles // got >= ops.BALANCE_MIN_RUN
                    assert ops.gemv_cta_groups(m, n_tiles * 128, (workers, ctas), (None,))
                    before = ops.cta_busiest_tiles(
                        n_tiles, k_tiles, n_tiles * rule,
                        ops.grid_ctas(kernel, n_tiles * rule, slots), 132,
                    )  # fmt: skip
                    after = ops.cta_busiest_tiles(n_tiles, k_tiles, workers, ctas, 132)
                    assert after <= ops.GROUPED_EVEN_GAIN * before
    assert moved > 0


@pytest.mark.parametrize(
    "K, N, k, workers, crossing",
    [
        (4096, 14336, 3, 528, True),  # 448 runs of 16 K tiles (52 SMs hold 4, 80 hold 3)
        (4096, 14336, 2, 528, True),
        (18944, 3584, 5, 528, True),  # 448 runs of 18-19 tiles
        (8192, 28672, 5, 528, True),  # (5 quads per CTA: busiest SM 256 -> 218 K tiles)
        (4096, 14336, 4, 448, False),  # k = 4, bound by the DRAM stream (on the H100)
        (14336, 4096, 3, 512, False),  # 116 SMs hold 4 runs, 16 hold 3: even enough
        (3584, 18944, 3, 660, True),  # (busiest SM 70 -> 63 K tiles)
        (8192, 28672, 2, 924, True),  # (224 -> 218: 28 SMs held 6 runs, 104 held 7)
        (8192, 28672, 3, 924, True),
        (28672, 8192, 5, 512, False),  # (k = 5: 224 -> 218 is 0.97 of the rule's)
        (28672, 8192, 3, 528, True),
        (11008, 4096, 2, 512, False),  # (44 -> 42 K tiles: fewer than EVEN_GRID_MIN_SAVED)
        (2048, 10240, 5, 396, True),  # (24 -> 20 K tiles: 0.83 of the rule's)
        (1536, 8960, 3, 350, False),  # (runs of 4.2 K tiles)
        (2048, 5120, 3, 320, False),
        (256, 128, 3, 1, False),  # (a grid of no more runs than SMs)
    ],
)
def test_even_workers_at_m1(K, N, k, workers, crossing):
    """``ops.even_workers`` on a 132-SM H100 (M = 1, k != 4): where the rule's grid leaves
    some SMs more K tiles than others and an even grid (q x SMs runs, across strips) cuts
    the busiest SM's to ``EVEN_GRID_GAIN`` of its or (k = 2, 3) saves it
    ``EVEN_GRID_MIN_SAVED`` tiles or more, the even grid, on the ``crossing`` variant. M = 2
    keeps the rule's grid and the variant without it."""
    got, ctas = ops.gemv_grid(k, 1, torch.float16, N, K, 132)
    assert got == workers
    assert ops.gemv_crossing(1, k, N, (got, ctas), False) == crossing
    rule, _ = ops.gemv_grid(k, 2, torch.float16, N, K, 132)
    assert rule % -(-N // 128) == 0  # (no even grid at M = 2: runs stay in their strips)
    assert not ops.gemv_crossing(2, k, N, (workers, ctas), False)


def test_even_workers_and_crossing_variants_are_sm90_only(monkeypatch):
    """On sm_80 the rule's grid stays (its crossing variants of k = 2, 3 spilled) and the
    library ships no crossing variant; sm_90a ships those of M = 1, k = 2..5 (k = 4's for
    devices of fast memory, with its deeper ring too)."""
    from kbit_cute.kernels import device_helpers, gemv

    assert {s.name for s in gemv.specs("sm_90a") if s.name.endswith("_x")} == {
        f"gemv_k{k}_m1_{d}{st}_x" for k in (2, 3, 4, 5) for d in ("f16", "bf16")
        for st in ("", *(["_s4"] if k == 4 else []))
    }  # fmt: skip
    assert not [s.name for s in gemv.specs("sm_80") if s.name.endswith("_x")]
    monkeypatch.setattr(device_helpers, "target_arch_family", lambda: "sm_80")
    assert not ops.even_grid_applies(1, 3)
    assert not ops.gemv_crossing(1, 3, 14336, (528, 132), False)


def test_plan_takes_the_crossing_variant_for_an_even_grid(fake_gpu, loaded_variants, gen):
    """4096x14336 k = 3 at M = 1 runs 528 runs across strips on the ``crossing`` variant; at
    M = 4 (CTA groups, runs inside strips) the variant without it."""
    calls, _ = fake_gpu
    K, N = 4096, 14336
    w = fake_weight(gen, N, K, 3, torch.float16)
    for M in (1, 4):
        kbit_cute.gemm(fake(torch.randn(M, K, generator=gen).half()), w)
    assert loaded_variants == [
        (3, 1, torch.float16, None, None, False, True, False),
        (3, 4, torch.float16, None, None, True, False, False),
    ]
    assert calls[0][12] == 528  # the even grid's workers


def test_balanced_splits_stay_in_bounds():
    """Over a sweep of shapes the balanced count is never below the rule's, and never past
    one wave of resident quads, five runs per SM (four at M = 5..8), one polling round (at
    M = 5..8 the bucket's 8 splits) or runs of ``BALANCE_MIN_RUN`` tiles (longer past 3 runs
    per SM); where it moves, the busiest SM streams fewer tiles."""
    from kbit_cute.kernels.gemv import POLL_WORKERS

    moved = 0
    for n_tiles in range(1, 300, 7):
        for k_tiles in range(5, 400, 11):
            for m in (1, 2, 4, 8):
                wide = m == 8  # (2 slots per polling round: its own bounds)
                gain = ops.BALANCE_GAIN_M8 if wide else ops.BALANCE_GAIN
                max_runs = ops.BALANCE_MAX_RUNS_M8 if wide else ops.BALANCE_MAX_RUNS
                for resident in (528, 924):
                    rule = ops.gemv_splits(n_tiles * 128, k_tiles * 64, 132, m)
                    got = ops.balanced_splits(n_tiles, k_tiles, rule, 132, resident, m)
                    assert got >= rule
                    if got == rule:
                        continue
                    moved += 1
                    assert n_tiles * got <= min(resident, max_runs * 132)
                    assert got <= (ops.gemv_max_splits(m) if wide else POLL_WORKERS[m])
                    assert k_tiles // got >= ops.BALANCE_MIN_RUN
                    if n_tiles * got > ops.BALANCE_CROWDED_RUNS * 132:
                        assert k_tiles // got > ops.BALANCE_MIN_RUN
                    before = ops.busiest_sm_tiles(n_tiles, k_tiles, rule, 132)
                    after = ops.busiest_sm_tiles(n_tiles, k_tiles, got, 132)
                    assert after <= gain * before
    assert moved > 0


def test_gemv_grid_refuses_runs_past_32_bits():
    """The GEMV computes its stream-K run bounds in 32 bits: a weight whose (column tile, K
    tile) units x workers reach 2^32 is refused with a message, not computed wrongly."""
    N, K = 1 << 17, 1 << 17  # 1024 x 2048 = 2^21 units
    with pytest.raises(ValueError, match="too large for one GEMV launch"):
        ops.gemv_grid(4, 1, torch.float16, N, K, 132, workers=1 << 11)
    assert ops.gemv_grid(4, 1, torch.float16, N, K, 132, workers=1 << 10)[0] == 1 << 10


def test_gemv_grid_takes_full_ctas_where_they_nearly_fill_the_gpu():
    """896 quads (8192x28672, 4 splits) on 132 SMs of 7 quads: 128 full CTAs for the
    DRAM-bound table kernels (k >= 3), every SM for k = 2 (bound by each SM's shared-memory
    pipe) and for grids far from full (4096x14336: 448 quads). (The library's M = 1 grid at
    k = 2, 3 is the even one, 924 quads: ``test_even_workers_at_m1``.)"""
    for k, ctas in ((2, 132), (3, 128), (4, 128)):
        assert ops.gemv_grid(k, 1, torch.float16, 28672, 8192, 132, workers=896) == (896, ctas)
    assert ops.gemv_grid(4, 1, torch.float16, 28672, 8192, 132) == (896, 128)
    assert ops.gemv_grid(4, 1, torch.float16, 14336, 4096, 132) == (448, 132)


def test_gemv_ring_depth_by_k_and_rows_bucket(monkeypatch):
    """k = 3 at M = 2 keeps 4 K tiles in its ring on sm_90 (``gemv.RING_STAGES_SM90``, with
    CTA groups too); every other GEMV its k's ``STAGES``, an explicit depth wins, and sm_80
    (163 KB: a deeper ring would cost quads, unmeasured) keeps ``STAGES`` throughout."""
    import cutlass

    from kbit_cute.kernels import gemv

    def depth(k, m, **kw):
        return gemv.GemvKernel(k, m, cutlass.Float16, **kw).stages

    assert depth(3, 2) == depth(3, 2, cta_groups=True) == 4
    others = [(k, m) for k in (2, 3, 4, 5) for m in gemv.M_BUCKETS if (k, m) != (3, 2)]
    assert [depth(k, m) for k, m in others] == [gemv.STAGES[k] for k, _ in others]
    assert depth(3, 2, stages=3) == 3
    monkeypatch.setattr(gemv, "target_arch_family", lambda: "sm_80")
    assert depth(3, 2) == gemv.STAGES[3] == 3


@pytest.mark.parametrize(
    "K, N, deep",
    [
        (10240, 2048, (1, 2, 4)),  # 1.9-2.9 workers per SM, runs of 7-10 K tiles
        (14336, 4096, (1, 2, 4)),  # 3.9 per SM, runs of 14
        (2048, 10240, (1,)),  # M = 1 2.4 per SM; M = 2, 4 4.8 per SM
        (4096, 14336, ()),  # M = 1 runs of 16; M = 2, 4 5.9 per SM
        (28672, 8192, ()),  # 3.9 per SM, runs of 56
        (8192, 28672, ()),  # 6.8 per SM
    ],
)
def test_k4_deep_ring_on_grids_of_few_short_runs(K, N, deep, monkeypatch):
    """k = 4 (``ops.gemv_variant``) takes ``gemv.DEEP_RING_STAGES`` at M = 1, 2, 4 where the
    default variant's grid has at most 4 workers per SM and runs of at most 14 K tiles; the
    rows bucket 8, other k and sm_80 keep their rings."""
    from kbit_cute.kernels import device_helpers

    want = [(None, 4 if m in deep else None) for m in (1, 2, 4, 8)]
    assert [ops.gemv_variant(4, m, N, K, 132) for m in (1, 2, 4, 8)] == want
    assert all(ops.gemv_variant(k, m, N, K, 132)[1] != 4 for k in (2, 3, 5) for m in (1, 4))
    monkeypatch.setattr(device_helpers, "target_arch_family", lambda: "sm_80")
    assert [ops.gemv_variant(4, m, N, K, 132) for m in (1, 2, 4)] == [(None, None)] * 3


def test_fast_memory_by_bandwidth_per_sm():
    """``ops.has_fast_memory``: from ``FAST_MEMORY_GBS_PER_SM`` of DRAM bandwidth per SM (the
    H200's 4.8 TB/s over 132 SMs, not the H100's 3.35; an unknown bandwidth, 0, is slow);
    there k = 4 joins k = 2, 3, 5 as issue-bound (``issue_bound_k``)."""
    from kbit_cute import device as kdev

    def props(gbs):
        return kdev.DeviceProps(0, "stub", (9, 0), 132, 50 << 20, 227 << 10, 228 << 10, gbs)

    assert not ops.has_fast_memory(props(3352.3))
    assert not ops.has_fast_memory(props(0.0))
    assert ops.has_fast_memory(props(4814.3))
    assert ops.issue_bound_k(False) == (2, 3, 5)
    assert ops.issue_bound_k(True) == (2, 3, 4, 5)


def test_device_props_bandwidth_from_the_driver_or_unknown(monkeypatch):
    """``device.device_props``: peak DRAM bandwidth = 2 x memory clock x bus width (an H200's
    3.134 GHz x 6144 bits: 4814 GB/s); a driver that does not report the clock leaves it 0
    (slow memory for ``ops.has_fast_memory``) instead of failing the device."""
    from cuda.bindings import driver

    from kbit_cute import device as kdev

    A, ok = driver.CUdevice_attribute, driver.CUresult.CUDA_SUCCESS
    values = {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
              A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
              A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
              A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: 3_134_000,
              A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: 6144}  # fmt: skip
    monkeypatch.setattr(driver, "cuInit", lambda flags: (ok,))
    monkeypatch.setattr(driver, "cuDeviceGet", lambda i: (ok, i))
    monkeypatch.setattr(driver, "cuDeviceGetName", lambda n, dev: (ok, b"stub\0"))
    monkeypatch.setattr(driver, "cuGetErrorString", lambda err: (ok, b"not supported"))
    monkeypatch.setattr(driver, "cuDeviceGetAttribute", lambda a, dev: (ok, values.get(a, 1 << 20)))
    props = kdev.device_props.__wrapped__(0)
    assert props.sm_count == 132 and round(props.memory_gbs) == 4814
    assert ops.has_fast_memory(props)
    del values[A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE]
    failing = driver.CUresult.CUDA_ERROR_NOT_SUPPORTED

    def attribute(a, dev):
        return (
            (failing, 0)
            if a == A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE
            else (ok, values.get(a, 1 << 20))
        )

    monkeypatch.setattr(driver, "cuDeviceGetAttribute", attribute)
    props = kdev.device_props.__wrapped__(0)
    assert props.sm_count == 132 and props.memory_gbs == 0.0
    assert not ops.has_fast_memory(props)


@pytest.mark.parametrize(
    "K, N, fast, workers, stages, crossing",
    [
        (4096, 14336, False, 448, None, False),  # the rule's: 52 SMs hold 4 runs
        (4096, 14336, True, 528, 4, True),  # even: 64 -> 55 K tiles, with the deeper ring
        (18944, 3584, True, 528, None, True),  # 76 -> 63 (runs of 18)
        (8192, 28672, True, 896, None, False),  # 6.8 per SM: as it was
    ],
)
def test_k4_plan_on_fast_memory_takes_the_even_grid(
    K, N, fast, workers, stages, crossing, fake_gpu, loaded_variants, gen, monkeypatch
):
    """On a device of fast memory (``ops.has_fast_memory``), where k = 4 is issue-bound, a
    k = 4 plan at M = 1 takes the even grid where it cuts the busiest SM's K tiles
    (``even_workers``), on the crossing variant, with the deeper ring where that grid has
    few, short runs; on the H100, the rule's grid."""
    fast_gpu(monkeypatch, fast)
    calls, _ = fake_gpu
    w = fake_weight(gen, N, K, 4, torch.float16)
    kbit_cute.gemm(fake(torch.randn(1, K, generator=gen).half()), w)
    assert loaded_variants == [(4, 1, torch.float16, None, stages, False, crossing, False)]
    assert calls[0][12] == workers


def fast_gpu(monkeypatch, fast: bool) -> None:
    """``fake_gpu``'s device with the H200's (fast) or the H100's memory bandwidth."""
    import dataclasses

    from kbit_cute import device as kdev

    props = dataclasses.replace(kdev.check_device(7), memory_gbs=4814.3 if fast else 3352.3)
    monkeypatch.setattr(kdev, "check_device", lambda index: props)


@pytest.mark.parametrize(
    "K, N, fast, stages",
    [
        (8192, 28672, False, 2),  # 224 x 8 runs wanted: more than MORE_QUADS_FROM per SM
        (4096, 14336, False, None),  # 112 x 4 runs: 3 stages on the H100
        (4096, 14336, True, 2),  # over MORE_QUADS_FAST_ELEMS on the H200
        (2048, 5120, True, 2),
        (2048, 4096, True, None),  # 2^23 elements: 3 stages
    ],
)
def test_k5_m8_shallow_ring_by_device(
    K, N, fast, stages, fake_gpu, loaded_variants, gen, monkeypatch
):
    """k = 5 at M = 5..8 (``ops.gemv_variant``): the 2-stage ring with more quads per CTA
    where the split rule wants more than ``MORE_QUADS_FROM`` workers per SM and, on devices of
    fast memory, on weights of more than ``MORE_QUADS_FAST_ELEMS`` elements."""
    fast_gpu(monkeypatch, fast)
    w = fake_weight(gen, N, K, 5, torch.float16)
    kbit_cute.gemm(fake(torch.randn(8, K, generator=gen).half()), w)
    assert [key[:5] for key in loaded_variants] == [(5, 8, torch.float16, None, stages)]


def test_k4_deep_ring_plan_loads_its_variant(fake_gpu, loaded_variants, gen):
    """A k = 4 plan loads the deeper ring's variant for the rows buckets whose grid takes it
    (M = 1 on 2048x10240: 2.4 workers per SM) and the default one for the others (M = 2:
    4.8 per SM), and launches both."""
    calls, _ = fake_gpu
    K, N = 2048, 10240
    w = fake_weight(gen, N, K, 4, torch.float16)
    for M in (1, 2):
        kbit_cute.gemm(fake(torch.randn(M, K, generator=gen).half()), w)
    assert [key[4] for key in loaded_variants] == [4, None]
    assert len(calls) == 2


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_planned_gemv_variant_is_registered(arch, monkeypatch):
    """Every variant a plan can load (``_GemvPlan``: rows bucket, row sets, lookup, ring
    depth, CTA groups, runs across strips) is one ``gemv.specs`` ships for the arch, so that
    precompile and warmup build what dispatch loads: k = 2..5, both dtypes, weights from
    512x512 to 8192x28672, on 132 and 78 SMs, with slow (H100) and fast (H200) memory."""
    from kbit_cute import compile as kc
    from kbit_cute.kernels import gemv

    monkeypatch.setattr(kc, "_arch", arch)
    shipped = {s.name for s in gemv.specs(arch)}
    shapes = [(512, 512), (2048, 512), (512, 2048), (1056, 1000), (2048, 2048), (5120, 2048),
              (2048, 10240), (4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192),
              (3584, 18944), (18944, 3584)]  # fmt: skip
    for k in (2, 3, 4, 5):
        for K, N in shapes:
            for dtype in (torch.float16, torch.bfloat16):
                for sms, fast in itertools.product((132, 78), (False, True)):
                    plan = ops._GemvPlan(k, N, K, dtype, sms, fast)
                    for (m, sets), (lookup, stages) in plan.variants.items():
                        f = (m, sets)
                        name = gemv.gemv_spec(
                            k, m, ops._GEMV_DTYPES[dtype], stages, lookup, None,
                            plan.groups[f], plan.crossing[f], sets > 1,
                        ).name  # fmt: skip
                        assert name in shipped, (arch, k, K, N, sms, fast, name)
