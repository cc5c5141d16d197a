"""``python -m perf moe`` on the CPU (``--cpu-smoke``): every implementation, the JSON, the
tables, failure reporting; plus the routing, the L2-cold copy rule and the layer shapes."""

import json

import pytest
import torch

from perf import common, models, moe
from perf.__main__ import build_parser, main

SMOKE_KS = [3]
SMOKE_TS = [1, 3]


def run_smoke(tmp_path, *extra):
    out = tmp_path / "moe"
    argv = ["moe", "--cpu-smoke", "--t", *map(str, SMOKE_TS), "--k", *map(str, SMOKE_KS)]
    rc = main([*argv, *extra, "--out", str(out)])
    return rc, json.loads((out / "moe.json").read_text()), out


def test_moe_pauses_before_a_light_point_after_a_heavy_one(tmp_path, monkeypatch):
    """Each implementation's first T follows the previous one's largest: with T = 3 made
    "heavy", every implementation after the first pauses once before T = 1."""
    pauses = []
    monkeypatch.setattr(common, "HEAVY_M", 3)
    monkeypatch.setattr(common.CpuSmokeTimer, "cool_down", lambda self: pauses.append(1))
    rc, run, _ = run_smoke(tmp_path, "--model", "qwen3-coder-next")
    assert rc == 0
    impls = {(r["impl"], r["k"]) for r in run["results"]}
    assert len(pauses) == len(impls) - 1 > 0


def test_moe_smoke_every_path(tmp_path):
    rc, run, out = run_smoke(tmp_path)
    assert rc == 0 and run["kind"] == "moe" and run["aborted"] is None
    cfg = run["config"]
    assert cfg["models"] == list(models.MOE_MODELS) and cfg["ts"] == SMOKE_TS
    assert cfg["ks"] == SMOKE_KS and cfg["dtype"] == "bf16"
    specs = {s["model"]: s for s in cfg["specs"]}
    res = {(r["model"], r["T"], r["impl"], r["k"]): r for r in run["results"]}
    assert len(res) == len(run["results"]) == 3 * len(SMOKE_TS) * (2 + 2 * len(SMOKE_KS))
    for (model, T, impl, k), r in res.items():
        assert r["status"] == "ok", r
        assert r["graph_us"] > 0 and r["eager_us"] > 0 and r["copies"] >= 2
        assert r["calls"] >= r["copies"] and r["expert_bytes"] > 0
        spec = specs[model]
        if T == 1:  # one token touches exactly top_k experts
            assert r["touched_experts"] == spec["top_k"]
        assert spec["top_k"] <= r["touched_experts"] <= min(spec["E"], T * spec["top_k"])
        want = r["touched_experts"] * r["expert_bytes"] + r["fixed_bytes"]
        assert r["touched_bytes"] == pytest.approx(want, rel=1e-3)
        if impl == "kbit-moe":
            assert r["rel_err"] is None and r["fixed_bytes"] > 0
        else:  # checked against the float32 reference on its own weights
            assert 0 < r["rel_err"] <= moe.CHECK_TOL
        if impl in ("grouped_mm", "loop"):
            assert r["expert_bytes"] == 3 * spec["I"] * spec["H"] * 2  # bf16
        else:
            assert r["expert_bytes"] == moe.kbit_expert_bytes(moe.MoeSpec(**spec), k)
    for model in cfg["models"]:
        for T in SMOKE_TS:
            peers = [res[(model, T, p, None)] for p in ("grouped_mm", "loop")]
            for k in SMOKE_KS:
                kb = res[(model, T, "kbit-experts", k)]
                assert kb["vs_grouped_mm"] == pytest.approx(
                    peers[0]["graph_us"] / kb["graph_us"], rel=2e-3
                )
                assert kb["vs_loop"] == pytest.approx(
                    peers[1]["graph_us"] / kb["graph_us"], rel=2e-3
                )
                target = kb["touched_bytes"] / (run["roofline"]["read_gbs"] * 1e3) + 5.0
                assert kb["target_us"] == pytest.approx(target, rel=2e-3)
                assert kb["target_ratio"] == pytest.approx(kb["graph_us"] / target, rel=2e-3)
                assert kb["targets"] == "met" or kb["targets"].startswith("missed")
                assert res[(model, T, "kbit-moe", k)]["vs_grouped_mm"] > 0
    md = (out / "moe.md").read_text()
    assert "### MoE layer (bf16)" in md and "### All points" in md
    h, rows = moe.summary_table(run)
    assert len(rows) == 3 * len(SMOKE_TS) * len(SMOKE_KS) and "vs grouped_mm" in h
    assert rows[0][:3] == [models.MOE_MODELS[0], 1, SMOKE_KS[0]]


