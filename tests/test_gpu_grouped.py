"""Grouped expert kernels (grouped_gemm, moe_gate_up) and KbitMoE on the GPU against a
per-expert float32 reference of the dequantized weights; CUDA graphs replayed with new
routings."""

import os

import pytest
import torch
import torch.nn.functional as F

import kbit_cute
from kbit_cute.experts import dequantize_experts, quantize_experts
from kbit_cute.grouped_ops import _DECODE_STAGES as DECODE_STAGES
from kbit_cute.grouped_ops import _grouped, grouped_gemm, moe_gate_up
from kbit_cute.moe import KbitMoE, route, sort_by_expert

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16)
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # test_gpu_gemv's, for grouped_gemm
# moe_gate_up rounds SiLU(g) * u, a product of two matmuls; the whole layer chains three
# rounded results (gate/up, down, shared expert) and the output.
GATE_UP_TOL = {d: 2 * t for d, t in TOL.items()}
MOE_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (E, top_k, H, I): small shapes with the real expert counts, and Qwen3-Coder-Next itself.
CONFIGS = {"e512": (512, 10, 256, 128), "e64": (64, 6, 256, 128)}
QWEN3_CODER_NEXT = (512, 10, 2048, 512)


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


class _Bank:
    """Quantized (gate_up [E, 2I, H], down [E, H, I]) experts per (E, H, I, k), made on first
    use from fresh random data each session; small ones also keep their dense fp32 copies."""

    def __init__(self):
        seed = int.from_bytes(os.urandom(4), "little")
        print(f"experts seed={seed}")
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cache = {}

    def randn(self, *shape):
        w = torch.randn(*shape, device="cuda", generator=self.gen, dtype=torch.bfloat16)
        return w.mul_(shape[-1] ** -0.5)

    def __call__(self, E, H, inter, k):
        key = (E, H, inter, k)
        if key not in self.cache:
            gu = quantize_experts(self.randn(E, 2 * inter, H), k)
            down = quantize_experts(self.randn(E, H, inter), k)
            dense = None
            if E * inter * H <= 1 << 25:
                dense = tuple(dequantize_experts(ex, torch.float32) for ex in (gu, down))
            self.cache[key] = (gu, down, dense)
        return self.cache[key]


@pytest.fixture(params=("stream", "grid", "grid-table", "gemm"))
def kernel(request, monkeypatch):
    """Every launch on GroupedStreamKernel (where its slot table holds the launch), on
    GroupedGemvKernel or on GroupedGemmKernel, whatever the dispatch would pick for these
    small experts; the grid kernel's decode launches with register lookups or (k <= 4) the
    shared-memory table."""
    grid_table = request.param == "grid-table"
    monkeypatch.setattr(kbit_cute.grouped_ops, "_KERNEL_OVERRIDE", request.param.split("-")[0])
    monkeypatch.setattr(kbit_cute.grouped_ops, "_GRID_TABLE", grid_table)
    return request.param


@pytest.fixture(scope="module")
def bank():
    b = _Bank()
    yield b
    b.cache.clear()


def make_ids(T, E, top_k, kind, gen):
    """[T, top_k] distinct experts per token. random: top-k of uniform scores; hot: expert
    E-1 for every token (T rows, the bound) plus experts from the first 2 top_k (most experts
    get no token); one: top_k = 1, every token on expert E-1 (the only busy expert)."""
    if kind == "random":
        return torch.rand(T, E, generator=gen).topk(top_k, dim=1).indices
    if kind == "one":
        return torch.full((T, 1), E - 1, dtype=torch.int64)
    rest = torch.rand(T, 2 * top_k, generator=gen).topk(top_k - 1, dim=1).indices
    return torch.cat([torch.full((T, 1), E - 1, dtype=torch.int64), rest], dim=1)


