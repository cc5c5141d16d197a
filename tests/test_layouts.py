"""The CuTe layouts of the tile format give the same offsets as the torch reference."""

import pytest
import torch

from kbit_cute import format as fmt
from kbit_cute import layouts


@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_weight_words_layout_matches_reference(k):
    n_tiles, k_tiles = 3, 2
    K, N = k_tiles * fmt.TILE_K, n_tiles * fmt.TILE_N
    shape, offsets = layouts.layout_offsets(
        lambda: layouts.weight_words_layout(n_tiles, k_tiles, k)
    )
    assert shape == ((128, n_tiles), (2, k_tiles), k)
    # CuTe's linear index is colexicographic over (n, kb, bit)
    n, kb, bit = torch.meshgrid(
        torch.arange(N), torch.arange(K // 32), torch.arange(k), indexing="ij"
    )
    ref = fmt.tiled_word_offset(n, kb, bit, K, N, k).permute(2, 1, 0).reshape(-1)
    assert torch.equal(torch.tensor(offsets), ref)
    assert sorted(offsets) == list(range(N * K // 32 * k))  # a bijection onto the buffer


def test_weight_absmax_layout_matches_reference():
    n_tiles, k_tiles = 2, 3
    K, N = k_tiles * fmt.TILE_K, n_tiles * fmt.TILE_N
    _, offsets = layouts.layout_offsets(lambda: layouts.weight_absmax_layout(n_tiles, k_tiles))
    n, kb = torch.meshgrid(torch.arange(N), torch.arange(K // 32), indexing="ij")
    ref = fmt.tiled_absmax_offset(n, kb, K, N).permute(1, 0).reshape(-1)
    assert torch.equal(torch.tensor(offsets), ref)


@pytest.mark.parametrize("k", (2, 5))
def test_tile_layouts_are_the_first_tile(k):
    _, tile = layouts.layout_offsets(lambda: layouts.tile_words_layout(k))
    n, kb, bit = torch.meshgrid(torch.arange(128), torch.arange(2), torch.arange(k), indexing="ij")
    ref = fmt.tiled_word_offset(n, kb, bit, 64, 128, k).permute(2, 1, 0).reshape(-1)
    assert torch.equal(torch.tensor(tile), ref)
    assert layouts.layout_string(lambda: layouts.tile_absmax_layout()) == "(128,2):(2,1)"
