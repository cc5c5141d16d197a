"""MoE on the CPU: routing, sorting by expert, KbitMoE forward against a float32 per-token
reference, state_dict / safetensors round trips, dtype conversion and the errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kbit_cute
from kbit_cute.experts import dequantize_experts, quantize_experts
from kbit_cute.moe import KbitExpertWeights, KbitMoE, combine, route, sort_by_expert

KS = (2, 3, 4, 5)


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def moe_weights(gen, E, H, inter, S=0):
    w = {
        "gate_up_proj": rand(gen, E, 2 * inter, H, scale=H**-0.5),
        "down_proj": rand(gen, E, H, inter, scale=inter**-0.5),
        "router_weight": rand(gen, E, H, scale=H**-0.5),
    }
    if S:
        w["shared"] = (rand(gen, S, H), rand(gen, S, H), rand(gen, H, S))
        w["shared_gate"] = rand(gen, 1, H)
    return w


def reference(m: KbitMoE, x: torch.Tensor) -> torch.Tensor:
    """float32, token by token, slot by slot, from the dequantized experts and the module's
    own routing (so both sides use the same experts)."""
    H = m.hidden_size
    x2 = x.reshape(-1, H)
    weights, ids = route(m.router(x2), m.top_k, m.normalize)
    Wgu = dequantize_experts(m.gate_up.weight, torch.float32)
    Wd = dequantize_experts(m.down.weight, torch.float32)
    inter = m.intermediate_size
    xf = x2.float()
    out = torch.zeros(x2.shape[0], H, dtype=torch.float64)
    for t in range(x2.shape[0]):
        for s in range(m.top_k):
            e = int(ids[t, s])
            g, u = (Wgu[e] @ xf[t]).split(inter)
            out[t] += float(weights[t, s]) * (Wd[e] @ (F.silu(g) * u)).double()
    if m.shared_expert is not None:
        se = m.shared_expert
        W = {n: kbit_cute.dequantize(getattr(se, n).weight, torch.float32) for n in
             ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        shared = (F.silu(xf @ W["gate_proj"].T) * (xf @ W["up_proj"].T)) @ W["down_proj"].T
        if m.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(xf @ m.shared_expert_gate.weight.float().T)
        out += shared.double()
    return out.float().view(x.shape)


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


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
    assert torch.equal(ids, ref_ids)
    if normalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.allclose(weights.sum(-1), torch.ones(14))
    assert torch.allclose(weights, ref_w, rtol=1e-6, atol=0)
    assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_route_errors():
    with pytest.raises(ValueError, match="top_k must be an int in 1..num_experts=8"):
        route(torch.randn(3, 8), 9)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(3, 8), 0)
    with pytest.raises(TypeError, match="floating point"):
        route(torch.ones(3, 8, dtype=torch.int64), 2)


@pytest.mark.parametrize("T,E,top_k", [(1, 512, 10), (5, 64, 6), (64, 8, 2), (37, 16, 16)])
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
        assert (rows.diff() > 0).all(), "rows of one expert must stay in token order"
        assert rows.numel() == int((flat == e).sum()), e
    if T * top_k < E:
        assert (offsets.diff() == 0).any(), "some experts get no token"


def test_sort_by_expert_all_tokens_on_one_expert():
    ids = torch.tensor([[5, 0], [5, 2], [5, 0]])
    order, offsets = sort_by_expert(ids, 6)
    assert offsets.tolist() == [0, 2, 2, 3, 3, 3, 6]
    assert order.tolist() == [1, 5, 3, 0, 2, 4]
    assert (order[3:] // 2).tolist() == [0, 1, 2]  # the tokens of expert 5


def test_sort_by_expert_errors():
    with pytest.raises(TypeError, match="int32 or int64"):
        sort_by_expert(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        sort_by_expert(torch.zeros(2, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"ids must lie in 0..3"):
        sort_by_expert(torch.tensor([[1, 4]]), 4)


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


def test_combine_weights_and_unsorts_rows(gen):
    T, top_k, N = 6, 3, 8
    ids = torch.stack([torch.randperm(10, generator=gen)[:top_k] for _ in range(T)])
    weights = torch.rand(T, top_k, generator=gen)
    order, _ = sort_by_expert(ids, 10)
    per_pair = rand(gen, T * top_k, N)  # the output of (token, slot) pair p
    y = per_pair[order].to(torch.bfloat16)  # what the grouped kernel returns: sorted rows
    got = combine(y, weights, order)
    ref = (per_pair.to(torch.bfloat16).float().view(T, top_k, N) * weights[..., None]).sum(1)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- KbitMoE


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shared", (False, True))
def test_forward_matches_float32_reference(k, shared, gen):
    w = moe_weights(gen, E=12, H=64, inter=64, S=32 if shared else 0)
    m = KbitMoE.from_experts(**w, top_k=3, k=k)
    x = rand(gen, 2, 5, 64)
    got = m(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, reference(m, x)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_forward_in_half_precision(dtype, tol, gen):
    w = {n: t.to(dtype) if isinstance(t, torch.Tensor) else t for n, t in
         moe_weights(gen, E=8, H=96, inter=128).items()}  # fmt: skip
    m = KbitMoE.from_experts(**w, top_k=2, k=4, normalize=False)
    assert m.dtype == dtype and m.router.weight.dtype == dtype
    x = rand(gen, 7, 96).to(dtype)
    got = m(x)
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, reference(m, x)) < tol


def test_from_experts_quantizes_like_quantize_experts(gen):
    w = moe_weights(gen, E=6, H=64, inter=64, S=64)
    m = KbitMoE.from_experts(**w, top_k=2, k=3)
    for mod, W in ((m.gate_up, w["gate_up_proj"]), (m.down, w["down_proj"])):
        ex = quantize_experts(W, 3)
        for name in ("packed", "absmax", "codebook", "scale"):
            assert torch.equal(getattr(mod, name), getattr(ex, name)), name
    assert torch.equal(m.router.weight, w["router_weight"])
    assert m.gate_up.codebook.data_ptr() != m.down.codebook.data_ptr()
    for lin, W in zip(
        (m.shared_expert.gate_proj, m.shared_expert.up_proj, m.shared_expert.down_proj),
        w["shared"],
        strict=True,
    ):
        assert torch.equal(lin.packed, kbit_cute.quantize(W, 3).packed)
    assert torch.equal(m.shared_expert_gate.weight, w["shared_gate"])
    assert (m.gate_up.N, m.gate_up.K, m.down.N, m.down.K) == (128, 64, 64, 64)


def test_from_experts_takes_a_transformers_style_shared_module(gen):
    w = moe_weights(gen, E=4, H=64, inter=64)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    mlp.down_proj = nn.Linear(32, 64, bias=False)
    m = KbitMoE.from_experts(**w, top_k=2, shared=mlp, shared_gate=nn.Linear(64, 1, bias=False))
    assert m.shared_intermediate_size == 32 and m.shared_expert_gate is not None
    assert torch.equal(
        m.shared_expert.down_proj.packed, kbit_cute.quantize(mlp.down_proj.weight).packed
    )


def test_empty_and_leading_dims(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64), top_k=2)
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
    m = KbitMoE(64, 64, 4, 2, shared_intermediate_size=32, shared_gate=True)
    keys = set(m.state_dict())
    for part in ("gate_up", "down"):
        assert {f"{part}.{n}" for n in ("packed", "absmax", "codebook", "scale")} <= keys
    assert {"router.weight", "shared_expert_gate.weight", "shared_expert.up_proj.packed"} <= keys
    assert m.gate_up.packed.shape[0] == 4 and m.gate_up.scale.shape == (4,)


def test_load_with_another_k_or_expert_count_names_the_fix(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64), top_k=2, k=3)
    with pytest.raises(ValueError, match=r"^gate_up: the checkpoint was quantized with k=3 but"):
        KbitMoE(64, 64, 4, 2, k=5, dtype=torch.float32).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="the checkpoint holds 4 experts but this layer has 6"):
        KbitMoE(64, 64, 6, 2, k=3, dtype=torch.float32).load_state_dict(m.state_dict())


def test_half_and_to_keep_the_format_tensors_float32(gen):
    m = KbitMoE.from_experts(**moe_weights(gen, E=4, H=64, inter=64, S=32), top_k=2)
    kept = {n: t.clone() for n, t in m.state_dict().items() if n.endswith(("codebook", "scale"))}
    m.half()
    assert m.dtype == torch.float16 and m.gate_up.dtype == torch.float16
    assert m.shared_expert.gate_proj.dtype == torch.float16
    assert m.shared_expert_gate.weight.dtype == torch.float16
    for n, t in kept.items():
        assert m.state_dict()[n].dtype == torch.float32 and torch.equal(m.state_dict()[n], t), n
    m.to(torch.bfloat16)
    x = rand(gen, 2, 64).bfloat16()
    assert m(x).dtype == torch.bfloat16
    assert m.gate_up.weight.dtype == torch.bfloat16 and m.gate_up.codebook.dtype == torch.float32


def test_repr_shows_experts_k_shapes_and_bytes(gen):
    m = KbitMoE(2048, 512, 16, 4, k=3, shared_intermediate_size=512, device="meta")
    r = repr(m)
    parts = ["num_experts=16", "top_k=4", "k=3", "gate_up=[16, 1024, 2048]"]
    parts += ["down=[16, 2048, 512]", "MB", "KbitExpertWeights(num_experts=16, N=1024"]
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


def test_forward_traces_without_graph_breaks(gen):
    """The whole layer (router, sort, grouped ops, combine, shared expert) in one graph."""
    m = KbitMoE.from_experts(**moe_weights(gen, E=8, H=64, inter=64, S=32), top_k=2)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    for T in (5, 7):  # the second T recompiles (dynamic shapes)
        x = rand(gen, T, 64)
        assert torch.equal(compiled(x), m(x))
