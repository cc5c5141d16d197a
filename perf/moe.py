"""The MoE layer benchmark of issue 7: ``python -m perf moe``.

Per model (``models.MOE_MODELS``: Qwen3-Coder-Next, GLM-4.7-Flash routed experts,
DeepSeek-V2-Lite), token count T and bit width k, four implementations on the **same
routings** (uniform random top-k distinct experts per token, seeded; ``draw_routing``):

- ``kbit-experts``: ``kbit_cute.grouped_ops.moe_gate_up`` then ``grouped_gemm`` on the
  expert-sorted rows (the expert part of a layer: sorted rows in, sorted rows out), with
  ``overlap=True`` as KbitMoE calls them;
- ``kbit-moe``: the whole ``kbit_cute.moe.KbitMoE`` forward (router, sort, gather, experts,
  combine, shared experts). Its router weight is [I_E | 0] and the tokens carry
  ``ROUTER_LOGIT`` in the channels of their experts, so its own top-k picks exactly the
  routing the others get (``make_routing``);
- ``grouped_mm``: bf16 ``torch._grouped_mm`` (gate_up, SiLU * up, down) over all E experts
  with int32 cumulative row ends, as transformers v5's grouped-mm experts call it;
- ``loop``: one ``F.linear`` pair per touched expert, launched from a host-known routing
  (what a naive implementation does).

**L2-cold expert weights.** A call reads only the experts its routing touches, so rotating
over whole-weight copies (the gemm rule) is not enough: two calls that share an expert would
find it in L2. Every call gets a fresh routing, and the weights are copied until the bytes
one call reads at the smallest T, times (copies - 1), exceed 4x the L2 (``copies_for`` on
per-call bytes, not on all experts): call j uses copy j % copies and routing j, so between
two uses of one copy more than 4x L2 of other weights stream through, whatever the routings.
This also covers models whose experts together are < 4x L2. Copies are capped by free GPU
memory (the record then says ``copies < copies_wanted``). A graph holds max(copies, 20)
calls, each with its own routing; per-call time = replay / calls (perf/common.py).

**Touched bytes** count the distinct experts a routing selects (mean over the graph's
routings): kbit bytes for the kbit rows (tiled words + absmax; KbitMoE adds its shared
experts at k bits and the bf16 router), bf16 bytes for the peers. Derived, per (model, T, k):
kbit GB/s = touched bytes / time; target = touched bytes / measured read bandwidth + 5 us,
and the ratio of the kbit-experts time to it (issue target <= 1.5x at T = 1); speedups of
kbit-experts (and of the whole KbitMoE layer, a stricter comparison) over ``grouped_mm``
(target >= 3x at T <= 16) and over ``loop``.

Every timed implementation is also checked once per point (routing 0) against a float32
per-expert reference on its own weights (dequantized for kbit): relative Frobenius error
above ``CHECK_TOL`` marks the point failed. KbitMoE is checked for shape and finiteness.

``--cpu-smoke`` runs every path on the CPU with toy-sized experts (``tiny_spec``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kbit_cute.moe import sort_by_expert

from . import models
from .common import (
    CALLS_PER_GRAPH,
    PowerCapPause,
    environment,
    error_text,
    progress,
    refresh_versions,
)
from .gemm import DTYPES, _context_lost, _over_budget
from .peers import Impl
from .tables import STATUS_SHORT, fmt, md_table, run_header

SCHEMA = "kbit_cute.perf/1"
DEFAULT_TS = (1, 4, 16, 64)
ROUTER_LOGIT = 4.0  # router logit of a token's chosen experts (all others get 0)
TARGET_OVERHEAD_US = 5.0  # issue 7: target = touched bytes / read bandwidth + 5 us
TARGET_RATIO_T1 = 1.5  # kbit-experts at T = 1 within 1.5x of the target
TARGET_SPEEDUP_GMM = 3.0  # kbit-experts >= 3x torch._grouped_mm at T <= 16
CHECK_TOL = 2e-2  # relative error vs the float32 reference (bf16 rounding is ~4e-3)
MEMORY_FRACTION = 0.6  # weight copies may take this share of the free GPU memory
IMPL_ORDER = ("kbit-experts", "kbit-moe", "grouped_mm", "loop")


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class MoeSpec:
    """One MoE layer: E experts of H -> I -> H, top_k per token, optional shared experts."""

    model: str
    E: int
    top_k: int
    H: int
    I: int  # noqa: E741 - the intermediate size, as in the configs
    shared_I: int  # all shared experts together (0: none)
    shared_gate: bool  # Qwen3-Next: sigmoid(shared_expert_gate(x)) scales the shared expert
    normalize: bool  # top-k weights rescaled to sum 1 (norm_topk_prob; DeepSeek-V2-Lite: no)
    source: str


def moe_spec(name: str, smoke: bool = False) -> MoeSpec:
    """The routed-expert layer of a model in ``models``; ``smoke``: toy sizes (``tiny_spec``)."""
    cfg = models.get_model(name)
    if not cfg.experts:
        raise ValueError(f"model {name!r} has no routed experts")
    spec = MoeSpec(name, cfg.experts, cfg.top_k, cfg.hidden, cfg.moe_intermediate,
                   cfg.shared_intermediate, cfg.family == "qwen3_next",
                   cfg.family != "deepseek_v2", cfg.source)  # fmt: skip
    return tiny_spec(spec) if smoke else spec


def tiny_spec(spec: MoeSpec) -> MoeSpec:
    """CPU-smoke sizes: I = 64 (moe_gate_up needs a multiple of 64), H = 128 >= E; few
    experts, since the CPU path of the grouped ops dequantizes every expert per call."""
    shared = 0 if not spec.shared_I else 64 * max(1, spec.shared_I // spec.I)
    return dataclasses.replace(spec, E=min(spec.E, 8), top_k=min(spec.top_k, 3), H=128, I=64,
                               shared_I=shared)  # fmt: skip


def kbit_expert_bytes(spec: MoeSpec, k: int) -> int:
    """Tiled words + absmax bytes of one expert's gate_up [2I, H] and down [H, I] at k bits."""
    from kbit_cute.ops import tiled_sizes

    total = 0
    for N, K in ((2 * spec.I, spec.H), (spec.H, spec.I)):
        words, blocks = tiled_sizes(k, N, K)
        total += 4 * words + blocks
    return total


