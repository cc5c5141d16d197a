"""Linear-layer shapes of the models the perf suite benchmarks.

Every shape is K x N: the layer computes out[M, N] = A[M, K] @ W^T with W [N, K]
(K = in_features, N = out_features), as in the seeds (002 §2, 000 §7).

Config numbers come from each model's published ``config.json`` (source next to
each config) and the layer structure from its Hugging Face modeling code. Where
the seed documents list a shape the model does not have, the difference is noted
at the config; ``qwen3-coder-next-seed`` keeps the seed's own list for comparison
with earlier notes (perf/NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class LinearShape:
    """One linear layer of a model (per-layer instance, or the whole-model layer for lm_head)."""

    name: str
    K: int
    N: int
    layers: int  # how many decoder layers hold it (1 for lm_head)
    per_token: int = 1  # instances a token reads per layer (MoE: top-k experts)
    quantized: bool = True  # kbit in the decode benchmark (routers and gates stay fp16)
    in_sweep: bool = True  # part of `python -m perf gemm --model` (lm_head is not: kept fp16)
    note: str = ""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the suite needs; ``family`` picks the decode-step builder."""

    name: str
    # "llama" (dense GQA), "qwen3_next" (hybrid linear/full attention + MoE), "glm4_moe_lite"
    # and "deepseek_v2" (multi-latent attention + MoE with shared experts)
    family: str
    source: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attention_bias: bool = False
    # MoE
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    first_dense_layers: int = 0
    # Qwen3-Next linear attention (Gated DeltaNet)
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    full_attention_interval: int = 0
    # GLM-4.7-Flash / DeepSeek-V2 multi-latent attention (q_lora_rank 0: a plain q_proj)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    seed_shapes: tuple[LinearShape, ...] | None = None  # overrides linears() (seed-only list)

    def is_full_attention(self, layer: int) -> bool:
        """Qwen3-Next: every ``full_attention_interval``-th layer is full attention."""
        if self.family != "qwen3_next":
            return True
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def full_attention_layers(self) -> int:
        return sum(self.is_full_attention(i) for i in range(self.layers))

    def linears(self) -> list[LinearShape]:
        """Every linear layer of the model with its K x N."""
        if self.seed_shapes is not None:
            return list(self.seed_shapes)
        H, L = self.hidden, self.layers
        if self.family == "llama":
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            out = [
                LinearShape("q_proj", H, q, L),
                LinearShape("k_proj", H, kv, L),
                LinearShape("v_proj", H, kv, L),
                LinearShape("o_proj", q, H, L),
                LinearShape("gate_proj", H, self.intermediate, L),
                LinearShape("up_proj", H, self.intermediate, L),
                LinearShape("down_proj", self.intermediate, H, L),
            ]
        elif self.family == "qwen3_next":
            full = self.full_attention_layers
            lin = L - full
            key_dim = self.lin_k_heads * self.lin_k_dim
            value_dim = self.lin_v_heads * self.lin_v_dim
            hd = self.head_dim
            out = [
                LinearShape(
                    "self_attn.q_proj",
                    H,
                    self.heads * hd * 2,
                    full,
                    note="query + output gate (gated attention)",
                ),
                LinearShape("self_attn.k_proj", H, self.kv_heads * hd, full),
                LinearShape("self_attn.v_proj", H, self.kv_heads * hd, full),
                LinearShape("self_attn.o_proj", self.heads * hd, H, full),
                LinearShape("linear_attn.in_proj_qkvz", H, 2 * key_dim + 2 * value_dim, lin),
                LinearShape(
                    "linear_attn.in_proj_ba",
                    H,
                    2 * self.lin_v_heads,
                    lin,
                    quantized=False,
                    in_sweep=False,
                    note="N = 64: kept fp16",
                ),
                LinearShape("linear_attn.out_proj", value_dim, H, lin),
                LinearShape(
                    "mlp.gate (router)",
                    H,
                    self.experts,
                    L,
                    quantized=False,
                    in_sweep=False,
                    note="router: kept fp16",
                ),
                LinearShape("mlp.experts.gate_proj", H, self.moe_intermediate, L, self.top_k),
                LinearShape("mlp.experts.up_proj", H, self.moe_intermediate, L, self.top_k),
                LinearShape("mlp.experts.down_proj", self.moe_intermediate, H, L, self.top_k),
                LinearShape("mlp.shared_expert.gate_proj", H, self.shared_intermediate, L),
                LinearShape("mlp.shared_expert.up_proj", H, self.shared_intermediate, L),
                LinearShape("mlp.shared_expert.down_proj", self.shared_intermediate, H, L),
                LinearShape("mlp.shared_expert_gate", H, 1, L, quantized=False, in_sweep=False),
            ]
        elif self.family in ("glm4_moe_lite", "deepseek_v2"):
            dense, moe = self.first_dense_layers, L - self.first_dense_layers
            qk = self.qk_nope_dim + self.qk_rope_dim
            shared = self.shared_intermediate
            if self.q_lora_rank:
                out = [
                    LinearShape("self_attn.q_a_proj", H, self.q_lora_rank, L),
                    LinearShape("self_attn.q_b_proj", self.q_lora_rank, self.heads * qk, L),
                ]
            else:
                out = [LinearShape("self_attn.q_proj", H, self.heads * qk, L)]
            out += [
                LinearShape(
                    "self_attn.kv_a_proj_with_mqa", H, self.kv_lora_rank + self.qk_rope_dim, L
                ),
                LinearShape(
                    "self_attn.kv_b_proj",
                    self.kv_lora_rank,
                    self.heads * (self.qk_nope_dim + self.v_head_dim),
                    L,
                ),
                LinearShape("self_attn.o_proj", self.heads * self.v_head_dim, H, L),
                LinearShape(
                    "mlp.gate_proj (dense)",
                    H,
                    self.intermediate,
                    dense,
                    note="dense MLP of the first layer"
                    + ("; seed 000 calls it 'shared'" if self.family == "glm4_moe_lite" else ""),
                ),
                LinearShape("mlp.up_proj (dense)", H, self.intermediate, dense),
                LinearShape("mlp.down_proj (dense)", self.intermediate, H, dense),
                LinearShape(
                    "mlp.gate (router)",
                    H,
                    self.experts,
                    moe,
                    quantized=False,
                    in_sweep=False,
                    note="router: kept fp16",
                ),
                LinearShape("mlp.experts.gate_proj", H, self.moe_intermediate, moe, self.top_k),
                LinearShape("mlp.experts.up_proj", H, self.moe_intermediate, moe, self.top_k),
                LinearShape("mlp.experts.down_proj", self.moe_intermediate, H, moe, self.top_k),
                LinearShape("mlp.shared_experts.gate_proj", H, shared, moe),
                LinearShape("mlp.shared_experts.up_proj", H, shared, moe),
                LinearShape("mlp.shared_experts.down_proj", shared, H, moe),
            ]
        else:  # pragma: no cover - guarded by the table below
            raise ValueError(f"unknown model family {self.family!r}")
        out.append(LinearShape("lm_head", H, self.vocab, 1, in_sweep=False, quantized=False,
                               note="kept fp16 (quantize_model skips lm_head)"))  # fmt: skip
        return out

    def sweep_shapes(self) -> list[tuple[int, int, list[str]]]:
        """Unique (K, N) of the swept layers, in model order, with the layer names of each."""
        seen: dict[tuple[int, int], list[str]] = {}
        for lin in self.linears():
            if lin.in_sweep:
                seen.setdefault((lin.K, lin.N), []).append(lin.name)
        return [(K, N, names) for (K, N), names in seen.items()]


