"""The ``layouts`` visualization package: the data each picture is drawn from is the layout.

CPU only. Every CuTe evaluation is a ``cute.jit`` trace (~0.1 s), so views are built once
per module and shared.
"""

from __future__ import annotations

import itertools
import math

import pytest

from kbit_cute.format import (
    BLOCK,
    BLOCKS_PER_TILE_K,
    TILE_K,
    TILE_N,
    tiled_absmax_offset,
    tiled_word_offset,
)
from layouts import (
    LayoutParseError,
    bank_phases,
    conflict_ways,
    evaluate,
    layout_at,
    offset_grid,
    parse_layout,
    smem_phases,
    tile_view,
    tv_grid,
)
from layouts.__main__ import main
from layouts.draw import banks_figure, grid_figure, save, tile_figure, tv_figure
from layouts.text import grid_text, tile_text

# --------------------------------------------------------------------------- reference


def _flat(t):
    return [x for e in t for x in _flat(e)] if isinstance(t, tuple) else [t]


def ref_offset(shape, stride, idx: int) -> int:
    """The layout function written out: colex split of idx, dot with the strides."""
    off = 0
    for n, d in zip(_flat(shape), _flat(stride), strict=True):
        off += (idx % n) * d
        idx //= n
    return off


def ref_swizzle(b: int, m: int, s: int, off: int) -> int:
    """Swizzle<B, M, S> for S > 0: XOR bits [M, M+B) with bits [M+S, M+S+B)."""
    return off ^ ((off >> s) & (((1 << b) - 1) << m))


SMALL = [
    ("(2,3):(3,1)", (2, 3), (3, 1), 2),
    ("((4,2),8):((1,32),4)", ((4, 2), 8), ((1, 32), 4), 8),
    ("(8,8):(8,1)", (8, 8), (8, 1), 8),
    ("8:2", 8, 2, 1),
    ("(4,2):(0,1)", (4, 2), (0, 1), 4),  # stride 0: offsets repeat
    ("(4,(2,3)):(6,(1,2))", (4, (2, 3)), (6, (1, 2)), 4),
    ("(2,3,4):(12,4,1)", (2, 3, 4), (12, 4, 1), 2),  # rank 3: columns are modes 1, 2
]


@pytest.fixture(scope="module")
def small_grids():
    out = {}
    for text, *_ in SMALL:
        spec = parse_layout(text)
        out[text] = (spec, offset_grid(evaluate(spec.make)))
    return out


@pytest.fixture(scope="module")
def tiles():
    """k -> views of tile (0, 0) of the smallest weight and tile (1, 2) of a ragged one."""
    return {
        k: (tile_view(k), tile_view(k, k_tile=1, n_tile=2, N=3 * TILE_N + 5, K=2 * TILE_K + 32))
        for k in (2, 3, 4, 5)
    }


# --------------------------------------------------------------------------- offset grids


@pytest.mark.parametrize("text,shape,stride,rows", SMALL)
def test_grid_cells_are_the_layout_function(small_grids, text, shape, stride, rows):
    spec, grid = small_grids[text]
    assert (spec.shape, spec.stride) == (shape, stride)
    cols = math.prod(_flat(shape)) // rows
    assert (grid.rows, grid.cols) == (rows, cols)
    for i, j in itertools.product(range(rows), range(cols)):
        assert grid.cells[i][j] == ref_offset(shape, stride, i + rows * j), (i, j)


