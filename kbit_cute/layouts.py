"""The tiled kbit format and the kernels' tilings as CuTe layouts.

One module for the kernels (which call these functions while they are traced,
with dynamic tile counts) and for the host side (tests and the ``layouts``
visualization tools evaluate them with static sizes through ``layout_offsets``).
The pure-torch reference of the same order is ``kbit_cute.format.tiled_word_offset``;
``tests/test_layouts.py`` proves that both give the same offsets.

Coordinates follow the weight W [N, K]: ``n`` is the output row, ``kb`` the
32-wide K block, ``bit`` the bit plane. Hierarchical modes (col, n_tile) and
(kb_in_tile, k_tile) let a plain row index ``n`` or block index ``kb`` address
the tiled memory, CuTe's colexicographic order splitting them for us.
"""

from __future__ import annotations

from collections.abc import Callable

import cutlass.cute as cute

from .format import BLOCKS_PER_TILE_K, TILE_N


def tile_words_layout(k: int) -> cute.Layout:
    """One repack tile: (col, kb, bit) -> word offset, ordered [col][kb][bit]."""
    return cute.make_layout((TILE_N, BLOCKS_PER_TILE_K, k), stride=(BLOCKS_PER_TILE_K * k, k, 1))


def tile_absmax_layout() -> cute.Layout:
    """One repack tile: (col, kb) -> absmax byte offset, ordered [col][kb]."""
    return cute.make_layout((TILE_N, BLOCKS_PER_TILE_K), stride=(BLOCKS_PER_TILE_K, 1))


def weight_words_layout(n_tiles, k_tiles, k: int) -> cute.Layout:
    """Whole tiled weight: ((col, n_tile), (kb, k_tile), bit) -> word offset.

    Tiles are ordered k_tile * n_tiles + n_tile. ``n_tiles``/``k_tiles`` may be
    dynamic (kernel) or static (host).
    """
    words_per_tile = TILE_N * BLOCKS_PER_TILE_K * k
    return cute.make_layout(
        ((TILE_N, n_tiles), (BLOCKS_PER_TILE_K, k_tiles), k),
        stride=(
            (BLOCKS_PER_TILE_K * k, words_per_tile),
            (k, n_tiles * words_per_tile),
            1,
        ),
    )


def weight_absmax_layout(n_tiles, k_tiles) -> cute.Layout:
    """Whole tiled weight: ((col, n_tile), (kb, k_tile)) -> absmax byte offset."""
    bytes_per_tile = TILE_N * BLOCKS_PER_TILE_K
    return cute.make_layout(
        ((TILE_N, n_tiles), (BLOCKS_PER_TILE_K, k_tiles)),
        stride=((BLOCKS_PER_TILE_K, bytes_per_tile), (1, n_tiles * bytes_per_tile)),
    )


# --------------------------------------------------------------------------- host side


def layout_offsets(make: Callable[[], cute.Layout]) -> tuple[tuple, list[int]]:
    """Evaluate a static layout on the host: (shape, offset of every linear index).

    CuTe layouts exist only while a function is traced, so ``make`` is called
    inside a throw-away ``cute.jit`` trace; static layouts fold to Python ints
    there. Only ints and tuples leave the trace (MLIR objects must not).
    """
    result: dict = {}

    @cute.jit
    def _probe():
        layout = make()
        result["shape"] = _to_ints(layout.shape)
        result["offsets"] = [int(layout(i)) for i in range(cute.size(layout))]

    _probe()
    return result["shape"], result["offsets"]


def layout_string(make: Callable[[], cute.Layout]) -> str:
    """The layout's ``shape:stride`` text, as CuTe prints it."""
    result: dict = {}

    @cute.jit
    def _probe():
        result["text"] = str(make())

    _probe()
    return result["text"]


def _to_ints(t):
    return tuple(_to_ints(x) for x in t) if isinstance(t, tuple) else int(t)