# --------------------------------------------------------------------------- the models

MODELS: dict[str, ModelConfig] = {}


def _add(cfg: ModelConfig) -> None:
    MODELS[cfg.name] = cfg


# https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
# hidden_size 4096, intermediate_size 14336, num_hidden_layers 32, num_attention_heads 32,
# num_key_value_heads 8 (head_dim 128), vocab_size 128256. Seed 000 §7: gate/up N = 14336.
_add(ModelConfig(
    name="llama3-8b", family="llama",
    source="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
    hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
    vocab=128256,
))  # fmt: skip

# https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
# hidden_size 8192, intermediate_size 28672, num_hidden_layers 80, num_attention_heads 64,
# num_key_value_heads 8 (head_dim 128), vocab_size 128256. Seed 000 §7: gate/up N = 28672.
_add(ModelConfig(
    name="llama3-70b", family="llama",
    source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
    hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, head_dim=128,
    vocab=128256,
))  # fmt: skip

# https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
# hidden_size 3584, intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
# num_key_value_heads 4 (head_dim 128), vocab_size 152064, q/k/v with bias.
# Seed 000 §7: gate/up N = 18944.
_add(ModelConfig(
    name="qwen2.5-7b", family="llama",
    source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
    hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128,
    vocab=152064, attention_bias=True,
))  # fmt: skip

