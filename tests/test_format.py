"""The kbit format on the CPU: E4M4, bit planes, quantize, repack, errors."""

import pytest
import torch

import kbit_cute
from kbit_cute import format as fmt
from kbit_cute import ops

KS = (2, 3, 4, 5)


# ----------------------------------------------------------------------------- E4M4


def test_e4m4_every_code_decodes_per_formula():
    for code in range(256):
        e, m = code >> 4, code & 15
        want = 2.0 ** (e - 11) * (1 + m / 16) if e > 0 else 2.0**-10 * (m / 16)
        got = ops.decode_e4m4(torch.tensor([code], dtype=torch.uint8)).item()
        assert got == want, (code, got, want)


def test_e4m4_encode_inverts_decode():
    codes = torch.arange(256, dtype=torch.uint8)
    values = ops.decode_e4m4(codes)
    assert torch.all(values[1:] > values[:-1])  # every code is the unique nearest to its value
    assert torch.equal(ops.encode_e4m4(values), codes)


def test_e4m4_encode_picks_nearest(gen):
    x = torch.rand(10000, generator=gen) * 40 * torch.rand(10000, generator=gen) ** 6
    codes = ops.encode_e4m4(x)
    table = fmt.e4m4_table()
    dist = (table.view(1, -1) - x.clamp(0, 31).view(-1, 1)).abs()
    assert torch.equal(dist.gather(1, codes.long().view(-1, 1)).view(-1), dist.min(1).values)
    assert ops.encode_e4m4(torch.tensor([100.0, -1.0])).tolist() == [255, 0]


