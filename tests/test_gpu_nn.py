"""KbitLinear and quantize_model on the GPU: CUDA forward against the CPU forward, device
moves, safetensors save/load on CUDA, and the module-level errors."""

import pytest
import torch
from torch import nn

from kbit_cute.nn import KbitLinear, quantize_model

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def model(dtype, device="cuda", seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(512, 1056), nn.GELU(), nn.Linear(1056, 384, bias=False))
    m.lm_head = nn.Linear(384, 100)
    return m.to(device, dtype)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", (1, 3, 9))
def test_cuda_forward_matches_cpu_forward(k, dtype, M, gen):
    lin = nn.Linear(512, 1056).to(dtype)
    q_cpu = KbitLinear.from_linear(lin, k)
    q_cuda = KbitLinear.from_linear(lin.cuda(), k)
    for name, t in q_cpu.state_dict().items():  # quantize is bit-identical on CPU and CUDA
        assert torch.equal(t, q_cuda.state_dict()[name].cpu()), name
    x = torch.randn(M, 512, generator=gen).to(dtype)
    ref = q_cpu.float()(x.float())
    got = q_cuda(x.cuda())
    assert not torch.isnan(got).any()
    assert rel_err(got.cpu(), ref) < TOL[dtype]


def test_module_moves_between_devices(gen):
    q = KbitLinear.from_linear(nn.Linear(256, 128).half(), k=4)
    x = torch.randn(2, 256, generator=gen).half()
    cpu_out = q(x)
    q.cuda()
    assert q.packed.is_cuda and q.codebook.dtype == torch.float32
    assert rel_err(q(x.cuda()).cpu(), cpu_out) < 5e-3  # CPU fp16 matmul vs the kernel
    q.to("cpu", torch.bfloat16)
    assert q.codebook.dtype == torch.float32 and q.dtype == torch.bfloat16


@pytest.mark.parametrize("k", KS)
def test_safetensors_save_load_on_cuda(k, tmp_path, gen):
    st = pytest.importorskip("safetensors.torch")
    m = quantize_model(model(torch.bfloat16), k=k, progress=False)
    path = str(tmp_path / "m.safetensors")
    st.save_file(m.state_dict(), path)
    fresh = quantize_model(model(torch.bfloat16, seed=1), k=k, progress=False)
    fresh.load_state_dict(st.load_file(path, device="cuda"))
    for name, t in m.state_dict().items():
        assert torch.equal(t, fresh.state_dict()[name]), name
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(m(x), fresh(x))
    # and onto the CPU: the same checkpoint serves a machine without a GPU
    cpu = quantize_model(model(torch.bfloat16, "cpu", seed=2), k=k, progress=False)
    cpu.load_state_dict(st.load_file(path))
    assert rel_err(cpu(x.cpu()), m(x).cpu()) < 2e-2  # two bf16 layers, CPU vs GPU rounding


def test_quantize_model_on_cuda_reports_and_runs(capsys):
    m = model(torch.float16)
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    ref = m(x)
    quantize_model(m, k=4)
    assert "2 nn.Linear -> KbitLinear(k=4)" in capsys.readouterr().out
    assert isinstance(m[0], KbitLinear) and type(m.lm_head) is nn.Linear
    assert rel_err(m(x), ref) < 0.2  # two k=4 layers (~9% weight error each)


def test_module_errors_on_cuda(gen):
    q = KbitLinear.from_linear(nn.Linear(256, 128, device="cuda", dtype=torch.float16), k=4)
    with pytest.raises(ValueError, match="is on cpu but the weight is on cuda"):
        q(torch.randn(1, 256, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        q.float()(torch.randn(1, 256, device="cuda"))