# https://huggingface.co/Qwen/Qwen3-Coder-Next/blob/main/config.json (as quoted in seed 002 §1)
# hidden_size 2048, num_hidden_layers 48, num_attention_heads 16, num_key_value_heads 2,
# head_dim 256, num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512,
# shared_expert_intermediate_size 512, linear_num_key_heads 16, linear_num_value_heads 32,
# linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4,
# full_attention_interval 4, vocab_size 151936, decoder_sparse_step 1 (every layer MoE).
# Layer structure from transformers' modeling_qwen3_next.py: q_proj has 2 * heads * head_dim
# outputs (query + output gate), Gated DeltaNet projections are fused (in_proj_qkvz,
# in_proj_ba). intermediate_size 5120 is unused: no layer has a dense MLP.
_add(ModelConfig(
    name="qwen3-coder-next", family="qwen3_next",
    source="https://huggingface.co/Qwen/Qwen3-Coder-Next/blob/main/config.json",
    hidden=2048, intermediate=5120, layers=48, heads=16, kv_heads=2, head_dim=256,
    vocab=151936, experts=512, top_k=10, moe_intermediate=512, shared_intermediate=512,
    lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_kernel=4,
    full_attention_interval=4,
    notes=(
        "seed 002 §2 lists Q 2048x4096 (no output gate), separate linear key/value "
        "projections 2048x2048 / 2048x4096 and a dense MLP 2048x5120 / 5120x2048; the model "
        "has q_proj 2048x8192, fused in_proj_qkvz 2048x12288 and no dense MLP "
        "(see qwen3-coder-next-seed for the seed's list)",
    ),
))  # fmt: skip

# The seed's own Qwen3-Coder-Next list (seed 002 §2 table; seed 000 §7), kept so numbers
# compare with perf/NOTES.md.
_add(replace(
    MODELS["qwen3-coder-next"], name="qwen3-coder-next-seed",
    source="seed 002 §2 (/work/shared/seeds/002_3ea281b60d02f3b4.txt)",
    notes=("the seed documents' shape list, not the model's exact layers",),
    seed_shapes=(
        LinearShape("Q proj (seed)", 2048, 4096, 12),
        LinearShape("K/V proj", 2048, 512, 12),
        LinearShape("O proj", 4096, 2048, 12),
        LinearShape("linear key proj (seed)", 2048, 2048, 36),
        LinearShape("linear value proj (seed)", 2048, 4096, 36),
        LinearShape("dense gate/up (seed)", 2048, 5120, 48),
        LinearShape("dense down (seed)", 5120, 2048, 48),
        LinearShape("MoE / shared expert gate/up", 2048, 512, 48, 10),
        LinearShape("MoE / shared expert down", 512, 2048, 48, 10),
    ),
))  # fmt: skip

