"""The whole perf pipeline on the CPU (``--cpu-smoke``): sweep, peers, JSON, tables, plots,
the decode step, merge and the README generator. Timing numbers are stubs; what is checked
is that every code path runs and that what it writes is complete and consistent."""

import json
import sys
import types

import pytest
import torch

import kbit_cute
from perf import decode, peers, readme_tables, schema
from perf.__main__ import main

PNG = b"\x89PNG\r\n\x1a\n"


def fake_bitsandbytes():
    """The bnb 0.50 API surface the peer uses, with the real argument names."""
    bnb = types.ModuleType("bitsandbytes")
    functional = types.ModuleType("bitsandbytes.functional")

    class QuantState:
        def __init__(self, absmax, shape, blocksize, quant_type, dtype):
            self.absmax, self.shape, self.blocksize = absmax, shape, blocksize
            self.quant_type, self.dtype, self.W = quant_type, dtype, None

    def quantize_4bit(A, absmax=None, out=None, blocksize=None, compress_statistics=False,
                      quant_type="fp4", quant_storage=torch.uint8):  # fmt: skip
        assert blocksize == 64 and quant_type == "nf4" and not compress_statistics
        q = torch.zeros((A.numel() + 1) // 2, 1, dtype=torch.uint8)
        st = QuantState(
            torch.ones(A.numel() // blocksize), torch.Size(A.shape), blocksize, "nf4", A.dtype
        )
        st.W = A.clone()
        return q, st

    def matmul_4bit(A, B, quant_state, out=None, bias=None):
        B.view(-1, 1)  # what bnb does with the transposed packed weight
        assert A.shape[-1] == quant_state.shape[1]
        return torch.nn.functional.linear(A, quant_state.W)

    functional.quantize_4bit = quantize_4bit
    bnb.functional, bnb.matmul_4bit = functional, matmul_4bit
    return bnb


def fake_gemlite():
    gl = types.ModuleType("gemlite")

    class DType:
        FP16, BF16 = "fp16", "bf16"

    class GemLiteLinear(torch.nn.Module):
        def __init__(self, W_nbits=4, group_size=64, in_features=None, out_features=None,
                     input_dtype=DType.FP16, output_dtype=DType.FP16, acc_dtype=None,
                     scaled_activations=False):  # fmt: skip
            super().__init__()
            assert W_nbits == 4 and group_size == 64 and in_features % group_size == 0
            self.N = out_features

        def pack(self, W_q, scales, zeros, bias=None, fma_mode=True):
            assert W_q.dtype == torch.uint8 and scales.shape == zeros.shape
            self.W_q = (W_q[:, ::8].to(torch.int32)).t()
            self.scales, self.zeros = scales.t(), zeros.t()
            return self

        def forward(self, x):
            return torch.zeros(*x.shape[:-1], self.N, dtype=x.dtype)

    gl.DType, gl.GemLiteLinear = DType, GemLiteLinear
    return gl


@pytest.fixture
def fake_peers(monkeypatch):
    bnb = fake_bitsandbytes()
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", bnb.functional)
    monkeypatch.setitem(sys.modules, "gemlite", fake_gemlite())


def load_run(path):
    return schema.validate_run(json.loads(path.read_text()))


def test_gemm_smoke_every_path(tmp_path, fake_peers):
    rc = main(["gemm", "--cpu-smoke", "--model", "llama3-8b", "--shape", "256x96",
               "--m", "1", "8", "--k", "2", "4", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    run = load_run(tmp_path / "gemm.json")
    cfg = run["config"]
    assert cfg["models"] == ["llama3-8b", "custom"] and cfg["ms"] == [1, 8]
    assert len(run["results"]) == len(cfg["shapes"]) * len(cfg["impls"]) * len(cfg["ms"])
    status = {}
    for r in run["results"]:
        status.setdefault(r["impl"], set()).add(r["status"])
        if r["impl"] == "gemlite":  # group 64: K = 96 (tiny down_proj) must fail, reported
            assert r["status"] == ("ok" if int(r["shape"].split("x")[0]) % 64 == 0 else "failed")
    assert status["cublas"] == status["kbit"] == status["bnb"] == {"ok"}
    assert status["tinygemm"] == {"failed"}  # no CPU kernel / K % 128: reported, not dropped
    for r in run["results"]:
        if r["status"] == "ok":
            assert r["graph_us"] > 0 and r["eager_us"] > 0 and r["bytes"] > r["weight_bytes"] > 0
            assert r["copies"] >= 2 and r["calls"] >= r["copies"]
        else:
            assert r["error"]
    kb = {(r["shape"], r["M"], r["k"]): r for r in run["results"] if r["impl"] == "kbit"}
    K, N = 256, 96
    assert kb[("256x96", 1, 4)]["weight_bytes"] == kbit_cute.quantize(torch.zeros(N, K), 4).nbytes
    assert all(r["speedup"] for r in run["results"] if r["status"] == "ok")
    md = (tmp_path / "gemm.md").read_text()
    assert "### llama3-8b: speedup vs cuBLAS" in md and "### All points" in md
    for name in ("speedup-llama3-8b.png", "roofline-llama3-8b.png", "speedup-custom.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_gemm_peer_failure_is_reported_not_dropped(tmp_path, monkeypatch):
    class Broken(peers.Impl):
        name, label = "bnb", "broken peer"

        def prepare(self, W, n_copies):
            self.nbytes = 1
            self.copies = [None, None]

        def make_call(self, i, A):
            raise RuntimeError("kernel says no")

    monkeypatch.setitem(peers.PEERS, "bnb", Broken)
    rc = main(["gemm", "--cpu-smoke", "--shape", "64x64", "--m", "1", "--k", "3",
               "--peers", "bnb", "--no-plots", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    run = load_run(tmp_path / "gemm.json")
    got = {r["impl"]: (r["status"], r["error"]) for r in run["results"]}
    assert got["bnb"] == ("failed", "RuntimeError: kernel says no")
    assert got["kbit"][0] == got["cublas"][0] == "ok"
    assert "broken peer" in (tmp_path / "gemm.md").read_text()


def test_gemm_budget_skips_and_still_reports(tmp_path):
    rc = main(["gemm", "--cpu-smoke", "--shape", "64x64", "--m", "1", "2", "--k", "2",
               "--peers", "--budget-s", "1e-9", "--no-plots", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    run = load_run(tmp_path / "gemm.json")
    assert {r["status"] for r in run["results"]} == {"skipped"}
    assert all("budget" in r["error"] for r in run["results"])


def test_gemm_cools_down_before_small_m_after_large_m(tmp_path, monkeypatch):
    """A point of M < HEAVY_M right after one of M >= HEAVY_M (the next implementation's
    first M) waits for the GPU to leave its power cap; nothing else waits."""
    from perf import common

    monkeypatch.setattr(common, "HEAVY_M", 4)  # (the CPU smoke run stops at M = 64)
    order = []
    monkeypatch.setattr(common.CpuSmokeTimer, "cool_down", lambda self: order.append("cool"))
    real = common.CpuSmokeTimer.time_calls

    def time_calls(self, fns):
        order.append("point")
        return real(self, fns)

    monkeypatch.setattr(common.CpuSmokeTimer, "time_calls", time_calls)
    rc = main(["gemm", "--cpu-smoke", "--shape", "64x64", "--m", "1", "4",
               "--k", "2", "--peers", "--no-plots", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    # cuBLAS M = 1, 4; pause; kbit k = 2 M = 1, 4
    assert order == ["point", "point", "cool", "point", "point"]


def test_power_cap_pause_only_from_heavy_to_light():
    from perf.common import HEAVY_M, PowerCapPause

    paused = []
    guard = PowerCapPause(lambda: paused.append(True))
    rows = [1, 64, HEAVY_M, 4096, 1, 4, HEAVY_M, HEAVY_M - 1, HEAVY_M - 1]
    seen = []
    for r in rows:
        n = len(paused)
        guard.before(r)
        seen.append(len(paused) > n)
    assert seen == [False, False, False, False, True, False, False, True, False]


def test_decode_smoke(tmp_path):
    rc = main(["decode", "--cpu-smoke", "--model", "llama3-8b", "qwen3-coder-next", "--k", "4",
               "--batch", "1", "3", "--moe", "loop", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    run = load_run(tmp_path / "decode.json")
    res = {(r["model"], r["batch"], r["variant"]): r for r in run["results"]}
    assert len(res) == 2 * 2 * 2
    for (model, B, variant), r in res.items():
        assert r["status"] == "ok" and r["finite"], r
        assert r["step_us"] > 0 and r["tokens_per_s"] == pytest.approx(
            B * 1e6 / r["step_us"], rel=2e-3
        )
        assert r["linear_us"] > 0 and r["linear_frac"] > 0
        base = res[(model, B, "fp16")]
        assert r["speedup"] == pytest.approx(
            base["step_us"] / r["step_us"], rel=2e-3
        )  # JSON keeps 4 digits
        if variant == "k=4":  # kbit weights are ~4x smaller than fp16 (lm_head stays fp16)
            assert r["weight_bytes"] < base["weight_bytes"]
    assert any("per-expert loop" in n for n in run["config"]["notes"])
    assert (tmp_path / "decode.png").read_bytes()[:8] == PNG


def test_expert_loop_matches_a_dense_reference():
    """The expert loop's routing arithmetic: each token gets its own experts, weighted by
    the router's top-k probabilities in plan order (checked against a per-token loop)."""
    from perf import models

    cfg = models.tiny(models.get_model("qwen3-coder-next"))
    ctx = decode.Ctx(None, torch.float32, torch.device("cpu"), 0, False)
    plan = [[0, 5, 7], [5, 1, 2], [3, 0, 9]]
    moe = decode.ExpertLoopMoE(cfg, ctx, plan)
    x = torch.randn(3, cfg.hidden, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    probs = torch.softmax(moe.router(x), -1).topk(cfg.top_k, -1).values
    probs = probs / probs.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for t in range(3):
        for j, e in enumerate(plan[t]):
            ref[t] += probs[t, j] * moe.experts[e](x[t : t + 1])[0]
    ref += moe.shared(x) * torch.sigmoid(moe.shared_gate(x))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    assert sorted(moe.experts) == [0, 1, 2, 3, 5, 7, 9]  # only the routed experts exist


def test_moe_backend_choice():
    assert decode.moe_backend("loop")[0] == "loop"
    backend, why = decode.moe_backend("auto")
    try:
        has = hasattr(__import__("kbit_cute.moe", fromlist=["x"]), "KbitMoE")
    except ImportError:
        has = False
    assert backend == ("kbit-moe" if has else "loop") and why
    if not has:
        with pytest.raises(ValueError, match="kbit-moe"):
            decode.moe_backend("kbit-moe")


def test_merge_and_readme_roundtrip(tmp_path):
    g, d = tmp_path / "g", tmp_path / "d"
    assert main(["gemm", "--cpu-smoke", "--shape", "64x64", "--m", "1", "--k", "2", "--peers",
                 "--no-plots", "--out", str(g)]) == 0  # fmt: skip
    assert main(["decode", "--cpu-smoke", "--model", "llama3-8b", "--k", "2", "--batch", "1",
                 "--no-plots", "--out", str(d)]) == 0  # fmt: skip
    coll_path = tmp_path / "h100.json"
    assert (
        main(["merge", str(g / "gemm.json"), str(d / "decode.json"), "--out", str(coll_path)]) == 0
    )
    coll = readme_tables.load(coll_path)
    assert [r["kind"] for r in coll["runs"]] == ["gemm", "decode"]
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- perf:begin -->\nplaceholder\n<!-- perf:end -->\n\nend\n")
    args = ["--results", str(coll_path), "--readme", str(readme)]
    assert readme_tables.main([*args, "--check"]) == 1
    assert main(["readme", *args]) == 0
    assert readme_tables.main([*args, "--check"]) == 0
    text = readme.read_text()
    assert "placeholder" not in text and text.endswith("<!-- perf:end -->\n\nend\n")
    assert "**Decode step**" in text and "| 64x64 | --shape | 1" in text
    assert (tmp_path / "h100-speedup.png").read_bytes()[:8] == PNG
    assert (tmp_path / "h100.md").read_text() == readme_tables.render_full(coll)
