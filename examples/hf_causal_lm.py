"""A Hugging Face causal LM quantized to k bits with kbit_cute, end to end.

    python examples/hf_causal_lm.py                 # GPU: fp16, k=4, 32 tokens
    python examples/hf_causal_lm.py --device cpu    # a quick run without a GPU (no graphs)

Builds a Llama-architecture ``LlamaForCausalLM`` from a small config (random
weights: nothing is downloaded), copies it and ``quantize_model``s the copy at
k=4 (``lm_head`` stays fp16), then

1. greedily generates 32 tokens with the fp16 model, one static-KV-cache decode
   step at a time (each step one CUDA-graph replay);
2. feeds the same tokens through the quantized model step by step and reports
   how often its logits' top-1 token agrees with the fp16 model's, and the mean
   relative error of the logits; then generates 32 tokens with the quantized
   model on its own;
3. times one decode step of each model under CUDA graphs (CUDA events, median).

Random weights give flat next-token distributions, so top-1 agreement is a
harsh test here (near-ties flip on small errors); a trained model agrees more.
Needs ``transformers`` (4.4x or 5.x).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

import kbit_cute


def build_model(args, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=4096,
        initializer_range=args.init_std,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model


def static_cache(model, max_len: int, dtype, device):
    """A StaticCache on either side of the transformers 5 API change."""
    from transformers import StaticCache

    try:  # transformers >= 5: sizes and dtype come from the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.4x
        return StaticCache(
            config=model.config, max_batch_size=1, max_cache_len=max_len, device=device, dtype=dtype
        )


class Decoder:
    """Greedy decoding with a static KV cache; with ``graph`` each step is one replay of a
    captured CUDA graph (static input token, position and cache)."""

    def __init__(self, model, max_len: int, dtype, device, graph: bool):
        self.model, self.device = model, device
        self.cache = static_cache(model, max_len, dtype, device)
        params = inspect.signature(model.model.forward).parameters
        self.pass_cache_position = "cache_position" in params  # transformers 4.4x
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = 0
        self.graph, self.want_graph, self.logits = None, graph, None

    def _forward(self, ids, position_ids, cache_position):
        kw = dict(input_ids=ids, position_ids=position_ids, past_key_values=self.cache)
        if self.pass_cache_position:
            kw["cache_position"] = cache_position
        return self.model(**kw, use_cache=True).logits[:, -1, :]

    def _set_length(self, n: int):
        """transformers 5 keeps the cache length in a device tensor per layer, advanced by
        every forward; set it so warm-up and replays write at the right position."""
        for layer in getattr(self.cache, "layers", []):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor) and length.device.type == self.device.type:
                length.fill_(n)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        n = prompt.shape[1]
        pos = torch.arange(n, device=self.device)
        logits = self._forward(prompt, pos[None], pos)
        self.pos = n
        if self.want_graph:
            self._capture()
        return logits[0]

    def _capture(self):
        self.position_ids.fill_(self.pos)
        self.cache_position.fill_(self.pos)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the graph (kernels loaded, memory sized)
            for _ in range(2):
                self._set_length(self.pos)
                self._forward(self.tok, self.position_ids, self.cache_position)
        torch.cuda.current_stream().wait_stream(s)
        self._set_length(self.pos)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward(self.tok, self.position_ids, self.cache_position)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token (at position ``self.pos``); return the next-token logits."""
        self.tok.copy_(token.view(1, 1))
        self.position_ids.fill_(self.pos)
        self.cache_position.fill_(self.pos)
        self._set_length(self.pos)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits[0].clone()
        else:
            logits = self._forward(self.tok, self.position_ids, self.cache_position)[0]
        self.pos += 1
        return logits


def run(model, prompt, tokens: int, args, dtype, device, force=None):
    """Generate ``tokens`` greedily (or feed ``force``); return (tokens, per-step logits)."""
    dec = Decoder(model, prompt.shape[1] + tokens + 1, dtype, device, args.graphs)
    logits = dec.prefill(prompt)
    out, all_logits = [], []
    for i in range(tokens):
        all_logits.append(logits.float())
        nxt = logits.argmax() if force is None else force[i]
        out.append(int(nxt))
        logits = dec.step(torch.as_tensor(nxt, device=device))
    return torch.tensor(out), torch.stack(all_logits), dec


def step_time_us(dec: Decoder, reps: int) -> float:
    """Median time of one decode step (graph replay, or eager forward without graphs),
    re-running the last step (the cache position is reset first: it must stay in bounds)."""
    dec.pos -= 1
    dec.position_ids.fill_(dec.pos)
    dec.cache_position.fill_(dec.pos)
    if dec.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            dec._set_length(dec.pos)
            dec._forward(dec.tok, dec.position_ids, dec.cache_position)
        return (time.perf_counter() - t0) / reps * 1e6
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dec._set_length(dec.pos)
        a.record()
        if dec.graph is not None:
            dec.graph.replay()
        else:
            dec._forward(dec.tok, dec.position_ids, dec.cache_position)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16, help="prompt length (random token ids)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        args.graphs = False
    dname = args.dtype or ("fp16" if device.type == "cuda" else "fp32")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dname]

    with torch.inference_mode():
        ref = build_model(args, dtype, device)
        quant = build_model(args, dtype, device)  # same seed: the same weights
        kbit_cute.quantize_model(quant, k=args.k, skip=("lm_head",))
        if device.type == "cuda":
            kbit_cute.warmup(k=args.k, dtypes=dtype, m=1)
        prompt = torch.randint(
            args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)
        )
        prompt = prompt.to(device)

        gen_ref, logits_ref, dec_ref = run(ref, prompt, args.tokens, args, dtype, device)
        _, logits_q, dec_q = run(quant, prompt, args.tokens, args, dtype, device, force=gen_ref)
        gen_q, _, _ = run(quant, prompt, args.tokens, args, dtype, device)
        agree = (logits_q.argmax(-1) == logits_ref.argmax(-1)).float().mean().item()
        rel = ((logits_q - logits_ref).norm(dim=-1) / logits_ref.norm(dim=-1)).mean().item()
        same_prefix = int((gen_q == gen_ref).long().cumprod(0).sum())
        t_ref = step_time_us(dec_ref, args.reps)
        t_q = step_time_us(dec_q, args.reps)

    mode = "CUDA graphs" if args.graphs else "eager"
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {dname}, kbit k={args.k}, {device}")
    w = max(len(dname), 4)
    print(f"{dname:<{w}} greedy tokens: {gen_ref.tolist()}")
    print(f"{'kbit':<{w}} greedy tokens: {gen_q.tolist()} (first {same_prefix} identical)")
    print(
        f"top-1 agreement over {args.tokens} teacher-forced decode steps: {agree * 100:.1f}%; "
        f"mean relative logit error {rel:.4f}"
    )
    print(
        f"decode step ({mode}): {dname} {t_ref:.1f} us, kbit k={args.k} {t_q:.1f} us "
        f"({t_ref / t_q:.2f}x)"
    )


if __name__ == "__main__":
    main()
