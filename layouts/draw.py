"""matplotlib pictures (PNG/SVG) of the grids, the tile and the bank maps.

Figures are built with ``matplotlib.figure.Figure`` and never touch pyplot, so drawing
is headless with any backend and importing this module changes no global state.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from kbit_cute.format import BLOCK

from .banks import BANKS, BankPhase
from .grid import OffsetGrid, TvGrid
from .text import tile_title, word_text  # one wording for terminal and pictures
from .tile import TileView

MAX_LABELLED = 2048  # above this many cells the numbers are unreadable; draw colors only
_CELL_IN = 0.42  # inches per cell of a small grid
_MAX_IN = 18.0  # largest figure side in inches


def _lighten(rgb: np.ndarray, amount: float = 0.45) -> np.ndarray:
    """Mix with white so black text stays readable on every cell."""
    return rgb[..., :3] * (1 - amount) + amount


def _by_offset(values: np.ndarray, cmap: str = "viridis") -> np.ndarray:
    lo, hi = values.min(), values.max()
    return _lighten(matplotlib.colormaps[cmap]((values - lo) / max(hi - lo, 1)))


def _by_class(ids: np.ndarray, cmap: str = "tab10") -> np.ndarray:
    colors = matplotlib.colormaps[cmap]
    return _lighten(colors(ids % colors.N))


def _figure(rows: int, cols: int, extra_w: float = 0.0, extra_h: float = 0.9) -> Figure:
    cell = min(_CELL_IN, _MAX_IN / max(rows, cols))
    return Figure(
        figsize=(cols * cell + 1.0 + extra_w, rows * cell + extra_h), layout="constrained"
    )


def _ticks(ax, n: int, axis: str, limit: int = 32) -> None:
    step = 1 if n <= limit else -(-n // limit)
    idx = np.arange(0, n, step)
    (ax.set_xticks if axis == "x" else ax.set_yticks)(idx, [str(i) for i in idx])


def _cells(ax, rgb: np.ndarray, labels: Sequence[Sequence[str]] | None = None) -> None:
    """Colored cells, thin borders on small grids and, if they fit, a label in each."""
    rows, cols = rgb.shape[:2]
    ax.imshow(rgb, interpolation="nearest", aspect="auto")
    if rows <= 64 and cols <= 64:  # every border is an SVG element: keep big pictures small
        ax.set_xticks(np.arange(-0.5, cols), minor=True)
        ax.set_yticks(np.arange(-0.5, rows), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False, labelsize=7)
    _ticks(ax, cols, "x")
    _ticks(ax, rows, "y")
    if labels is None or rows * cols > MAX_LABELLED:
        return
    longest = max(len(s) for row in labels for s in row)
    cell_pt = 72 * ax.figure.get_figwidth() / (cols + 2.5)
    size = max(3.0, min(9.0, 1.5 * cell_pt / max(longest, 1)))
    for i, row in enumerate(labels):
        for j, s in enumerate(row):
            ax.text(j, i, s, ha="center", va="center", fontsize=size)


def _title(fig: Figure, *lines: str) -> str:
    """Lines of a figure title, long ones wrapped to the figure's width (a caption can be a
    paragraph); the figure grows by the lines wrapping added."""
    width = max(30, int(12 * fig.get_figwidth()))  # characters of 9-10 pt text per line
    text = "\n".join(textwrap.fill(line, width) for line in lines if line)
    extra = text.count("\n") + 1 - sum(1 for line in lines if line)
    fig.set_figheight(fig.get_figheight() + 0.16 * extra)
    return text


def grid_figure(grid: OffsetGrid, caption: str = "") -> Figure:
    """Cell (i, j) shows layout(i, j), colored by offset; like CuTe's ``print_latex``."""
    offsets = np.array(grid.cells)
    fig = _figure(grid.rows, grid.cols, extra_h=0.9 + 0.2 * bool(caption))
    if caption:  # room for a readable paragraph above narrow grids
        fig.set_figwidth(max(fig.get_figwidth(), 6.0))
    ax = fig.add_subplot()
    _cells(ax, _by_offset(offsets), [[str(x) for x in row] for row in grid.cells])
    ax.set_title(_title(fig, caption, grid.title), fontsize=9)
    return fig


