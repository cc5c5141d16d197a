"""The torch.library ops on the CPU: opcheck, eager == op, torch.compile tracing without
graph breaks, autograd, and the error messages."""

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


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports CUDA device index 7: drives the CUDA branch of the dispatch
    on a machine without a GPU (the kernel launch itself is a stub)."""

    def get_device(self):
        return 7


@pytest.mark.parametrize("M,bias", [(1, True), (3, False), (2, True)])
def test_cuda_dispatch_passes_the_kernel_arguments_in_order(M, bias, monkeypatch, gen):
    from kbit_cute import compile as kc
    from kbit_cute import device as kdev
    from kbit_cute.kernels.gemv import gemv_spec

    K, N, k, dtype = 2048, 256, 4, torch.float16
    qw = weight(gen, N, K, k, dtype)
    calls = []
    m_bucket = {1: 1, 2: 2, 3: 4}[M]
    stub = kc.make_launch(
        "stub",
        kc.kernel_params(gemv_spec(k, m_bucket, "f16")),
        lambda *a: calls.append(a),
        current_device=lambda: 7,
        raw_stream=lambda dev: 1234,
    )
    props = kdev.DeviceProps(7, "stub", (9, 0), 132, 50 << 20, 227 << 10, 228 << 10)
    monkeypatch.setattr(kdev, "check_device", lambda index: props)
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: 1234)
    monkeypatch.setitem(ops._gemv_launchers, (k, m_bucket, dtype), stub)
    monkeypatch.setattr(ops, "_gemv_plans", {})
    monkeypatch.setattr(ops, "_split_states", {})
    fake = lambda t: t.as_subclass(FakeCuda)  # noqa: E731
    w = ops.KbitWeight(*(fake(t) for t in wargs(qw)[:4]), k, N, K, dtype)
    base = torch.randn(M * K + 8, generator=gen).to(dtype)
    A = fake(base[1 : 1 + M * K].view(M, K))  # misaligned: copied before the launch
    b = fake(torch.randn(N, generator=gen).to(dtype)) if bias else None

    out = kbit_cute.gemm(A, w, b)
    assert out.shape == (M, N) and out.get_device() == 7
    (args,) = calls  # one launch (the misaligned first try launched nothing)
    splits = ops.gemv_splits(N, K, 132, M)
    assert splits > 1
    assert args[0] % 16 == 0 and args[0] != A.data_ptr()
    assert args[1:5] == tuple(t.data_ptr() for t in wargs(qw)[:4])
    assert args[5] == (b.data_ptr() if bias else out.data_ptr()) and args[6] == out.data_ptr()
    assert args[9:] == (M, N, K, splits, int(bias), 1234)
    state = ops._split_states[(7, 1234)]
    assert args[7] == state.workspace.data_ptr() and args[8] == state.counters.data_ptr()
    assert state.workspace.numel() >= splits * m_bucket * (N // 64) * 64
    assert state.counters.numel() >= N // 64 and not state.counters.any()
