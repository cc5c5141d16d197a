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


# --------------------------------------------------------------------------- kernels' layouts

KERNEL_KINDS = ("gemv", "gemm", "moe")


def kernel_layouts(kind: str, k: int, config: str | None = None) -> dict[str, Callable[[], object]]:
    """The layouts kernel ``kind`` uses for ``k`` bits, for ``python -m layouts kernel``.

    Name -> zero-argument maker, called inside a trace (see ``layouts/kernel.py``):
    ``*_tv`` makers return ``(tile_mn, layout_tv)``, ``*_smem`` makers
    ``(layout, elem_bytes, vec)``, others a plain layout. Every maker calls the function
    the kernel itself builds the object with, so the pictures cannot drift from the code.
    gemm uses ``config`` (a ``GemmConfig`` name), default the dispatch table's first
    (smallest-M) config for ``k``.
    """
    if kind not in KERNEL_KINDS:
        raise ValueError(f"kernel kind must be one of {KERNEL_KINDS}, got {kind!r}")
    if k not in (2, 3, 4, 5):
        raise ValueError(f"k must be 2..5, got {k}")
    if kind == "moe":
        raise NotImplementedError("MoE kernels do not exist yet: no layouts to draw")
    if kind == "gemv":
        if config is not None:
            raise ValueError("the gemv kernel has no configs; drop --config")
        return _gemv_layouts(k)
    return _gemm_layouts(k, config)


def _mma_tv(tiled_mma) -> dict[str, Callable[[], object]]:
    """A/B/C thread-value layouts of a tiled MMA over its tiles (M x K, N x K, M x N)."""

    def tile(a: int, b: int) -> tuple[int, int]:
        return int(tiled_mma().get_tile_size(a)), int(tiled_mma().get_tile_size(b))

    return {
        "mma_a_tv": lambda: (tile(0, 2), tiled_mma().tv_layout_A_tiled),
        "mma_b_tv": lambda: (tile(1, 2), tiled_mma().tv_layout_B_tiled),
        "mma_c_tv": lambda: (tile(0, 1), tiled_mma().tv_layout_C_tiled),
    }


def _gemv_layouts(k: int) -> dict[str, Callable[[], object]]:
    import cutlass

    from .kernels.gemv import gemv_mma

    entries = _mma_tv(lambda: gemv_mma(cutlass.Float16)[1])
    entries["weight_words"] = lambda: weight_words_layout(1, 1, k)  # one repack tile
    entries["weight_absmax"] = lambda: weight_absmax_layout(1, 1)
    return entries


def _gemm_layouts(k: int, config: str | None) -> dict[str, Callable[[], object]]:
    from .gemm_dispatch import table_configs
    from .kernels.gemm import GemmConfig, GemmKernel

    cfg = GemmConfig.parse(config) if config else table_configs(k)[0]
    kern = GemmKernel(k, "f16", cfg)  # raises ValueError naming a bad config

    def a_stage0():  # one pipeline stage of the swizzled A ring: (TILE_M, TILE_K)
        return cute.slice_(kern.a_smem_layout(), (None, None, 0))

    def ldsm_a_smem():
        # (thread, value) -> A element offset of the first k16 step's ldmatrix: the copy's
        # source TV layout indexes its (M, 16) tile colex, as stage 0 does for K < 16.
        ldsm = kern.make_a_ldsm(kern.make_tiled_mma())
        return cute.composition(a_stage0(), ldsm.layout_src_tv_tiled), 2, 8

    entries = _mma_tv(kern.make_tiled_mma)
    entries["a_smem_layout"] = a_stage0  # drawn as offsets: the swizzle
    entries["ldsm_a_smem"] = ldsm_a_smem
    return entries
