"""The mma.sync GEMM without a GPU: its index tricks on host ints, the MMA layouts it relies
on, extra tile configs compiling, the dispatch table logic and bad-input errors.
(The table's variants are compiled and gated for sm_90a and sm_80 by test_inspect.)"""

import math
import os

import cutlass
import cutlass.cute as cute
import pytest
import torch

from kbit_cute import format as fmt
from kbit_cute import gemm_dispatch as gd
from kbit_cute.kernels import device_helpers as dh
from kbit_cute.kernels import gemm as g
from kbit_cute.kernels import gemm_table
from kbit_cute.layouts import layout_offsets

KS = (2, 3, 4, 5)


@pytest.mark.parametrize("k", KS)
def test_pair_offsets_address_each_threads_pairs(k, gen):
    """Every lane quad position t gets table byte offsets whose interleaved index decodes to
    the codebook indices of its elements (8c + 2t, 8c + 2t + 1)."""
    idx = torch.randint(0, 1 << k, (64, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k).view(64, k)
    for blk in range(64):
        planes = [int(w) & 0xFFFFFFFF for w in packed[blk].tolist()]
        for t in range(4):
            offsets = dh.pair_offsets(planes, t, k)
            for c, off in enumerate(offsets):
                assert off % 4 == 0 and 0 <= off < 4 << (2 * k)
                i0, i1 = dh.pair_table_index(off // 4, k)
                assert (i0, i1) == (idx[blk, 8 * c + 2 * t], idx[blk, 8 * c + 2 * t + 1])


@pytest.mark.parametrize("k", (2, 3, 4))
def test_pair_row_offsets_address_each_lanes_copy(k, gen):
    """Row-table addresses: 256 p + 4 lane, p decoding to the thread's element pairs."""
    idx = torch.randint(0, 1 << k, (64, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k).view(64, k)
    for blk in range(64):
        planes = [int(w) & 0xFFFFFFFF for w in packed[blk].tolist()]
        for lane in (0, 5, 31):
            t = lane % 4
            for c, addr in enumerate(dh.pair_row_offsets(planes, t, k, 4 * lane)):
                assert addr % 256 == 4 * lane and addr < 256 << (2 * k)
                i0, i1 = dh.pair_table_index(addr // 256, k)
                assert (i0, i1) == (idx[blk, 8 * c + 2 * t], idx[blk, 8 * c + 2 * t + 1])


def test_pair_half_offsets_address_each_lanes_copy(gen):
    """Half-row table addresses (k = 4): 128 q + 4 lane, q = p rotated right by one bit, p
    decoding to the thread's element pairs."""
    k = 4
    idx = torch.randint(0, 1 << k, (64, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k).view(64, k)
    entry_pair = {dh.pair_half_entry(p): p for p in range(256)}
    assert sorted(entry_pair) == list(range(256))
    assert all(dh.half_entry_pair(q) == p for q, p in entry_pair.items())
    for blk in range(64):
        planes = [int(w) & 0xFFFFFFFF for w in packed[blk].tolist()]
        for lane in (0, 6, 31):
            t = lane % 4
            for c, addr in enumerate(dh.pair_half_offsets(planes, t, 4 * lane * 0x01010101)):
                assert addr % 128 == 4 * lane and addr < 128 << (2 * k)
                i0, i1 = dh.pair_table_index(entry_pair[addr // 128], k)
                assert (i0, i1) == (idx[blk, 8 * c + 2 * t], idx[blk, 8 * c + 2 * t + 1])


@pytest.mark.parametrize("k", KS)
def test_pair_table_index_is_a_bijection(k):
    pairs = {dh.pair_table_index(p, k) for p in range(1 << (2 * k))}
    assert pairs == {(a, b) for a in range(1 << k) for b in range(1 << k)}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_absmax_register_trick_is_exact(dtype):
    """code * MAGIC read as a 16-bit float, times the table's factor, is decode_e4m4(code),
    subnormal codes and code 0 included, in both halves."""
    code = torch.arange(256, dtype=torch.int64)
    word = (code * dh.ABSMAX_MAGIC[dtype]) & 0xFFFFFFFF
    assert torch.equal(word >> 16, word & 0xFFFF)
    half = (word & 0xFFFF).to(torch.int16).view(torch.float16 if dtype == "f16" else torch.bfloat16)
    value = half.to(torch.float64) * dh.CODEBOOK_FACTOR[dtype]
    assert torch.equal(value, fmt.decode_e4m4(code.to(torch.uint8)).to(torch.float64))


@pytest.mark.parametrize("warps", [(1, 4), (1, 8), (2, 4), (2, 8)])
def test_b_fragment_layout_is_what_the_dequant_assumes(warps):
    """The dequant gives thread tid (lane = g*4 + t) column 8*wn + g of each n8 rep and K
    pairs (2t, 2t+1) + 8 v1 of each k16 step: check it against the tiled MMA's B layout."""
    wm, wn = warps

    def make():
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16))
        return cute.make_tiled_mma(op, cute.make_layout((wm, wn, 1))).tv_layout_B_tiled

    _, offsets = layout_offsets(make)
    threads, n_tile = 32 * wm * wn, 8 * wn
    for tid in range(threads):
        lane, warp_n = tid % 32, (tid // 32) // wm
        for v in range(4):
            off = offsets[tid + threads * v]
            n, kk = off % n_tile, off // n_tile
            assert (n, kk) == (8 * warp_n + lane // 4, 2 * (lane % 4) + (v & 1) + 8 * (v >> 1))


@pytest.mark.parametrize("groups", [1, 2])
def test_wgmma_a_fragment_layout_is_what_the_dequant_assumes(groups):
    """wgmma's register A: thread tid's register r (fp16 values 2r, 2r + 1) of m tile mt
    holds weight column rep0_column(tid) + rep_offset(2 mt + r % 2) and K pair 2t + 8 (r //
    2) of the k16 step (``WgmmaGemmKernel.set_pair``): check it against the tiled MMA."""
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from kbit_cute.kernels.gemm_wgmma import WgmmaGemmKernel

    def make():
        op = warpgroup.MmaF16BF16Op(
            cutlass.Float16, cutlass.Float32, (64, 32, 16), warpgroup.OperandSource.RMEM,
            OperandMajorMode.K, OperandMajorMode.K,
        )  # fmt: skip
        return cute.make_tiled_mma(op, cute.make_layout((groups, 1, 1))).tv_layout_A_tiled

    _, offsets = layout_offsets(make)
    cfg = g.GemmConfig(32, 128, 64, 4, 1, 4 * groups, wgmma=True)
    kern = WgmmaGemmKernel(4, "f16", cfg)
    threads, m_tile = 128 * groups, 64 * groups
    for tid in range(threads):
        for v in range(8):
            off = offsets[tid + threads * v]
            m, kk = off % m_tile, off // m_tile
            r = v // 2  # the 32-bit register, (row half, K half) = (r % 2, r // 2)
            col = kern.rep0_column(tid) + kern.rep_offset(r % 2)
            assert (m, kk) == (col, 2 * (tid % 4) + v % 2 + 8 * (r // 2)), (tid, v)


@pytest.mark.parametrize("name", ["m16n128k64s4w1x4", "m128n128k128s3w1x8", "m32n256k128s3w1x8"])
def test_a_copy_offsets_follow_the_swizzled_layout(name):
    """The A copy adds static offsets to one swizzled offset per thread: passes advance
    whole 8-row atoms, an 8-element chunk is contiguous, stages are tile_m*tile_k apart."""
    cfg = g.GemmConfig.parse(name)
    kern = g.GemmKernel(4, "f16", cfg)
    shape, offs = layout_offsets(kern.a_smem_layout)
    tm, tk, st = (math.prod(_flat(mode)) for mode in shape)  # modes may be hierarchical
    assert (tm, tk, st) == (cfg.tile_m, cfg.tile_k, cfg.stages)
    assert sorted(offs) == list(range(tm * tk * st))

    def at(r, c, s):
        return offs[r + tm * (c + tk * s)]

    rows_pass, chunks_row = kern.a_rows_per_pass(), cfg.tile_k // 8
    for tid in range(cfg.threads):
        row0, kc = tid // chunks_row, tid % chunks_row
        for i in range(kern.a_passes()):
            row = row0 + i * rows_pass
            if row >= tm:
                continue
            for s in range(st):
                base = at(min(row0, tm - 1), kc * 8, 0) + s * tm * tk + i * rows_pass * 64
                assert [at(row, kc * 8 + e, s) for e in range(8)] == [base + e for e in range(8)]


def _flat(mode):
    return [x for m in mode for x in _flat(m)] if isinstance(mode, tuple) else [mode]


@pytest.mark.parametrize(
    "k,dtype,name",
    [
        (3, "bf16", "m16n256k128s4w1x8"), (5, "f16", "m128n128k64s3w2x4"),
        (2, "bf16", "m64n256k64s4w1x8rg"), (5, "f16", "m128n256k128s4w1x8g"),
        (4, "f16", "m16n128k64s6w1x4lgp"), (5, "bf16", "m64n128k64s6w1x4gp"),
    ],
)  # fmt: skip
def test_other_tile_configs_compile(k, dtype, name):
    """TILE_N = 256, TILE_K = 128, warps_m = 2, wgmma and warp-specialized tilings (not all
    in the dispatch table) compile."""
    from kbit_cute.kernels.gemm_wgmma import WgmmaGemmKernel
    from kbit_cute.kernels.gemm_ws import WsGemmKernel

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cfg = g.GemmConfig.parse(name)
    fn, args = g.gemm_spec(k, dtype, cfg).build()
    want = WsGemmKernel if cfg.specialized else WgmmaGemmKernel if cfg.wgmma else g.GemmKernel
    assert type(fn) is want
    assert cute.compile(fn, *args) is not None


# ----------------------------------------------------------------------------- config


def test_config_names_round_trip_and_bad_configs_are_named():
    cfg = g.GemmConfig(64, 256, 128, 3, 1, 8)
    assert g.GemmConfig.parse(cfg.name) == cfg
    for table, suffix in (("compact", ""), ("lane", "l"), ("row", "r")):
        for wgmma in (False, True):
            c = g.GemmConfig(64, 256, 64, 4, 1, 8, table=table, wgmma=wgmma)
            assert c.name == "m64n256k64s4w1x8" + suffix + ("g" if wgmma else "")
            assert g.GemmConfig.parse(c.name) == c
            assert (c.lane_table, c.row_table) == (table == "lane", table == "row")
            assert c.copy_per_lane == (table != "compact")
    with pytest.raises(ValueError, match="not a GEMM config"):
        g.GemmConfig.parse("m64n256")
    with pytest.raises(ValueError, match="not a GEMM config"):
        g.GemmConfig.parse("m64n256k64s4w1x8lr")  # one table layout
    with pytest.raises(ValueError, match="table must be one of"):
        g.GemmKernel(4, "f16", g.GemmConfig(table="lanes"))
    with pytest.raises(ValueError, match="tile_n"):
        g.GemmKernel(4, "f16", g.GemmConfig(tile_n=192))
    with pytest.raises(ValueError, match="k must be"):
        g.GemmKernel(6, "f16", g.GemmConfig())
    with pytest.raises(ValueError, match="dtype"):
        g.GemmKernel(4, "f32", g.GemmConfig())
    assert not g.GemmKernel.can_implement(5, "f16", g.GemmConfig(128, 256, 128, 5, 1, 8))
    assert g.GemmKernel.can_implement(5, "f16", g.GemmConfig())
    wg = g.GemmConfig.parse("m256n128k64s4w1x8rg")
    assert wg.wgmma and wg.row_table and wg.tile_m == 256 and g.GemmConfig.parse(wg.name) == wg
    with pytest.raises(ValueError, match="warpgroups"):
        g.GemmKernel(4, "f16", g.GemmConfig.parse("m128n128k64s4w2x4g"))
    with pytest.raises(ValueError, match="tile_m"):
        g.GemmKernel(4, "f16", g.GemmConfig.parse("m256n128k64s4w2x4"))  # mma.sync: <= 128
    ws = g.GemmConfig.parse("m16n128k128s6w1x4lgp")
    assert ws.specialized and ws.wgmma and g.GemmConfig.parse(ws.name) == ws
    assert ws.block_threads == 128 * (1 + 128 // 32)  # a producer group per 32-K block
    with pytest.raises(ValueError, match="needs the warpgroup MMA"):
        g.GemmKernel(4, "f16", g.GemmConfig.parse("m16n128k64s6w1x4p"))
    with pytest.raises(ValueError, match="4 stages or more"):
        g.GemmKernel(4, "f16", g.GemmConfig.parse("m16n128k64s3w1x4gp"))
    assert g.for_arch(ws, "sm_80") == g.GemmConfig.parse("m16n128k128s3w1x4l")


def test_wgmma_configs_take_an_mma_sync_twin_before_sm90():
    """Every wgmma tiling the tune tries or the table holds has a valid mma.sync twin for
    targets without wgmma, which fits an A100 (163 KB) once its table is compact."""
    from perf.bench_gemm import BUCKETS

    names = {n for _, _, ns in BUCKETS for n in ns} | {
        r[1] for k in KS for r in gemm_table.RULES[k]
    }
    wgmma = [g.GemmConfig.parse(n) for n in names if g.GemmConfig.parse(n).wgmma]
    assert wgmma
    for cfg in wgmma:
        assert g.for_arch(cfg, "sm_90a") == cfg
        twin = g.for_arch(cfg, "sm_80")
        assert not twin.wgmma and not twin.problems(), (cfg.name, twin.name)
        for k in KS:
            if g.GemmKernel.can_implement(k, "f16", cfg):
                a100 = gd._fitting(twin, k, 163 * 1024)
                assert g.GemmKernel.can_implement(k, "f16", a100, smem_limit=163 * 1024)


# ----------------------------------------------------------------------------- table


def test_table_rows_are_valid_and_cover_every_m():
    for k in KS:
        rows = gemm_table.RULES[k]
        assert [r[0] for r in rows] == sorted(r[0] for r in rows) and rows[-1][0] >= 1 << 20
        over_l2 = gemm_table.RULES_OVER_L2.get(k, [])
        assert [r[0] for r in over_l2] == sorted(r[0] for r in over_l2)
        small = gemm_table.RULES_SMALL.get(k, [])
        assert [r[0] for r in small] == sorted(r[0] for r in small)
        for _m_max, name, ctas_per_sm, max_splits in rows + over_l2 + small:
            cfg = g.GemmConfig.parse(name)
            assert g.GemmKernel.can_implement(k, "f16", cfg), name
            # On an A100 (163 KB) the dispatcher takes the mma.sync twin of a wgmma row and
            # falls back to the compact pair table.
            a100 = gd._fitting(g.for_arch(cfg, "sm_80"), k, 163 * 1024)
            assert g.GemmKernel.can_implement(k, "f16", a100, smem_limit=163 * 1024), name
            assert ctas_per_sm >= 1 and max_splits >= 1
        for M in (5, 16, 17, 100, 4096, 1 << 20):
            assert gd.table_rule(k, M)[0] in [r[1] for r in rows]
            assert gd.table_rule(k, M, True)[0] in [r[1] for r in rows + over_l2]
            assert gd.table_rule(k, M, small=True)[0] in [r[1] for r in rows + small]
        for m_max, *row in small:  # a small row serves its own bucket
            assert gd.table_rule(k, m_max, small=True) == tuple(row)
            # a weight over the L2 is never of the small class
            assert gd.table_rule(k, m_max, True, small=True) == gd.table_rule(k, m_max, True)


def test_lane_table_falls_back_where_it_does_not_fit():
    cfg = g.GemmConfig.parse("m128n256k64s3w2x4l")
    assert cfg.lane_table and cfg.name == "m128n256k64s3w2x4l"
    assert cfg.smem_bytes(5) - g.GemmConfig.parse("m128n256k64s3w2x4").smem_bytes(5) == 31 * 4096
    h100, a100 = 227 * 1024, 163 * 1024
    assert gd._fitting(cfg, 5, h100) == cfg
    assert gd._fitting(cfg, 5, a100) == g.GemmConfig.parse("m128n256k64s3w2x4")
    assert gd._fitting(cfg, 4, a100) == cfg  # 32 KB table: fits


def test_splits_fill_the_sms_within_the_limits():
    cfg = g.GemmConfig.parse("m16n128k64s4w1x4")
    # 8192 x 28672, M = 16: 224 tiles already give 1.7 CTAs per SM.
    assert gd.choose_splits(16, 28672, 8192, cfg, 132, 1, 16) == 1
    # 2048 x 512 at M = 16: 4 tiles; 4 CTAs/SM wants 132 splits, capped by max and K.
    assert gd.choose_splits(16, 512, 2048, cfg, 132, 4, 16) == 16
    assert gd.choose_splits(16, 512, 2048, cfg, 132, 4, 64) == 2048 // 64 // 2
    # 14336 x 4096: 32 tiles x 5 splits >= 132 SMs.
    assert gd.choose_splits(16, 4096, 14336, cfg, 132, 1, 16) == 5
    assert gd.choose_splits(5, 128, 32, cfg, 132, 4, 16) == 1  # one K slice: no split


def test_stream_k_workers_fill_the_sms_evenly():
    cfg = g.GemmConfig.parse("m16n128k128s3w1x4")
    # 8192 x 28672, M = 16: 224 tiles x 64 K slices in 2 x 132 equal runs (a grid of whole
    # tiles would leave 40 of 264 slots empty, or split every tile into 2 CTAs).
    assert gd.plan_workers(16, 28672, 8192, cfg, 132, 2, 16) == 264
    assert gd.plan_workers(16, 28672, 8192, cfg, 132, 2, 16, resident=1) == 132
    assert gd.plan_workers(16, 28672, 8192, cfg, 132, 4, 16, resident=0) == 132
    # 2048 x 512: 4 tiles x 16 K slices; at most 16 CTAs per tile, each >= 2 slices.
    assert gd.plan_workers(16, 512, 2048, cfg, 132, 4, 16) == 4 * 16 // 2
    assert gd.plan_workers(16, 512, 2048, cfg, 132, 4, 4) == 16
    assert gd.plan_workers(5, 128, 32, cfg, 132, 4, 16) == 1  # one K slice: one CTA
    # Several M tiles: whole tiles x the split-K count (weight tiles shared in time).
    assert gd.plan_workers(100, 28672, 8192, cfg, 132, 1, 16) == 7 * 224
    assert gd.plan_workers(40, 4096, 14336, cfg, 132, 1, 16) == 3 * 32 * 2
    assert not gd.hands_over(40, 4096, cfg, 3 * 32)
    assert gd.hands_over(16, 28672, cfg, 264) and gd.hands_over(16, 28672, cfg, 132)
    assert not gd.hands_over(16, 28672, cfg, 112)  # runs of 2 whole tiles
    big = g.GemmConfig.parse("m64n256k64s3w1x8l")
    assert gd.resident_ctas(big, 5, 228 * 1024) == 1
    assert gd.resident_ctas(cfg, 2, 228 * 1024) >= 4


def test_plan_and_cublas_threshold():
    for k in KS:
        cfg, workers = gd.plan(17, 5120, 2048, k, 132)
        assert cfg.tile_m >= 16 and workers >= 1
        assert cfg in gd.table_configs(k)
        m0 = gemm_table.CUBLAS_FROM_M[k]
        assert gd.prefer_cublas(8, k) is False
        assert gd.prefer_cublas(1 << 30, k) is (m0 is not None)


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def cpu_weight():
    return fmt.quantize(torch.randn(96, 64), 4)


def _call(A, qw, bias=None, out=None, **kw):
    if out is None:
        out = torch.empty(A.shape[0] if A.ndim else 1, qw.N, dtype=A.dtype)
    return gd.gemm_mma(A, qw, bias, out, **kw)


def test_bad_inputs_raise_clear_errors(cpu_weight):
    qw = cpu_weight
    A = torch.randn(8, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="KbitWeight"):
        gd.gemm_mma(A, "not a weight", None, torch.empty(8, 96))
    with pytest.raises(ValueError, match=r"\[M, K=64\]"):
        _call(torch.randn(8, 32, dtype=torch.float16), qw)
    with pytest.raises(ValueError, match=r"\[M, K=64\]"):
        _call(torch.randn(2, 4, 64, dtype=torch.float16), qw, out=torch.empty(8, 96))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _call(torch.randn(8, 64), qw)
    with pytest.raises(ValueError, match="out must be"):
        _call(A, qw, out=torch.empty(8, 95, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        _call(A, qw, out=torch.empty(8, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias must be"):
        _call(A, qw, bias=torch.zeros(95, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must be"):
        _call(A, qw, bias=torch.zeros(96))
    with pytest.raises(ValueError, match="CUDA"):
        _call(A, qw)


def _written_table(tmp_path, update, gpu, command):
    """``bench_gemm.write_table(update, gpu, command)`` into a file of ``tmp_path``, imported
    as a module (the committed table stays as it is)."""
    import importlib.util

    from perf import bench_gemm as bg

    path = tmp_path / "table.py"
    bg.write_table(update, gpu, command, path)
    spec = importlib.util.spec_from_file_location("t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("provisional", [True, False])
def test_benchmark_writes_a_loadable_table(tmp_path, monkeypatch, provisional):
    """perf.bench_gemm's table writer, fed synthetic timings: the fastest candidate per
    bucket wins, cuBLAS takes over where it was faster at every larger M. The table stays
    provisional while some k's rows were never measured."""
    from perf import bench_gemm as bg

    monkeypatch.setattr(gemm_table, "PROVISIONAL", provisional)

    recs = []
    for K, N in bg.SHAPES[:2]:
        for m_max, Ms, names in bg.BUCKETS:
            for M in Ms:
                base = dict(K=K, N=N, k=3, M=M, m_max=m_max)
                recs.append(dict(base, impl="dequant_cublas", us=50.0 if M >= 1024 else 1e9))
                for i, name in enumerate(names):
                    for ctas in bg.CTAS_PER_SM:
                        us = 100.0 + 10 * i + (0 if ctas == 2 else 1)
                        recs.append(dict(base, impl="kernel", config=name, ctas_per_sm=ctas,
                                         splits=1, us=us))  # fmt: skip
    update = bg.table_from(recs)
    rules, cublas_from = update.rules, update.cublas_from
    assert cublas_from == {3: 1024} and update.rules_over_l2 == {}
    assert [r[1:3] for r in rules[3]] == [(names[0], 2) for _, _, names in bg.BUCKETS]
    mod = _written_table(tmp_path, update, "Test GPU", "python -m perf.bench_gemm --test")
    assert mod.RULES[3] == rules[3] and mod.CUBLAS_FROM_M[3] == 1024
    assert mod.PROVISIONAL is provisional  # the other k kept their rows, measured or not
    assert mod.MEASURED_ON == "Test GPU" and set(mod.RULES) == {2, 3, 4, 5}


def test_table_rows_pass_the_compile_gate():
    """A tiling the gate refuses (one that spills) never becomes a row: the bucket takes the
    best candidate that passes, and the gate is asked only down to that one."""
    from perf import bench_gemm as bg

    recs = []
    for K, N in bg.SHAPES[:2]:
        base = dict(K=K, N=N, k=5, M=128, m_max=128)
        for us, name in ((10.0, "m128n256k64s4w1x8gc"), (11.0, "m128n128k64s4w1x8g"),
                         (12.0, "m128n256k64s4w1x8g")):  # fmt: skip
            recs.append(dict(base, impl="kernel", config=name, ctas_per_sm=1, us=us))
    asked = []

    def gate(k, name):
        asked.append(name)
        return name != "m128n256k64s4w1x8gc"

    assert bg.table_from(recs).rules[5] == [(128, "m128n256k64s4w1x8gc", 1, bg.MAX_SPLITS)]
    assert bg.table_from(recs, gate=gate).rules[5] == [
        (128, "m128n128k64s4w1x8g", 1, bg.MAX_SPLITS)
    ]
    assert asked == ["m128n256k64s4w1x8gc", "m128n128k64s4w1x8g"]


def test_tuning_some_buckets_keeps_the_other_rows(tmp_path):
    """``bench_gemm --tune --buckets``: the measured buckets' rows are replaced, the others
    and the cuBLAS threshold stay, and the command history keeps the earlier tune."""
    from perf import bench_gemm as bg

    recs = []
    for K, N in bg.SHAPES[:2]:
        for ctas in bg.CTAS_PER_SM:
            base = dict(K=K, N=N, k=4, M=16, m_max=16)
            recs.append(dict(base, impl="kernel", config="m16n128k64s4w1x4", ctas_per_sm=ctas,
                             us=10.0 + abs(ctas - 3)))  # fmt: skip
    update = bg.table_from(recs)
    assert update.rules[4] == [(16, "m16n128k64s4w1x4", 3, bg.MAX_SPLITS)]
    assert update.cublas_from == {}
    mod = _written_table(tmp_path, update, "Test GPU", "python -m perf.bench_gemm --test")
    assert mod.RULES[4][0] == (16, "m16n128k64s4w1x4", 3, bg.MAX_SPLITS)
    assert mod.RULES[4][1:] == gemm_table.RULES[4][1:]
    assert mod.CUBLAS_FROM_M == gemm_table.CUBLAS_FROM_M
    assert mod.RULES_OVER_L2 == gemm_table.RULES_OVER_L2
    assert mod.CUBLAS_FROM_M_OVER_L2 == gemm_table.CUBLAS_FROM_M_OVER_L2
    assert mod.RULES_SMALL == gemm_table.RULES_SMALL
    assert mod.SMALL_WEIGHT_ELEMENTS == gemm_table.SMALL_WEIGHT_ELEMENTS
    assert mod.COMMAND.startswith(gemm_table.COMMAND) and mod.COMMAND.endswith("--test")


def test_weights_over_l2_get_rows_of_their_own(tmp_path, monkeypatch):
    """Records of weights over the L2 (``over_l2``) make RULES_OVER_L2 and its own cuBLAS
    threshold, the other records the general rows; both land in the written table, which
    the dispatcher then reads: over-L2 rows where they cover M, else the general rows."""
    from perf import bench_gemm as bg

    monkeypatch.setattr(gemm_table, "RULES_OVER_L2", {})
    monkeypatch.setattr(gemm_table, "CUBLAS_FROM_M_OVER_L2", {})
    recs = []
    general, big = "m128n128k64s4w1x8rg", "m128n256k64s4w1x8rg"
    for (K, N), over in (((4096, 14336), False), ((14336, 4096), False), ((8192, 28672), True)):
        for M, kern_us in ((128, 10.0), (512, 30.0)):
            base = dict(K=K, N=N, k=4, M=M, m_max=M, over_l2=over)
            recs.append(dict(base, impl="dequant_cublas", us=20.0))  # cuBLAS wins at 512
            for name in (general, big):
                fast = (name == big) == over
                recs.append(dict(base, impl="kernel", config=name, ctas_per_sm=1,
                                 us=kern_us * (1.0 if fast else 1.5)))  # fmt: skip
    update = bg.table_from(recs)
    assert update.rules[4] == [(128, general, 1, 16), (512, general, 1, 16)]
    assert update.rules_over_l2[4] == [(128, big, 1, 16), (512, big, 1, 16)]
    assert update.cublas_from == {4: 512} and update.cublas_from_over_l2 == {4: 512}
    mod = _written_table(tmp_path, update, "Test GPU", "python -m perf.bench_gemm --test")
    assert mod.RULES_OVER_L2 == {4: update.rules_over_l2[4]}
    assert mod.CUBLAS_FROM_M_OVER_L2 == {4: 512}
    assert (128, general, 1, 16) in mod.RULES[4]

    monkeypatch.setattr(gemm_table, "RULES_OVER_L2", mod.RULES_OVER_L2)
    monkeypatch.setattr(gemm_table, "CUBLAS_FROM_M_OVER_L2", {4: None})
    l2 = 50 << 20
    assert gd.table_rule(4, 100, weight_over_l2=True)[0] == big
    assert gd.plan(100, 28672, 8192, 4, 132, l2)[0] == g.GemmConfig.parse(big)
    assert gd.plan(100, 14336, 4096, 4, 132, l2)[0] == g.GemmConfig.parse(gd.table_rule(4, 100)[0])
    # past the over-L2 rows' last bucket the general rows apply
    assert gd.table_rule(4, 4096, weight_over_l2=True) == gd.table_rule(4, 4096, False)
    # the over-L2 threshold (None: the kernel always won) overrides the general one
    assert gd.prefer_cublas(1 << 20, 4, weight_over_l2=True) is False
    assert gd.prefer_cublas(1 << 20, 4) is (gemm_table.CUBLAS_FROM_M[4] is not None)
    assert gd.prefer_cublas(1 << 20, 5, weight_over_l2=True) is gd.prefer_cublas(1 << 20, 5)
    # kbit_cute.gemm's question per call: the weight's class on the device, then its threshold
    monkeypatch.setattr(gd, "_over_l2_on", lambda N, K, k, dev: gd.weight_over_l2(N, K, k, l2))
    assert gd.use_cublas(1 << 20, 28672, 8192, 4, 0) is False
    assert gd.use_cublas(1 << 20, 14336, 4096, 4, 0) is gd.prefer_cublas(1 << 20, 4)
    # more rows than the dequantize kernel takes: the GEMM, whatever the table says
    assert gd.use_cublas(1 << 20, gd.MAX_DEQUANTIZE_ROWS + 128, 64, 4, 0) is False
    assert big in {c.name for c in gd.table_configs(4)}


def test_small_weights_get_rows_of_their_own(tmp_path, monkeypatch):
    """Records of weights of at most SMALL_WEIGHT_ELEMENTS (by their size, also in tunes from
    before the class existed) make RULES_SMALL, the others the general rows; the written
    table's small rows are what ``plan`` takes for such weights where they cover M, and
    they leave the cuBLAS thresholds alone (small weights have CUBLAS_FROM_M_SMALL)."""
    from perf import bench_gemm as bg

    monkeypatch.setattr(gemm_table, "RULES_SMALL", {})
    m32, m64 = "m32n128k64s4w1x4r", "m64n256k64s6w1x8rg"
    _, m16, m16_ctas, _ = gemm_table.RULES[4][0]  # the general M <= 16 row
    recs = []
    for (K, N), small in (((2048, 512), True), ((4096, 2048), True), ((4096, 14336), False)):
        assert gd.small_weight(N, K, False) is small and not gd.small_weight(N, K, True)
        base = dict(K=K, N=N, k=4, M=64, m_max=64, over_l2=False)
        # dequantize + cuBLAS fast on the small weights only: it must not move CUBLAS_FROM_M
        recs.append(dict(base, impl="dequant_cublas", us=5.0 if small else 50.0))
        for name in (m32, m64):
            fast = (name == m32) == small
            recs.append(dict(base, impl="kernel", config=name, ctas_per_sm=1,
                             us=10.0 * (1.0 if fast else 1.4)))  # fmt: skip
        if small:  # at M = 16 the general row wins: no small row for that bucket
            base = dict(base, M=16, m_max=16)
            recs.append(dict(base, impl="dequant_cublas", us=5.0))
            for name, ctas, us in ((m16, m16_ctas, 4.0), (m32, 1, 6.0)):
                recs.append(dict(base, impl="kernel", config=name, ctas_per_sm=ctas, us=us))
    update = bg.table_from(recs)
    assert update.rules_small[4] == [(64, m32, 1, 16)]
    assert update.rules[4] == [(64, m64, 1, 16)]
    assert update.cublas_from == {}
    mod = _written_table(tmp_path, update, "Test GPU", "python -m perf.bench_gemm")
    assert mod.RULES_SMALL == {4: [(64, m32, 1, 16)]}
    assert mod.CUBLAS_FROM_M_SMALL == gemm_table.CUBLAS_FROM_M_SMALL
    monkeypatch.setattr(gemm_table, "RULES_SMALL", mod.RULES_SMALL)
    l2 = 50 << 20
    assert gd.plan(64, 2048, 4096, 4, 132, l2)[0] == g.GemmConfig.parse(m32)
    assert gd.plan(64, 14336, 4096, 4, 132, l2)[0] == g.GemmConfig.parse(gd.table_rule(4, 64)[0])
    # buckets without a small row (below and past it) take the general rows
    for M in (16, 32, 100):
        got = gd.plan(M, 2048, 4096, 4, 132, l2)[0]
        assert got == g.GemmConfig.parse(gd.table_rule(4, M)[0]), M
    assert m32 in {c.name for c in gd.table_configs(4)}


@pytest.mark.parametrize(
    "old,kernel_us_512,want", [(1024, 12.0, 512), (256, 8.0, 1024), (1024, 8.0, None)]
)
def test_cublas_threshold_from_buckets_below_the_largest(monkeypatch, old, kernel_us_512, want):
    """Tuning buckets up to M = 512: dequantize + cuBLAS winning at 512 moves the threshold
    down to 512; the kernel winning at and above an old threshold moves it to the next
    representative M (1024); otherwise the old threshold stays (not in the result)."""
    from perf import bench_gemm as bg

    monkeypatch.setitem(gemm_table.CUBLAS_FROM_M, 4, old)
    recs = []
    for K, N in bg.SHAPES[:2]:
        for M, kern_us in ((256, 5.0), (512, kernel_us_512)):
            base = dict(K=K, N=N, k=4, M=M, m_max=M)
            recs.append(dict(base, impl="dequant_cublas", us=10.0))
            recs.append(dict(base, impl="kernel", config="m64n128k64s3w1x4", ctas_per_sm=1,
                             us=kern_us))  # fmt: skip
    assert bg.table_from(recs).cublas_from.get(4) == want


def test_keep_tilings_chooses_among_the_tables_own():
    """``--keep-tilings``: a faster candidate the table does not have yet is passed over
    for the best tiling it has (no new variant to compile and validate)."""
    from perf import bench_gemm as bg

    have = gemm_table.RULES[4][0][1]  # the M <= 16 row's tiling
    new = next(n for n in bg.BUCKETS[0][2] if n not in {r[1] for r in g.table_rows(4)})
    recs = []
    for K, N in bg.SHAPES[:2]:
        base = dict(K=K, N=N, k=4, M=16, m_max=16, over_l2=False)
        recs.append(dict(base, impl="kernel", config=new, ctas_per_sm=1, us=5.0))
        recs.append(dict(base, impl="kernel", config=have, ctas_per_sm=3, us=9.0))
    assert bg.table_from(recs).rules[4] == [(16, new, 1, bg.MAX_SPLITS)]
    assert bg.table_from(recs, keep_tilings=True).rules[4] == [(16, have, 3, bg.MAX_SPLITS)]
    # a bucket left without kernel timings keeps its row and its cuBLAS verdict
    only_new = [r for r in recs if r["config"] == new]
    only_new += [dict(r, impl="dequant_cublas", us=50.0) for r in only_new]
    for r in only_new[2:]:
        r.pop("config")
    update = bg.table_from(only_new, keep_tilings=True)
    assert update.rules == {} and update.cublas_from == {}


def test_weights_over_l2_take_a_tile_that_covers_m(monkeypatch):
    """A weight larger than the L2 is read from DRAM once per M tile: without over-L2 rows
    for M the dispatcher takes a later table row whose tile covers M where the row for M
    has a shorter tile."""
    monkeypatch.setattr(gemm_table, "RULES_OVER_L2", {})
    l2 = 50 << 20  # the H100's
    big, small = (28672, 8192), (14336, 4096)  # 66 MB and 15 MB at k = 2
    assert gd.weight_bytes(*big, 2) > l2 > gd.weight_bytes(*small, 2)
    assert gd.weight_over_l2(*big, 2, l2) and not gd.weight_over_l2(*big, 2, None)
    for k in KS:
        for M in (9, 17, 33, 64, 65, 100, 300):
            plain = g.GemmConfig.parse(gd.table_rule(k, M)[0])
            assert gd.plan(M, *small, k, 132, l2)[0] == plain
            cfg = gd.plan(M, *big, k, 132, l2)[0]
            covering = [
                g.GemmConfig.parse(r[1]) for r in gemm_table.RULES[k] if r[0] >= M
            ]  # rows from M's on
            want = next((c for c in covering if c.tile_m >= M), plain)
            assert cfg == (plain if plain.tile_m >= M else want), (k, M)
    # the case that motivated it: k = 2, M = 64 on 8192 x 28672 leaves the m32 tile
    if g.GemmConfig.parse(gd.table_rule(2, 64)[0]).tile_m < 64:
        assert gd.plan(64, *big, 2, 132, l2)[0].tile_m >= 64


def test_weight_bytes_match_a_quantized_weight(gen):
    for k, (N, K) in zip(KS, [(200, 96), (128, 64), (300, 1056), (1, 32)], strict=True):
        qw = fmt.quantize(torch.randn(N, K, generator=gen), k)
        assert gd.weight_bytes(N, K, k) == qw.nbytes


def test_small_weights_take_cublas_from_their_own_rows(tmp_path, monkeypatch):
    """``bench_gemm --write-small-from``: per weight size and k the smallest M from which
    dequantize + cuBLAS won at every larger M (None where the kernel won at the largest);
    the written rows lower k's general threshold for weights up to their size, never raise
    it, and leave weights over the L2 and larger weights alone."""
    from perf import bench_gemm as bg

    recs = []
    # (K, N) -> per M: kernel / dequantize + cuBLAS for k = 2 and k = 4
    wins = {(2048, 512): {64: (2, 2), 128: (2, 2), 256: (2, 2)},
            (4096, 2048): {64: (0.5, 0.5), 128: (2, 0.5), 256: (2, 2)},
            (4096, 4096): {64: (0.5, 0.5), 128: (0.5, 0.5), 256: (0.5, 2)},
            (8192, 4096): {64: (0.5, 0.5), 128: (0.5, 0.5), 256: (0.5, 0.5)}}  # fmt: skip
    for (K, N), by_m in wins.items():
        for M, ratios in by_m.items():
            for k, ratio in zip((2, 4), ratios, strict=True):
                recs.append(dict(K=K, N=N, k=k, M=M, kernel_us=10.0 * ratio,
                                 dequant_cublas_us=10.0))  # fmt: skip
    same = [dict(r, N=r["N"] // 2) for r in recs if (r["K"], r["N"]) == (2048, 512)]
    assert bg.small_weight_rows(same + recs)[0] == (1 << 20, {2: 64, 4: 64})  # one row for both
    rows = bg.small_weight_rows(recs)
    assert rows == [(1 << 20, {2: 64, 4: 64}), (1 << 23, {2: 128, 4: 256}),
                    (1 << 24, {2: None, 4: 256})]  # fmt: skip
    update = bg.TableUpdate({}, {}, {}, {}, rows)
    mod = _written_table(tmp_path, update, "Test GPU", "bench --small")
    assert mod.CUBLAS_FROM_M_SMALL == rows and mod.RULES == gemm_table.RULES
    assert mod.CUBLAS_FROM_M == gemm_table.CUBLAS_FROM_M
    assert mod.COMMAND.startswith(gemm_table.COMMAND) and mod.COMMAND.endswith("bench --small")

    monkeypatch.setattr(gemm_table, "CUBLAS_FROM_M_SMALL", rows)
    monkeypatch.setitem(gemm_table.CUBLAS_FROM_M, 2, 1024)
    monkeypatch.setitem(gemm_table.CUBLAS_FROM_M, 4, 128)
    assert gd.prefer_cublas(64, 2, elements=2048 * 512)  # the first row that holds it
    assert not gd.prefer_cublas(32, 2, elements=2048 * 512)
    assert gd.prefer_cublas(128, 2, elements=2048 * 2048) and not gd.prefer_cublas(
        64, 2, False, 1 << 22
    )
    assert not gd.prefer_cublas(512, 2, elements=1 << 24)  # None: the general threshold
    assert gd.prefer_cublas(128, 4, elements=1 << 23)  # never above the general threshold
    assert not gd.prefer_cublas(512, 2, elements=1 << 25)  # larger than every row
    assert not gd.prefer_cublas(64, 2, weight_over_l2=True, elements=1 << 20)
    assert not gd.prefer_cublas(64, 3, elements=1 << 20)  # k without a row entry
