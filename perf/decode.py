"""Decode-step benchmark: a model-shaped stack of linear layers, one token per sequence.

``python -m perf decode --model llama3-8b qwen3-coder-next --batch 1 4``

For each weight format (fp16/bf16 baseline, then kbit k = 2..5) the model is built from the
same random weights (N(0, 1/K), the scale of trained LLM layers), every quantizable linear
going through ``kbit_cute.quantize`` / ``kbit_cute.gemm`` (never KbitLinear), the MoE blocks
optionally through ``kbit_cute.moe.KbitMoE`` (``--moe``). One decode step (embedding, all
layers, final norm, lm_head) is captured in a CUDA graph and replayed (median of the timer's
repeats); the eager step time is reported next to it. The weights of one step are far
larger than L2, so replays read HBM.

- llama3-8b: RMSNorm, q/k/v/o, RoPE, KV cache of ``--context`` tokens, torch SDPA (GQA),
  SwiGLU MLP.
- qwen3-coder-next: 3 of 4 layers Gated DeltaNet (fused in_proj_qkvz / in_proj_ba, a
  4-tap causal conv state, the gated delta-rule recurrent state in fp32, gated RMSNorm,
  out_proj), every 4th gated full attention (q_proj with output gate, q/k norms, partial
  RoPE, SDPA); every layer MoE: fp16 router (softmax top-10 of 512), shared expert with its
  sigmoid gate, routed experts. Routed experts run one of two ways (``--moe``):
  * ``loop``: a **per-expert loop of kbit_cute.gemm
    calls** (F.linear for fp16) with **host-fixed routing**: each token's 10 experts per
    layer are drawn on the host once, only those experts are allocated (the bytes a real
    step reads, within memory), and the GPU router's top-k weights scale their outputs
    (router computed, not used for dispatch: a graph cannot change host-issued launches).
  * ``kbit-moe`` (``auto`` picks it when ``kbit_cute.moe.KbitMoE`` exists): the whole block
    (router, shared expert and its gate, routed experts) is one KbitMoE, with its own
    on-device routing over a pool of ``--moe-experts`` experts per layer. If building or
    running it fails, the run falls back to the loop and records why.
- lm_head stays fp16 unless ``--quantize-lm-head`` (quantize_model skips it by default);
  routers, in_proj_ba (N = 64) and the shared-expert gate (N = 1) stay fp16 (in KbitMoE the
  gate is a row of the router).

"in linears" = time of a graph replaying only the quantizable linears (kbit_cute.gemm in the
kbit formats, the same layers' F.linear in the baseline) on their recorded inputs, divided
by the step time: the fraction of the step spent in our kernels.
"""

from __future__ import annotations

import gc
import importlib
import math
import random
import time

import torch
import torch.nn.functional as F

import kbit_cute

from . import models
from .common import environment, error_text