def tv_figure(grid: TvGrid, caption: str = "") -> Figure:
    """Each tile element shows its owner ``T<thread> V<value>``, colored by thread."""
    first = np.array([[o[0][0] if o else -1 for o in row] for row in grid.cells])
    rgb = _by_class(np.maximum(first, 0), "tab20")
    rgb[first < 0] = 1.0  # elements no thread owns stay white
    labels = [
        [f"T{o[0][0]}\nV{o[0][1]}" + (f"\n+{len(o) - 1}" if len(o) > 1 else "") if o else ""
         for o in row]
        for row in grid.cells
    ]  # fmt: skip
    fig = _figure(grid.rows, grid.cols)
    ax = fig.add_subplot()
    _cells(ax, rgb, labels)
    ax.set_title(
        _title(fig, caption, grid.title, f"{grid.threads} threads x {grid.values} values"),
        fontsize=10,
    )
    return fig


def banks_figure(title: str, phases: Sequence[BankPhase]) -> Figure:
    """Rows: warp access phases; columns: the 32 banks; cell: distinct words served."""
    counts = np.array([p.words_per_bank for p in phases])
    # white idle, green for one word (no conflict), reds for conflicts
    palette = np.array(
        [[1, 1, 1], [0.75, 0.92, 0.75], [1, 0.85, 0.6], [1, 0.7, 0.5], [1, 0.55, 0.45]]
    )
    rgb = palette[np.minimum(counts, len(palette) - 1)]
    labels = [[str(c) if c else "" for c in row] for row in counts]
    fig = _figure(len(phases), BANKS, extra_w=2.0)
    ax = fig.add_subplot()
    _cells(ax, rgb, labels)
    step = max(1, -(-len(phases) // 32))
    ax.set_yticks(range(0, len(phases), step), [f"{p.label}: {p.ways}-way" for p in phases[::step]])
    ax.set_xlabel("bank")
    ax.xaxis.set_label_position("top")
    worst = max(p.ways for p in phases)
    ax.set_title(_title(fig, title, f"worst phase: {worst}-way (1 = conflict-free)"), fontsize=9)
    return fig


def tile_figure(view: TileView, word: int = 0) -> Figure:
    """One repack tile: its words in memory order, its absmax bytes, and the weights.

    Left: a row per column ``col``, the tile's uint32 words [kb][bit] colored by bit
    plane. Middle: the absmax bytes. Right: the tile's 128 x 64 weights colored by the
    memory offset of the (bit-0) word holding them. The chosen word and its 32 weights
    are outlined in red.
    """
    amax = view.block_absmax()
    cols, kbs = (1 + max(c[i] for c in view.absmax_crd) for i in (0, 1))
    k = view.k
    # Row = column col, its words left to right in memory order (as the layout has them).
    by_col: list[list[int]] = [[] for _ in range(cols)]
    for off, (col, _, _) in enumerate(view.word_crd):
        by_col[col].append(off)
    crd = [[view.word_crd[off] for off in row] for row in by_col]
    planes = np.array([[b for _, _, b in row] for row in crd])
    shade = np.array([[kb for _, kb, _ in row] for row in crd])
    words_rgb = _by_class(planes) * (1 - 0.12 * shade[..., None])  # kb 1 a shade darker
    weights = np.array(view.weight_word())
    amax_offsets = np.array([[amax[c, kb] for kb in range(kbs)] for c in range(cols)])

    fig = Figure(figsize=(11, 9.5), layout="constrained")
    ax_w, ax_a, ax_m = fig.subplots(1, 3, width_ratios=[0.45 * kbs * k, 1.2, 6.4])
    _cells(ax_w, words_rgb)
    _cells(ax_a, _by_offset(amax_offsets, "cividis"))
    image = ax_m.imshow(weights, cmap="viridis", alpha=0.6, interpolation="nearest", aspect="auto")
    fig.colorbar(image, ax=ax_m, shrink=0.5, label="tile offset of the word holding bit 0")
    for p in range(1, len(crd[0])):  # block boundaries: a word never crosses them
        if crd[0][p][1] != crd[0][p - 1][1]:
            ax_w.axvline(p - 0.5, color="black", linewidth=1)
    for x in range(1, kbs):
        ax_a.axvline(x - 0.5, color="black", linewidth=1)
        ax_m.axvline(x * BLOCK - 0.5, color="black", linewidth=1)
    ax_w.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False, labelsize=7)
    ax_w.set_xticks(range(len(crd[0])), [f"kb{kb}\nb{b}" for _, kb, b in crd[0]])
    rows = range(0, cols, 16)
    ax_w.set_yticks(rows, [f"{c} @{by_col[c][0]}" for c in rows])
    ax_w.set_ylabel("col = n - n0   @ offset of its first word")
    ax_w.set_title("words in memory order\n[col][kb][bit]", fontsize=9)
    ax_a.set_xticks(range(kbs), [f"kb{kb}" for kb in range(kbs)])
    ax_a.set_yticks(rows, [str(amax[c, 0]) for c in rows])
    ax_a.set_title("absmax\nbytes", fontsize=9)
    n0 = view.n_tile * cols
    k0 = min(view.word_weights(0)[1][0], view.word_weights(view.words - 1)[1][0])
    ticks = range(0, weights.shape[1], 8)
    ax_m.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False, labelsize=7)
    ax_m.set_xticks(ticks, [str(k0 + x) for x in ticks])
    ax_m.set_yticks(rows, [str(n0 + c) for c in rows])
    ax_m.set_title("weights W[n, k], colored by the memory offset of their word", fontsize=9)
    ax_m.set_ylabel("n")

    col, kb, _ = view.word_crd[word]
    n, ks, _ = view.word_weights(word)
    red = {"fill": False, "edgecolor": "red", "linewidth": 1.6}
    ax_w.add_patch(Rectangle((by_col[col].index(word) - 0.5, col - 0.5), 1, 1, **red))
    ax_a.add_patch(Rectangle((kb - 0.5, col - 0.5), 1, 1, **red))
    ax_m.add_patch(Rectangle((ks[0] - k0 - 0.5, n - n0 - 0.5), len(ks), 1, **red))

    title = tile_title(view) + ".  In red: " + word_text(view, word)
    fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write PNG or SVG (by suffix); SVG keeps text as text and has no date, so it diffs."""
    path = Path(path)
    # One font name instead of matplotlib's fallback list on every <text>: halves the SVG.
    rc = {"svg.fonttype": "none", "svg.hashsalt": "layouts", "font.sans-serif": ["DejaVu Sans"]}
    with matplotlib.rc_context(rc):
        fig.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
    if path.suffix == ".svg":
        path.write_text(_compact_svg(path.read_text()))
    return path


def _compact_svg(svg: str) -> str:
    """Same picture, about half the bytes: matplotlib repeats a ~90-byte style, a no-op
    ``rotate(-0 x y)``, a <g> and 6 decimals on every <text>; styles used 3+ times become
    CSS classes (tick labels are <g>s with paths: left as they are)."""
    svg = re.sub(r' transform="rotate\(-0 [-0-9.e]+ [-0-9.e]+\)"', "", svg)
    svg = re.sub(  # text positions to 1/100 px
        r"translate\(([-0-9.]+) ([-0-9.]+)\)",
        lambda m: f"translate({float(m.group(1)):.2f} {float(m.group(2)):.2f})",
        svg,
    )
    svg = re.sub(r'<g id="text_\d+">\s*((?:<text[^<]*</text>\s*)+)</g>', r"\1", svg)
    svg = re.sub(r"\n\s+", "\n", svg)  # indentation
    counts = Counter(re.findall(r' style="([^"]*)"', svg))
    classes = {st: f"s{i}" for i, st in enumerate(st for st, n in counts.items() if n >= 3)}
    if not classes or "</style>" not in svg:
        return svg
    css = "".join(f"\n.{c}{{{st}}}" for st, c in classes.items())
    svg = svg.replace("</style>", css + "</style>", 1)
    return re.sub(
        r' style="([^"]*)"',
        lambda m: f' class="{classes[m.group(1)]}"' if m.group(1) in classes else m.group(0),
        svg,
    )
