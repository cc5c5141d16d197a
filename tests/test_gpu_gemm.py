"""mma.sync GEMM (M >= 5) on the GPU against the float32 reference of the dequantized weight."""

import os

import pytest
import torch
from test_gpu_gemv import SHAPES as GEMV_SHAPES  # tests/ is on sys.path (rootdir import)

import kbit_cute
from kbit_cute import gemm_dispatch as gd
from kbit_cute.kernels import gemm_table
from kbit_cute.kernels.gemm import GemmConfig, GemmKernel

pytestmark = pytest.mark.gpu
KS = (2, 3, 4, 5)
MS = (5, 8, 16, 17, 32, 64, 100, 256, 1024, 4096)
DTYPES = (torch.float16, torch.bfloat16)
SHAPES = GEMV_SHAPES  # (K, N): the GEMV issue's shapes, odd ones included
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Tilings outside the dispatch table, so every TILE_M / TILE_N / TILE_K / warps_m runs.
EXTRA_CONFIGS = [
    "m16n256k128s4w1x8", "m64n256k64s3w1x8", "m128n128k128s3w1x8", "m128n128k64s3w2x4",
    "m128n256k64s3w2x4l", "m16n256k128s3w1x8r", "m128n128k64s3w2x4r",
    # wgmma (sm_90a): M tiles up to 256, one or two warpgroups, every pair-table layout
    "m32n128k64s4w1x4g", "m64n256k64s4w1x8rg", "m256n128k64s5w1x8lg", "m128n256k128s4w1x8g",
    "m16n256k64s4w1x16r",  # 16 warps sharing one pair table
]  # fmt: skip