SCHEMA = "kbit_cute.perf/1"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first cos.numel() channels of the last dim (partial RoPE)."""
    rot = cos.numel()
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    out = xr * cos + torch.cat([-x2, x1], -1) * sin
    return out if rot == x.shape[-1] else torch.cat([out, xp], -1)


def rope_table(rot: int, pos: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.cat([pos * inv, pos * inv])
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


class Ctx:
    """What the layers share: the weight format, the generator, and the call recorder."""

    def __init__(self, k: int | None, dtype, device, seed: int, quantize_lm_head: bool):
        self.k, self.dtype, self.device = k, dtype, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.quantize_lm_head = quantize_lm_head
        self.recording: list | None = None  # (Linear, input) of every call while set

    def weight(self, N: int, K: int) -> torch.Tensor:
        w = torch.randn(N, K, generator=self.gen, device=self.device) / math.sqrt(K)
        return w.to(self.dtype)

    def linear(self, N: int, K: int, quantized: bool = True) -> Linear:
        return Linear(self, self.weight(N, K), self.k if quantized else None, quantized)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype, device=self.device)


class Linear:
    """fp16/bf16 F.linear, or kbit_cute.quantize + kbit_cute.gemm when k is set."""

    def __init__(self, ctx: Ctx, W: torch.Tensor, k: int | None, quantizable: bool):
        self.ctx, self.k, self.quantizable = ctx, k, quantizable
        if k is None:
            self.w, self.nbytes = W, W.numel() * W.element_size()
        else:
            self.qw = kbit_cute.quantize(W, k)
            self.nbytes = self.qw.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.recording is not None:
            self.ctx.recording.append((self, x))
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.k is None:
            return F.linear(x, self.w)
        return kbit_cute.gemm(x, self.qw)


# ----------------------------------------------------------------------------- layers


class Attention:
    """GQA attention over a KV cache; ``gated`` adds Qwen3-Next's output gate and q/k norms."""

    def __init__(self, cfg: models.ModelConfig, ctx: Ctx, gated: bool):
        H, hd = cfg.hidden, cfg.head_dim
        self.cfg, self.gated = cfg, gated
        self.q = ctx.linear(cfg.heads * hd * (2 if gated else 1), H)
        self.k = ctx.linear(cfg.kv_heads * hd, H)
        self.v = ctx.linear(cfg.kv_heads * hd, H)
        self.o = ctx.linear(H, cfg.heads * hd)
        self.q_norm, self.k_norm = ctx.ones(hd), ctx.ones(hd)

    def new_state(self, B: int, context: int, ctx: Ctx) -> dict:
        cfg = self.cfg
        shape = (B, cfg.kv_heads, context, cfg.head_dim)
        kc = torch.randn(shape, generator=ctx.gen, device=ctx.device).to(ctx.dtype)
        vc = torch.randn(shape, generator=ctx.gen, device=ctx.device).to(ctx.dtype)
        rot = cfg.head_dim // 4 if self.gated else cfg.head_dim  # Qwen3-Next: 25% rotary
        cos, sin = rope_table(rot, context - 1, ctx.dtype, ctx.device)
        return dict(kc=kc, vc=vc, cos=cos, sin=sin, pos=context - 1,
                    bytes=2 * kc.numel() * kc.element_size())  # fmt: skip

    def __call__(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        cfg, B, hd = self.cfg, x.shape[0], self.cfg.head_dim
        q = self.q(x)
        if self.gated:
            q, gate = q.view(B, cfg.heads, 2 * hd).split(hd, -1)
            q = rms(q, self.q_norm)
        q = q.reshape(B, cfg.heads, 1, hd)
        k = self.k(x).view(B, cfg.kv_heads, 1, hd)
        if self.gated:
            k = rms(k, self.k_norm)
        v = self.v(x).view(B, cfg.kv_heads, 1, hd)
        q, k = rope(q, st["cos"], st["sin"]), rope(k, st["cos"], st["sin"])
        p = st["pos"]
        st["kc"][:, :, p : p + 1] = k
        st["vc"][:, :, p : p + 1] = v
        a = F.scaled_dot_product_attention(q, st["kc"], st["vc"], enable_gqa=True)
        a = a.reshape(B, cfg.heads, hd)
        if self.gated:
            a = a * torch.sigmoid(gate)
        return self.o(a.reshape(B, cfg.heads * hd))


class GatedDeltaNet:
    """Qwen3-Next linear attention, one recurrent decode step (torch ops; state in fp32)."""

    def __init__(self, cfg: models.ModelConfig, ctx: Ctx):
        self.cfg = cfg
        self.key_dim = cfg.lin_k_heads * cfg.lin_k_dim
        self.value_dim = cfg.lin_v_heads * cfg.lin_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.qkvz = ctx.linear(self.conv_dim + self.value_dim, cfg.hidden)
        self.ba = ctx.linear(2 * cfg.lin_v_heads, cfg.hidden, quantized=False)
        self.out = ctx.linear(cfg.hidden, self.value_dim)
        self.conv_w = ctx.weight(self.conv_dim, cfg.conv_kernel)
        self.A_log = torch.zeros(cfg.lin_v_heads, device=ctx.device)
        self.dt_bias = torch.ones(cfg.lin_v_heads, device=ctx.device)
        self.norm_w = torch.ones(cfg.lin_v_dim, device=ctx.device)

    def new_state(self, B: int, context: int, ctx: Ctx) -> dict:
        cfg = self.cfg
        conv = torch.zeros(B, self.conv_dim, cfg.conv_kernel, dtype=ctx.dtype, device=ctx.device)
        S = torch.zeros(B, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, device=ctx.device)
        return dict(
            conv=conv, S=S, bytes=2 * S.numel() * 4 + 2 * conv.numel() * conv.element_size()
        )

    def __call__(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        cfg, B = self.cfg, x.shape[0]
        nk, nv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        qkv, z = self.qkvz(x).split([self.conv_dim, self.value_dim], -1)
        b, a = self.ba(x).float().split(nv, -1)
        st["conv"].copy_(torch.cat([st["conv"][:, :, 1:], qkv.unsqueeze(-1)], -1))
        qkv = F.silu((st["conv"] * self.conv_w).sum(-1))
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = F.normalize(q.view(B, nk, dk), dim=-1).repeat_interleave(nv // nk, 1)
        k = F.normalize(k.view(B, nk, dk), dim=-1).repeat_interleave(nv // nk, 1)
        v = v.view(B, nv, dv)
        beta = torch.sigmoid(b)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        S = st["S"]
        S.mul_(g.exp()[..., None, None])
        kv_mem = torch.einsum("bhk,bhkv->bhv", k, S)
        S.add_(k[..., :, None] * ((v - kv_mem) * beta[..., None])[..., None, :])
        o = torch.einsum("bhk,bhkv->bhv", q * dk**-0.5, S)
        o = rms(o, self.norm_w) * F.silu(z.float().view(B, nv, dv))
        return self.out(o.to(x.dtype).reshape(B, self.value_dim))


class MLP:
    def __init__(self, ctx: Ctx, H: int, inter: int):
        self.gate, self.up, self.down = (
            ctx.linear(inter, H),
            ctx.linear(inter, H),
            ctx.linear(H, inter),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ExpertLoopMoE:
    """Qwen3-Next sparse MoE block with routed experts as a per-expert loop (module doc)."""

    backend = "loop"

    def __init__(self, cfg: models.ModelConfig, ctx: Ctx, plan: list[list[int]]):
        H = cfg.hidden
        self.cfg, self.plan = cfg, plan
        self.router = ctx.linear(cfg.experts, H, quantized=False)
        self.experts = {
            e: MLP(ctx, H, cfg.moe_intermediate) for e in sorted({e for p in plan for e in p})
        }
        self.shared = MLP(ctx, H, cfg.shared_intermediate)
        self.shared_gate = ctx.linear(1, H, quantized=False)
        self._groups: dict[int, list] = {}

    def groups(self, B: int, device) -> list:
        """Per expert used by tokens 0..B-1: (expert, token rows, top-k slots), as tensors."""
        if B not in self._groups:
            by: dict[int, tuple[list, list]] = {}
            for t in range(B):
                for slot, e in enumerate(self.plan[t]):
                    by.setdefault(e, ([], []))[0].append(t)
                    by[e][1].append(slot)
            self._groups[B] = [
                (e, torch.tensor(rows, device=device), torch.tensor(slots, device=device), rows == list(range(B)))
                for e, (rows, slots) in sorted(by.items())
            ]  # fmt: skip
        return self._groups[B]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        probs = torch.softmax(self.router(x).float(), -1)
        topv = probs.topk(self.cfg.top_k, -1).values
        topv = topv / topv.sum(-1, keepdim=True)
        y = torch.zeros(B, self.cfg.hidden, device=x.device)
        for e, rows, slots, all_rows in self.groups(B, x.device):
            xe = x if all_rows else x.index_select(0, rows)
            y.index_add_(0, rows, self.experts[e](xe).float() * topv[rows, slots].unsqueeze(-1))
        shared = self.shared(x).float() * torch.sigmoid(self.shared_gate(x).float())
        return (y + shared).to(x.dtype)


class KbitMoEBlock:
    """The whole sparse MoE block as one ``kbit_cute.moe.KbitMoE``: router, routed experts
    over a pool of ``--moe-experts``, the shared expert and its sigmoid gate (the module runs
    the shared expert inside its grouped expert launches at decode)."""

    backend = "kbit-moe"
    quantizable = True

    def __init__(self, cfg: models.ModelConfig, ctx: Ctx, pool: int):
        KbitMoE = importlib.import_module("kbit_cute.moe").KbitMoE
        H, S = cfg.hidden, cfg.shared_intermediate
        # The fused gate/up kernel's 64-wide tile; real configs are multiples already, only
        # the CPU smoke's toy size (32) is rounded up.
        inter = -(-cfg.moe_intermediate // 64) * 64
        gen, dev = ctx.gen, ctx.device
        gate_up = (torch.randn(pool, 2 * inter, H, generator=gen, device=dev) / H**0.5).to(
            ctx.dtype
        )
        down = (torch.randn(pool, H, inter, generator=gen, device=dev) / inter**0.5).to(ctx.dtype)
        shared = (ctx.weight(S, H), ctx.weight(S, H), ctx.weight(H, S)) if S else None
        self.moe = KbitMoE.from_experts(
            gate_up, down, ctx.weight(pool, H), cfg.top_k, k=ctx.k, shared=shared,
            shared_gate=ctx.weight(1, H) if S else None,
        )  # fmt: skip
        del gate_up, down, shared
        self.ctx = ctx
        # Bytes one token reads: its top_k experts, the shared pieces, the router (+ gate).
        per_expert = self.moe.gate_up.weight.nbytes_per_expert
        per_expert += self.moe.down.weight.nbytes_per_expert
        router = self.moe.router.weight
        self.nbytes = (cfg.top_k + self.moe.shared_experts) * per_expert + router.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.recording is not None:
            self.ctx.recording.append((self, x))
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class Layer:
    def __init__(self, mixer, mlp, cfg: models.ModelConfig, ctx: Ctx):
        self.mixer, self.mlp = mixer, mlp
        self.ln1, self.ln2 = ctx.ones(cfg.hidden), ctx.ones(cfg.hidden)

    def __call__(self, h: torch.Tensor, st: dict) -> torch.Tensor:
        h = h + self.mixer(rms(h, self.ln1), st)
        return h + self.mlp(rms(h, self.ln2))


class DecodeModel:
    """Embedding, the model's layers, final norm and lm_head, in one weight format."""

    def __init__(self, cfg: models.ModelConfig, ctx: Ctx, moe: str, max_batch: int,
                 moe_experts: int, seed: int):  # fmt: skip
        self.cfg, self.ctx = cfg, ctx
        self.embed = ctx.weight(cfg.vocab, cfg.hidden)
        self.layers = []
        self.moe_backend = None
        for i in range(cfg.layers):
            if cfg.family == "llama":
                self.layers.append(
                    Layer(
                        Attention(cfg, ctx, False), MLP(ctx, cfg.hidden, cfg.intermediate), cfg, ctx
                    )
                )
                continue
            if cfg.family != "qwen3_next":
                raise ValueError(f"no decode builder for family {cfg.family!r}")
            mixer = (
                Attention(cfg, ctx, True) if cfg.is_full_attention(i) else GatedDeltaNet(cfg, ctx)
            )
            if moe == "kbit-moe" and ctx.k is not None:
                block = KbitMoEBlock(cfg, ctx, moe_experts)
            else:
                rng = random.Random(seed * 1000 + i)  # same routing in every weight format
                plan = [rng.sample(range(cfg.experts), cfg.top_k) for _ in range(max_batch)]
                block = ExpertLoopMoE(cfg, ctx, plan)
            self.moe_backend = block.backend
            self.layers.append(Layer(mixer, block, cfg, ctx))
        self.norm = ctx.ones(cfg.hidden)
        self.lm_head = ctx.linear(cfg.vocab, cfg.hidden, quantized=ctx.quantize_lm_head)

    def new_state(self, B: int, context: int) -> list[dict]:
        return [layer.mixer.new_state(B, context, self.ctx) for layer in self.layers]

    def step(self, tokens: torch.Tensor, state: list[dict]) -> torch.Tensor:
        h = F.embedding(tokens, self.embed)
        for layer, st in zip(self.layers, state, strict=True):
            h = layer(h, st)
        return self.lm_head(rms(h, self.norm))


# ----------------------------------------------------------------------------- running


def moe_backend(requested: str) -> tuple[str, str]:
    """(backend, why): 'kbit-moe' when asked or auto and kbit_cute.moe.KbitMoE exists."""
    if requested == "loop":
        return "loop", "--moe loop"
    try:
        has = hasattr(importlib.import_module("kbit_cute.moe"), "KbitMoE")
    except Exception as exc:
        has, why = False, f"kbit_cute.moe does not import ({error_text(exc, 80)})"
    else:
        why = "kbit_cute.moe.KbitMoE exists" if has else "kbit_cute.moe has no KbitMoE"
    if requested == "kbit-moe" and not has:
        raise ValueError(f"--moe kbit-moe: {why}")
    return ("kbit-moe" if has else "loop"), why


def measure(model: DecodeModel, B: int, context: int, timer) -> dict:
    """Step time (graph and eager), in-linears time, bytes per step, for batch B."""
    cfg, ctx = model.cfg, model.ctx
    state = model.new_state(B, context)
    tokens = torch.randint(0, cfg.vocab, (B,), generator=ctx.gen, device=ctx.device)
    step = lambda: model.step(tokens, state)
    step()  # compile kernels, allocate workspaces
    ctx.recording = []
    with torch.no_grad():
        logits = step()
    rec, ctx.recording = ctx.recording, None
    finite = bool(torch.isfinite(logits).all())
    weight_bytes = sum(lin.nbytes for lin, _ in rec)
    state_bytes = sum(st["bytes"] for st in state)
    ours = [(lin, x.clone()) for lin, x in rec if lin.quantizable]
    eager_us = timer.time_eager(step)
    step_us = timer.time_graph(step)
    linear_us = timer.time_graph(lambda: [lin.forward(x) for lin, x in ours]) if ours else None
    return dict(step_us=step_us, eager_us=eager_us, linear_us=linear_us,
                weight_bytes=weight_bytes, state_bytes=state_bytes, finite=finite)  # fmt: skip


def run_decode(args, timer) -> dict:
    smoke = timer.kind == "cpu-smoke"
    dtype = DTYPES[args.dtype]
    backend, backend_why = moe_backend(args.moe)
    context = min(args.context, 16) if smoke else args.context
    env = environment(timer)
    read_gbs = timer.read_bandwidth_gbs()
    variants: list[int | None] = [None, *args.k]
    results: list[dict] = []
    notes = [
        f"batch = sequences decoding one token each; KV cache of {context} tokens; torch SDPA",
        "lm_head " + ("kbit" if args.quantize_lm_head else f"{args.dtype} (not quantized)")
        + "; routers, in_proj_ba and the shared-expert gate stay " + args.dtype,
        "in linears: share of the step time spent in the quantizable linear layers "
        "(kbit_cute.gemm for k = 2..5, their F.linear in the baseline), from a graph of "
        "those calls alone on their recorded inputs",
    ]  # fmt: skip
    t0 = time.perf_counter()
    aborted = None
    for name in args.model:
        if aborted:
            break
        cfg = models.get_model(name)
        if smoke:
            cfg = models.tiny(cfg)
        for k in variants:
            if aborted:
                break
            label = args.dtype if k is None else f"k={k}"
            use = backend if cfg.family == "qwen3_next" else "none"
            try:
                model, use, fallback = _build(cfg, k, dtype, timer.device, args, use)
            except Exception as exc:
                results += [_drec(name, B, label, k, "failed", error="build: " + error_text(exc))
                            for B in args.batch]  # fmt: skip
                continue
            if fallback:
                notes.append(f"{name} {label}: KbitMoE failed ({fallback}); expert loop used")
            for B in args.batch:
                try:
                    m = measure(model, B, context, timer)
                except Exception as exc:
                    results.append(
                        _drec(name, B, label, k, "failed", error=error_text(exc), moe=use)
                    )
                    try:
                        timer.synchronize()
                    except Exception as dead:  # the CUDA context is gone: report and stop
                        aborted = f"CUDA context lost ({error_text(dead, 120)})"
                        break
                    continue
                results.append(_drec(name, B, label, k, "ok", moe=use, **m))
                print(f"decode {name} batch {B} {label}: {m['step_us']:.0f} us/step")
            del model
            gc.collect()
            if timer.device.type == "cuda":
                torch.cuda.empty_cache()
    if backend == "loop" and any(models.get_model(n).family == "qwen3_next" for n in args.model):
        notes.append(f"MoE experts: per-expert loop of kbit_cute.gemm calls, host-fixed "
                     f"routing ({backend_why})")  # fmt: skip
    _derive(results, read_gbs)
    return {
        "schema": SCHEMA,
        "kind": "decode",
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "env": env,
        "method": {"timer": timer.kind, "step": "one decode step captured in a CUDA graph, "
                   f"median of {timer.repeats} replays; eager: median of 3 Python-launched steps"},
        "roofline": {"read_gbs": read_gbs},
        "config": {"models": list(args.model), "batches": list(args.batch), "ks": list(args.k),
                   "dtype": args.dtype, "context": context, "moe": backend, "moe_why": backend_why,
                   "moe_experts": args.moe_experts, "quantize_lm_head": args.quantize_lm_head,
                   "seed": args.seed, "notes": notes},
        "elapsed_s": time.perf_counter() - t0,
        "aborted": aborted,
        "results": results,
    }  # fmt: skip


def _build(cfg, k, dtype, device, args, backend):
    """The model in one weight format; KbitMoE failures fall back to the expert loop."""

    def make(moe):
        ctx = Ctx(k, dtype, device, args.seed, args.quantize_lm_head)
        return DecodeModel(cfg, ctx, moe, max(args.batch), args.moe_experts, args.seed)

    if backend != "kbit-moe" or k is None:
        model = make("loop")
        return model, model.moe_backend or "none", None
    try:
        model = make("kbit-moe")
        x = torch.zeros(1, cfg.hidden, dtype=dtype, device=device)
        model.layers[0].mlp(x)  # the module must run, not only build
        return model, "kbit-moe", None
    except Exception as exc:
        gc.collect()
        model = make("loop")
        return model, "loop", error_text(exc, 160)


def _drec(model, B, variant, k, status, error=None, moe=None, **m) -> dict:
    rec = dict(model=model, batch=B, variant=variant, k=k, status=status, error=error, moe=moe,
               step_us=None, eager_us=None, linear_us=None, weight_bytes=None, state_bytes=None,
               finite=None)  # fmt: skip
    rec.update(m)
    return rec


def _derive(results: list[dict], read_gbs: float) -> None:
    base = {
        (r["model"], r["batch"]): r["step_us"] for r in results if r["k"] is None and r["step_us"]
    }
    for r in results:
        t = r["step_us"]
        b = base.get((r["model"], r["batch"]))
        r["tokens_per_s"] = r["batch"] * 1e6 / t if t else None
        r["speedup"] = b / t if t and b else None
        r["linear_frac"] = r["linear_us"] / t if t and r["linear_us"] else None
        total = (r["weight_bytes"] or 0) + (r["state_bytes"] or 0)
        r["roofline_us"] = total / (read_gbs * 1e3) if total else None
        r["pct_roofline"] = 100 * r["roofline_us"] / t if t and r["roofline_us"] else None