# https://huggingface.co/zai-org/GLM-4.7-Flash/blob/main/config.json (model_type glm4_moe_lite;
# the same numbers appear in vLLM's glm4_moe_lite config test): hidden_size 2048,
# intermediate_size 10240, moe_intermediate_size 1536, num_hidden_layers 47,
# num_attention_heads 20, q_lora_rank 768, kv_lora_rank 512, qk_nope_head_dim 192,
# qk_rope_head_dim 64, v_head_dim 256, n_routed_experts 64, n_shared_experts 1,
# num_experts_per_tok 4, first_k_dense_replace 1, vocab_size 154880.
# Multi-latent attention as in DeepSeek-V3 (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj);
# the shared expert has n_shared_experts * moe_intermediate_size = 1536 channels.
_add(ModelConfig(
    name="glm-4.7-flash", family="glm4_moe_lite",
    source="https://huggingface.co/zai-org/GLM-4.7-Flash/blob/main/config.json",
    hidden=2048, intermediate=10240, layers=47, heads=20, kv_heads=20, head_dim=256,
    vocab=154880, experts=64, top_k=4, moe_intermediate=1536, shared_intermediate=1536,
    first_dense_layers=1, q_lora_rank=768, kv_lora_rank=512, qk_nope_dim=192, qk_rope_dim=64,
    v_head_dim=256,
    notes=(
        "seed 000 §7 calls 2048x10240 / 10240x2048 'shared gate/up / down'; in the config "
        "they are the dense MLP of layer 0 (first_k_dense_replace = 1)",
    ),
))  # fmt: skip

# https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (model_type
# deepseek_v2): hidden_size 2048, intermediate_size 10944, num_hidden_layers 27,
# num_attention_heads 16, num_key_value_heads 16, q_lora_rank null, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 64,
# n_shared_experts 2, num_experts_per_tok 6, moe_intermediate_size 1408,
# first_k_dense_replace 1, norm_topk_prob false, vocab_size 102400.
# Layer structure from DeepSeek's modeling_deepseek.py: q_lora_rank null means one q_proj
# (no q_a/q_b); the two shared experts are one MLP of n_shared_experts * moe_intermediate_size
# = 2816 channels.
_add(ModelConfig(
    name="deepseek-v2-lite", family="deepseek_v2",
    source="https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
    hidden=2048, intermediate=10944, layers=27, heads=16, kv_heads=16, head_dim=192,
    vocab=102400, experts=64, top_k=6, moe_intermediate=1408, shared_intermediate=2 * 1408,
    first_dense_layers=1, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
))  # fmt: skip

DECODE_MODELS = ("llama3-8b", "qwen3-coder-next")
MOE_MODELS = ("qwen3-coder-next", "glm-4.7-flash", "deepseek-v2-lite")  # python -m perf moe


def get_model(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at toy size, for the CPU smoke run (every K a multiple of 32)."""
    if cfg.seed_shapes is not None:
        return replace(cfg, seed_shapes=tuple(
            replace(s, K=32 * max(1, s.K // 2048), N=max(8, s.N // 64)) for s in cfg.seed_shapes
        ))  # fmt: skip
    return replace(
        cfg, name=cfg.name, hidden=64, intermediate=96, layers=4 if cfg.family == "qwen3_next" else 2,
        heads=4, kv_heads=2 if cfg.kv_heads != cfg.heads else 4, head_dim=16, vocab=256,
        experts=min(cfg.experts, 16), top_k=min(cfg.top_k, 3), moe_intermediate=32 if cfg.experts else 0,
        shared_intermediate=32 if cfg.shared_intermediate else 0,
        lin_k_heads=2 if cfg.lin_k_heads else 0, lin_v_heads=4 if cfg.lin_v_heads else 0,
        lin_k_dim=16 if cfg.lin_k_dim else 0, lin_v_dim=16 if cfg.lin_v_dim else 0,
        q_lora_rank=32 if cfg.q_lora_rank else 0, kv_lora_rank=32 if cfg.kv_lora_rank else 0,
        qk_nope_dim=16 if cfg.qk_nope_dim else 0, qk_rope_dim=8 if cfg.qk_rope_dim else 0,
        v_head_dim=16 if cfg.v_head_dim else 0,
    )  # fmt: skip
