"""Terminal renderings (plain or ANSI-colored) of the grids, the tile and the bank maps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .banks import BANKS, BankPhase
from .grid import OffsetGrid, TvGrid
from .tile import TileView

# 256-color backgrounds, light enough for black text; cycled so neighbours differ.
_PALETTE = (153, 194, 223, 189, 230, 217, 159, 187)
_HOT = (231, 194, 229, 223, 217, 210, 203, 196)  # bank words: 0, 1 (ok), 2.. (conflicts)


def paint(text: str, bg: int | None, color: bool) -> str:
    """``text`` on 256-color background ``bg`` when color is on."""
    if not color or bg is None:
        return text
    return f"\x1b[48;5;{bg}m\x1b[38;5;16m{text}\x1b[0m"


def boxed_table(
    title: str,
    cells: Sequence[Sequence[str]],
    bg: Callable[[int, int], int | None] = lambda i, j: None,
    color: bool = False,
) -> str:
    """A ``print_layout``-style table: column indices on top, row indices on the left."""
    rows, cols = len(cells), len(cells[0])
    w = max(len(str(cols - 1)), *(len(c) for row in cells for c in row))
    rw = len(str(rows - 1))
    rule = " " * (rw + 1) + ("+" + "-" * (w + 2)) * cols + "+"
    head = " " * (rw + 1) + "".join(f"  {j:>{w}} " for j in range(cols))
    lines = [title, head.rstrip(), rule]
    for i, row in enumerate(cells):
        body = "".join("|" + paint(f" {c:>{w}} ", bg(i, j), color) for j, c in enumerate(row))
        lines += [f"{i:>{rw}} {body}|", rule]
    return "\n".join(lines)


def grid_text(grid: OffsetGrid, color: bool = False) -> str:
    """The layout's offsets, laid out as CuTe's ``print_layout`` does."""
    cells = [[str(x) for x in row] for row in grid.cells]
    return boxed_table(
        grid.title, cells, lambda i, j: _PALETTE[grid.cells[i][j] % len(_PALETTE)], color
    )


def tv_text(grid: TvGrid, color: bool = False) -> str:
    """Each tile element's owner as ``T<thread>V<value>`` (``+n``: n more owners)."""

    def cell(owners: tuple[tuple[int, int], ...]) -> str:
        if not owners:
            return "."
        t, v = owners[0]
        return f"T{t}V{v}" + (f"+{len(owners) - 1}" if len(owners) > 1 else "")

    def bg(i: int, j: int) -> int | None:
        owners = grid.cells[i][j]
        return _PALETTE[owners[0][0] % len(_PALETTE)] if owners else None

    title = f"{grid.title}  ({grid.threads} threads x {grid.values} values)"
    return boxed_table(title, [[cell(o) for o in row] for row in grid.cells], bg, color)


def banks_text(title: str, phases: Sequence[BankPhase], color: bool = False) -> str:
    """One line per warp phase: distinct words each bank serves ('.' = idle) and the ways."""
    label_w = max(len(p.label) for p in phases)
    head = " " * label_w + " bank" + "".join(f"{b:>3}" for b in range(BANKS)) + "  ways"
    lines = [title, head]
    for p in phases:
        counts = "".join(
            paint(f"{c if c else '.':>3}", _HOT[min(c, len(_HOT) - 1)], color)
            for c in p.words_per_bank
        )
        lines.append(f"{p.label:<{label_w}}     {counts}  {p.ways:>4}")
    worst = max(p.ways for p in phases)
    lines.append(f"worst phase: {worst}-way" + (" (conflict-free)" if worst == 1 else ""))
    return "\n".join(lines)


def tile_text(view: TileView, word: int = 0, color: bool = False) -> str:
    """Memory view of one tile (a row per column ``col``) and the weights of ``word``."""
    where = {crd: off for off, crd in enumerate(view.word_crd)}
    amax = view.block_absmax()
    cols, kbs = (1 + max(c[i] for c in view.absmax_crd) for i in (0, 1))
    w = len(str(view.words - 1)) + 1  # + a column for the '*' marking the chosen word

    def cell(off: int, bit: int) -> str:
        if off == word:
            return f"\x1b[7m{off:>{w}}\x1b[0m" if color else f"*{off}".rjust(w)
        return paint(f"{off:>{w}}", _PALETTE[bit % len(_PALETTE)], color)

    planes = "".join(f" {'b' + str(b):>{w}}" for b in range(view.k))
    lines = [
        tile_title(view),
        f"tile-local offsets (colored by bit plane); global offset = {view.word_global[0]} + "
        f"offset for words, {view.absmax_global[0]} + offset for absmax bytes",
        "  col |" + "|".join(f" kb{kb}:{planes} " for kb in range(kbs)) + "| absmax",
    ]
    for col in range(cols):
        blocks = (
            " " * len(f" kb{kb}:")  # under the header's block label
            + "".join(" " + cell(where[col, kb, b], b) for b in range(view.k))
            + " "
            for kb in range(kbs)
        )
        absmax = " ".join(f"{amax[col, kb]:>3}" for kb in range(kbs))
        lines.append(f"  {col:>3} |" + "|".join(blocks) + f"| {absmax}")
    lines.append(word_text(view, word))
    return "\n".join(lines)


def tile_title(view: TileView) -> str:
    """One line naming the tile, the weight and the sizes."""
    return (
        f"kbit tile k={view.k}: tile (k_tile={view.k_tile}, n_tile={view.n_tile}) of W "
        f"[N={view.N}, K={view.K}]: {view.words} uint32 words [col][kb][bit] "
        f"+ {len(view.absmax_crd)} absmax bytes [col][kb]"
    )


def word_text(view: TileView, word: int) -> str:
    """Which 32 weights the bits of tile word ``word`` belong to."""
    n, ks, plane = view.word_weights(word)
    col, kb, _ = view.word_crd[word]
    return (
        f"word {word} (global offset {view.word_global[word]}) = bit plane {plane} of block "
        f"(col {col}, kb {kb}): bit j holds bit {plane} of the codebook index of "
        f"W[{n}, {ks[0]} + j], j = 0..{len(ks) - 1}; the block's absmax byte is at tile offset "
        f"{view.block_absmax()[col, kb]}"
    )
