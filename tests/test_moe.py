"""MoE on the CPU: routing, sorting by expert, combining, KbitMoE forward against a float32
per-token reference, the shared expert as experts, state_dict / safetensors round trips,
dtype conversion and the errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kbit_cute.experts import dequantize_experts, quantize_experts
from kbit_cute.moe import (
    KbitExpertWeights,
    KbitMoE,
    _shared_pieces,
    combine,
    route,
    sort_by_expert,
)

KS = (2, 3, 4, 5)


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def moe_weights(gen, E, H, inter, S=0, gate=True):
    w = {
        "gate_up_proj": rand(gen, E, 2 * inter, H, scale=H**-0.5),
        "down_proj": rand(gen, E, H, inter, scale=inter**-0.5),
        "router_weight": rand(gen, E, H, scale=H**-0.5),
    }
    if S:
        w["shared"] = (rand(gen, S, H), rand(gen, S, H), rand(gen, H, S))
        if gate:
            w["shared_gate"] = rand(gen, 1, H)
    return w


def reference(m: KbitMoE, x: torch.Tensor) -> torch.Tensor:
    """float64, token by token, from the dequantized experts (routed, then the shared
    pieces) and the module's own routing (so both sides use the same experts)."""
    H, E, inter = m.hidden_size, m.num_experts, m.intermediate_size
    x2 = x.reshape(-1, H)
    logits = m.router(x2)
    weights, ids = route(logits[:, :E], m.top_k, m.normalize)
    Wgu = dequantize_experts(m.gate_up.weight, torch.float32)
    Wd = dequantize_experts(m.down.weight, torch.float32)
    xf = x2.float()

    def expert(e, v):
        g, u = (Wgu[e] @ v).split(inter)
        return (Wd[e] @ (F.silu(g) * u)).double()

    out = torch.zeros(x2.shape[0], H, dtype=torch.float64)
    for t in range(x2.shape[0]):
        for s in range(m.top_k):
            out[t] += float(weights[t, s]) * expert(int(ids[t, s]), xf[t])
        g = torch.sigmoid(logits[t, E].float()) if m.shared_gate else 1.0
        for e in range(E, E + m.shared_experts):
            out[t] += float(g) * expert(e, xf[t])
    return out.float().view(x.shape)


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def by_id(weights, ids):
    """A token's slots in expert order (route leaves them unordered)."""
    ids, perm = ids.sort(dim=-1)
    return weights.gather(-1, perm), ids


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("normalize", (True, False))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_route_is_softmax_then_topk(normalize, dtype, gen):
    logits = rand(gen, 2, 7, 16, scale=3).to(dtype)
    weights, ids = route(logits, 4, normalize)
    assert weights.shape == ids.shape == (14, 4)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    probs = torch.softmax(logits.reshape(14, 16).float(), -1)
    ref_w, ref_ids = probs.topk(4, -1)
    if normalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.allclose(weights.sum(-1), torch.ones(14))
    got_w, got_ids = by_id(weights, ids)
    ref_w, ref_ids = by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids)
    assert torch.allclose(got_w, ref_w, rtol=1e-5, atol=0)
    half_w, half_ids = route(logits, 4, normalize, dtype=torch.bfloat16)
    assert half_w.dtype == torch.bfloat16 and torch.equal(half_ids, ids)
    assert torch.allclose(half_w.float(), weights, rtol=2**-8, atol=0)