def kbit_shared_bytes(spec: MoeSpec, k: int) -> int:
    """What a KbitMoE call reads besides its routed experts: shared experts at k bits (their
    gate stays bf16) and the bf16 router."""
    from kbit_cute.ops import tiled_sizes

    total = 2 * spec.E * spec.H + (2 * spec.H if spec.shared_gate else 0)
    if spec.shared_I:
        for N, K in ((spec.shared_I, spec.H), (spec.shared_I, spec.H), (spec.H, spec.shared_I)):
            words, blocks = tiled_sizes(k, N, K)
            total += 4 * words + blocks
    return total


def expected_touched(spec: MoeSpec, T: int) -> float:
    """Mean distinct experts T tokens with uniform random top-k routing select."""
    return spec.E * (1.0 - (1.0 - spec.top_k / spec.E) ** T)


# ----------------------------------------------------------------------------- routing


def draw_routing(gen: torch.Generator, T: int, E: int, top_k: int) -> torch.Tensor:
    """int64 [T, top_k]: per token top_k distinct experts, uniform at random (CPU generator)."""
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in 1..E={E}, got {top_k}")
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :top_k]


@dataclass
class Routing:
    """One routing and everything each implementation needs for it, on the run's device."""

    T: int
    ids: torch.Tensor  # int64 [T, top_k] (CPU): the experts of each token
    x: torch.Tensor  # [T, H] tokens; channel e < E is ROUTER_LOGIT where e is chosen, else 0
    A: torch.Tensor  # [T * top_k, H] rows of x sorted by expert (kbit_cute.moe.sort_by_expert)
    offsets: torch.Tensor  # int32 [E + 1]: rows offsets[e]:offsets[e+1] go to expert e
    offs: torch.Tensor  # int32 [E]: offsets[1:], torch._grouped_mm's cumulative row ends
    groups: list[tuple[int, int, int]]  # (expert, first row, end row) of the touched experts

    @property
    def touched(self) -> int:
        return len(self.groups)


