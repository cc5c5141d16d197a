"""Stacked experts on the CPU: quantize_experts / dequantize_experts against per-expert
kbit_cute.quantize / dequantize (bit-identical), the KbitWeight views, and the errors."""

import pytest
import torch

import kbit_cute
from kbit_cute import experts as experts_mod
from kbit_cute.experts import KbitExperts, check_experts, dequantize_experts, quantize_experts

KS = (2, 3, 4, 5)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def stacked(gen, E, N, K, dtype=torch.float32):
    """Experts of very different magnitudes (so their tensor scales differ), one all zero."""
    mags = torch.logspace(-4, 3, E, dtype=torch.float64)[torch.randperm(E, generator=gen)]
    W = torch.randn(E, N, K, generator=gen) * mags.view(-1, 1, 1).float()
    W[E // 2] = 0
    return W.to(dtype)


def assert_same_as_per_expert(ex, W, k, codebook=None):
    assert (ex.E, ex.N, ex.K, ex.k, ex.dtype) == (*W.shape, k, W.dtype)
    for e in range(W.shape[0]):
        qw = kbit_cute.quantize(W[e], k, codebook)
        assert torch.equal(ex.packed[e], qw.packed), e
        assert torch.equal(ex.absmax[e], qw.absmax), e
        assert torch.equal(ex.scale[e : e + 1], qw.scale), e
        assert torch.equal(ex.codebook, qw.codebook)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_experts_is_per_expert_quantize(k, dtype, gen):
    W = stacked(gen, 5, 130, 96, dtype)  # ragged N and K: padded tiles
    ex = quantize_experts(W, k)
    assert ex.packed.dtype == torch.int32 and ex.absmax.dtype == torch.uint8
    assert ex.scale.shape == (5,) and ex.scale.dtype == torch.float32
    assert_same_as_per_expert(ex, W, k)
    assert len(set(ex.scale.tolist())) >= 4, "the experts' tensor scales should differ"


def test_quantize_experts_in_small_groups_is_unchanged(gen, monkeypatch):
    """The float32 temporaries are bounded by quantizing a few experts at a time."""
    W = stacked(gen, 7, 256, 128, torch.bfloat16)
    whole = quantize_experts(W, 3)
    monkeypatch.setattr(experts_mod, "_CHUNK_ELEMS", 2 * 256 * 128 + 1)  # 2 experts a group
    grouped = quantize_experts(W, 3)
    for name in ("packed", "absmax", "scale", "codebook"):
        assert torch.equal(getattr(grouped, name), getattr(whole, name)), name
    assert_same_as_per_expert(grouped, W, 3)


def test_quantize_experts_takes_strided_stacks(gen):
    W = stacked(gen, 4, 64, 96, torch.float16)
    Wt = W.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major experts
    for got in (quantize_experts(Wt, 4), quantize_experts(W[::2], 4)):
        ref = quantize_experts(W if got.E == 4 else W[::2].contiguous(), 4)
        for name in ("packed", "absmax", "scale"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_quantize_experts_custom_codebook(gen):
    cb = torch.linspace(-1, 1, 8) ** 3
    W = stacked(gen, 3, 64, 64)
    ex = quantize_experts(W, 3, codebook=cb)
    assert torch.equal(ex.codebook, cb)
    assert_same_as_per_expert(ex, W, 3, cb)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", (None, torch.float32, torch.float16))
def test_dequantize_experts_is_per_expert_dequantize(k, dtype, gen):
    W = stacked(gen, 4, 200, 160, torch.bfloat16)
    ex = quantize_experts(W, k)
    D = dequantize_experts(ex, dtype)
    assert D.shape == (4, 200, 160) and D.dtype == (dtype or torch.bfloat16)
    for e in range(4):
        assert torch.equal(D[e], kbit_cute.dequantize(ex.expert(e), dtype)), e
    rel = (D.float() - W.float()).norm(dim=(1, 2)) / W.float().norm(dim=(1, 2)).clamp_min(1e-30)
    bound = {2: 0.45, 3: 0.2, 4: 0.1, 5: 0.06}[k]  # the format's round-trip error (README)
    assert (rel < bound).all(), rel
    assert not D[2].any(), "the all-zero expert must stay zero"


def test_expert_is_a_view_and_sizes(gen):
    ex = quantize_experts(stacked(gen, 3, 300, 192), 4)
    words, blocks = kbit_cute.ops.tiled_sizes(4, 300, 192)
    assert ex.packed.shape == (3, words) and ex.absmax.shape == (3, blocks)
    assert ex.nbytes_per_expert == 4 * words + blocks and ex.nbytes == 3 * ex.nbytes_per_expert
    w = ex.expert(1)
    assert isinstance(w, kbit_cute.KbitWeight) and (w.k, w.N, w.K) == (4, 300, 192)
    assert w.packed.data_ptr() == ex.packed[1].data_ptr()
    assert w.absmax.data_ptr() == ex.absmax[1].data_ptr()
    assert w.scale.shape == (1,) and w.scale.data_ptr() == ex.scale[1:].data_ptr()
    last = ex.expert(-1)
    assert last.scale.shape == (1,) and torch.equal(last.packed, ex.packed[2])
    assert ex.device == torch.device("cpu")
    moved = ex.to("meta")
    assert moved.packed.is_meta and moved.scale.is_meta and moved.E == 3 and moved.N == 300
    with pytest.raises(IndexError, match="expert index 3 out of range for 3 experts"):
        ex.expert(3)
    with pytest.raises(TypeError, match="must be an int"):
        ex.expert(1.0)


def test_check_experts_names_the_bad_tensor(gen):
    ex = quantize_experts(stacked(gen, 2, 64, 64), 2)
    args = (ex.packed, ex.absmax, ex.codebook, ex.scale)
    assert check_experts(*args, 2, 64, 64) == 2
    with pytest.raises(ValueError, match=r"codebook .* \(was it quantized with k=3\?\)"):
        check_experts(*args, 3, 64, 64)
    with pytest.raises(ValueError, match="scale of k=2 experts"):
        check_experts(ex.packed, ex.absmax, ex.codebook, ex.scale[:1], 2, 64, 64)
    with pytest.raises(ValueError, match="absmax of k=2 experts"):
        check_experts(ex.packed, ex.absmax.float(), ex.codebook, ex.scale, 2, 64, 64)
    with pytest.raises(ValueError, match="packed of k=2 experts"):
        check_experts(ex.packed[:, ::2], ex.absmax, ex.codebook, ex.scale, 2, 64, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        check_experts(*args, 2, 64, 48)
    with pytest.raises(TypeError, match="scale must be a torch.Tensor"):
        check_experts(ex.packed, ex.absmax, ex.codebook, 1.0, 2, 64, 64)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: quantize_experts(torch.randn(64, 64)), ValueError, r"3-D \[E, N, K\]"),
        (lambda: quantize_experts(torch.randn(2, 8, 48)), ValueError, "multiple of 32"),
        (lambda: quantize_experts(torch.randn(0, 8, 64)), ValueError, "E, N > 0"),
        (lambda: quantize_experts(torch.ones(2, 8, 64, dtype=torch.int32)), TypeError, "float"),
        (lambda: quantize_experts(torch.randn(2, 8, 64).double()), TypeError, "float64"),
        (lambda: quantize_experts(torch.randn(2, 8, 64), k=6), ValueError, "k must be one of"),
        (lambda: quantize_experts([[[1.0]]]), TypeError, "torch.Tensor"),
        (lambda: quantize_experts(torch.randn(2, 8, 64), 2, torch.zeros(8)), ValueError, "4 ent"),
        (lambda: dequantize_experts(torch.randn(2, 8, 64)), TypeError, "KbitExperts"),
    ],
)
def test_bad_input_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_non_finite_weight_names_expert_and_row(gen, monkeypatch):
    W = torch.randn(6, 16, 64, generator=gen)
    W[4, 11, 5] = float("nan")
    with pytest.raises(ValueError, match="expert 4, row 11"):
        quantize_experts(W)
    monkeypatch.setattr(experts_mod, "_CHUNK_ELEMS", 3 * 16 * 64)  # the bad one in group 2
    W[4, 11, 5] = float("inf")
    with pytest.raises(ValueError, match="expert 4, row 11"):
        quantize_experts(W)


def test_dequantize_experts_rejects_inconsistent_tensors(gen):
    ex = quantize_experts(stacked(gen, 2, 64, 64), 4)
    bad = KbitExperts(ex.packed, ex.absmax, ex.codebook, ex.scale, 5, 64, 64, ex.dtype)
    with pytest.raises(ValueError, match="was it quantized with k=5"):
        dequantize_experts(bad)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        dequantize_experts(ex, torch.float64)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_takes_non_contiguous_weights(k, dtype, gen):
    """kbit_cute.quantize(W.T) and of a strided slice: the same words as of a contiguous copy."""
    W = torch.randn(96, 128, generator=gen).to(dtype)
    for view in (W.T, W[:, ::2].T, W[::2]):
        assert not view.is_contiguous()
        got, ref = kbit_cute.quantize(view, k), kbit_cute.quantize(view.contiguous(), k)
        for name in ("packed", "absmax", "scale"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        assert (got.N, got.K) == tuple(view.shape)
