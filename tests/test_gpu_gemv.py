"""GEMV (M <= 8; M <= 64 in row sets on small weights) on the GPU against the float32
reference of the dequantized weight."""

import os

import pytest
import torch

import kbit_cute
from kbit_cute import ops
from kbit_cute.kernels.gemv import QUAD_SKEW

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
SHAPES = [
    (2048, 512),
    (512, 2048),
    (2048, 5120),
    (5120, 2048),
    (4096, 2048),
    (2048, 4096),
    (1056, 1000),
]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def reference(A, qw, bias=None):
    r = A.float() @ kbit_cute.dequantize(qw, torch.float32).T
    return r if bias is None else r + bias.float()


@pytest.fixture(scope="module")
def weights():
    """One quantized weight per (shape, k), fresh random data each session."""
    g = torch.Generator(device="cuda").manual_seed(
        int.from_bytes(__import__("os").urandom(4), "little")
    )
    return {
        (K, N, k): kbit_cute.quantize(torch.randn(N, K, device="cuda", generator=g) * 0.05, k)
        for K, N in SHAPES
        for k in KS
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_gemv_matches_reference(K, N, k, M, dtype, weights):
    qw = weights[(K, N, k)]
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    got = kbit_cute.gemm(A, qw, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), "an output element was not written"
    assert rel_err(got, reference(A, qw)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_leading_dims_and_bias(dtype, weights):
    K, N, k = 2048, 4096, 4
    qw = weights[(K, N, k)]
    A = torch.randn(2, 2, K, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    got = kbit_cute.gemm(A, qw, bias=bias)
    assert got.shape == (2, 2, N) and got.dtype == dtype
    assert rel_err(got.view(4, N), reference(A.view(4, K), qw, bias)) < TOL[dtype]


def test_gemv_alternating_shapes_match_fresh_calls(weights):
    """Split-K workspace and counters stay right across calls of different shapes and M."""
    ks, ms = [2, 5, 3, 4, 4, 2, 5], [1, 4, 2, 8, 3, 5, 2]
    cases = [(K, N, k, M) for (K, N), k, M in zip(SHAPES, ks, ms, strict=True)]
    inputs = {c: torch.randn(c[3], c[0], device="cuda", dtype=torch.float16) for c in cases}
    fresh = {c: kbit_cute.gemm(inputs[c], weights[c[:3]]).clone() for c in cases}
    for _ in range(3):
        for c in cases[::-1] + cases:
            assert torch.equal(kbit_cute.gemm(inputs[c], weights[c[:3]]), fresh[c]), c


ROW_SET_MS = (9, 12, 16, 17, 24, 32, 41, 48, 57, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_row_sets_match_reference(K, N, k, dtype, weights):
    """M = 9..64 on the weights the GEMV serves them for (``ops.gemv_max_m``): sets of 8
    rows (the last one partial at 9, 12, 17, 41, 57), into a NaN-poisoned out, bit-identical
    on a second call."""
    qw = weights[(K, N, k)]
    served = [M for M in ROW_SET_MS if M <= ops.gemv_max_m(N, K, k)]
    assert served, "every shape here is small enough for row sets"
    for M in served:
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        got = kbit_cute.gemm(A, qw, out=out)
        assert not torch.isnan(got).any(), (M, "an output element was not written")
        assert rel_err(got, reference(A, qw)) < TOL[dtype], M
        assert torch.equal(kbit_cute.gemm(A, qw), got), M


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_sets_leading_dims_bias_and_alternating_m(dtype, weights):
    """Row sets with leading dims and bias, and calls that alternate between row-set counts,
    plain GEMV rows and the GEMM (4096 x 14336: no row sets) match fresh calls: each set's
    slots and counters are left as the next call needs them."""
    K, N, k = 4096, 2048, 3
    qw = weights[(K, N, k)]
    A = torch.randn(2, 12, K, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    got = kbit_cute.gemm(A, qw, bias=bias)
    assert got.shape == (2, 12, N)
    assert rel_err(got.view(24, N), reference(A.view(24, K), qw, bias)) < TOL[dtype]
    big = kbit_cute.quantize(torch.randn(14336, 4096, device="cuda") * 0.05, k)
    assert ops.gemv_max_m(14336, 4096, k) == ops.GEMV_MAX_M < 16 <= ops.gemv_max_m(N, K, k)
    cases = [(qw, M) for M in (32, 3, 16, 9, 1, 24, 17)] + [(big, 16), (big, 4)]
    inputs = {i: torch.randn(M, c.K, device="cuda", dtype=dtype) for i, (c, M) in enumerate(cases)}
    fresh = {i: kbit_cute.gemm(inputs[i], cases[i][0]).clone() for i in inputs}
    for _ in range(2):
        for i in list(inputs)[::-1] + list(inputs):
            assert torch.equal(kbit_cute.gemm(inputs[i], cases[i][0]), fresh[i]), cases[i][1]
    dev = torch.cuda.current_device()
    slots = ops._split_states[(dev, ops._raw_stream(dev))].slots
    assert (slots.view(torch.int32) == -1).all()  # every set's slots empty again


@pytest.mark.parametrize("K, N", [(5120, 2048), (2048, 5120)])
@pytest.mark.parametrize("workers", [1, 5, "tiles", 37, 1000, "s8", "s32"])
def test_gemv_stream_k_is_deterministic(K, N, workers, weights):
    """Any stream-K grid: one worker for all (whole strips only), runs over several column
    tiles with partial ends (5), one per column tile (no partials), partial strips summed
    from 2-3 (37) or 25-63 (1000) workers, s-way splits (8, 32); at M = 4 both shapes take the
    GEMV variant with CTA groups (``finish_cta_group``; 20 and 8 splits of the library's), so
    the aligned grids run its groups (CTAs of 1-7 workers) and the others its per-worker
    hand-over; bit-identical run to run."""
    k = 4
    n_tiles = N // 128
    if isinstance(workers, str):
        workers = n_tiles * (1 if workers == "tiles" else int(workers[1:]))
    qw = weights[(K, N, k)]
    A = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
    out = torch.full((4, N), float("nan"), device="cuda", dtype=A.dtype)
    first = ops._gemv(A, qw, None, out, 4, workers).clone()
    assert rel_err(first, reference(A, qw)) < TOL[torch.bfloat16]
    plan = ops._gemv_plans[(k, N, K, torch.cuda.current_device(), A.dtype)]
    assert plan.groups[(4, 1)]  # M = 4 takes the variant with CTA groups on both shapes
    for _ in range(5):
        again = ops._gemv(A, qw, None, out.fill_(float("nan")), 4, workers)
        assert torch.equal(again, first)


@pytest.mark.parametrize("M", [1, 3, 8, 24])
def test_gemv_leaves_every_split_slot_empty(M, weights):
    """The polled hand-over's invariant: after any call the stream's slots are all
    EMPTY_SLOT again, whatever the split (16-way, runs over several strips, 63 workers a
    strip; at M = 3, 8 2048x5120 takes the variant with CTA groups: 8- and 32-way splits
    and, per worker, 1000; M = 24 runs three row sets of each grid), so the next call's owner
    waits for the partials of its own call."""
    for (K, N, k), workers in [((5120, 2048, 4), None), ((5120, 2048, 3), 5),
                               ((2048, 512, 5), 1000), ((1056, 1000, 2), 37),
                               ((2048, 5120, 3), None), ((2048, 5120, 4), 1280),
                               ((2048, 5120, 2), 1000)]:  # fmt: skip
        qw = weights[(K, N, k)]
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=A.dtype)
        got = ops._gemv(A, qw, None, out, M, workers)
        assert rel_err(got, reference(A, qw)) < TOL[torch.float16]
        dev = torch.cuda.current_device()
        slots = ops._split_states[(dev, ops._raw_stream(dev))].slots
        assert (slots.view(torch.int32) == -1).all(), (K, N, k, workers)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", KS)
def test_gemv_balanced_splits_match_reference(k, dtype):
    """Shapes whose split count ``ops.balanced_splits`` raises past the power-of-two rule
    (3584x3584: 8 -> 14 at M = 1; 2560x9728: 2 -> 5 at M = 1..8), through ``kbit_cute.gemm``
    twice per M (the slots left empty for the next call)."""
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for K, N in [(3584, 3584), (2560, 9728)]:
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda") * 0.05, k)
        for M in (1, 2, 4, 6):
            m = ops._M_BUCKET[M]
            workers, _ = ops.gemv_grid(k, m, dtype, N, K, sm)
            n_tiles = -(-N // 128)
            if sm == 132 and (M == 1 or K == 2560):
                assert workers != n_tiles * ops.gemv_splits(N, K, sm, m), "not balanced"
            for _ in range(2):
                A = torch.randn(M, K, device="cuda", dtype=dtype)
                out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                got = kbit_cute.gemm(A, qw, out=out)
                assert not torch.isnan(got).any(), (K, N, M)
                assert rel_err(got, reference(A, qw)) < TOL[dtype], (K, N, M)


def test_gemm_large_m_falls_back_correctly(weights):
    qw = weights[(1056, 1000, 3)]
    A = torch.randn(37, 1056, device="cuda", dtype=torch.float16)
    assert rel_err(kbit_cute.gemm(A, qw), reference(A, qw)) < TOL[torch.float16]


@pytest.mark.parametrize("M", [1, 16])
def test_gemv_under_cuda_graph(M, weights):
    qw = weights[(2048, 5120, 4)]
    A = torch.randn(M, 2048, device="cuda", dtype=torch.float16)
    out = torch.empty(M, 5120, device="cuda", dtype=torch.float16)
    kbit_cute.gemm(A, qw, out=out)  # warm: compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kbit_cute.gemm(A, qw, out=out)
    for _ in range(3):
        A.copy_(torch.randn_like(A))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(A, qw)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("workers", ["s1", 13])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_gemv_pair_table_option(k, workers, dtype, weights):
    """The shared-memory pair-table lookup with 8 stream-K quads per CTA sharing one table
    (a tuning option: the default CTA holds at most 7), against the reference; the split-K
    counters are left at zero."""
    from perf import gemv_kernel_check
    from perf.gemv_kernel_check import run_gemv

    K, N, M = 1056, 1000, 3
    qw = weights[(K, N, k)]
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    run_gemv(A, qw, out, workers, None, "pair_table", 8)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(A, qw)) < TOL[dtype]
    assert not gemv_kernel_check._counters.any(), "split-K counters must be left at zero"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "k, stages, lookup",
    [(2, None, None), (3, None, None), (4, None, None), (5, None, None), (5, 2, None),
     (5, None, "shuffle")],
)  # fmt: skip
def test_gemv_runs_across_strips_keep_the_ring_running(k, stages, lookup, dtype):
    """The ``crossing`` variant, whose ring runs on across a strip's end (the shipped ones:
    k = 2, 3, 5, k = 5's 2-stage ring; k = 4, and the shuffle lookup: no table, so its
    copies start after the CTA's setup instead of before a table fill), on grids whose runs
    cross strips: strips of one K tile (K = 64: every step after the first a crossing), of
    two (K = 128: under the ring's depth), of three (K = 160), runs over several strips (5
    workers), partial strips of 2-3 workers (37), the even grid ``ops.even_workers`` gives
    4096x14336 (528 workers, runs of 13-14 of its 64 K tiles; 924 workers, 7 quads a CTA).
    Bit-identical to the variant that drains and refills the ring at each crossing (the same
    sums in the same order) where the runs are equal, within the reference's tolerance; the
    split slots left empty (k = 2 and 4 with ``row_roles`` on sm_90 in both variants). Where
    ``gemv.QUAD_SKEW`` shifts them (k = 3 on 4096x14336: by up to a K tile), its own repeat
    bit-identical instead."""
    from perf import gemv_kernel_check
    from perf.gemv_kernel_check import run_gemv

    for K, N, workers in [(64, 512, 3), (64, 1000, 5), (128, 1000, 37), (160, 200, 4),
                          (1056, 1000, 5), (1056, 1000, 37), (4096, 14336, 528),
                          (4096, 14336, 924)]:  # fmt: skip
        qw = kbit_cute.quantize(torch.randn(N, K, device="cuda") * 0.05, k)
        A = torch.randn(1, K, device="cuda", dtype=dtype)
        skewed = QUAD_SKEW.get(k, 0) > 0 and K == 4096
        own_repeat = skewed
        got = []
        for crossing in (True, own_repeat):
            out = torch.full((1, N), float("nan"), device="cuda", dtype=dtype)
            run_gemv(A, qw, out, workers, stages, lookup, crossing=crossing)
            got.append(out)
        assert torch.equal(got[0], got[1]), (K, N, workers)
        assert rel_err(got[0], reference(A, qw)) < TOL[dtype], (K, N, workers)
        assert (gemv_kernel_check._ws.view(torch.int32) == -1).all(), "slots left empty"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("workers", ["s1", 13])
@pytest.mark.parametrize(
    "lookup, stages", [("pair_table5", None), ("pair_table5", 2), ("shuffle", None)]
)
def test_gemv_k5_variants_on_an_odd_shape(lookup, stages, workers, M, dtype, weights):
    """k = 5's three GEMV variants, launched directly (those ``ops.gemv_variant`` picks from:
    the 128 KB pair table with a 3- or 2-stage ring, the shuffles of small weights), on a
    shape padded in N and K, with and without split-K."""
    from perf import gemv_kernel_check
    from perf.gemv_kernel_check import run_gemv

    K, N = 1056, 1000
    qw = weights[(K, N, 5)]
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    run_gemv(A, qw, out, workers, stages, lookup)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference(A, qw)) < TOL[dtype]
    assert not gemv_kernel_check._counters.any(), "split-K counters must be left at zero"


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gemv_table_follows_the_codebook_the_kernel_before_wrote(k):
    """A codebook rewritten by the kernel just before, on the same stream: another GEMV
    whose output is this weight's codebook (bf16 pairs read as fp32), new values every
    round. (The GEMV may launch while that kernel still runs, programmatic dependent launch;
    it reads the codebook only after waiting for it. A read before the wait would rarely
    lose the race here, so this is a correctness check, not proof of the order.)"""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    # (k = 5: a weight large enough for its table, ``gemv.SMALL_WEIGHT``)
    K2, N2, K1 = 2048, 4104 if k == 5 else 1000, 256
    qw2 = kbit_cute.quantize(torch.randn(N2, K2, device="cuda", generator=g) * 0.05, k)
    A2 = torch.randn(3, K2, device="cuda", dtype=torch.bfloat16, generator=g)
    kbit_cute.gemm(A2, qw2)  # plan and load the variant
    # The first GEMV writes 2 x 2^k bf16 outputs over the 2^k fp32 entries: rows of one
    # positive value each, so every output (and every fp32 entry) is finite and distinct.
    values = 0.5 + torch.arange(2 << k, device="cuda", dtype=torch.float32) / (2 << k)
    qw1 = kbit_cute.quantize(values[:, None].expand(-1, K1) / K1, k)
    cb_as_bf16 = qw2.codebook.view(torch.bfloat16).view(1, 2 << k)
    for r in range(4):
        A1 = torch.full((1, K1), 1.0 + r, device="cuda", dtype=torch.bfloat16)
        before = qw2.codebook.clone()
        kbit_cute.gemm(A1, qw1, out=cb_as_bf16)
        out = torch.full((3, N2), float("nan"), device="cuda", dtype=torch.bfloat16)
        kbit_cute.gemm(A2, qw2, out=out)
        torch.cuda.synchronize()
        assert not torch.equal(before, qw2.codebook), "the first GEMV did not change the codebook"
        assert torch.isfinite(qw2.codebook).all()
        assert rel_err(out, reference(A2, qw2)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("M", [1, 4])
def test_gemv_chain_reads_what_the_split_gather_wrote(M, weights):
    """A GEMV whose activations are the previous GEMV's output, both split-K: the outputs of
    split strips are stored by the owners' gather, which runs after the next launch was let
    in (programmatic dependent launch); its wait must still cover them. The first output is
    poisoned with NaN before every round."""
    qw1, qw2 = weights[(4096, 2048, 4)], weights[(2048, 5120, 2)]
    A1 = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    out1 = torch.empty(M, 2048, device="cuda", dtype=torch.float16)
    for _ in range(4):
        A1.copy_(torch.randn_like(A1))
        out1.fill_(float("nan"))
        out2 = kbit_cute.gemm(kbit_cute.gemm(A1, qw1, out=out1), qw2)
        torch.cuda.synchronize()
        assert rel_err(out1, reference(A1, qw1)) < TOL[torch.float16]
        assert rel_err(out2, reference(out1, qw2)) < TOL[torch.float16]