def make_routing(spec: MoeSpec, ids: torch.Tensor, gen: torch.Generator, dtype, device) -> Routing:
    """Tokens and expert-sorted rows for routing ``ids`` (see ``Routing``).

    A router with weight [I_E | 0] gives logits = x[:, :E]: ROUTER_LOGIT on a token's
    experts, 0 elsewhere, so softmax (or sigmoid) top-k selects exactly ``ids``.
    """
    T, top_k = ids.shape
    E, H = spec.E, spec.H
    if E > H:
        raise ValueError(f"the routing-forcing router needs E <= H, got E={E}, H={H}")
    x = torch.randn(T, H, generator=gen)
    x[:, :E] = 0.0
    x.scatter_(1, ids, ROUTER_LOGIT)
    order, offsets = sort_by_expert(ids, E)  # the library's own sort, on the CPU
    counts = offsets[1:] - offsets[:-1]
    A = x[order // top_k]
    groups = [
        (e, int(offsets[e]), int(offsets[e + 1])) for e in counts.nonzero().flatten().tolist()
    ]
    offsets = offsets.to(device)
    x = x.to(device=device, dtype=dtype)
    return Routing(T, ids, x, A.to(device=device, dtype=dtype), offsets,
                   offsets[1:].contiguous(), groups)  # fmt: skip


class RoutingPool:
    """Routings for one (model, T), drawn on demand from their own seeded generator, so the
    first n are the same whatever implementation asks first and however many it needs."""

    def __init__(self, spec: MoeSpec, T: int, seed: int, dtype, device):
        self.spec, self.T, self.dtype, self.device = spec, T, dtype, device
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + T)
        self.routings: list[Routing] = []

    def first(self, n: int) -> list[Routing]:
        while len(self.routings) < n:
            ids = draw_routing(self.gen, self.T, self.spec.E, self.spec.top_k)
            self.routings.append(make_routing(self.spec, ids, self.gen, self.dtype, self.device))
        return self.routings[:n]


# ----------------------------------------------------------------------------- weights


@dataclass
class MoeWeights:
    """A layer's weights in the run's dtype, transformers v5 layout (out x in per expert)."""

    gate_up: torch.Tensor  # [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
    down: torch.Tensor  # [E, H, I]
    router: torch.Tensor  # [E, H] = [I_E | 0] (see make_routing)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # gate, up [S, H]; down [H, S]
    shared_gate: torch.Tensor | None  # [1, H]: Qwen3-Next's shared_expert_gate


def random_weights(spec: MoeSpec, dtype, device, seed: int) -> MoeWeights:
    """N(0, 1/fan_in) weights (the scale of trained layers), generated in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        w = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return w.mul_(shape[-1] ** -0.5)

    E, H, inter, Is = spec.E, spec.H, spec.I, spec.shared_I
    router = torch.zeros(E, H, dtype=dtype, device=device)
    router[:, :E] = torch.eye(E, dtype=dtype, device=device)
    shared = (randn(Is, H), randn(Is, H), randn(H, Is)) if Is else None
    return MoeWeights(randn(E, 2 * inter, H), randn(E, H, inter), router, shared,
                      randn(1, H) if spec.shared_gate else None)  # fmt: skip


def build_kbit_moe(spec: MoeSpec, w: MoeWeights, k: int):
    """``kbit_cute.moe.KbitMoE.from_experts`` on the layer's weights (quantized on their device)."""
    from kbit_cute.moe import KbitMoE

    return KbitMoE.from_experts(w.gate_up, w.down, w.router, spec.top_k, k,
                                normalize=spec.normalize, shared=w.shared,
                                shared_gate=w.shared_gate)  # fmt: skip


# ----------------------------------------------------------------------------- implementations


def reference(r: Routing, weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]], inter: int):
    """float32 [rows, H] of SiLU(A Wg^T) * (A Wu^T) @ Wd^T per touched expert, sorted rows."""
    out = torch.zeros(r.A.shape[0], r.A.shape[1], dtype=torch.float32, device=r.A.device)
    for e, s, t in r.groups:
        wgu, wd = weights(e)
        h = r.A[s:t].float() @ wgu.float().t()
        out[s:t] = (F.silu(h[:, :inter]) * h[:, inter:]) @ wd.float().t()
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if tuple(y.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(y.shape)}, expected {tuple(ref.shape)}")
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


