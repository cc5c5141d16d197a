"""``python -m layouts kernel gemv|gemm|moe``: the kernels' own layouts and bank maps.

CPU only. Every check compares what a picture is drawn from with an independent statement
of the kernel's indexing (the PTX fragment tables, the Swizzle<3,3,3> formula, the index
arithmetic the kernels are written with), so a drawing that drifts from the code fails.
CuTe evaluations are traces (~0.1 s each): views are built once per module.
"""

from __future__ import annotations

import itertools
import sys
import xml.etree.ElementTree as ET

import cutlass.cute as cute
import pytest

import kbit_cute.layouts as kl
from kbit_cute.kernels.gemm import _C_PAD, GemmConfig, GemmKernel
from layouts import access_phases, kernel_views, layout_at, layout_view, split_layout
from layouts.__main__ import main

MOE_MODULE = "kbit_cute.kernels.grouped_gemv"

# --------------------------------------------------------------------------- references


def _swizzled_a(row: int, kk: int, tile_m: int) -> int:
    """A(row, kk)'s element offset in a stage: 8 x 64 Swizzle<3,3,3> atoms, M first."""
    atom = (row % 8) * 64 + (kk % 64)
    atom ^= ((atom >> 6) & 7) << 3  # 16-byte chunk ^= row within the atom
    return atom + (row // 8) * 512 + (kk // 64) * tile_m * 64


def _ldsm_row(lane: int) -> tuple[int, int]:
    """ldmatrix.x4 for an m16n8k16 A fragment: lane l gives the address of row l % 8 of
    matrix l // 8; the matrices are (rows 0-7 | 8-15) x (K 0-7 | 8-15), rows first."""
    return 8 * ((lane // 8) % 2) + lane % 8, 8 * (lane // 16)


def _mma_a_owner(m: int, kk: int) -> tuple[int, int]:
    """PTX m16n8k16 A fragment (ISA 'Matrix Fragments for mma.m16n8k16'): lane 4g + t holds
    rows g (a0, a1, a4, a5) and g + 8 (a2, a3, a6, a7), columns 2t, 2t + 1 (+ 8 for a4..a7),
    so element a_v has v = (k odd) + 2 (row >= 8) + 4 (k >= 8): CuTe's value index."""
    g, t = m % 8, (kk % 8) // 2
    v = (kk % 2) + 2 * (m // 8) + 4 * (kk // 8)
    return 4 * g + t, v


def _evaluated(kind: str, k: int, config: str | None = None) -> dict:
    """name -> (access bytes, [instruction][thread] address) of every bank map entry."""
    entries = kl.kernel_layouts(kind, k, config)
    return {n: e.evaluate() for n, e in entries.items() if isinstance(e, kl.SmemAccess)}


GEMM_M16 = "m16n128k64s4w1x4"


@pytest.fixture(scope="module")
def gemm_m16():
    """k = 4, config m16n128k64s4w1x4: kernel, accesses."""
    return GemmKernel(4, "f16", GemmConfig.parse(GEMM_M16)), _evaluated("gemm", 4, GEMM_M16)


# --------------------------------------------------------------------------- bank maps


def test_access_phases_idle_threads():
    inst = [[4 * t if t % 2 else None for t in range(64)], [None] * 64]
    phases = access_phases(inst, 4)
    assert [p.label for p in phases] == ["access 0, warp 0", "access 0, warp 1"]
    assert phases[0].threads == tuple(range(1, 32, 2))
    assert phases[0].words_per_bank == (0, 1) * 16 and phases[0].ways == 1
    assert access_phases([[None] * 8 + [0] * 8], 16)[0].label == "access 0, warp 0 phase 1"
    with pytest.raises(ValueError, match="no thread"):
        access_phases([[None] * 32], 4)


EXPECTED_TINY_MAP = (
    "== x_smem_access\n"
    "x_smem_access: tiny; 4-byte accesses\n"
    "                 bank  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15"
    " 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31  ways\n"
    "access 0, warp 0       2  .  .  .  .  .  .  .  .  .  .  .  .  .  .  ."
    "  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  1     2\n"
    "worst phase: 2-way\n"
)


def test_kernel_access_text_matches(monkeypatch, capsys):
    def kernel_layouts(kind: str, k: int):
        # thread 0 and 1 share bank 0 through two words (2-way); 2 is idle; 3 is bank 31
        return {"x_smem_access": kl.SmemAccess("tiny", lambda: (4, [[0, 128, None, 124]]))}

    monkeypatch.setattr(kl, "kernel_layouts", kernel_layouts)
    assert main(["kernel", "gemm", "--format", "text", "--color", "never"]) == 0
    assert capsys.readouterr().out == EXPECTED_TINY_MAP


def test_gemm_a_stores_are_the_kernel_copy(gemm_m16):
    kern, acc = gemm_m16
    nbytes, inst = acc["a_store_smem"]
    assert nbytes == 16 and len(inst) == 1  # 128 threads copy the 16 x 64 stage in one pass
    for t in range(128):  # row tidx // 8, chunk tidx % 8 (the kernel's a_copy_offsets)
        assert inst[0][t] == kern.plan["a"] + 2 * _swizzled_a(t // 8, (t % 8) * 8, 16), t
    phases = access_phases(inst, nbytes)
    assert len(phases) == 16 and max(p.ways for p in phases) == 1


def test_gemm_a_stores_m32_passes():
    """Two passes; the kernel adds rows_pass * 64 elements per pass to the pass-0 offset."""
    kern = GemmKernel(4, "f16", GemmConfig.parse("m32n128k64s4w1x4"))
    nbytes, inst = _evaluated("gemm", 4, kern.cfg.name)["a_store_smem"]
    assert len(inst) == 2
    for i, t in itertools.product(range(2), range(128)):
        row, kk = t // 8 + 16 * i, (t % 8) * 8
        assert inst[i][t] == 2 * _swizzled_a(row, kk, 32) == inst[0][t] + 2 * i * 16 * 64
    assert max(p.ways for p in access_phases(inst, nbytes)) == 1


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gemm_b_and_table_stores(k):
    kern = GemmKernel(k, "f16", GemmConfig.parse(GEMM_M16))
    entries = kl.kernel_layouts("gemm", k, GEMM_M16)
    chunks, plan = 64 * k, kern.plan  # 16-byte chunks of one repack tile's words
    nbytes, inst = entries["w_store_smem"].evaluate()
    assert nbytes == 16 and len(inst) == -(-chunks // 128)
    for i, t in itertools.product(range(len(inst)), range(128)):
        q = t + 128 * i
        assert inst[i][t] == (plan["w"] + 16 * q if q < chunks else None), (i, t)
    nbytes, inst = entries["absmax_store_smem"].evaluate()
    assert nbytes == 16  # the CTA's last 16 threads, one chunk each:
    assert inst == [[None] * 112 + [plan["s"] + 16 * q for q in range(16)]]
    nbytes, inst = entries["table_store_smem"].evaluate()
    assert nbytes == 4 and len(inst) == max(1, (1 << 2 * k) // 128)
    for i, t in itertools.product(range(len(inst)), range(128)):
        p = t + 128 * i
        assert inst[i][t] == (plan["table"] + 4 * p if p < 1 << 2 * k else None), (i, t)
    for name in ("w_store_smem", "absmax_store_smem", "table_store_smem"):
        nbytes, inst = entries[name].evaluate()
        assert max(p.ways for p in access_phases(inst, nbytes)) == 1, name


@pytest.mark.parametrize("k", [2, 4])
def test_gemm_lane_table_stores(k):
    """Lane-replicated pair table: 16-byte stores of 4 lanes' copies, entry p's row of 32
    copies at p * 128 (bank = lane), written without conflicts."""
    cfg = GEMM_M16 + "l"
    kern = GemmKernel(k, "f16", GemmConfig.parse(cfg))
    assert kern.plan["total"] - GemmKernel(k, "f16", GemmConfig.parse(GEMM_M16)).plan["total"] == (
        31 * (4 << 2 * k)
    )
    nbytes, inst = kl.kernel_layouts("gemm", k, cfg)["table_store_smem"].evaluate()
    stores = 8 << 2 * k
    assert nbytes == 16 and len(inst) == -(-stores // 128)
    for i, t in itertools.product(range(len(inst)), range(128)):
        q = t + 128 * i
        want = kern.plan["table"] + 128 * (q // 8) + 16 * (q % 8)
        assert inst[i][t] == (want if q < stores else None), (i, t)
    assert max(p.ways for p in access_phases(inst, nbytes)) == 1


def test_gemm_epilogue_stores_are_the_c_fragment(gemm_m16):
    """partition_C(sC): lane 4g + t holds (g, 2t..2t+1) and (g + 8, 2t..2t+1) of each
    n8 tile, warp w the w-th n8 of every 32 columns; autovec_copy stores pairs (the SASS
    of this variant has 32-bit STS only in its epilogue)."""
    kern, acc = gemm_m16
    nbytes, inst = acc["c_store_smem"]
    assert nbytes == 4 and len(inst) == 2 * 4  # (c0c1 | c2c3) x 4 n8 tiles per warp
    pitch = 128 + _C_PAD
    for a, t in itertools.product(range(8), range(128)):
        half, nj = a % 2, a // 2
        g, tq, w = (t % 32) // 4, t % 4, t // 32
        row, col = g + 8 * half, 32 * nj + 8 * w + 2 * tq
        assert inst[a][t] == 2 * (row * pitch + col), (a, t)
    assert max(p.ways for p in access_phases(inst, nbytes)) == 1


@pytest.mark.parametrize("config", ["m16n128k64s4w1x4", "m32n128k64s4w1x4"])
def test_gemm_ldmatrix_reads_the_fragment_rows(config):
    """thr_ldsm.partition_S(sA): every warp (4 tile N, A is shared) reads the same rows;
    instruction (mi, ks) of lane l reads row 16 mi + _ldsm_row(l) at K 16 ks + 8 (l // 16).
    m32 (two MMA row tiles per warp) was wrong when the map composed the TV layout with
    the whole stage."""
    cfg = GemmConfig.parse(config)
    nbytes, inst = _evaluated("gemm", 4, config)["ldsm_a_smem"]
    mi_n = cfg.tile_m // 16
    assert nbytes == 16 and len(inst) == mi_n * 4
    for a, t in itertools.product(range(len(inst)), range(128)):
        mi, ks = a % mi_n, a // mi_n
        row, kk = _ldsm_row(t % 32)
        assert inst[a][t] == 2 * _swizzled_a(16 * mi + row, 16 * ks + kk, cfg.tile_m), (a, t)
    assert max(p.ways for p in access_phases(inst, nbytes)) == 1


def test_gemm_ldmatrix_tv_is_the_tiled_copy():
    """The TiledCopy's own TV layout: lane l supplies row 8 (l // 8 % 2) + l % 8 at K
    8 (l // 16) of the (16, 16) A tile; the 4 warps (tiling N) copy the same rows."""
    tv = layout_view("ldsm_a_tv", kl.kernel_layouts("gemm", 4)["ldsm_a_tv"]).data
    assert (tv.rows, tv.cols, tv.threads, tv.values) == (16, 16, 128, 8)
    for m, kk in itertools.product(range(16), range(16)):
        owners = tv.cells[m][kk]
        lanes = {t % 32 for t, _ in owners}
        assert len(owners) == 4 and len(lanes) == 1, (m, kk)
        assert _ldsm_row(lanes.pop()) == (m, kk - kk % 8) and owners[0][1] == kk % 8


def test_gemm_without_plans_says_so(monkeypatch):
    for name in kl.GEMM_PLANS:
        monkeypatch.delattr(GemmKernel, name, raising=False)
    entries = kl.kernel_layouts("gemm", 4)
    assert "a_store_smem" not in entries and "ldsm_a_smem" in entries
    assert "GemmKernel.a_copy_plan" in entries["smem_stores"]


def test_gemm_config_errors(capsys):
    assert main(["kernel", "gemm", "--config", "m16", "--format", "text"]) == 2
    assert "not a GEMM config name: 'm16'" in capsys.readouterr().err
    assert main(["kernel", "gemm", "--only", "nothing_here", "--format", "text"]) == 2
    assert "no layout of 'gemm' matches" in capsys.readouterr().err


# --------------------------------------------------------------------------- mma layouts


def test_kernel_gemv_mma_a_is_the_ptx_fragment():
    entries = kl.kernel_layouts("gemv", 4)
    tv = layout_view("mma_a_tv", entries["mma_a_tv"]).data
    assert (tv.rows, tv.cols, tv.threads, tv.values) == (16, 16, 32, 8)
    split = split_layout(entries["mma_a_tv"])
    coords = [(t, v) for v in range(8) for t in range(32)]
    # The drawn cells are the layout function: cell (idx % 16, idx // 16) is owned by (t, v).
    for (t, v), idx in zip(coords, layout_at(split.make, coords), strict=True):
        assert tv.cells[idx % 16][idx // 16] == ((t, v),)
    # ... and that function is the PTX fragment the kernel's register code assumes.
    for m, kk in itertools.product(range(16), range(16)):
        assert tv.cells[m][kk] == (_mma_a_owner(m, kk),), (m, kk)


def test_kernel_gemm_a_smem_swizzle():
    views = {v.name: v for v in kernel_views("gemm", 4, GEMM_M16, only="a_smem_layout|mma_b")}
    a = views["a_smem_layout"].data  # m16 config: one (16, 64) stage of the A ring
    assert (a.rows, a.cols) == (16, 64)
    for m, kk in itertools.product(range(16), range(64)):
        assert a.cells[m][kk] == _swizzled_a(m, kk, 16)
    assert views["mma_b_tv"].data.threads == 128  # 4 warps tile N


def test_kernel_gemv_has_no_smem_map(tmp_path, capsys):
    assert main(["kernel", "gemv", "--only", "smem", "--format", "text"]) == 0
    assert capsys.readouterr().out.startswith("== smem\nnote: no shared-memory tile, so no bank")
    assert main(["kernel", "gemv", "--only", "mma_a|smem", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("kernel_gemv_k4_mma_a_tv.svg") and out[1].startswith("smem: no shared")
    assert [p.name for p in tmp_path.iterdir()] == ["kernel_gemv_k4_mma_a_tv.svg"]  # no empty map
    root = ET.parse(tmp_path / "kernel_gemv_k4_mma_a_tv.svg").getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("V0") == 32 and "T31" in texts  # the A fragment: 8 values / thread


# --------------------------------------------------------------------------- moe


def _moe_expected(gate_up: bool, inter: int, i: int, j: int) -> int:
    """Cell (i, j) = column of (g, w) = divmod(i, 8)[::-1], (h, r) = divmod(j, 2)[::-1]."""
    g, w, h, r = i % 8, i // 8, j % 2, j // 2
    if gate_up:
        return g + 8 * h + 16 * r + 32 * (w % 2) + inter * (w // 2)
    return g + 8 * h + 16 * r + 32 * w


@pytest.mark.parametrize(("config", "inter"), [("gate_up:192", 192), ("down", 0)])
def test_moe_cta_columns_are_the_layout(config, inter):
    views = {v.name: v for v in kernel_views("moe", 4, config, only="cta_columns|smem")}
    name = f"cta_columns_{config.split(':')[0]}"
    grid = views[name].data
    assert (grid.rows, grid.cols) == (32, 4)
    for i, j in itertools.product(range(32), range(4)):
        assert grid.cells[i][j] == _moe_expected(config != "down", inter, i, j), (i, j)
    assert "lanes 4g..4g+3 of warp w" in views[name].title
    assert views["smem"].is_note and "cp.async ring" in views["smem"].data


@pytest.mark.parametrize(("config", "inter"), [("gate_up:192", 192), ("down", 0)])
def test_moe_stream_columns_are_the_layout(config, inter):
    """GroupedStreamKernel: gate/up warp w holds gate columns 16 w + g + 8 h in row tile 0
    and the same columns of up in row tile 1; dense as the CTA kernel."""
    views = {v.name: v for v in kernel_views("moe", 4, config, only="stream_columns")}
    grid = views[f"stream_columns_{config.split(':')[0]}"].data
    for i, j in itertools.product(range(32), range(4)):
        g, w, h, r = i % 8, i // 8, j % 2, j // 2
        want = g + 8 * h + (inter * r + 16 * w if inter else 16 * r + 32 * w)
        assert grid.cells[i][j] == want, (i, j)


EXPECTED_MOE_DOWN_HEAD = """\
== cta_columns_down
CTA columns: cell = weight column - the CTA's first column (cta_column_layout); row = (g, w): \
lanes 4g..4g+3 of warp w (thread 32w + 4g + t, t = 0..3 share the column); column = (h, r): \
the mma values of column half h, row tile r
((8,4),(2,2)):((1,32),(8,16))
       0     1     2     3
   +-----+-----+-----+-----+
 0 |   0 |   8 |  16 |  24 |
   +-----+-----+-----+-----+
 1 |   1 |   9 |  17 |  25 |
"""


def test_moe_text_and_pictures(tmp_path, capsys):
    argv = ["kernel", "moe", "--config", "down", "--only", "cta"]
    assert main([*argv, "--format", "text", "--color", "never"]) == 0
    assert capsys.readouterr().out.startswith(EXPECTED_MOE_DOWN_HEAD)
    argv = ["kernel", "moe", "--config", "gate_up", "--only", "cta", "--out", str(tmp_path)]
    assert main([*argv, "--format", "png"]) == 0
    assert _is_picture(tmp_path / "kernel_moe_k4_gate_up_cta_columns_gate_up.png", "png")
    # without --config both column maps are drawn, gate_up at the default intermediate
    names = [v.name for v in kernel_views("moe", 4, only="cta")]
    assert names == ["cta_columns_gate_up", "cta_columns_down"]


def test_moe_mma_is_the_gemv_mma():
    moe = layout_view("mma_a_tv", kl.kernel_layouts("moe", 4)["mma_a_tv"]).data
    assert moe == layout_view("mma_a_tv", kl.kernel_layouts("gemv", 4)["mma_a_tv"]).data


@pytest.mark.parametrize(
    ("config", "message"),
    [("up", "moe config must be"), ("down:128", "moe config must be"), ("gate_up:96", "64")],
)
def test_moe_bad_config(capsys, config, message):
    assert main(["kernel", "moe", "--config", config, "--format", "text"]) == 2
    assert message in capsys.readouterr().err


def test_moe_kernel_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, MOE_MODULE, None)  # import raises ImportError
    assert main(["kernel", "moe", "--format", "text"]) == 2
    assert "cannot import the grouped expert kernel (kbit_cute/kernels/grouped_gemv.py)" in (
        capsys.readouterr().err
    )


# --------------------------------------------------------------------------- registry, pictures


def _is_picture(path, fmt: str) -> bool:
    head = path.read_bytes()[:8]
    return path.stat().st_size > 1000 and (
        head.startswith(b"\x89PNG") if fmt == "png" else head.startswith(b"<?xml")
    )


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_gemm_bank_map_pictures(tmp_path, capsys, fmt):
    argv = ["kernel", "gemm", "--only", "absmax_store", "--format", fmt, "--out", str(tmp_path)]
    assert main(argv) == 0
    path = tmp_path / f"kernel_gemm_k4_absmax_store_smem.{fmt}"
    assert capsys.readouterr().out.strip() == str(path)
    assert _is_picture(path, fmt)


def test_kernel_not_registered(monkeypatch, capsys):
    monkeypatch.delattr(kl, "kernel_layouts", raising=False)
    assert main(["kernel", "gemv", "--k", "4", "--format", "text"]) == 2
    assert "kernel layouts for 'gemv' are not registered yet" in capsys.readouterr().err


def test_kernel_registry_raising(monkeypatch, capsys):
    def kernel_layouts(kind: str, k: int):
        raise KeyError(kind)

    monkeypatch.setattr(kl, "kernel_layouts", kernel_layouts, raising=False)
    assert main(["kernel", "moe", "--format", "text"]) == 2
    assert "kernel layouts for 'moe' are not registered yet" in capsys.readouterr().err


def test_kernel_views_from_registry(monkeypatch, tmp_path, capsys):
    def kernel_layouts(kind: str, k: int):
        assert (kind, k) == ("gemm", 3)
        return {
            "a_tv": lambda: cute.make_layout_tv(
                cute.make_layout((4, 8), stride=(8, 1)), cute.make_layout((2, 2))
            ),
            "b_smem": lambda: (cute.make_layout((32, 4), stride=(4, 1)), 4, 4),
            "c": lambda: (cute.make_layout((2, 3), stride=(3, 1)), "a caption"),
            "d": "a note",
        }

    monkeypatch.setattr(kl, "kernel_layouts", kernel_layouts, raising=False)
    assert main(["kernel", "gemm", "--k", "3", "--format", "text", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "== a_tv" in out and "T0V0" in out
    assert "worst phase: 1-way (conflict-free)" in out
    assert "== c\na caption\n(2,3):(3,1)\n" in out and "== d\nnote: a note" in out
    assert main(["kernel", "gemm", "--k", "3", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "d: a note"
    for name in ("a_tv", "b_smem", "c"):
        assert _is_picture(tmp_path / f"kernel_gemm_k3_{name}.svg", "svg")
    tv = layout_view("a_tv", kernel_layouts("gemm", 3)["a_tv"]).data
    assert (tv.rows, tv.cols, tv.threads, tv.values) == (8, 16, 32, 4)


def test_kernel_bad_input():
    with pytest.raises(ValueError, match="k must be 2..5"):
        kl.kernel_layouts("gemv", 6)
    with pytest.raises(ValueError, match="kernel kind"):
        kl.kernel_layouts("conv", 4)
    with pytest.raises(ValueError, match="no configs"):
        kl.kernel_layouts("gemv", 4, "m16n128k64s4w1x4")