def test_moe_failures_are_reported_not_dropped(tmp_path, monkeypatch):
    """A peer that raises and a peer with a wrong result are both recorded as failed with
    the reason; the kbit rows keep their numbers and lose only the speedups."""

    def broken(self, i, r):
        raise RuntimeError("kernel says no")

    def wrong(self, i, r):
        return lambda: torch.zeros_like(r.A)

    monkeypatch.setattr(moe.GroupedMMImpl, "make_call", broken)
    monkeypatch.setattr(moe.LoopImpl, "make_call", wrong)
    rc, run, _ = run_smoke(tmp_path, "--model", "deepseek-v2-lite")
    assert rc == 0
    res = {(r["T"], r["impl"]): r for r in run["results"]}
    for T in SMOKE_TS:
        assert res[(T, "grouped_mm")]["status"] == "failed"
        assert res[(T, "grouped_mm")]["error"] == "RuntimeError: kernel says no"
        loop = res[(T, "loop")]
        assert loop["status"] == "failed" and "relative error" in loop["error"]
        assert loop["rel_err"] == pytest.approx(1.0)
        kb = res[(T, "kbit-experts")]
        assert kb["status"] == "ok" and kb["vs_grouped_mm"] is None and kb["vs_loop"] is None
    h, rows = moe.summary_table(run)
    assert rows[0][h.index("grouped_mm us")] == rows[0][h.index("loop us")] == "failed"


def test_moe_budget_skips_and_still_reports(tmp_path):
    rc, run, _ = run_smoke(tmp_path, "--model", "glm-4.7-flash", "--budget-s", "1e-9")
    assert rc == 0
    assert {r["status"] for r in run["results"]} == {"skipped"}
    assert all("budget" in r["error"] for r in run["results"])