class MoeImpl(Impl):
    """One implementation; ``prepare`` builds its weight copies, ``make_call`` returns a
    zero-argument call on copy i and one routing, ``check`` its error on a routing. Name,
    key and the lazy import check come from the GEMM suite's ``peers.Impl``."""

    def __init__(self) -> None:
        super().__init__()
        self.expert_bytes = 0  # bytes a call reads per touched expert
        self.fixed_bytes = 0  # bytes a call reads whatever the routing (shared experts, router)
        self.copies_wanted = 0

    def prepare(self, spec: MoeSpec, w: MoeWeights, n_copies: Callable[[int, int, int], int]):
        """n_copies(expert_bytes, fixed_bytes, bytes of one copy) -> how many copies."""
        raise NotImplementedError

    def make_call(self, i: int, r: Routing) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def check(self, r: Routing) -> float | None:
        raise NotImplementedError


def _clone_experts(ex):
    return dataclasses.replace(ex, packed=ex.packed.clone(), absmax=ex.absmax.clone())


class KbitExpertsImpl(MoeImpl):
    name, module = "kbit-experts", "kbit_cute.grouped_ops"

    def __init__(self, k: int):
        super().__init__()
        self.k, self.label = k, f"kbit k={k} moe_gate_up + grouped_gemm"

    def prepare(self, spec, w, n_copies):
        from kbit_cute.experts import quantize_experts

        gu, dn = quantize_experts(w.gate_up, self.k), quantize_experts(w.down, self.k)
        self.I = spec.I
        self.expert_bytes = gu.nbytes_per_expert + dn.nbytes_per_expert
        n = n_copies(self.expert_bytes, 0, gu.nbytes + dn.nbytes)
        self.copies = [(gu, dn)] + [(_clone_experts(gu), _clone_experts(dn)) for _ in range(n - 1)]

    def make_call(self, i, r):
        from kbit_cute.grouped_ops import grouped_gemm, moe_gate_up

        gu, dn = self.copies[i]
        A, off, T = r.A, r.offsets, r.T
        # As KbitMoE calls them: neither launch follows a kernel that writes the offsets.
        return lambda: grouped_gemm(
            moe_gate_up(A, gu, off, max_rows_per_expert=T, overlap=True), dn, off,
            max_rows_per_expert=T, overlap=True,
        )  # fmt: skip

    def check(self, r):
        from kbit_cute.ops import dequantize

        gu, dn = self.copies[0]
        y = self.make_call(0, r)()
        f32 = torch.float32
        ref = reference(r, lambda e: (dequantize(gu.expert(e), f32), dequantize(dn.expert(e), f32)),
                        self.I)  # fmt: skip
        return rel_err(y, ref)


class KbitMoEImpl(MoeImpl):
    name, module = "kbit-moe", "kbit_cute.moe"

    def __init__(self, k: int):
        super().__init__()
        self.k, self.label = k, f"kbit k={k} KbitMoE layer"

    def prepare(self, spec, w, n_copies):
        moe = build_kbit_moe(spec, w, self.k)
        self.spec = spec
        self.expert_bytes = kbit_expert_bytes(spec, self.k)
        self.fixed_bytes = kbit_shared_bytes(spec, self.k)
        n = n_copies(
            self.expert_bytes, self.fixed_bytes, spec.E * self.expert_bytes + self.fixed_bytes
        )
        self.copies = [moe]
        for _ in range(n - 1):
            try:
                self.copies.append(copy.deepcopy(moe))
            except Exception:  # a module that cannot be deep-copied: build another one
                self.copies.append(build_kbit_moe(spec, w, self.k))

    def make_call(self, i, r):
        moe, x = self.copies[i], r.x
        return lambda: moe(x)

    def check(self, r):
        y = self.make_call(0, r)()
        want = (r.T, self.spec.H)
        if tuple(y.shape) != want:
            raise ValueError(f"KbitMoE output shape {tuple(y.shape)}, expected {want}")
        if not bool(torch.isfinite(y).all()):
            raise ValueError("KbitMoE output has NaN or Inf")
        return None