@pytest.mark.parametrize("text", [t for t, shape, *_ in SMALL if isinstance(shape, tuple)])
def test_grid_rows_are_mode_0_in_cute(small_grids, text):
    """Cell (i, j) is what CuTe itself returns for coordinate (i, j) of a rank-2 layout,
    and for (i, (j split over modes 1, 2)) of a rank-3 one."""
    spec, grid = small_grids[text]
    cells = list(itertools.product(range(grid.rows), range(grid.cols)))
    if len(spec.shape) == 2:
        coords = cells
    else:
        coords = [(i, j % spec.shape[1], j // spec.shape[1]) for i, j in cells]
    assert layout_at(spec.make, coords) == [grid.cells[i][j] for i, j in cells]


def test_grid_title_is_cute_text(small_grids):
    assert small_grids["((4,2),8):((1,32),4)"][1].title == "((4,2),8):((1,32),4)"


def test_swizzled_grid():
    spec = parse_layout("S<3,4,3> o (8,64):(64,1)")
    assert spec.swizzle == (3, 4, 3)
    grid = offset_grid(evaluate(spec.make))
    for i, j in itertools.product(range(8), range(64)):
        assert grid.cells[i][j] == ref_swizzle(3, 4, 3, 64 * i + j)
    assert sorted(x for row in grid.cells for x in row) == list(range(512))


def test_default_stride_is_column_major():
    ev = evaluate(parse_layout("(4,3)").make)
    assert ev.text == "(4,3):(1,4)"
    assert ev.offsets == tuple(range(12))


EXPECTED_2x3 = """\
(2,3):(3,1)
    0   1   2
  +---+---+---+
0 | 0 | 1 | 2 |
  +---+---+---+
1 | 3 | 4 | 5 |
  +---+---+---+"""


def test_text_form_matches(small_grids, capsys):
    assert grid_text(small_grids["(2,3):(3,1)"][1]) == EXPECTED_2x3
    assert main(["show", "(2,3):(3,1)", "--format", "text", "--color", "never"]) == 0
    assert capsys.readouterr().out == EXPECTED_2x3 + "\n"


def test_text_form_colored(small_grids):
    colored = grid_text(small_grids["(2,3):(3,1)"][1], color=True)
    assert "\x1b[48;5;" in colored
    assert "\x1b" not in grid_text(small_grids["(2,3):(3,1)"][1], color=False)


# --------------------------------------------------------------------------- parse errors


@pytest.mark.parametrize(
    "text,why",
    [
        ("(4,2:(1,2)", "expected ')'"),
        ("(4,2):(1,(2,3))", "nesting"),
        ("(0,2):(1,2)", "positive"),
        ("(4,2):(1,2", "expected ')', found the end"),
        ("", "empty"),
        ("(4,x)", "unexpected character 'x'"),
        ("(4,2):(1,2) 7", "after the layout"),
        ("S<3,4> o 8:1", "expected ','"),
        ("()", "expected an integer"),
    ],
)
def test_bad_layout_expression(text, why):
    with pytest.raises(LayoutParseError, match="bad layout expression") as info:
        parse_layout(text)
    assert why in str(info.value)
    assert "^" in str(info.value)  # points at the spot


def test_bad_layout_expression_cli(capsys):
    assert main(["show", "(4,2:(1,2)", "--format", "text"]) == 2
    err = capsys.readouterr().err
    assert "bad layout expression" in err and "(4,2:(1,2)" in err


# --------------------------------------------------------------------------- tile view


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_tile_word_mapping_matches_format(tiles, k):
    for view in tiles[k]:
        words_per_tile = TILE_N * BLOCKS_PER_TILE_K * k
        k_tiles = -(-view.K // TILE_K)
        n_tiles = -(-view.N // TILE_N)
        assert (k_tiles, n_tiles) > (view.k_tile, view.n_tile)
        base = (view.k_tile * n_tiles + view.n_tile) * words_per_tile
        assert view.words == words_per_tile
        seen = set()
        for word in range(view.words):
            n, ks, bit = view.word_weights(word)
            assert ks == tuple(range(ks[0], ks[0] + BLOCK)) and ks[0] % BLOCK == 0
            assert view.n_tile * TILE_N <= n < (view.n_tile + 1) * TILE_N
            assert view.k_tile * TILE_K <= ks[0] < (view.k_tile + 1) * TILE_K
            expect = tiled_word_offset(n, ks[0] // BLOCK, bit, view.K, view.N, k)
            assert view.word_global[word] == expect == base + word, (k, word)
            seen.add((n, ks[0], bit))
        assert len(seen) == view.words  # every (row, block, plane) of the tile exactly once


@pytest.mark.parametrize("k", [2, 5])
def test_tile_absmax_and_weight_colors(tiles, k):
    for view in tiles[k]:
        for off, (col, kb) in enumerate(view.absmax_crd):
            n, kblock = view.n_tile * TILE_N + col, view.k_tile * BLOCKS_PER_TILE_K + kb
            assert view.absmax_global[off] == tiled_absmax_offset(n, kblock, view.K, view.N)
        ww = view.weight_word()
        assert (len(ww), len(ww[0])) == (TILE_N, TILE_K)
        for col, kk in itertools.product(range(TILE_N), range(TILE_K)):
            assert view.word_crd[ww[col][kk]] == (col, kk // BLOCK, 0)


def test_tile_text_names_the_word(tiles):
    text = tile_text(tiles[3][1], word=13)
    assert "*13" in text  # the chosen word is marked in the memory view
    n, ks, bit = tiles[3][1].word_weights(13)
    assert f"bit plane {bit}" in text and f"W[{n}, {ks[0]} + j]" in text


# --------------------------------------------------------------------------- bank conflicts


def test_bank_conflicts_hand_cases():
    assert conflict_ways([128 * t for t in range(32)]) == 32  # every thread in bank 0
    assert conflict_ways([4 * t for t in range(32)]) == 1  # consecutive words
    assert conflict_ways([0] * 32) == 1  # one word for everyone: a broadcast
    assert conflict_ways([8 * t for t in range(32)]) == 2  # every other bank, twice
    assert conflict_ways([4 * 33 * t for t in range(32)]) == 1  # padded rows


def test_bank_phases_of_vectors():
    phases = bank_phases([16 * t for t in range(32)], access_bytes=16)
    assert [len(p.threads) for p in phases] == [8, 8, 8, 8]  # 16-byte accesses: 4 phases
    assert all(p.ways == 1 and sum(p.words_per_bank) == 32 for p in phases)
    assert conflict_ways([128 * t for t in range(32)], access_bytes=16) == 8
    with pytest.raises(ValueError, match="aligned"):
        bank_phases([2], access_bytes=4)


def test_smem_phases_from_layouts():
    column = evaluate(parse_layout("(32,4):(32,1)").make)  # thread t reads row t of 32 words
    assert [p.ways for p in smem_phases(column)] == [32] * 4
    swz = evaluate(parse_layout("S<3,3,3> o (32,8):(64,1)").make)  # fp16 rows, 16 B vectors
    plain = evaluate(parse_layout("(32,8):(64,1)").make)
    assert max(p.ways for p in smem_phases(plain, elem_bytes=2, vec=8)) == 8
    assert max(p.ways for p in smem_phases(swz, elem_bytes=2, vec=8)) == 1
    with pytest.raises(ValueError, match="adjacent"):
        smem_phases(evaluate(parse_layout("(32,8):(1,32)").make), elem_bytes=2, vec=8)


# --------------------------------------------------------------------------- TV layouts


def test_tv_grid_owners():
    shape, stride = ((8, 4), (2, 2)), ((16, 2), (1, 8))
    ev = evaluate(parse_layout("((8,4),(2,2)):((16,2),(1,8))").make)
    grid = tv_grid(ev, (8, 16))
    assert (grid.threads, grid.values, grid.rows, grid.cols) == (32, 4, 8, 16)
    for t, v in itertools.product(range(32), range(4)):
        idx = ref_offset(shape, stride, t + 32 * v)
        assert grid.cells[idx % 8][idx // 8] == ((t, v),)


def test_tv_grid_broadcast_lists_every_owner():
    grid = tv_grid(evaluate(parse_layout("(4,2):(0,1)").make), (1, 2))
    assert grid.cells[0][1] == ((0, 1), (1, 1), (2, 1), (3, 1))


# --------------------------------------------------------------------------- pictures


def _is_picture(path, fmt: str) -> bool:
    head = path.read_bytes()[:8]
    return path.stat().st_size > 1000 and (
        head.startswith(b"\x89PNG") if fmt == "png" else head.startswith(b"<?xml")
    )


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_figures_render_headless(tmp_path, small_grids, tiles, fmt):
    ev = evaluate(parse_layout("((8,4),(2,2)):((16,2),(1,8))").make)
    figures = {
        "grid": grid_figure(small_grids["((4,2),8):((1,32),4)"][1]),
        "tv": tv_figure(tv_grid(ev, (8, 16))),
        "banks": banks_figure("t", bank_phases([8 * t for t in range(32)])),
        "tile": tile_figure(tiles[4][1], word=13),
    }
    for name, fig in figures.items():
        assert _is_picture(save(fig, tmp_path / f"{name}.{fmt}"), fmt), name


def test_cli_writes_pictures(tmp_path, capsys):
    assert main(["tile", "--k", "2", "--word", "3", "--out", str(tmp_path)]) == 0
    assert main(["show", "(8,8):(8,1)", "--format", "png", "--out", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert [p.split("/")[-1] for p in written] == ["tile_k2_w3.svg", "layout_8_8_8_1.png"]
    assert _is_picture(tmp_path / "tile_k2_w3.svg", "svg")
    assert _is_picture(tmp_path / "layout_8_8_8_1.png", "png")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["tile", "--k", "2", "--word", "512"], "--word must be in 0..511"),
        (["tile", "--k", "2", "--tile", "0,2", "--weight", "256,64"], "outside W"),
        (["show", "(32,8):(1,32)", "--banks", "--vec", "8"], "adjacent"),
    ],
)
def test_cli_input_errors(capsys, argv, message):
    assert main([*argv, "--format", "text"]) == 2
    assert message in capsys.readouterr().err