# ----------------------------------------------------------------------------- bit planes


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("nb", [1, 3, 113])
def test_pack_unpack_round_trip(k, nb, gen):
    idx = torch.randint(0, 1 << k, (nb, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k)
    assert packed.dtype == torch.int32 and packed.shape == (nb * k,)
    assert torch.equal(fmt.unpack_bitplanes(packed, k), idx)
    # word b*k+i holds bit i of element j in bit j (checked against the seed's extraction loop)
    words = packed.view(nb, k).tolist()
    for b in range(nb):
        for j in (0, 7, 31):
            got = sum(((words[b][i] >> j) & 1) << i for i in range(k))
            assert got == idx[b, j].item()


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("k", KS)
def test_quantize_picks_nearest_codebook_entry(k, gen):
    w = torch.randn(64 * 32, generator=gen)
    cb = kbit_cute.codebook(k)
    packed, absmax = ops.quantize_kbit(w, cb, k)
    idx = fmt.unpack_bitplanes(packed, k).long()
    scale = ops.decode_e4m4(absmax).view(-1, 1)
    normed = w.view(-1, 32) / scale
    dist = (normed.unsqueeze(-1) - cb.view(1, 1, -1)).abs()
    assert torch.equal(dist.gather(2, idx.unsqueeze(-1)).squeeze(-1), dist.min(-1).values)
    assert torch.equal(absmax, ops.encode_e4m4(w.view(-1, 32).abs().amax(1)))


def test_codebook_values():
    for k in KS:
        cb = kbit_cute.codebook(k)
        assert cb.dtype == torch.float32 and cb.numel() == 1 << k
        assert torch.all(cb[1:] > cb[:-1]) and cb.abs().max() == 1.0
        assert torch.allclose(cb, -cb.flip(0))
    assert torch.allclose(
        kbit_cute.codebook(2), torch.tensor([-1.0, -0.27699, 0.27699, 1.0]), atol=1e-4
    )
    # Phi^-1(3/8) / Phi^-1(1/8) = 0.318639 / 1.150349


def test_custom_codebook_unsorted(gen):
    cb = torch.tensor([0.5, -1.0, 1.0, -0.25])  # any 2^k finite values, any order
    W = torch.randn(8, 64, generator=gen)
    qw = kbit_cute.quantize(W, 2, codebook=cb)
    D = kbit_cute.dequantize(qw, torch.float32)
    blockmax = (W.abs().view(8, 2, 32).amax(-1, keepdim=True)).expand(8, 2, 32).reshape(8, 64)
    ratio = D / blockmax
    for v in ratio.flatten().tolist():  # every value is one of cb * (absmax rounding)
        assert min(abs(v - c) for c in cb.tolist()) < 0.07


# Measured relative Frobenius error of dequantize(quantize(W)) on N(0, 1) weights,
# 512 x 4096, NF codebook: k=2 0.425, k=3 0.178, k=4 0.0872, k=5 0.0486. Bounds add ~3%.
ERROR_BOUND = {2: 0.44, 3: 0.184, 4: 0.090, 5: 0.050}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("magnitude", [1.0, 1e-4, 1e3])
def test_round_trip_error(k, magnitude, gen):
    W = torch.randn(512, 1024, generator=gen) * magnitude
    D = kbit_cute.dequantize(kbit_cute.quantize(W, k), torch.float32)
    err = ((D - W).norm() / W.norm()).item()
    assert err < ERROR_BOUND[k], err
    assert err > ERROR_BOUND[k] * 0.8  # the bound is tight: a broken codebook would move it


def test_more_bits_less_error(gen):
    W = torch.randn(256, 512, generator=gen)
    errs = [(kbit_cute.dequantize(kbit_cute.quantize(W, k), torch.float32) - W).norm() for k in KS]
    assert errs[0] > errs[1] > errs[2] > errs[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(1, 32), (3, 96), (113, 160), (1000, 1056), (130, 4097 // 32 * 32)]
)
def test_quantize_any_shape(dtype, shape, gen):
    W = torch.randn(shape, generator=gen).to(dtype)
    qw = kbit_cute.quantize(W, 3)
    assert (qw.N, qw.K, qw.dtype) == (*shape, dtype)
    D = kbit_cute.dequantize(qw)
    assert D.shape == shape and D.dtype == dtype
    # one block can be unlucky: a looser bound than the large-tensor one
    assert ((D.float() - W.float()).norm() / W.float().norm()) < 2 * ERROR_BOUND[3]


def test_zero_weight_is_exact():
    qw = kbit_cute.quantize(torch.zeros(4, 64), 4)
    assert torch.equal(kbit_cute.dequantize(qw), torch.zeros(4, 64))


# ----------------------------------------------------------------------------- repack


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("K,N", [(64, 128), (128, 256), (96, 200), (1056, 1000)])
def test_repack_matches_seed_formula(k, K, N, gen):
    packed = torch.randint(
        -(2**31), 2**31 - 1, (N * K // 32 * k,), generator=gen, dtype=torch.int32
    )
    absmax = torch.randint(0, 256, (N * K // 32,), generator=gen, dtype=torch.uint8)
    tiled, tiled_abs = ops.repack_kbit(packed, absmax, K, N, k)
    Kp, Np = fmt.padded_shape(K, N)
    assert tiled.numel() == Np * Kp // 32 * k and tiled_abs.numel() == Np * Kp // 32
    n, kb, bit = torch.meshgrid(
        torch.arange(N), torch.arange(K // 32), torch.arange(k), indexing="ij"
    )
    off = fmt.tiled_word_offset(n, kb, bit, K, N, k)
    assert torch.equal(tiled[off], packed.view(N, K // 32, k))
    aoff = fmt.tiled_absmax_offset(n[..., 0], kb[..., 0], K, N)
    assert torch.equal(tiled_abs[aoff], absmax.view(N, K // 32))
    # everything else is zero padding
    mask = torch.ones_like(tiled, dtype=torch.bool)
    mask[off.flatten()] = False
    assert not tiled[mask].any()
    back_p, back_a = ops.unrepack_kbit(tiled, tiled_abs, K, N, k)
    assert torch.equal(back_p, packed) and torch.equal(back_a, absmax)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, err, text",
    [
        (lambda: kbit_cute.quantize(torch.randn(4, 64), 1), ValueError, "k must be one of"),
        (lambda: kbit_cute.quantize(torch.randn(4, 64), 6), ValueError, "k must be one of"),
        (lambda: kbit_cute.quantize(torch.randn(4, 64), 4.0), TypeError, "k must be an int"),
        (lambda: kbit_cute.quantize(torch.randn(4, 48), 4), ValueError, "multiple of 32"),
        (lambda: kbit_cute.quantize(torch.randn(64), 4), ValueError, "2-D"),
        (lambda: kbit_cute.quantize(torch.randn(2, 4, 64), 4), ValueError, "2-D"),
        (lambda: kbit_cute.quantize(torch.ones(4, 64, dtype=torch.int32), 4), TypeError, "float"),
        (lambda: kbit_cute.quantize([[1.0] * 32], 4), TypeError, "torch.Tensor"),
        (
            lambda: kbit_cute.quantize(torch.randn(4, 64), 4, torch.randn(8)),
            ValueError,
            "16 entries",
        ),
        (
            lambda: kbit_cute.quantize(
                torch.randn(4, 64), 2, torch.tensor([0.0, 1.0, float("nan"), 2.0])
            ),
            ValueError,
            "NaN or Inf",
        ),
        (
            lambda: ops.quantize_kbit(torch.randn(40), kbit_cute.codebook(2), 2),
            ValueError,
            "multiple of 32",
        ),
        (
            lambda: ops.repack_kbit(
                torch.zeros(8, dtype=torch.int32), torch.zeros(2, dtype=torch.uint8), 64, 2, 4
            ),
            ValueError,
            "expected",
        ),
        (
            lambda: ops.repack_kbit(
                torch.zeros(8, dtype=torch.int64), torch.zeros(2, dtype=torch.uint8), 32, 2, 4
            ),
            TypeError,
            "int32",
        ),
        (lambda: ops.decode_e4m4(torch.zeros(3, dtype=torch.int32)), TypeError, "uint8"),
    ],
)
def test_bad_input_raises(call, err, text):
    with pytest.raises(err, match=text):
        call()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_names_first_bad_row(bad):
    W = torch.randn(10, 64)
    W[7, 3] = bad
    W[9, 0] = bad
    with pytest.raises(ValueError, match="first bad row is 7"):
        kbit_cute.quantize(W, 4)