class GroupedMMImpl(MoeImpl):
    name, label = "grouped_mm", "torch._grouped_mm bf16"

    def unavailable(self):
        if hasattr(torch, "_grouped_mm"):
            return None
        return f"torch {torch.__version__} has no _grouped_mm"

    def prepare(self, spec, w, n_copies):
        self.I = spec.I
        self.expert_bytes = 3 * spec.I * spec.H * w.down.element_size()
        n = n_copies(self.expert_bytes, 0, w.gate_up.nbytes + w.down.nbytes)
        # [E, H, 2I] / [E, I, H] column-major views: mat_b of x @ W^T, no transposed copy.
        self.copies = [(w.gate_up.transpose(1, 2), w.down.transpose(1, 2))] + [
            (w.gate_up.clone().transpose(1, 2), w.down.clone().transpose(1, 2))
            for _ in range(n - 1)
        ]

    def make_call(self, i, r):
        gut, dnt = self.copies[i]
        A, offs, inter = r.A, r.offs, self.I

        def call():
            h = torch._grouped_mm(A, gut, offs=offs)
            return torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], dnt, offs=offs)

        return call

    def check(self, r):
        gut, dnt = self.copies[0]
        y = self.make_call(0, r)()
        return rel_err(y, reference(r, lambda e: (gut[e].t(), dnt[e].t()), self.I))


class LoopImpl(MoeImpl):
    name, label = "loop", "F.linear loop bf16"

    def prepare(self, spec, w, n_copies):
        self.I, self.H = spec.I, spec.H
        self.expert_bytes = 3 * spec.I * spec.H * w.down.element_size()
        n = n_copies(self.expert_bytes, 0, w.gate_up.nbytes + w.down.nbytes)
        self.copies = [(w.gate_up, w.down)] + [
            (w.gate_up.clone(), w.down.clone()) for _ in range(n - 1)
        ]

    def make_call(self, i, r):
        gu, dn = self.copies[i]
        A, inter, R = r.A, self.I, r.A.shape[0]
        work = [(A[s:t], gu[e], dn[e].t(), s, t) for e, s, t in r.groups]

        def call():
            out = A.new_empty(R, self.H)
            for a, wgu, wdt, s, t in work:
                h = F.linear(a, wgu)
                torch.mm(F.silu(h[:, :inter]) * h[:, inter:], wdt, out=out[s:t])
            return out

        return call

    def check(self, r):
        gu, dn = self.copies[0]
        y = self.make_call(0, r)()
        return rel_err(y, reference(r, lambda e: (gu[e], dn[e]), self.I))


def make_impls(ks) -> list[MoeImpl]:
    """bf16 peers first (timed once per model: they do not depend on k), then kbit per k."""
    out: list[MoeImpl] = [GroupedMMImpl(), LoopImpl()]
    for k in ks:
        out += [KbitExpertsImpl(k), KbitMoEImpl(k)]
    return out


# ----------------------------------------------------------------------------- the run


def _record(spec: MoeSpec, impl: MoeImpl, T: int, status: str, **kw) -> dict:
    rec = dict(model=spec.model, T=T, impl=impl.name, k=impl.k, status=status, error=None,
               graph_us=None, eager_us=None, calls=None, copies=len(impl.copies) or None,
               copies_wanted=impl.copies_wanted or None, touched_experts=None,
               touched_bytes=None, expert_bytes=impl.expert_bytes or None,
               fixed_bytes=impl.fixed_bytes, rel_err=None, warm_s=None)  # fmt: skip
    rec.update(kw)
    return rec