def test_route_errors():
    with pytest.raises(ValueError, match="top_k must be an int in 1..num_experts=8"):
        route(torch.randn(3, 8), 9)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(3, 8), 0)
    with pytest.raises(TypeError, match="floating point"):
        route(torch.ones(3, 8, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="dtype must be"):
        route(torch.randn(3, 8), 2, dtype=torch.int32)


# (200, 64, 6): 1200 keys, past the topk sort (torch.sort instead).
@pytest.mark.parametrize(
    "T,E,top_k", [(1, 512, 10), (5, 64, 6), (64, 8, 2), (37, 16, 16), (200, 64, 6)]
)
@pytest.mark.parametrize("id_dtype", (torch.int64, torch.int32))
def test_sort_by_expert_groups_rows_by_expert(T, E, top_k, id_dtype, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
    ids = ids.to(id_dtype)
    order, offsets = sort_by_expert(ids, E)
    assert order.dtype == torch.int64 and order.shape == (T * top_k,)
    assert offsets.dtype == torch.int32 and offsets.shape == (E + 1,)
    assert offsets[0] == 0 and offsets[-1] == T * top_k and (offsets.diff() >= 0).all()
    assert torch.equal(order.sort().values, torch.arange(T * top_k)), "not a permutation"
    flat = ids.reshape(-1)
    for e in range(E):
        rows = order[offsets[e] : offsets[e + 1]]
        assert (flat[rows] == e).all(), e
        assert rows.numel() == int((flat == e).sum()), e
    if T * top_k < E:
        assert (offsets.diff() == 0).any(), "some experts get no token"
    again = sort_by_expert(ids.clone(), E)
    assert torch.equal(again[0], order) and torch.equal(again[1], offsets)


def test_sort_by_expert_all_tokens_on_one_expert():
    ids = torch.tensor([[5, 0], [5, 2], [5, 0]])
    order, offsets = sort_by_expert(ids, 6)
    assert offsets.tolist() == [0, 2, 2, 3, 3, 3, 6]
    assert sorted(order[:2].tolist()) == [1, 5] and order[2] == 3
    assert sorted((order[3:] // 2).tolist()) == [0, 1, 2]  # the tokens of expert 5


def test_sort_by_expert_errors_and_empty():
    with pytest.raises(TypeError, match="int32 or int64"):
        sort_by_expert(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        sort_by_expert(torch.zeros(2, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"ids must lie in 0..3"):
        sort_by_expert(torch.tensor([[1, 4]]), 4)
    order, offsets = sort_by_expert(torch.zeros(0, 3, dtype=torch.int64), 4)
    assert order.shape == (0,) and offsets.tolist() == [0] * 5


def test_route_and_sort_trace_without_graph_breaks(gen):
    """No host reads or data-dependent shapes: fullgraph tracing fails on any of them."""

    def step(logits):
        weights, ids = route(logits, 3)
        order, offsets = sort_by_expert(ids, 12)
        return weights, order, offsets

    logits = rand(gen, 9, 12)
    got = torch.compile(step, fullgraph=True, backend="eager")(logits)
    for a, b in zip(got, step(logits), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_add", (False, True))
def test_combine_weights_unsorts_and_sums(dtype, tol, with_add, gen):
    T, top_k, N = 6, 3, 8
    ids = torch.stack([torch.randperm(10, generator=gen)[:top_k] for _ in range(T)])
    weights = torch.rand(T, top_k, generator=gen)
    order, _ = sort_by_expert(ids, 10)
    per_pair = rand(gen, T * top_k, N).to(dtype)  # the output of (token, slot) pair p
    y = per_pair[order]  # what the grouped kernel returns: sorted rows
    add = rand(gen, T, N).to(dtype) if with_add else None
    got = combine(y, weights, order, add)
    w = weights.to(dtype).float()  # combine uses the weights in y's dtype
    ref = (per_pair.float().view(T, top_k, N) * w[..., None]).sum(1)
    if with_add:
        ref += add.float()
    assert got.dtype == dtype and got.shape == (T, N)
    assert torch.allclose(got.float(), ref, rtol=tol, atol=tol)


def test_combine_errors():
    y, w, order = torch.zeros(6, 4), torch.ones(3, 2), torch.arange(6)
    with pytest.raises(ValueError, match=r"combine takes y \[T \* slots, N\]"):
        combine(y[:5], w, order)
    with pytest.raises(ValueError, match="combine takes"):
        combine(y, w, order[:4])
    with pytest.raises(ValueError, match="combine takes"):
        combine(y, w.view(-1), order)


# --------------------------------------------------------------------------- KbitMoE

SHARED = {  # S (shared intermediate), gate: I = 64 below
    "none": (0, False),
    "gated": (64, True),  # Qwen3-Next: one piece, sigmoid gate
    "two_pieces": (128, False),  # DeepSeek-V2-Lite: two experts' worth, weight 1
    "padded": (96, True),  # 1.5 pieces: the second half zero
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shared", SHARED)
def test_forward_matches_float32_reference(k, shared, gen):
    S, gate = SHARED[shared]
    w = moe_weights(gen, E=12, H=64, inter=64, S=S, gate=gate)
    m = KbitMoE.from_experts(**w, top_k=3, k=k)
    assert m.shared_experts == -(-S // 64) and m.shared_gate == gate
    for shape in ((2, 5, 64), (1, 64)):  # T = 1 takes the row copy, not the gather
        x = rand(gen, *shape)
        got = m(x)
        assert got.shape == x.shape and got.dtype == torch.float32
        assert rel_err(got, reference(m, x)) < 1e-5, shape


@pytest.mark.parametrize("shared", ("gated", "two_pieces"))
def test_shared_expert_by_gemm_past_the_fused_token_count(shared, gen):
    """More tokens than fuse_shared_max_tokens: the shared pieces go through kbit_cute.gemm;
    the same result as in the grouped ops."""
    S, gate = SHARED[shared]
    m = KbitMoE.from_experts(**moe_weights(gen, E=8, H=64, inter=64, S=S, gate=gate), top_k=2)
    x = rand(gen, 9, 64)
    fused = m(x)
    m.fuse_shared_max_tokens = 8
    split = m(x)
    assert rel_err(split, fused) < 1e-6
    assert rel_err(split, reference(m, x)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("normalize", (True, False))
def test_forward_in_half_precision(dtype, tol, normalize, gen):
    w = moe_weights(gen, E=8, H=96, inter=128, S=128)
    w = {n: t.to(dtype) if isinstance(t, torch.Tensor) else tuple(u.to(dtype) for u in t)
         for n, t in w.items()}  # fmt: skip
    m = KbitMoE.from_experts(**w, top_k=2, k=4, normalize=normalize)
    assert m.dtype == dtype and m.router.weight.dtype == dtype
    x = rand(gen, 7, 96).to(dtype)
    got = m(x)
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, reference(m, x)) < tol


@pytest.mark.parametrize("S", (32, 64, 96, 192))
def test_shared_pieces_sum_to_the_mlp(S, gen):
    H, inter = 64, 64
    g, u, d = rand(gen, S, H), rand(gen, S, H), rand(gen, H, S)
    gate_up, down = _shared_pieces(g, u, d, inter, "cpu")
    m = -(-S // inter)
    assert gate_up.shape == (m, 2 * inter, H) and down.shape == (m, H, inter)
    assert down.is_contiguous()
    x = rand(gen, 5, H)
    ref = (F.silu(x @ g.T) * (x @ u.T)) @ d.T
    got = sum(
        (F.silu(x @ gate_up[j, :inter].T) * (x @ gate_up[j, inter:].T)) @ down[j].T
        for j in range(m)
    )
    assert rel_err(got, ref) < 1e-6


def test_from_experts_quantizes_like_quantize_experts(gen):
    w = moe_weights(gen, E=6, H=64, inter=64, S=128)
    m = KbitMoE.from_experts(**w, top_k=2, k=3)
    shared_gu, shared_down = _shared_pieces(*w["shared"], 64, "cpu")
    for mod, W, Ws in ((m.gate_up, w["gate_up_proj"], shared_gu),
                       (m.down, w["down_proj"], shared_down)):  # fmt: skip
        ex, exs = quantize_experts(W, 3), quantize_experts(Ws, 3)
        assert mod.num_experts == 8
        for name in ("packed", "absmax", "scale"):
            assert torch.equal(getattr(mod, name)[:6], getattr(ex, name)), name
            assert torch.equal(getattr(mod, name)[6:], getattr(exs, name)), name
        assert torch.equal(mod.codebook, ex.codebook)
    assert torch.equal(m.router.weight[:6], w["router_weight"])
    assert torch.equal(m.router.weight[6:], w["shared_gate"])
    assert m.gate_up.codebook.data_ptr() != m.down.codebook.data_ptr()
    assert (m.gate_up.N, m.gate_up.K, m.down.N, m.down.K) == (128, 64, 64, 64)


def test_from_experts_takes_a_transformers_style_shared_module(gen):
    w = moe_weights(gen, E=4, H=64, inter=64)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    mlp.down_proj = nn.Linear(32, 64, bias=False)
    gate = nn.Linear(64, 1, bias=False)
    m = KbitMoE.from_experts(**w, top_k=2, shared=mlp, shared_gate=gate)
    assert m.shared_intermediate_size == 32 and m.shared_experts == 1 and m.shared_gate
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    ex = quantize_experts(_shared_pieces(*weights, 64, "cpu")[1])
    assert torch.equal(m.down.packed[4], ex.packed[0])
    assert torch.equal(m.router.weight[4], gate.weight[0].detach())


def test_empty_and_leading_dims(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64, S=64), top_k=2)
    assert m(torch.zeros(0, 64)).shape == (0, 64)
    x = rand(gen, 2, 3, 64)
    assert torch.allclose(m(x), m(x.view(6, 64)).view(2, 3, 64))


@pytest.mark.parametrize("k", KS)
def test_safetensors_round_trip_is_bit_exact(k, gen, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    w = {n: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) else tuple(u.bfloat16() for u in t)
         for n, t in moe_weights(gen, E=5, H=64, inter=64, S=32).items()}  # fmt: skip
    m = KbitMoE.from_experts(**w, top_k=2, k=k)
    path = str(tmp_path / "moe.safetensors")
    st.save_file(m.state_dict(), path)
    fresh = KbitMoE(64, 64, 5, 2, k=k, shared_intermediate_size=32, shared_gate=True,
                    dtype=torch.bfloat16)  # fmt: skip
    x = rand(gen, 3, 64).bfloat16()
    fresh.load_state_dict(st.load_file(path))
    for name, t in m.state_dict().items():
        u = fresh.state_dict()[name]
        assert t.dtype == u.dtype and torch.equal(t.view(torch.uint8), u.view(torch.uint8)), name
    assert torch.equal(m(x), fresh(x))


def test_state_dict_keys():
    m = KbitMoE(64, 64, 4, 2, shared_intermediate_size=128, shared_gate=True)
    keys = set(m.state_dict())
    want = {f"{part}.{n}" for part in ("gate_up", "down")
            for n in ("packed", "absmax", "codebook", "scale")}  # fmt: skip
    assert keys == want | {"router.weight"}, "index buffers must stay out of the state_dict"
    assert m.gate_up.packed.shape[0] == 6 and m.gate_up.scale.shape == (6,)
    assert m.router.weight.shape == (5, 64)


def test_old_layout_checkpoint_names_the_fix(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64, S=64), top_k=2)
    sd = m.state_dict()
    sd["shared_expert.gate_proj.packed"] = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="older KbitMoE layout.*from_experts"):
        KbitMoE(64, 64, 4, 2, shared_intermediate_size=64, shared_gate=True,
                dtype=torch.float32).load_state_dict(sd)  # fmt: skip


def test_load_with_another_k_or_expert_count_names_the_fix(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64), top_k=2, k=3)
    with pytest.raises(ValueError, match=r"^gate_up: the checkpoint was quantized with k=3 but"):
        KbitMoE(64, 64, 4, 2, k=5, dtype=torch.float32).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="the checkpoint holds 4 experts but this layer has 6"):
        KbitMoE(64, 64, 6, 2, k=3, dtype=torch.float32).load_state_dict(m.state_dict())


def test_half_and_to_keep_the_format_tensors_float32(gen):
    w = moe_weights(gen, E=4, H=64, inter=64, S=64, gate=False)
    m = KbitMoE.from_experts(**w, top_k=2)
    kept = {n: t.clone() for n, t in m.state_dict().items() if n.endswith(("codebook", "scale"))}
    m.half()
    assert m.dtype == torch.float16 and m.gate_up.dtype == torch.float16
    assert m._shared_ones.dtype == torch.float16 and m._bounds.dtype == torch.int64
    for n, t in kept.items():
        assert m.state_dict()[n].dtype == torch.float32 and torch.equal(m.state_dict()[n], t), n
    m.to(torch.bfloat16)
    x = rand(gen, 2, 64).bfloat16()
    assert m(x).dtype == torch.bfloat16
    assert m.gate_up.weight.dtype == torch.bfloat16 and m.gate_up.codebook.dtype == torch.float32


def test_repr_shows_experts_k_shapes_and_bytes():
    m = KbitMoE(2048, 512, 16, 4, k=3, shared_intermediate_size=512, device="meta")
    r = repr(m)
    parts = ["num_experts=16", "top_k=4", "k=3", "(1 pieces)", "gate_up=[17, 1024, 2048]"]
    parts += ["down=[17, 2048, 512]", "MB", "KbitExpertWeights(num_experts=17, N=1024"]
    for part in parts:
        assert part in r, r
    assert m.nbytes == sum(t.nbytes for t in (*m.parameters(), *m.buffers()))


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: KbitMoE(64, 96, 4, 2), ValueError, "intermediate_size must be .* multiple of 64"),
        (lambda: KbitMoE(48, 64, 4, 2), ValueError, "hidden_size must be .* multiple of 32"),
        (lambda: KbitMoE(64, 64, 4, 5), ValueError, "top_k must be an int in 1..num_experts=4"),
        (lambda: KbitMoE(64, 64, 0, 1), ValueError, "num_experts must be positive"),
        (lambda: KbitMoE(64, 64, 4, 2, k=6), ValueError, "k must be one of"),
        (lambda: KbitMoE(64, 64, 4, 2, dtype=torch.int8), TypeError, "dtype must be"),
        (lambda: KbitMoE(64, 64, 4, 2, shared_gate=True), ValueError, "shared_gate needs a shared"),
        (lambda: KbitExpertWeights(4, 64, 40), ValueError, "multiple of 32"),
    ],
)  # fmt: skip
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_from_experts_errors(gen):
    w = moe_weights(gen, E=4, H=64, inter=64)
    gu, down, router = w["gate_up_proj"], w["down_proj"], w["router_weight"]
    with pytest.raises(ValueError, match=r"gate_up_proj must be a 3-D tensor"):
        KbitMoE.from_experts(gu[0], down, router, top_k=2)
    with pytest.raises(ValueError, match=r"expected gate_up_proj \[E, 2I, H\] and down_proj"):
        KbitMoE.from_experts(gu, down[:, :32], router, top_k=2)
    with pytest.raises(ValueError, match=r"router_weight must be \[E=4, H=64\]"):
        KbitMoE.from_experts(gu, down, router.T, top_k=2)
    with pytest.raises(ValueError, match="multiple of 64"):
        KbitMoE.from_experts(gu[:, :64], down[:, :, :32], router, top_k=2)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        KbitMoE.from_experts(gu.double(), down, router, top_k=2)
    with pytest.raises(ValueError, match=r"shared down_proj must have weight shape \(64, 32\)"):
        KbitMoE.from_experts(gu, down, router, 2, shared=(rand(gen, 32, 64),) * 3)
    with pytest.raises(ValueError, match="has a bias"):
        KbitMoE.from_experts(gu, down, router, 2, shared_gate=nn.Linear(64, 1))
    with pytest.raises(ValueError, match="shared_gate needs a shared expert"):
        KbitMoE.from_experts(gu, down, router, 2, shared_gate=rand(gen, 1, 64))
    with pytest.raises(TypeError, match="gate_proj / up_proj / down_proj"):
        KbitMoE.from_experts(gu, down, router, 2, shared=nn.ReLU())


def test_forward_errors_name_the_fix(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64), top_k=2)
    with pytest.raises(ValueError, match="last dimension must be hidden_size=64"):
        m(torch.randn(2, 32))
    with pytest.raises(TypeError, match="module computes in torch.float32"):
        m(torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="move one"):
        m(torch.randn(2, 64, device="meta"))


@pytest.mark.parametrize("fuse", (32, 0))
def test_forward_traces_without_graph_breaks(fuse, gen):
    """The whole layer (router, sort, grouped ops, shared expert, combine) in one graph."""
    m = KbitMoE.from_experts(**moe_weights(gen, E=8, H=64, inter=64, S=64), top_k=2)
    m.fuse_shared_max_tokens = fuse
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    for T in (5, 7):  # the second T recompiles (dynamic shapes)
        x = rand(gen, T, 64)
        assert torch.equal(compiled(x), m(x))


def test_grouped_ops_overlap_must_be_bool(gen):
    from kbit_cute.grouped_ops import grouped_gemm, moe_gate_up

    ex = quantize_experts(torch.randn(4, 128, 64, generator=gen), 4)
    A = torch.randn(3, 64, generator=gen)
    offsets = torch.tensor([0, 1, 3, 3, 3], dtype=torch.int32)
    assert grouped_gemm(A, ex, offsets, overlap=True).shape == (3, 128)
    for op in (grouped_gemm, moe_gate_up):
        with pytest.raises(TypeError, match="overlap must be a bool"):
            op(A, ex, offsets, overlap=1)


def test_grouped_ops_mirrors_the_kernel_constants():
    """grouped_ops copies kernel constants to keep cutlass out of its import: they must agree."""
    import cutlass

    from kbit_cute import grouped_ops
    from kbit_cute.kernels import grouped_gemv

    assert grouped_ops.ROWS_PER_PASS == grouped_gemv.ROWS_PER_PASS
    assert grouped_ops._DECODE_STAGES == grouped_gemv.DECODE_STAGES
    assert grouped_ops._CTA_COLS == grouped_gemv.COLS_PER_GROUP
    assert grouped_ops._MAX_STREAM_SLOTS == grouped_gemv.MAX_SLOTS
    assert grouped_ops._CLUSTER_SPLITS == grouped_gemv.CLUSTER_SPLITS
    for k in (2, 3, 4):
        for gate_up in (False, True):
            kern = grouped_gemv.GroupedGemvKernel(
                k, cutlass.BFloat16, gate_up, grouped_gemv.DECODE_STAGES, table=True
            )
            assert kern.table and kern.min_ctas_per_sm == grouped_ops._TABLE_CTAS_PER_SM


# (model, T, k) -> (gate_up launch: slots, N = 2 I, K), (stages, table, splits) expected:
# the decode ring for launches of few experts (every k), the table where the layer's gate_up
# experts hold >= 10 MiB (k <= 4), K splits as many as CTAs fit the SMs (2 per SM with the
# table).
GRID_PLANS = {
    ("qwen3-coder-next", 1, 2): ((10, 1024, 2048), (5, False, 4)),
    ("qwen3-coder-next", 1, 4): ((10, 1024, 2048), (5, True, 3)),
    ("glm-4.7-flash", 1, 3): ((4, 3072, 2048), (5, False, 4)),
    ("glm-4.7-flash", 1, 4): ((4, 3072, 2048), (5, True, 2)),
    ("deepseek-v2-lite", 1, 4): ((6, 2816, 2048), (5, True, 2)),
    ("deepseek-v2-lite", 2, 4): ((12, 2816, 2048), (5, True, 1)),  # 35 MB: no prefetch
    ("deepseek-v2-lite", 2, 5): ((12, 2816, 2048), (5, False, 1)),  # few experts: the ring
    ("qwen3-coder-next", 1, 5): ((10, 1024, 2048), (5, False, 4)),
    ("deepseek-v2-lite", 1, 5): ((6, 2816, 2048), (5, False, 2)),  # 3 (not a power of 2): slower
}


@pytest.mark.parametrize("case", GRID_PLANS)
def test_grid_plan_by_launch_size(case):
    from kbit_cute.gemm_dispatch import weight_bytes
    from kbit_cute.grouped_ops import grid_plan

    (slots, N, K), want = GRID_PLANS[case]
    k = case[2]
    groups = N // 2 // 64
    plan = grid_plan(k, True, slots, weight_bytes(N, K, k), groups, K // 64, 132)
    assert plan == want
    # the layer's down launch (half the bytes per expert) agrees on the ring and the table
    down = grid_plan(k, False, slots, weight_bytes(K, N // 2, k), K // 128, N // 2 // 64, 132)
    assert down[:2] == want[:2]
    if case == ("glm-4.7-flash", 1, 4):
        assert down[2] == 4  # 64 items, 24 K tiles: 4 splits of 6 (with the table)


@pytest.mark.parametrize("E", (1, 8, 64, 512))
@pytest.mark.parametrize("R", (1, 5, 8, 9, 40, 160, 640))
def test_stream_slots_bounds_every_routing(R, E):
    """stream_slots bounds the sum over experts of ceil(rows / 8) for random splits of R
    rows over E experts (crowded ones included): the stream kernel's slot table never
    overflows."""
    from kbit_cute.grouped_ops import stream_slots

    gen = torch.Generator().manual_seed(R * 1000 + E)
    for spread in (1, 2, E):  # rows land on up to this many experts
        for _ in range(50):
            experts = torch.randint(min(spread, E), (R,), generator=gen)
            rows = torch.bincount(experts, minlength=E)
            assert int(((rows + 7) // 8).sum()) <= stream_slots(R, E), (R, E, spread)
    busy = min(E, R)  # one crowded expert, every other busy expert with one row
    assert busy - 1 + -(-(R - busy + 1) // 8) <= stream_slots(R, E)


@pytest.mark.parametrize(
    "R, E, N, want",
    [
        (10, 512, 1024, "grid"),  # Qwen3-Coder-Next T = 1: 10 experts, one row each
        (2560, 512, 1024, "stream"),  # T = 256: 5 rows per expert
        (10240, 512, 1024, "gemm"),  # T = 1024: 20 rows per expert
        (1024, 64, 3072, "gemm"),  # GLM-4.7-Flash T = 256: 16 rows per expert
        (1024, 64, 3068, "stream"),  # N % 8 != 0: no 16-byte output rows for the GEMM
    ],
)
def test_choose_kernel_by_rows_per_expert(R, E, N, want):
    """The grouped GEMM takes launches of >= 16 rows per busy expert (their bound), the
    GEMV kernels the rest."""
    from kbit_cute.grouped_ops import _choose_kernel, stream_slots

    assert _choose_kernel(4, stream_slots(R, E), min(E, R), R, N) == want


@pytest.mark.parametrize("arch, want", [("sm_90a", "stream"), ("sm_80", "grid")])
def test_k5_takes_the_stream_kernel_where_it_has_a_table(arch, want, monkeypatch):
    """k = 5's busy launches (Qwen3-Coder-Next T = 4: 40 experts) run the stream kernel
    where its 128 KB pair table serves (sm_90), the grid kernel on sm_80 (shuffles); k = 4
    the stream kernel on both. T = 1 (10 experts) the grid kernel."""
    from kbit_cute import compile as kc
    from kbit_cute.grouped_ops import _choose_kernel, stream_slots

    monkeypatch.setattr(kc, "_arch", arch)
    assert _choose_kernel(5, stream_slots(40, 512), 40, 40, 1024) == want
    assert _choose_kernel(4, stream_slots(40, 512), 40, 40, 1024) == "stream"
    assert _choose_kernel(5, stream_slots(10, 512), 10, 10, 1024) == "grid"


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("inter", [64, 128, 192, 320])
def test_gate_up_source_gathers_gate_and_up_half_tiles(k, inter):
    """The fused gate/up GEMM's sources (``grouped_gemm.gate_up_source``): staged column
    c < 64 of column CTA n is gate column 64 n + c, staged column 64 + c is up column
    I + 64 n + c, for every word and absmax byte (the format's own offset formulas;
    I % 128 = 64 puts the up halves mid-tile)."""
    from kbit_cute.format import tiled_absmax_offset, tiled_word_offset
    from kbit_cute.kernels.grouped_gemm import gate_up_source

    K, N = 192, 2 * inter  # 3 repack k-tiles
    n_tiles128 = -(-N // 128)
    words, absmax = 128 * 2 * k, 128 * 2  # per repack tile: [col][kb][bit], [col][kb]
    for kt64 in range(K // 64):
        for n_cta in range(inter // 64):
            for per_tile, per_col in ((words, 2 * k), (absmax, 2)):
                off = torch.arange(per_tile)
                up = (off >= per_tile // 2).long()
                staged = off // per_col  # staged column 0..127
                gate = 64 * n_cta + staged
                col = torch.where(staged < 64, gate, inter + gate - 64)
                kb = 2 * kt64 + (off % per_col) // (per_col // 2)
                if per_tile == words:
                    want = tiled_word_offset(col, kb, off % k, K, N, k)
                else:
                    want = tiled_absmax_offset(col, kb, K, N)
                got = gate_up_source(kt64, n_cta, n_tiles128, off, per_tile, up)
                assert torch.equal(got, want), (per_tile, kt64, n_cta)