def test_moe_arguments():
    a = build_parser().parse_args(["moe"])
    assert a.model == list(models.MOE_MODELS) and a.t == [1, 4, 16, 64]
    assert a.k == [4] and a.dtype == "bf16" and a.repeats == 9 and not a.cpu_smoke
    a = build_parser().parse_args(["moe", "--k", "2", "3", "4", "5", "--t", "1", "--dtype", "fp16"])
    assert a.k == [2, 3, 4, 5] and a.t == [1] and a.dtype == "fp16"
    for bad in (["--model", "llama3-8b"], ["--t", "0"], ["--k", "6"], ["--dtype", "fp32"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["moe", *bad])


def test_moe_layer_shapes_from_the_configs():
    q, g, d = (moe.moe_spec(n) for n in models.MOE_MODELS)
    assert (q.E, q.top_k, q.H, q.I, q.shared_I, q.shared_gate, q.normalize) == (
        512, 10, 2048, 512, 512, True, True
    )  # fmt: skip
    assert (g.E, g.top_k, g.H, g.I, g.shared_I, g.shared_gate) == (64, 4, 2048, 1536, 1536, False)
    assert (d.E, d.top_k, d.H, d.I, d.shared_I, d.shared_gate, d.normalize) == (
        64, 6, 2048, 1408, 2 * 1408, False, False
    )  # fmt: skip
    assert "DeepSeek-V2-Lite" in d.source
    shapes = {lin.name: (lin.K, lin.N) for lin in models.get_model("deepseek-v2-lite").linears()}
    assert shapes["self_attn.q_proj"] == (2048, 16 * 192)  # q_lora_rank null: one q_proj
    assert shapes["mlp.experts.gate_proj"] == (2048, 1408)
    assert shapes["mlp.shared_experts.down_proj"] == (2816, 2048)
    for spec in (q, g, d):
        tiny = moe.tiny_spec(spec)
        assert tiny.I % 64 == 0 and tiny.E <= tiny.H and tiny.top_k <= tiny.E
        assert bool(tiny.shared_I) == bool(spec.shared_I)


def test_routing_is_uniform_distinct_and_sorted(gen):
    E, top_k, T = 16, 4, 20000
    ids = moe.draw_routing(gen, T, E, top_k)
    assert ids.shape == (T, top_k)
    assert all(len(set(row)) == top_k for row in ids[:500].tolist())
    counts = torch.bincount(ids.flatten(), minlength=E).float()
    assert (counts - T * top_k / E).abs().max() < 0.1 * T * top_k / E  # ~8 sigma
    with pytest.raises(ValueError, match="top_k"):
        moe.draw_routing(gen, 1, 4, 5)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_make_routing_rows_offsets_and_forced_router(gen, T):
    spec = moe.tiny_spec(moe.moe_spec("qwen3-coder-next"))
    ids = moe.draw_routing(gen, T, spec.E, spec.top_k)
    r = moe.make_routing(spec, ids, gen, torch.float32, torch.device("cpu"))
    off = r.offsets.tolist()
    assert off[0] == 0 and off[-1] == T * spec.top_k and off == sorted(off)
    assert r.offs.tolist() == off[1:] and r.offs.dtype == r.offsets.dtype == torch.int32
    assert sum(t - s for _, s, t in r.groups) == T * spec.top_k
    assert r.touched == len(set(ids.flatten().tolist()))
    for e, s, t in r.groups:  # each sorted row is the x row of a token routed to e
        for row in r.A[s:t]:
            tok = (r.x == row).all(dim=1).nonzero().flatten().tolist()
            assert tok and any(e in ids[i].tolist() for i in tok)
    # The router [I_E | 0] sees logits x[:, :E]: its top-k are exactly the routing.
    w = moe.random_weights(spec, torch.float32, torch.device("cpu"), 0)
    top = (r.x @ w.router.t()).topk(spec.top_k, dim=1).indices
    assert [set(a) for a in top.tolist()] == [set(a) for a in ids.tolist()]
    with pytest.raises(ValueError, match="E <= H"):
        big = moe.dataclasses.replace(spec, E=spec.H + 1)
        moe.make_routing(big, ids, gen, torch.float32, torch.device("cpu"))


def test_copy_rule_keeps_calls_l2_cold():
    """Between two uses of one weight copy, more than 4x L2 of other calls' weights stream."""

    class Stub:
        kind, l2_bytes = "stub", 50 * 2**20

        def copies_for(self, nbytes):
            return common.copies_for(nbytes, self.l2_bytes)

    spec = moe.moe_spec("qwen3-coder-next")
    per_expert = moe.kbit_expert_bytes(spec, 4)
    assert 1.5e6 < per_expert < 1.8e6  # 3 x 2048 x 512 weights at ~4.1 bits
    for T in (1, 4, 64):
        touched = moe.expected_touched(spec, T)
        rule = moe._copies_rule(Stub(), touched)
        n = rule(per_expert, 0, spec.E * per_expert)
        assert rule.wanted == n >= 2
        assert (n - 1) * touched * per_expert >= 4 * Stub.l2_bytes
    assert moe.expected_touched(spec, 1) == pytest.approx(10)
    assert moe.expected_touched(spec, 64) == pytest.approx(512 * (1 - (1 - 10 / 512) ** 64))