def _time_point(spec, impl: MoeImpl, T: int, pool: RoutingPool, timer) -> dict:
    n_copies = len(impl.copies)
    calls = max(n_copies, CALLS_PER_GRAPH if timer.kind == "cuda" else 1)
    try:
        routings = pool.first(calls)
        touched = sum(r.touched for r in routings) / calls
        nbytes = touched * impl.expert_bytes + impl.fixed_bytes
        fns = [impl.make_call(j % n_copies, routings[j]) for j in range(calls)]
        t = timer.time_calls(fns)
    except Exception as exc:
        return _record(spec, impl, T, "failed", error=error_text(exc))
    info = dict(graph_us=t.graph_us, eager_us=t.eager_us, calls=t.calls, warm_s=t.warm_s,
                touched_experts=touched, touched_bytes=nbytes)  # fmt: skip
    if t.graph_us is None:
        return _record(spec, impl, T, "failed", error=t.error, **info)
    try:
        err = impl.check(routings[0])
    except Exception as exc:
        return _record(spec, impl, T, "failed", error="check: " + error_text(exc), **info)
    if err is not None and not err <= CHECK_TOL:
        return _record(spec, impl, T, "failed", rel_err=err,
                       error=f"check: relative error {err:.3g} > {CHECK_TOL}", **info)  # fmt: skip
    return _record(spec, impl, T, "ok", rel_err=err, **info)


