"""KbitLinear and quantize_model on the CPU: forward against the dense reference, buffers
in the state_dict, safetensors round trips, dtype conversion, and the error messages."""

import pytest
import torch
from torch import nn

import kbit_cute
from kbit_cute.nn import KbitLinear, quantize_model

KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BUFFERS = ("packed", "absmax", "codebook", "scale")


def linear(gen, K, N, bias=True, dtype=torch.float32):
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=gen))
    return lin.to(dtype)


def mlp(gen, dtype=torch.float32):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    m = nn.Sequential(
        nn.Linear(64, 160), nn.GELU(), nn.Linear(160, 96, bias=False), nn.GELU(), nn.Linear(96, 33)
    )
    m.lm_head = nn.Linear(33, 10)
    return m.to(dtype)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_linear_forward_is_dequantize_then_matmul(k, dtype, gen):
    lin = linear(gen, 96, 130, dtype=dtype)
    q = KbitLinear.from_linear(lin, k)
    x = torch.randn(3, 4, 96, generator=gen).to(dtype)
    W = kbit_cute.dequantize(q.weight, dtype)
    expect = torch.nn.functional.linear(x, W, lin.bias)
    got = q(x)
    assert got.dtype == dtype and got.shape == (3, 4, 130)
    assert torch.equal(got, expect)
    assert q.k == k and q.in_features == 96 and q.out_features == 130 and q.dtype == dtype
    assert all(isinstance(getattr(q, n), torch.Tensor) for n in BUFFERS)
    assert dict(q.named_buffers()).keys() == set(BUFFERS)
    assert torch.equal(q.bias, lin.bias) and q.bias.data_ptr() != lin.bias.data_ptr()


def test_quantize_model_replaces_linears_and_reports_bytes(gen, capsys):
    m = mlp(gen)
    x = torch.randn(5, 64, generator=gen)
    ref = m(x)
    out = quantize_model(m, k=4, progress=False)
    assert out is m
    kinds = [type(mod).__name__ for mod in (m[0], m[2], m[4], m.lm_head)]
    assert kinds == ["KbitLinear", "KbitLinear", "KbitLinear", "Linear"]
    printed = capsys.readouterr().out
    assert "3 nn.Linear -> KbitLinear(k=4)" in printed and " KB -> " in printed, printed
    rel = ((m(x) - ref).norm() / ref.norm()).item()
    assert rel < 0.2, rel


def test_quantize_model_skip_patterns_and_unfit_layers(gen, capsys):
    m = mlp(gen)
    m.odd = nn.Linear(40, 8)  # in_features not a multiple of 32: stays nn.Linear
    quantize_model(m, k=3, skip=("lm_head", "2"), progress=False)
    assert isinstance(m[0], KbitLinear) and isinstance(m[4], KbitLinear)
    assert type(m[2]) is nn.Linear and type(m.lm_head) is nn.Linear and type(m.odd) is nn.Linear
    assert "kept 1 nn.Linear" in capsys.readouterr().out
    m2 = quantize_model(mlp(gen), k=2, skip=("*.lm_*", "lm_head"), progress=True)
    assert type(m2.lm_head) is nn.Linear


def test_repr_shows_k_shape_and_bytes(gen):
    q = KbitLinear.from_linear(linear(gen, 4096, 1024, dtype=torch.float16), k=3)
    r = repr(q)
    for part in ("in_features=4096", "out_features=1024", "k=3", "bias=True", "MB"):
        assert part in r, r
    assert q.nbytes == 4 * q.packed.numel() + q.absmax.numel() + 4 * 8 + 4 + 2 * 1024


@pytest.mark.parametrize("k", KS)
def test_safetensors_round_trip_is_bit_exact(k, gen, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    m = quantize_model(mlp(gen, torch.bfloat16), k=k, progress=False)
    path = tmp_path / "model.safetensors"
    safetensors.save_file(m.state_dict(), str(path))
    fresh = quantize_model(
        mlp(torch.Generator().manual_seed(1), torch.bfloat16), k=k, progress=False
    )
    fresh.load_state_dict(safetensors.load_file(str(path)))
    for name, t in m.state_dict().items():
        u = fresh.state_dict()[name]
        assert t.dtype == u.dtype and torch.equal(t.view(torch.uint8), u.view(torch.uint8)), name
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(m(x), fresh(x))


def test_state_dict_round_trip_into_a_fresh_module(gen):
    q = KbitLinear.from_linear(linear(gen, 64, 48), k=5)
    empty = KbitLinear(64, 48, k=5, dtype=torch.float32)
    x = torch.randn(3, 64, generator=gen)
    assert not torch.equal(empty(x), q(x))
    empty.load_state_dict(q.state_dict())
    assert torch.equal(empty(x), q(x))


def test_load_with_another_k_names_the_fix(gen):
    q = KbitLinear.from_linear(linear(gen, 64, 48), k=3)
    wrong = KbitLinear(64, 48, k=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"quantized with k=3 but this layer has k=4.*k=3"):
        wrong.load_state_dict(q.state_dict())
    model = nn.Sequential(KbitLinear(64, 48, k=2, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"^0: the checkpoint was quantized with k=3"):
        model.load_state_dict({f"0.{n}": t for n, t in q.state_dict().items()})


def test_half_and_to_keep_the_format_tensors_float32(gen):
    q = KbitLinear.from_linear(linear(gen, 64, 48), k=4)
    cb, scale = q.codebook.clone(), q.scale.clone()
    q.half()
    assert q.codebook.dtype == torch.float32 and torch.equal(q.codebook, cb)
    assert q.scale.dtype == torch.float32 and torch.equal(q.scale, scale)
    assert q.bias.dtype == torch.float16 and q.dtype == torch.float16
    q.to(torch.bfloat16)
    assert q.dtype == torch.bfloat16 and torch.equal(q.codebook, cb)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    assert q(x).dtype == torch.bfloat16
    nobias = KbitLinear.from_linear(linear(gen, 64, 48, bias=False), k=4).half()
    assert nobias.dtype == torch.float16 and nobias.codebook.dtype == torch.float32


def test_weight_property_is_a_view_of_the_buffers(gen):
    q = KbitLinear.from_linear(linear(gen, 64, 48), k=2)
    w = q.weight
    assert w.packed is q.packed and (w.k, w.N, w.K) == (2, 48, 64)
    assert w.device == q.packed.device


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: KbitLinear(40, 8), ValueError, "multiple of 32.*keep such a layer as nn.Linear"),
        (lambda: KbitLinear(64, 8, k=6), ValueError, "k must be one of"),
        (lambda: KbitLinear(64, 8, dtype=torch.int32), TypeError, "dtype must be"),
        (lambda: KbitLinear(64, 8, k=2, codebook=torch.zeros(8)), ValueError, "4 entries"),
        (lambda: KbitLinear.from_linear(nn.Conv1d(3, 3, 1)), TypeError, "nn.Linear"),
    ],
)
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_forward_errors_name_the_fix(gen):
    q = KbitLinear.from_linear(linear(gen, 64, 48, dtype=torch.float16), k=4)
    with pytest.raises(ValueError, match="last dimension must be the weight's K=64"):
        q(torch.randn(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must be a torch.float32"):
        q(torch.randn(2, 64))
    with pytest.raises(ValueError, match="move one"):
        q(torch.randn(2, 64, dtype=torch.float16, device="meta"))
