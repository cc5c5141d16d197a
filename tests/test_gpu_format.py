"""On the GPU: CUDA quantize and the dequantize kernel are bit-identical to the CPU reference."""

import pytest
import torch

import kbit_cute

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
SHAPES = [(128, 64), (1000, 1056), (512, 2048), (2048, 512), (3, 96)]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_quantize_bit_identical_to_cpu(k, dtype, shape, gen):
    W = torch.randn(shape, generator=gen).to(dtype)
    cpu = kbit_cute.quantize(W, k)
    gpu = kbit_cute.quantize(W.cuda(), k)
    assert gpu.packed.is_cuda
    for name in ("packed", "absmax", "codebook", "scale"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_kernel_bit_identical_to_cpu(k, out_dtype, shape, gen):
    W = torch.randn(shape, generator=gen) * 0.02
    qw = kbit_cute.quantize(W, k)
    ref = kbit_cute.dequantize(qw, out_dtype)
    out = torch.full(shape, float("nan"), dtype=out_dtype, device="cuda")  # poison
    got = kbit_cute.dequantize(qw.to("cuda"), out_dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "an output element was not written"
    assert torch.equal(got.cpu(), ref)


def test_dequantize_alternating_shapes_and_k(gen):
    cases = [(k, s) for s in SHAPES[:3] for k in KS]
    weights = [(kbit_cute.quantize(torch.randn(s, generator=gen), k)) for k, s in cases]
    for _ in range(2):
        for qw in weights:
            got = kbit_cute.dequantize(qw.to("cuda"), torch.float16)
            assert torch.equal(got.cpu(), kbit_cute.dequantize(qw, torch.float16))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_kernel_every_absmax_code(k, out_dtype, gen):
    """Every E4M4 code (subnormal ones included) at every position of the kernel's absmax
    word (4 adjacent columns x 2 K blocks): bit-identical to the CPU reference."""
    N, K = 256, 256  # 256 columns x 8 blocks: 2048 blocks, each code 8 times
    qw = kbit_cute.quantize(torch.randn(N, K, generator=gen), k)
    codes = torch.randperm(qw.absmax.numel(), generator=gen) % 256
    qw.absmax.copy_(codes.to(torch.uint8).view_as(qw.absmax))
    out = torch.full((N, K), float("nan"), dtype=out_dtype, device="cuda")
    got = kbit_cute.dequantize(qw.to("cuda"), out_dtype, out=out)
    assert torch.equal(got.cpu(), kbit_cute.dequantize(qw, out_dtype))