def _copies_rule(timer, per_call_touched: float):
    """n_copies(expert_bytes, fixed_bytes, copy_bytes) for prepare: L2-cold rotation on the
    bytes one call reads (module docstring), capped by free GPU memory."""

    def n_copies(expert_bytes: int, fixed_bytes: int, copy_bytes: int) -> int:
        per_call = max(1, int(per_call_touched * expert_bytes + fixed_bytes))
        want = timer.copies_for(per_call)
        n = want
        if timer.kind == "cuda":
            free = torch.cuda.mem_get_info()[0]
            n = max(1, min(want, 1 + int(MEMORY_FRACTION * free // max(copy_bytes, 1))))
        n_copies.wanted = want
        return n

    n_copies.wanted = 0
    return n_copies


def run_moe(args, timer) -> dict:
    """Time every (model, implementation, T) and return the run's JSON dict."""
    smoke = timer.kind == "cpu-smoke"
    dtype = DTYPES[args.dtype]
    device = timer.device
    specs = [moe_spec(name, smoke) for name in args.model]
    ts = list(args.t)
    impls = make_impls(args.k)
    env = environment(timer)
    read_gbs = timer.read_bandwidth_gbs()
    print(f"moe: {len(specs)} models x {len(impls)} implementations x {len(ts)} T "
          f"(budget {args.budget_s:.0f} s; 0 = none); read bandwidth {read_gbs:.0f} GB/s")  # fmt: skip
    why_not = {impl.key: impl.unavailable() for impl in impls}
    results: list[dict] = []
    t0 = time.perf_counter()
    fatal: str | None = None
    bar = progress(len(specs) * len(impls) * len(ts), "moe")
    power_cap = PowerCapPause(timer.cool_down)
    try:
        with torch.no_grad():
            for mi, spec in enumerate(specs):
                pools = {T: RoutingPool(spec, T, args.seed * 101 + mi, dtype, device) for T in ts}
                w, err = None, fatal
                if not fatal:
                    try:
                        w = random_weights(spec, dtype, device, args.seed + mi)
                    except Exception as exc:  # e.g. out of memory: this model fails, run goes on
                        err = "weights: " + error_text(exc)
                        fatal = _context_lost(timer, err)
                for impl in impls:
                    if w is None:  # no weights (or a lost context): every point says why
                        status = "skipped" if fatal else "failed"
                        results += [_record(spec, impl, T, status, error=err) for T in ts]
                        for _ in ts:
                            bar.update()
                        continue
                    fatal = _run_impl(spec, impl, w, ts, pools, why_not, timer, args, t0,
                                      results, bar, fatal, power_cap)  # fmt: skip
                del w, pools
                _free(timer)
    except KeyboardInterrupt:
        fatal = "interrupted"
    except Exception as exc:  # a bug or a dead context: keep what was measured
        fatal = "moe run error: " + error_text(exc)
    finally:
        bar.close()
    refresh_versions(env)
    derive(results, read_gbs)
    return {
        "schema": SCHEMA,
        "kind": "moe",
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "env": env,
        "method": _method(timer),
        "roofline": {"read_gbs": read_gbs},
        "config": {
            "models": list(args.model),
            "ts": ts,
            "ks": list(args.k),
            "dtype": args.dtype,
            "impls": [dict(key=i.key, impl=i.name, k=i.k, label=i.label) for i in impls],
            "specs": [dataclasses.asdict(s) for s in specs],
            "budget_s": args.budget_s,
            "seed": args.seed,
        },
        "elapsed_s": time.perf_counter() - t0,
        "aborted": fatal,
        "results": results,
    }


def _run_impl(spec, impl, w, ts, pools, why_not, timer, args, t0, results, bar, fatal, power_cap):
    """Prepare one implementation's copies, time it at every T, free them. Returns the fatal
    reason (lost CUDA context) that stops the run, or None. ``power_cap``: the sweep's
    ``PowerCapPause`` (T tokens count as its rows)."""
    stop = fatal or _over_budget(args.budget_s, t0)
    if why_not[impl.key] or stop:
        status = "unavailable" if why_not[impl.key] else "skipped"
        for T in ts:
            results.append(_record(spec, impl, T, status, error=why_not[impl.key] or stop))
            bar.update()
        return fatal
    rule = _copies_rule(timer, expected_touched(spec, min(ts)))
    try:
        impl.prepare(spec, w, rule)
        impl.copies_wanted = rule.wanted
    except Exception as exc:
        err = "prepare: " + error_text(exc)
        results += [_record(spec, impl, T, "failed", error=err) for T in ts]
        for _ in ts:
            bar.update()
        impl.release()
        return _context_lost(timer, err)
    for T in ts:
        stop = fatal or _over_budget(args.budget_s, t0)
        if stop:
            results.append(_record(spec, impl, T, "skipped", error=stop))
        else:
            power_cap.before(T)
            results.append(_time_point(spec, impl, T, pools[T], timer))
            if results[-1]["status"] == "failed":
                fatal = _context_lost(timer, results[-1]["error"])
        bar.update(f"{spec.model} {impl.key} T={T}")
    impl.release()
    impl.copies_wanted = 0
    _free(timer)
    return fatal


def _free(timer) -> None:
    """Give the released copies back to the GPU before the next implementation builds its."""
    if timer.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _method(timer) -> dict:
    return {
        "timer": timer.kind,
        "l2_bytes": timer.l2_bytes,
        "routing": "uniform random top-k distinct experts per token (seeded), a fresh routing "
        "per call of a graph; the same routings for every implementation",
        "rotation": "weight copies until (copies - 1) x bytes one call reads at the smallest T "
        "> 4x L2; call j uses copy j % copies (capped by free memory: copies_wanted)",
        "graph": f"max(copies, {CALLS_PER_GRAPH}) calls per CUDA graph; median of "
        f"{timer.repeats} replays / calls",
        "eager": f"same calls launched from Python, CUDA events, median of {timer.eager_repeats}",
        "target": f"touched kbit bytes / read GB/s (1 GiB .sum()) + {TARGET_OVERHEAD_US:g} us",
        "check": f"routing 0 vs a float32 per-expert reference, relative error <= {CHECK_TOL}",
    }


def derive(results: list[dict], read_gbs: float) -> None:
    """GB/s of every ok point; for kbit points the speedups over the bf16 peers at the same
    (model, T); for kbit-experts the target, its ratio and ``targets``: "met", "missed ..."
    or None where none of the issue's targets applies (T > 16)."""

    def ok(r: dict | None) -> float | None:
        return r["graph_us"] if r and r["status"] == "ok" else None

    peer = {(r["model"], r["T"], r["impl"]): r for r in results if r["k"] is None}
    for r in results:
        t = ok(r)
        r["gbs"] = r["touched_bytes"] / (t * 1e3) if t and r["touched_bytes"] else None
        if r["k"] is None:
            continue
        for name in ("grouped_mm", "loop"):
            b = ok(peer.get((r["model"], r["T"], name)))
            r[f"vs_{name}"] = b / t if t and b else None
        if r["impl"] != "kbit-experts":
            continue
        tb = r["touched_bytes"]
        r["target_us"] = tb / (read_gbs * 1e3) + TARGET_OVERHEAD_US if tb else None
        r["target_ratio"] = t / r["target_us"] if t and r["target_us"] else None
        targets = {}
        if r["T"] == 1 and r["target_ratio"] is not None:
            targets[f"<= {TARGET_RATIO_T1:g}x target"] = r["target_ratio"] <= TARGET_RATIO_T1
        if r["T"] <= 16 and r["vs_grouped_mm"] is not None:
            targets[f">= {TARGET_SPEEDUP_GMM:g}x grouped_mm"] = (
                r["vs_grouped_mm"] >= TARGET_SPEEDUP_GMM
            )
        missed = [name for name, met in targets.items() if not met]
        r["targets"] = None if not targets else "missed " + ", ".join(missed) if missed else "met"


# ----------------------------------------------------------------------------- tables


def _cell(r: dict | None, value: str) -> str:
    if r is None:
        return ""
    return value if r["status"] == "ok" else STATUS_SHORT.get(r["status"], r["status"])


def _label(r: dict) -> str:
    return r["impl"] if r["k"] is None else f"{r['impl']} k={r['k']}"


def detail_table(run: dict) -> tuple[list[str], list[list]]:
    """Every point: time (graph, eager), experts and MB read, GB/s, copies, error, status."""
    headers = ["model", "T", "implementation", "us (graph)", "us (eager)", "experts",
               "MB read", "GB/s", "copies", "rel err", "status"]  # fmt: skip
    rows = []
    order = {name: i for i, name in enumerate(IMPL_ORDER)}
    for r in sorted(run["results"], key=lambda r: (run["config"]["models"].index(r["model"]),
                    r["T"], r["k"] or 0, order[r["impl"]])):  # fmt: skip
        status = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:80]}"
        copies = r.get("copies")
        if copies and r.get("copies_wanted") and copies < r["copies_wanted"]:
            copies = f"{copies} (of {r['copies_wanted']})"
        mb = r.get("touched_bytes")
        rows.append([r["model"], r["T"], _label(r), fmt(r.get("graph_us")), fmt(r.get("eager_us")),
                     fmt(r.get("touched_experts"), ".1f"), fmt(mb and mb / 1e6, ".1f"),
                     fmt(r.get("gbs"), ".0f"), copies, fmt(r.get("rel_err"), ".1e"), status])  # fmt: skip
    return headers, rows


def summary_table(run: dict) -> tuple[list[str], list[list]]:
    """One row per (model, T, k): kbit experts vs its target and the bf16 peers, KbitMoE."""
    headers = ["model", "T", "k", "experts", "kbit MB", "kbit us", "target us", "x target",
               "GB/s", "KbitMoE us", "grouped_mm us", "loop us", "vs grouped_mm", "vs loop",
               "targets"]  # fmt: skip
    by = {(r["model"], r["T"], r["impl"], r["k"]): r for r in run["results"]}
    rows = []
    for model in run["config"]["models"]:
        for T in run["config"]["ts"]:
            gmm, loop = by.get((model, T, "grouped_mm", None)), by.get((model, T, "loop", None))
            for k in run["config"]["ks"]:
                kb, moe = by.get((model, T, "kbit-experts", k)), by.get((model, T, "kbit-moe", k))
                if kb is None:
                    continue
                ok = kb["status"] == "ok"
                mb = kb.get("touched_bytes")
                rows.append([
                    model, T, k, fmt(kb.get("touched_experts"), ".1f"),
                    fmt(mb and mb / 1e6, ".1f"), _cell(kb, fmt(kb["graph_us"])),
                    fmt(kb.get("target_us")), _cell(kb, fmt(kb.get("target_ratio"), ".2f", "x")),
                    _cell(kb, fmt(kb.get("gbs"), ".0f")),
                    _cell(moe, fmt(moe and moe["graph_us"])),
                    _cell(gmm, fmt(gmm and gmm["graph_us"])),
                    _cell(loop, fmt(loop and loop["graph_us"])),
                    fmt(kb.get("vs_grouped_mm") if ok else None, ".2f", "x"),
                    fmt(kb.get("vs_loop") if ok else None, ".2f", "x"),
                    kb.get("targets") or "",
                ])  # fmt: skip
    return headers, rows


def markdown(run: dict) -> str:
    """The run's moe.md: header, the summary, then every point."""
    h, rows = summary_table(run)
    out = [run_header(run), "", f"### MoE layer ({run['config']['dtype']})", "", md_table(h, rows)]
    h, rows = detail_table(run)
    out += ["", "### All points", "", md_table(h, rows)]
    return "\n".join(out) + "\n"