def rel_err(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def reference(A, qw, bias=None):
    r = A.float() @ kbit_cute.dequantize(qw, torch.float32).T
    return r if bias is None else r + bias.float()


def run(A, qw, bias=None, **kw):
    """gemm_mma into a NaN-poisoned output; every element must be written."""
    out = torch.full((A.shape[0], qw.N), float("nan"), device="cuda", dtype=A.dtype)
    got = gd.gemm_mma(A, qw, bias, out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), "an output element was not written"
    return out


class _Weights:
    """Quantized weights per (K, N, k), made on first use, fresh random data each session."""

    def __init__(self):
        seed = int.from_bytes(os.urandom(4), "little")
        print(f"weights seed={seed}")
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cache = {}

    def __call__(self, K, N, k):
        if (K, N, k) not in self.cache:
            W = torch.randn(N, K, device="cuda", generator=self.gen) * 0.05
            self.cache[(K, N, k)] = kbit_cute.quantize(W, k)
        return self.cache[(K, N, k)]


@pytest.fixture(scope="module")
def weights():
    return _Weights()


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_matches_reference(k, dtype, M, weights):
    """Every k x dtype x M with the table's tiling and splits; the shapes rotate so each
    M meets several of them (test_every_shape covers each shape for each k)."""
    K, N = SHAPES[(MS.index(M) + 3 * KS.index(k) + DTYPES.index(dtype)) % len(SHAPES)]
    qw = weights(K, N, k)
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    assert rel_err(run(A, qw), reference(A, qw)) < TOL[dtype]


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("k", KS)
def test_every_shape(k, K, N, weights):
    qw = weights(K, N, k)
    for M, dtype in ((17, torch.float16), (100, torch.bfloat16)):
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        assert rel_err(run(A, qw), reference(A, qw)) < TOL[dtype], (M, dtype)


@pytest.mark.parametrize(
    "name", sorted({c.name for k in KS for c in gd.table_configs(k)}) + EXTRA_CONFIGS
)
def test_every_tile_config(name, weights):
    """Each tiling on an odd shape (partial tiles in M, N and K), with and without split-K,
    at k = 3 or, for a tiling k = 3 cannot take (the half-row table), k = 4."""
    cfg = GemmConfig.parse(name)
    K, N = 1056, 1000
    k = next(k for k in (3, 4) if GemmKernel.can_implement(k, "f16", cfg))
    qw = weights(K, N, k)
    A = torch.randn(100, K, device="cuda", dtype=torch.float16)
    ref = reference(A, qw)
    for splits, workers in ((1, None), (3, None), (None, 23)):
        det = splits == 3
        got = run(A, qw, config=name, splits=splits, workers=workers, deterministic=det)
        assert rel_err(got, ref) < TOL[torch.float16], (splits, workers)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_lane_table_gives_the_same_bits(k, dtype, weights):
    """The pair tables with a copy per lane (lane-replicated, rows of 256 bytes: k <= 4,
    the lane table's layout addressed by PRMT: k = 4) hold the compact table's values:
    same bits out."""
    K, N = 1056, 1000
    qw = weights(K, N, k)
    A = torch.randn(37, K, device="cuda", dtype=dtype)
    compact = run(A, qw, config="m16n128k64s4w1x4", splits=2, deterministic=True)
    assert rel_err(compact, reference(A, qw)) < TOL[dtype]
    lane = run(A, qw, config="m16n128k64s4w1x4l", splits=2, deterministic=True)
    assert torch.equal(lane, compact)
    if k <= 4:
        rows = run(A, qw, config="m16n128k64s4w1x4r", splits=2, deterministic=True)
        assert torch.equal(rows, compact)
    if k == 4:
        half = run(A, qw, config="m16n128k64s4w1x4h", splits=2, deterministic=True)
        assert torch.equal(half, compact)


# (the fourth: K slices of 128, four blocks per slice, as the k = 5 rows of M <= 128; the
# last: the half-row pair table, k = 4 only)
WGMMA_CONFIGS = [
    "m64n256k64s4w1x8g", "m256n128k64s4w1x8g", "m128n256k64s4w1x8rg", "m64n128k128s4w1x4g",
    "m32n128k64s4w1x4hg",
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_wgmma_every_k_and_dtype(k, dtype, weights):
    """The wgmma kernel (register weights, shared activations) for every k and dtype, M
    tiles partly filled, with split-K and stream-K runs; and bit-identical to itself."""
    check_sm90_configs(k, dtype, weights, WGMMA_CONFIGS, (5, 100, 256))


def check_sm90_configs(k, dtype, weights, configs, Ms):
    """Each config on two shapes (1056x1000: K past the last full slice, odd N; 4096x520:
    long K) at each M, split-K 1 / 3 and stream-K 23 / 4 workers, against the reference and
    bit-identical to itself. Configs the k cannot take (k = 5: no row table; the half-row
    table: k = 4 only; a lane table too large next to a 256-row ring) are left out."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    for K, N in ((1056, 1000), (4096, 520)):
        qw = weights(K, N, k)
        for M in Ms:
            A = torch.randn(M, K, device="cuda", dtype=dtype)
            ref = reference(A, qw)
            for name in configs:
                if not GemmKernel.can_implement(k, "f16", GemmConfig.parse(name)):
                    continue
                for splits, workers in ((1, None), (3, None), (None, 23), (None, 4)):
                    kw = dict(config=name, splits=splits, workers=workers, deterministic=True)
                    got = run(A, qw, **kw)
                    assert rel_err(got, ref) < TOL[dtype], (K, N, M, name, splits, workers)
                    assert torch.equal(got, run(A, qw, **kw)), (K, N, M, name, splits, workers)


SPECIALIZED_CONFIGS = ["m16n128k64s8w1x4gp", "m16n128k128s4w1x4gp", "m64n128k64s6w1x4gp"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_specialized_every_k_and_dtype(k, dtype, weights):
    """The warp-specialized wgmma kernel (producer warps dequantize into shared memory)
    for every k and dtype, M tiles partly filled, several tiles per CTA (stream-K runs
    that start and end inside tiles, K runs shorter and longer than the ring)."""
    check_sm90_configs(k, dtype, weights, SPECIALIZED_CONFIGS, (5, 64, 100))


# Copy-producer wgmma tilings (suffix "gc"): one or two tiles of the M = 128 / 256 / 64 rows.
PRODUCER_CONFIGS = [
    "m128n128k64s4w1x8rgc", "m256n128k64s5w1x8lgc", "m64n256k64s6w1x8gc", "m256n128k64s4w1x8gc",
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
def test_copy_producer_every_k_and_dtype(k, dtype, weights):
    """The wgmma kernel with a copy-producer warpgroup on mbarriers, every k and dtype: M
    tiles partly filled and several per CTA (the ring's phases carried across tiles, the
    epilogue staged in the ring between them), stream-K runs starting and ending inside
    tiles, runs shorter and longer than the ring."""
    check_sm90_configs(k, dtype, weights, PRODUCER_CONFIGS, (5, 100, 300))


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_split_k_deterministic_mode_is_bit_identical(splits, weights):
    K, N, k = 5120, 2048, 4
    qw = weights(K, N, k)
    A = torch.randn(24, K, device="cuda", dtype=torch.bfloat16)
    first = run(A, qw, splits=splits, deterministic=True)
    assert rel_err(first, reference(A, qw)) < TOL[torch.bfloat16]
    for _ in range(5):
        assert torch.equal(run(A, qw, splits=splits, deterministic=True), first)
    atomic = run(A, qw, splits=splits, deterministic=False)
    assert rel_err(atomic, reference(A, qw)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("workers", [2, 7, 31, 40, 131, 10_000])
def test_stream_k_runs_that_end_inside_tiles(workers, weights):
    """Runs of every length against the tiles (2048 x 520 at M = 20: 5 tiles of 32 x 128,
    32 K slices of 64 each): partials handed over in both modes, deterministic
    bit-identical; more workers than units are capped at one unit each."""
    K, N, k = 2048, 520, 5
    qw = weights(K, N, k)
    A = torch.randn(20, K, device="cuda", dtype=torch.float16)
    ref = reference(A, qw)
    cfg = "m32n128k64s4w1x4"
    first = run(A, qw, config=cfg, workers=workers, deterministic=True)
    assert rel_err(first, ref) < TOL[torch.float16]
    for _ in range(3):
        assert torch.equal(run(A, qw, config=cfg, workers=workers, deterministic=True), first)
    atomic = run(A, qw, config=cfg, workers=workers)
    assert rel_err(atomic, ref) < TOL[torch.float16]


def test_large_m_split_grid(weights):
    """A grid of whole tiles at large M: 64 x 92 tiles x 128 K slices x 5888 CTAs is past
    32-bit run products unless reduced by their gcd (the kernel's run arithmetic)."""
    K, N, k, M = 8192, 11776, 2, 4096
    qw = weights(K, N, k)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    got = run(A, qw, config="m64n128k64s3w1x4", splits=1)
    assert rel_err(got, reference(A, qw)) < TOL[torch.float16]


def test_workspace_and_counters_survive_changing_shapes(weights):
    """Counters and the atomic sums buffer are left at zero by every call: calls of other
    shapes, splits and modes in between do not change a result."""
    cases = [
        (2048, 512, 2, 16, 8, True), (5120, 2048, 5, 100, 3, False),
        (1056, 1000, 3, 5, 16, False), (2048, 4096, 4, 33, 4, True),
        (512, 2048, 4, 64, 2, False),
    ]  # fmt: skip
    inputs = {c: torch.randn(c[3], c[0], device="cuda", dtype=torch.float16) for c in cases}

    def call(c):
        K, N, k, M, splits, det = c
        return run(inputs[c], weights(K, N, k), splits=splits, deterministic=det)

    fresh = {c: call(c) for c in cases}
    for c in cases:
        assert rel_err(fresh[c], reference(inputs[c], weights(*c[:3]))) < TOL[torch.float16]
    for _ in range(3):
        for c in cases[::-1] + cases:
            if c[5]:  # deterministic: bit-identical
                assert torch.equal(call(c), fresh[c]), c
            else:
                assert rel_err(call(c), fresh[c].float()) < 1e-3, c


@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("M", [16, 64])
def test_gemm_chain_reads_what_the_previous_gemm_wrote(M, splits, weights):
    """A GEMM whose activations are the previous GEMM's output. On sm_90 each is launched
    with programmatic dependent launch (it may start while the one before runs): its wait
    must cover the first's split-K hand-over and stores. Both outputs are poisoned with NaN
    before every round."""
    qw1, qw2 = weights(4096, 2048, 4), weights(2048, 5120, 2)
    A1 = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    out1 = torch.empty(M, 2048, device="cuda", dtype=torch.float16)
    out2 = torch.empty(M, 5120, device="cuda", dtype=torch.float16)
    for _ in range(4):
        A1.copy_(torch.randn_like(A1))
        out1.fill_(float("nan"))
        out2.fill_(float("nan"))
        gd.gemm_mma(A1, qw1, None, out1, splits=splits)  # back to back: no kernel between
        gd.gemm_mma(out1, qw2, None, out2, splits=splits)
        torch.cuda.synchronize()
        assert not torch.isnan(out2).any(), "an output element was not written"
        assert rel_err(out1, reference(A1, qw1)) < TOL[torch.float16]
        assert rel_err(out2, reference(out1, qw2)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_and_unaligned_tensors(dtype, weights):
    K, N, k = 2048, 4096, 4
    qw = weights(K, N, k)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    buf = torch.randn(40 * K + 8, device="cuda", dtype=dtype)
    A = buf[1 : 1 + 40 * K].view(40, K)  # starts 2 bytes past a 16-byte boundary
    obuf = torch.full((40 * N + 8,), float("nan"), device="cuda", dtype=dtype)
    out = obuf[3 : 3 + 40 * N].view(40, N)
    got = gd.gemm_mma(A, qw, bias, out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert rel_err(out, reference(A, qw, bias)) < TOL[dtype]
    At = torch.randn(K, 40, device="cuda", dtype=dtype).T  # non-contiguous
    assert rel_err(run(At, qw, bias), reference(At, qw, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_subnormal_absmax_blocks(dtype):
    """Blocks of zeros (absmax code 0) give exactly 0; blocks 1e4 x smaller than the tensor's
    largest get E4M4 subnormal codes (e = 0), decoded exactly by the register trick."""
    K, N = 1024, 384
    W = torch.randn(N, K, device="cuda")
    W[:128] = 0
    W[128:256] *= 1e-4
    qw = kbit_cute.quantize(W, 4)
    assert ((qw.absmax > 0) & (qw.absmax < 16)).sum() > 1000, "expected subnormal E4M4 codes"
    A = torch.randn(37, K, device="cuda", dtype=dtype)
    got = run(A, qw)
    ref = reference(A, qw)
    assert torch.equal(got[:, :128], torch.zeros_like(got[:, :128]))
    assert rel_err(got[:, 128:256], ref[:, 128:256]) < TOL[dtype]
    assert rel_err(got[:, 256:], ref[:, 256:]) < TOL[dtype]


def test_under_cuda_graph(weights):
    K, N, k = 2048, 5120, 4
    qw = weights(K, N, k)
    A = torch.randn(48, K, device="cuda", dtype=torch.float16)
    out = torch.empty(48, N, device="cuda", dtype=torch.float16)
    gd.gemm_mma(A, qw, None, out, splits=4)  # warm: compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gd.gemm_mma(A, qw, None, out, splits=4)
    for _ in range(3):
        A.copy_(torch.randn_like(A))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(A, qw)) < TOL[torch.float16]


# 1056 x 1000 at k = 5: M = 5 (GEMV), 27 and 39 (GEMV row sets), 300 (dequantize + cuBLAS
# for this small weight); 4096 x 4608 (too large for row sets): M = 12 (GEMM kernel)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "K,N,lead",
    [(1056, 1000, (1, 5)), (1056, 1000, (3, 9)), (1056, 1000, (3, 13)), (1056, 1000, (2, 150)),
     (4096, 4608, (2, 6))],
)  # fmt: skip
def test_kbit_cute_gemm_for_m_above_4(K, N, lead, with_bias, weights):
    """The public entry point for M > 4, across the GEMV / GEMV row sets / GEMM / dequantize
    + cuBLAS dispatch, into a NaN-poisoned ``out`` (cuBLAS writes it directly), with and
    without bias."""
    k = 5
    dev = torch.cuda.current_device()
    # every path is among the cases (a re-tuned table or row-set rule may need others here)
    assert kbit_cute.ops.gemv_max_m(1000, 1056, k) >= 39
    assert kbit_cute.ops.gemv_max_m(4608, 4096, k) < 12
    assert not gd.use_cublas(12, 4608, 4096, k, dev)
    assert gd.use_cublas(300, 1000, 1056, k, dev)
    qw = weights(K, N, k)
    A = torch.randn(*lead, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) if with_bias else None
    out = torch.full((*lead, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    M = lead[0] * lead[1]
    got = kbit_cute.gemm(A, qw, bias=bias, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    ref = reference(A.view(M, K), qw, bias)
    assert rel_err(out.view(M, N), ref) < TOL[torch.bfloat16]


def test_table_is_labelled():
    """A provisional table says so; a measured one names the GPU and the command."""
    assert gemm_table.PROVISIONAL or (gemm_table.MEASURED_ON and gemm_table.COMMAND)