def reference(A, ex, offsets, gate_up, dense=None):
    """float32 out [R, N or N/2], expert by expert from the dequantized weights."""
    bounds = offsets.tolist()
    out = torch.zeros(A.shape[0], ex.N // 2 if gate_up else ex.N, device=A.device)
    for e in range(ex.E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            W = dense[e] if dense is not None else kbit_cute.dequantize(ex.expert(e), torch.float32)
            y = A[lo:hi].float() @ W.T
            if gate_up:
                g, u = y.chunk(2, dim=-1)
                y = F.silu(g) * u
            out[lo:hi] = y
    return out


def check_both_ops(E, top_k, H, inter, k, T, dtype, kind, gen, bank, bound="T"):
    """moe_gate_up on tokens gathered in expert order, grouped_gemm on [R, I] rows, both into
    NaN-poisoned outputs, against the reference."""
    gu, down, dense = bank(E, H, inter, k)
    ids = make_ids(T, E, top_k, kind, gen)
    order, offsets = sort_by_expert(ids.cuda(), E)
    order_cpu, offsets_cpu = sort_by_expert(ids, E)
    # The same grouping as on the CPU (the order within an expert may differ).
    flat = ids.reshape(-1)
    assert torch.equal(offsets.cpu(), offsets_cpu)
    assert torch.equal(flat[order.cpu()], flat[order_cpu])
    assert torch.equal(order.sort().values.cpu(), torch.arange(flat.numel()))
    max_rows = {"T": T, "none": None, "2T": 2 * T}[bound]
    R = ids.numel()
    x = torch.randn(T, H, generator=gen).to("cuda", dtype)
    A_gu = x[order // ids.shape[1]]
    A_down = torch.randn(R, inter, generator=gen).to("cuda", dtype)
    for op, A, ex, gate_up, tol in (
        (moe_gate_up, A_gu, gu, True, GATE_UP_TOL[dtype]),
        (grouped_gemm, A_down, down, False, TOL[dtype]),
    ):
        out = torch.full((R, ex.N // 2 if gate_up else ex.N), float("nan"), device="cuda",
                         dtype=dtype)  # fmt: skip
        got = op(A, ex, offsets, out=out, max_rows_per_expert=max_rows)
        assert got.data_ptr() == out.data_ptr()
        assert not torch.isnan(out).any(), f"{op.__name__}: an output element was not written"
        d = None if dense is None else dense[0 if gate_up else 1]
        err = rel_err(out, reference(A, ex, offsets, gate_up, d))
        assert err < tol, (op.__name__, err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("T", (1, 4, 16, 64, 512))
@pytest.mark.parametrize("config", ("e512", "e64"))
def test_grouped_ops_match_reference(config, T, k, dtype, gen, bank, kernel):
    check_both_ops(*CONFIGS[config], k, T, dtype, "random", gen, bank)


@pytest.mark.parametrize("kind", ("hot", "one"))
@pytest.mark.parametrize("k", (3, 4))
@pytest.mark.parametrize("T", (4, 512))
def test_hot_expert_and_idle_experts(T, k, kind, gen, bank, kernel):
    E, top_k, H, inter = CONFIGS["e512"]
    check_both_ops(E, 1 if kind == "one" else top_k, H, inter, k, T, torch.bfloat16, kind,
                   gen, bank)  # fmt: skip


@pytest.mark.parametrize("bound", ("none", "T", "2T"))
@pytest.mark.parametrize("T", (4, 64))
def test_max_rows_per_expert_given_or_not(T, bound, gen, bank, kernel):
    check_both_ops(*CONFIGS["e64"], 4, T, torch.float16, "hot", gen, bank, bound=bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (2, 5))
def test_gate_up_width_of_odd_half_tiles(k, dtype, gen, bank, kernel):
    """I = 192 (three half tiles, 1.5 repack tiles): the up columns start in the middle of a
    repack tile (the grouped GEMM gathers gate and up half tiles of other positions)."""
    check_both_ops(64, 6, 256, 192, k, 64, dtype, "random", gen, bank)


QWEN_CASES = [(T, 4, d) for T in (1, 4, 16, 64) for d in DTYPES]
QWEN_CASES += [(16, k, torch.bfloat16) for k in (2, 3, 5)]


@pytest.mark.parametrize("T,k,dtype", QWEN_CASES)
def test_qwen3_coder_next_shape(T, k, dtype, gen, bank):
    check_both_ops(*QWEN3_CODER_NEXT, k, T, dtype, "random", gen, bank)


def test_no_rows(bank):
    E, top_k, H, inter = CONFIGS["e64"]
    gu, down, _ = bank(E, H, inter, 4)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    h = moe_gate_up(torch.empty(0, H, device="cuda", dtype=torch.float16), gu, offsets)
    y = grouped_gemm(h, down, offsets)
    assert h.shape == (0, inter) and y.shape == (0, H)


# --------------------------------------------------------------------------- KbitMoE


def build_moe(E, top_k, H, inter, k, dtype, gen, shared=256, gate=True, normalize=True):
    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to("cuda", dtype)

    return KbitMoE.from_experts(
        randn(E, 2 * inter, H), randn(E, H, inter), randn(E, H), top_k, k, normalize,
        shared=(randn(shared, H), randn(shared, H), randn(H, shared)) if shared else None,
        shared_gate=randn(1, H) if shared and gate else None,
    )  # fmt: skip


def moe_reference(m, x):
    """float32: each expert's tokens through its dequantized weights, weighted, plus the
    shared expert's pieces (experts E.., weight sigmoid(gate) or 1); routing from the
    module's own router (the same logits as its forward)."""
    E = m.num_experts
    x2 = x.reshape(-1, m.hidden_size)
    logits = m.router(x2)
    weights, ids = route(logits[:, :E], m.top_k, m.normalize)
    Wgu = dequantize_experts(m.gate_up.weight, torch.float32)
    Wd = dequantize_experts(m.down.weight, torch.float32)
    xf = x2.float()

    def expert(e, rows):
        g, u = (rows @ Wgu[e].T).chunk(2, dim=-1)
        return (F.silu(g) * u) @ Wd[e].T

    out = torch.zeros_like(xf)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, expert(e, xf[tok]) * weights[tok, slot].unsqueeze(1))
    gate = torch.sigmoid(logits[:, E:].float()) if m.shared_gate else 1.0
    for e in range(E, E + m.shared_experts):
        out += expert(e, xf) * gate
    return out.view(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("T", (1, 16, 64))  # 64 > fuse_shared_max_tokens: shared by gemm
def test_kbit_moe_forward_matches_reference(T, k, dtype, gen):
    m = build_moe(*CONFIGS["e64"], k, dtype, gen)
    x = torch.randn(T, 256, generator=gen).to("cuda", dtype)
    got = m(x)
    assert got.shape == x.shape and got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, moe_reference(m, x)) < MOE_TOL[dtype]


@pytest.mark.parametrize("config", ("e64", "e512"))
def test_kbit_moe_cuda_graph_replays_new_routings(config, gen):
    """One captured forward replayed with new tokens and a new router copied into its static
    inputs: each replay matches the eager forward and the reference. The eager forward also
    runs under sync debug mode "error": no host synchronization."""
    E, top_k, H, inter = CONFIGS[config]
    T, dtype = 16, torch.bfloat16
    m = build_moe(E, top_k, H, inter, 4, dtype, gen)
    router = m.router.weight  # [E + 1, H]: the last row is the shared expert's gate
    hot = router.detach().clone()
    hot[:E] = 0
    hot[E - top_k : E] = 0.1  # with positive tokens, every token picks the last top_k experts
    cases = [  # (tokens, router weight)
        (torch.randn(T, H, generator=gen), router.detach().clone()),
        (torch.randn(T, H, generator=gen), router.detach().clone()),
        (torch.rand(T, H, generator=gen) + 0.5, hot),
        (torch.randn(T, H, generator=gen), router.detach().clone()),
    ]
    x = cases[0][0].to("cuda", dtype)
    m(x)  # warm-up: compile and load the kernels, allocate the workspaces
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = m(x)
    used = []
    for tokens, weight in cases:
        x.copy_(tokens.to(dtype))
        with torch.no_grad():
            router.copy_(weight)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        used.append(frozenset(route(m.router(x)[:, :E], top_k)[1].unique().tolist()))
        # Not torch.equal: cuBLAS may pick another router kernel under capture.
        assert rel_err(y, m(x).float()) < 1e-3, "a replay differs from the eager forward"
        assert rel_err(y, moe_reference(m, x)) < MOE_TOL[dtype]
    assert used[2] == frozenset(range(E - top_k, E)) and len(set(used)) >= 3


def captured(step) -> torch.cuda.CUDAGraph:
    """``step`` once eagerly (compile, load, allocate the workspaces), then captured."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_grouped_ops_cuda_graph_replays_new_offsets(gen, bank, kernel):
    """moe_gate_up and grouped_gemm captured once, replayed with new rows and offsets."""
    E, top_k, H, inter = CONFIGS["e512"]
    T, k, dtype = 16, 3, torch.float16
    gu, down, (Wgu, Wd) = bank(E, H, inter, k)
    R = T * top_k
    A_gu = torch.empty(R, H, device="cuda", dtype=dtype)
    A_down = torch.empty(R, inter, device="cuda", dtype=dtype)
    offsets = torch.empty(E + 1, device="cuda", dtype=torch.int32)
    h = torch.empty(R, inter, device="cuda", dtype=dtype)
    y = torch.empty(R, H, device="cuda", dtype=dtype)

    def load(kind):
        A_gu.copy_(torch.randn(R, H, generator=gen))
        A_down.copy_(torch.randn(R, inter, generator=gen))
        offsets.copy_(sort_by_expert(make_ids(T, E, top_k, kind, gen), E)[1])

    def step():
        moe_gate_up(A_gu, gu, offsets, out=h, max_rows_per_expert=T)
        grouped_gemm(A_down, down, offsets, out=y, max_rows_per_expert=T)

    load("random")
    graph = captured(step)
    for kind in ("hot", "random", "hot", "random"):
        load(kind)
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, moe_gate_up(A_gu, gu, offsets, max_rows_per_expert=T)), kind
        assert torch.equal(y, grouped_gemm(A_down, down, offsets, max_rows_per_expert=T)), kind
        assert rel_err(h, reference(A_gu, gu, offsets, True, Wgu)) < GATE_UP_TOL[dtype]
        assert rel_err(y, reference(A_down, down, offsets, False, Wd)) < TOL[dtype]


@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_overlapped_chain_reads_gate_up_output(k, dtype, T, gen, bank, kernel):
    """moe_gate_up -> grouped_gemm with ``overlap``: the down launch starts early (finds its
    experts, prefetches weights) yet reads gate_up's output only once written. Replayed in a
    graph with new rows and routings: the same bits as the eager calls without overlap."""
    E, top_k, H, inter = CONFIGS["e512"]
    gu, down, (Wgu, Wd) = bank(E, H, inter, k)
    R = T * top_k
    A = torch.empty(R, H, device="cuda", dtype=dtype)
    offsets = torch.empty(E + 1, device="cuda", dtype=torch.int32)
    y = torch.empty(R, H, device="cuda", dtype=dtype)

    def load(kind):
        A.copy_(torch.randn(R, H, generator=gen))
        offsets.copy_(sort_by_expert(make_ids(T, E, top_k, kind, gen), E)[1])

    def step():
        h = moe_gate_up(A, gu, offsets, max_rows_per_expert=T, overlap=True)
        grouped_gemm(h, down, offsets, out=y, max_rows_per_expert=T, overlap=True)

    load("random")
    graph = captured(step)
    for kind in ("random", "hot", "random"):
        load(kind)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        h = moe_gate_up(A, gu, offsets, max_rows_per_expert=T)
        assert torch.equal(y, grouped_gemm(h, down, offsets, max_rows_per_expert=T)), kind
        assert rel_err(y, reference(h, down, offsets, False, Wd)) < TOL[dtype]


def decode_launches(k, dtype, gen, bank):
    """(T, gate_up, experts, dense weights, A, offsets, a maker of NaN outputs) of the e64
    experts' gate_up and down launches at T = 1 (random) and 12 (one hot expert: 12 rows,
    two passes), fresh activations each."""
    E, top_k, H, inter = CONFIGS["e64"]
    gu, down, (Wgu, Wd) = bank(E, H, inter, k)
    for T, kind in ((1, "random"), (12, "hot")):
        ids = make_ids(T, E, top_k, kind, gen)
        offsets = sort_by_expert(ids.cuda(), E)[1]
        R = ids.numel()
        for gate_up, ex, W in ((True, gu, Wgu), (False, down, Wd)):
            A = torch.randn(R, ex.K, generator=gen).to("cuda", dtype)
            shape = (R, ex.N // 2 if gate_up else ex.N)
            poisoned = lambda s=shape: torch.full(s, float("nan"), device="cuda", dtype=dtype)  # noqa: E731
            yield T, gate_up, ex, W, A, offsets, poisoned


@pytest.mark.parametrize("table", (False, True))
@pytest.mark.parametrize("splits", kbit_cute.grouped_ops._CLUSTER_SPLITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_cluster_split_sums_match_the_workspace(k, dtype, splits, table, gen, bank, monkeypatch):
    """Decode launches on sm_90 sum their K splits in a cluster (distributed shared memory):
    the same bits as the workspace path, and right against the reference; an expert with
    12 rows (two passes) included; register lookups and the shared-memory table."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("clusters need sm_90")
    if table and k == 5:
        pytest.skip("no table for k = 5")
    monkeypatch.setattr(kbit_cute.grouped_ops, "_GRID_TABLE", table)
    for T, gate_up, ex, W, A, offsets, poisoned in decode_launches(k, dtype, gen, bank):
        outs = []
        for cluster in (True, False):
            out = poisoned()
            _grouped(gate_up, A, ex, offsets, out, T, splits, DECODE_STAGES, cluster=cluster)
            outs.append(out)
        assert not torch.isnan(outs[0]).any(), "an output element was not written"
        assert torch.equal(outs[0], outs[1]), (T, gate_up)
        tol = GATE_UP_TOL[dtype] if gate_up else TOL[dtype]
        assert rel_err(outs[0], reference(A, ex, offsets, gate_up, W)) < tol


@pytest.mark.parametrize("table", (False, True))
@pytest.mark.parametrize("splits", (3, 4))
@pytest.mark.parametrize("k", (2, 4, 5))
def test_workspace_split_counts_match_reference(k, splits, table, gen, bank, monkeypatch):
    """K splits summed through the workspace, any count (3: not a power of two; the split
    rule fills the SMs), decode ring with and without the table; 12 rows on one expert."""
    monkeypatch.setattr(kbit_cute.grouped_ops, "_GRID_TABLE", table)
    dtype = torch.bfloat16
    for T, gate_up, ex, W, A, offsets, poisoned in decode_launches(k, dtype, gen, bank):
        out = poisoned()
        _grouped(gate_up, A, ex, offsets, out, T, splits, DECODE_STAGES, cluster=False)
        assert not torch.isnan(out).any(), "an output element was not written"
        tol = GATE_UP_TOL[dtype] if gate_up else TOL[dtype]
        assert rel_err(out, reference(A, ex, offsets, gate_up, W)) < tol, (T, gate_up)


# One KbitMoE forward at decode, bf16, k = 4: (E, top_k, H, I, shared I, gate, normalize, T)
# and the kernels kbit_cute/moe.py counts for it (its docstring lists them).
KERNEL_CASES = {
    "qwen3-next-T1": ((512, 10, 256, 128, 128, True, True, 1), 14),
    "qwen3-next-T4": ((512, 10, 256, 128, 128, True, True, 4), 15),  # gather, not copy
    "deepseek-v2-T1": ((64, 6, 256, 128, 256, False, False, 1), 14),  # 2 pieces, no gate
    "no-shared-T1": ((64, 4, 256, 128, 0, False, True, 1), 11),
}
KERNEL_SLACK = 1  # cuBLAS may run a GEMM (router, combine) as two kernels


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kbit_moe_decode_kernel_count(case, gen):
    """Under a CUDA graph every kernel costs ~2-3 us however small: the profiler counts what
    one warm forward launches (memsets and copies included) against the budget."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    (E, top_k, H, inter, S, gate, normalize, T), want = KERNEL_CASES[case]
    m = build_moe(E, top_k, H, inter, 4, torch.bfloat16, gen, S, gate, normalize)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        first = m(x)  # compile, plan, allocate workspaces
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = m(x)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    listing = "\n".join(kernels)
    assert len(kernels) <= want + KERNEL_SLACK, f"{len(kernels)} kernels:\n{listing}"
    print(f"{case}: {len(kernels)} kernels (counted {want})\n{listing}")
    assert torch.equal(y, first), "two forwards differ"
