"""One repack tile of the kbit format, evaluated from ``kbit_cute.layouts``.

The tile's memory order comes from inverting ``tile_words_layout(k)`` (tile-local
offset -> (col, kb, bit)); where the tile sits in the whole tiled weight comes from
``weight_words_layout`` evaluated at the tile's coordinates. Nothing here re-states
the format; ``tests/test_layouts_viz.py`` checks it against ``kbit_cute.format``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kbit_cute.format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N, check_k, padded_shape
from kbit_cute.layouts import (
    tile_absmax_layout,
    tile_words_layout,
    weight_absmax_layout,
    weight_words_layout,
)

from .probe import evaluate, idx2crd, layout_at


@dataclass(frozen=True)
class TileView:
    """Tile (k_tile, n_tile) of a tiled weight W [N, K] with k bits per weight."""

    k: int
    k_tile: int
    n_tile: int
    N: int
    K: int
    word_crd: tuple[tuple[int, int, int], ...]  # tile word offset -> (col, kb, bit)
    word_global: tuple[int, ...]  # tile word offset -> offset in the whole tiled words
    absmax_crd: tuple[tuple[int, int], ...]  # tile byte offset -> (col, kb)
    absmax_global: tuple[int, ...]  # tile byte offset -> offset in the whole absmax bytes

    @property
    def words(self) -> int:
        return len(self.word_crd)

    def word_weights(self, word: int) -> tuple[int, tuple[int, ...], int]:
        """Tile word -> (n, the 32 k coordinates, bit plane): bit j of the word is bit
        ``plane`` of weight W[n, ks[j]]'s codebook index."""
        col, kb, bit = self.word_crd[word]
        k0 = (self.k_tile * BLOCKS_PER_TILE_K + kb) * BLOCK
        return self.n_tile * TILE_N + col, tuple(range(k0, k0 + BLOCK)), bit

    def weight_word(self) -> tuple[tuple[int, ...], ...]:
        """[TILE_N][TILE_K]: tile offset of the bit-0 word holding each weight of the tile
        (its other bits are in the next k-1 words)."""
        first = {}
        for off, (col, kb, bit) in enumerate(self.word_crd):
            if bit == 0:
                first[col, kb] = off
        return tuple(
            tuple(first[col, kk // BLOCK] for kk in range(TILE_K)) for col in range(TILE_N)
        )

    def block_absmax(self) -> dict[tuple[int, int], int]:
        """(col, kb) -> tile offset of the block's absmax byte."""
        return {crd: off for off, crd in enumerate(self.absmax_crd)}


def tile_view(k: int, k_tile: int = 0, n_tile: int = 0, N: int = 0, K: int = 0) -> TileView:
    """Evaluate tile (k_tile, n_tile); N, K default to the smallest weight holding it."""
    check_k(k)
    N = N or (n_tile + 1) * TILE_N
    K = K or (k_tile + 1) * TILE_K
    Kp, Np = padded_shape(K, N)
    n_tiles, k_tiles = Np // TILE_N, Kp // TILE_K
    if not (0 <= n_tile < n_tiles and 0 <= k_tile < k_tiles):
        raise ValueError(
            f"tile (k_tile={k_tile}, n_tile={n_tile}) is outside W [N={N}, K={K}], "
            f"which has {k_tiles} x {n_tiles} tiles"
        )
    word_crd = _invert(evaluate(lambda: tile_words_layout(k)))
    word_global = layout_at(
        lambda: weight_words_layout(n_tiles, k_tiles, k),
        [((col, n_tile), (kb, k_tile), bit) for col, kb, bit in word_crd],
    )
    absmax_crd = _invert(evaluate(tile_absmax_layout))
    absmax_global = layout_at(
        lambda: weight_absmax_layout(n_tiles, k_tiles),
        [((col, n_tile), (kb, k_tile)) for col, kb in absmax_crd],
    )
    return TileView(
        k, k_tile, n_tile, N, K, word_crd, tuple(word_global), absmax_crd, tuple(absmax_global)
    )


def _invert(ev) -> tuple[tuple[int, ...], ...]:
    """Offset -> coordinate of a layout that is a bijection onto 0..size-1."""
    crd: list = [None] * len(ev.offsets)
    for lin, off in enumerate(ev.offsets):
        if not 0 <= off < len(crd) or crd[off] is not None:
            raise ValueError(f"{ev.text} is not a bijection onto 0..{len(crd) - 1}")
        crd[off] = idx2crd(lin, ev.shape)
    return tuple(crd)
