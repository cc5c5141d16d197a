"""What the pictures are drawn from: plain grids of ints built from evaluated layouts."""

from __future__ import annotations

from dataclasses import dataclass

from .parse import IntTuple, size
from .probe import Evaluated

MAX_CELLS = 1 << 16  # larger grids make unreadable pictures and slow probes


@dataclass(frozen=True)
class OffsetGrid:
    """A layout as CuTe's ``print_layout`` shows it: cell (i, j) = layout(i, j).

    Rows are mode 0, columns the remaining modes (colexicographic, so a rank-2 layout
    gives the usual picture); a rank-1 layout is one row. Hierarchical modes are
    flattened: row i is the i-th coordinate of mode 0 in CuTe's colex order.
    """

    title: str
    shape: IntTuple
    cells: tuple[tuple[int, ...], ...]  # [row][col] -> offset

    @property
    def rows(self) -> int:
        return len(self.cells)

    @property
    def cols(self) -> int:
        return len(self.cells[0])


def grid_dims(shape: IntTuple) -> tuple[int, int]:
    """(rows, cols) of the picture of a layout of this shape."""
    if not isinstance(shape, tuple) or len(shape) == 1:
        return 1, size(shape)
    return size(shape[0]), size(shape) // size(shape[0])


def offset_grid(ev: Evaluated) -> OffsetGrid:
    """Arrange the colex offsets of a layout as its (mode 0) x (other modes) grid."""
    rows, cols = grid_dims(ev.shape)
    if rows * cols > MAX_CELLS:
        raise ValueError(f"{ev.text} has {rows * cols} cells; at most {MAX_CELLS} can be drawn")
    # linear index i + rows * j is coordinate (i, j) in CuTe's colexicographic order
    cells = tuple(tuple(ev.offsets[i + rows * j] for j in range(cols)) for i in range(rows))
    return OffsetGrid(ev.text, ev.shape, cells)


@dataclass(frozen=True)
class TvGrid:
    """A thread-value layout drawn over its tile: which (thread, value) owns each element."""

    title: str
    threads: int
    values: int
    cells: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]  # [m][n] -> owners (t, v)

    @property
    def rows(self) -> int:
        return len(self.cells)

    @property
    def cols(self) -> int:
        return len(self.cells[0])


def tv_grid(ev: Evaluated, tile: IntTuple | None = None) -> TvGrid:
    """``ev`` maps (thread, value) -> index in a tile of shape ``tile`` (M, N), colex.

    Without ``tile`` the tile is one row as long as the layout's codomain. An element
    owned by several (thread, value) pairs (stride-0 broadcast) lists all of them.
    """
    if not isinstance(ev.shape, tuple) or len(ev.shape) != 2:
        raise ValueError(f"a TV layout has two modes (thread, value); got {ev.text}")
    threads, values = size(ev.shape[0]), size(ev.shape[1])
    if tile is None:
        tile = (1, max(ev.offsets) + 1)
    if not isinstance(tile, tuple) or len(tile) != 2:
        raise ValueError(f"the tile of a TV layout must be (M, N), got {tile}")
    m_size, n_size = size(tile[0]), size(tile[1])
    if m_size * n_size > MAX_CELLS:
        raise ValueError(f"tile {tile} has more than {MAX_CELLS} cells to draw")
    owners: list[list[list[tuple[int, int]]]] = [[[] for _ in range(n_size)] for _ in range(m_size)]
    for lin, idx in enumerate(ev.offsets):
        if not 0 <= idx < m_size * n_size:
            raise ValueError(f"{ev.text} maps to index {idx}, outside the tile {tile}")
        t, v = lin % threads, lin // threads
        owners[idx % m_size][idx // m_size].append((t, v))
    cells = tuple(tuple(tuple(c) for c in row) for row in owners)
    return TvGrid(ev.text, threads, values, cells)
