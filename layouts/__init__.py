"""Visualization of the kbit tile format and of CuTe layouts (``python -m layouts --help``).

Data first, pictures second: the probes evaluate layouts to plain ints, the grids and
bank maps are plain dataclasses (what the tests check), and ``layouts.draw`` /
``layouts.text`` only render them.
"""

from .banks import BankPhase, access_phases, bank_phases, conflict_ways, smem_phases
from .grid import OffsetGrid, TvGrid, offset_grid, tv_grid
from .kernel import NotRegistered, View, kernel_views, layout_view
from .parse import LayoutParseError, LayoutSpec, parse_layout
from .probe import Evaluated, evaluate, layout_at, split_layout
from .tile import TileView, tile_view

__all__ = [
    "BankPhase",
    "Evaluated",
    "LayoutParseError",
    "LayoutSpec",
    "NotRegistered",
    "OffsetGrid",
    "TileView",
    "TvGrid",
    "View",
    "access_phases",
    "bank_phases",
    "conflict_ways",
    "evaluate",
    "kernel_views",
    "layout_at",
    "layout_view",
    "offset_grid",
    "parse_layout",
    "smem_phases",
    "split_layout",
    "tile_view",
    "tv_grid",
]
