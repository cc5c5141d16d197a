"""Model shape tables of the perf suite (perf/models.py) against the published configs."""

import pytest

from perf import models


def shapes(name):
    return {lin.name: (lin.K, lin.N) for lin in models.get_model(name).linears()}


def test_llama3_8b_and_70b():
    s8, s70 = shapes("llama3-8b"), shapes("llama3-70b")
    assert s8 == {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
                  "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
                  "down_proj": (14336, 4096), "lm_head": (4096, 128256)}  # fmt: skip
    assert s70["gate_proj"] == (8192, 28672) and s70["down_proj"] == (28672, 8192)
    assert s70["k_proj"] == (8192, 1024) and s70["q_proj"] == (8192, 8192)
    assert [K for K, N, _ in models.get_model("llama3-70b").sweep_shapes()] == [
        8192,
        8192,
        8192,
        28672,
    ]


def test_qwen25_7b():
    s = shapes("qwen2.5-7b")
    assert s["q_proj"] == (3584, 3584) and s["k_proj"] == (3584, 512)
    assert s["gate_proj"] == (3584, 18944) and s["down_proj"] == (18944, 3584)


def test_qwen3_coder_next():
    cfg = models.get_model("qwen3-coder-next")
    s = {lin.name: lin for lin in cfg.linears()}
    assert cfg.full_attention_layers == 12  # layers 3, 7, ..., 47
    assert (s["self_attn.q_proj"].K, s["self_attn.q_proj"].N) == (2048, 8192)  # query + gate
    assert (s["self_attn.k_proj"].K, s["self_attn.k_proj"].N) == (2048, 512)
    assert (s["self_attn.o_proj"].K, s["self_attn.o_proj"].N) == (4096, 2048)
    qkvz = s["linear_attn.in_proj_qkvz"]
    assert (qkvz.K, qkvz.N, qkvz.layers) == (2048, 2 * 2048 + 2 * 4096, 36)
    assert (s["linear_attn.out_proj"].K, s["linear_attn.out_proj"].N) == (4096, 2048)
    gate = s["mlp.experts.gate_proj"]
    assert (gate.K, gate.N, gate.layers, gate.per_token) == (2048, 512, 48, 10)
    assert (s["mlp.experts.down_proj"].K, s["mlp.experts.down_proj"].N) == (512, 2048)
    assert not s["mlp.gate (router)"].quantized and not s["mlp.gate (router)"].in_sweep
    keys = [(K, N) for K, N, _ in cfg.sweep_shapes()]
    assert keys == [(2048, 8192), (2048, 512), (4096, 2048), (2048, 12288), (512, 2048)]


def test_qwen3_coder_next_seed_list():
    keys = {(K, N) for K, N, _ in models.get_model("qwen3-coder-next-seed").sweep_shapes()}
    assert keys == {(2048, 4096), (2048, 512), (4096, 2048), (2048, 2048), (2048, 5120),
                    (5120, 2048), (512, 2048)}  # fmt: skip


def test_glm_47_flash():
    s = {lin.name: lin for lin in models.get_model("glm-4.7-flash").linears()}
    assert (s["self_attn.q_a_proj"].K, s["self_attn.q_a_proj"].N) == (2048, 768)
    assert (s["self_attn.q_b_proj"].K, s["self_attn.q_b_proj"].N) == (768, 20 * 256)
    assert (s["self_attn.kv_a_proj_with_mqa"].K, s["self_attn.kv_a_proj_with_mqa"].N) == (2048, 576)
    assert (s["self_attn.kv_b_proj"].K, s["self_attn.kv_b_proj"].N) == (512, 20 * 448)
    assert (s["self_attn.o_proj"].K, s["self_attn.o_proj"].N) == (5120, 2048)
    dense = s["mlp.gate_proj (dense)"]
    assert (dense.K, dense.N, dense.layers) == (2048, 10240, 1)
    routed = s["mlp.experts.gate_proj"]
    assert (routed.K, routed.N, routed.layers, routed.per_token) == (2048, 1536, 46, 4)
    assert (s["mlp.shared_experts.down_proj"].K, s["mlp.shared_experts.down_proj"].N) == (
        1536,
        2048,
    )


@pytest.mark.parametrize("name", list(models.MODELS))
def test_every_model_sweeps_kbit_compatible_unique_shapes(name):
    for cfg in (models.get_model(name), models.tiny(models.get_model(name))):
        swept = cfg.sweep_shapes()
        keys = [(K, N) for K, N, _ in swept]
        assert keys
        assert all(K % 32 == 0 and K > 0 and N > 0 for K, N in keys), keys
        covered = {n for _, _, names in swept for n in names}
        assert covered == {lin.name for lin in cfg.linears() if lin.in_sweep}
        assert cfg.source


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'llama4'"):
        models.get_model("llama4")
