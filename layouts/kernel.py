"""The kernels' layouts, as ``kbit_cute.layouts.kernel_layouts(kind, k)`` registers them.

Contract (the kernels module provides the function; this package only reads it)::

    kernel_layouts(kind: str, k: int) -> dict[str, Callable[[], cute.Layout]]

Each callable builds a static layout inside a trace; its name says how it is drawn:

* ``<name>_tv``: a thread-value layout, (thread, value) -> index in a tile. It may
  return ``(tiler_mn, layout_tv)`` as ``cute.make_layout_tv`` does; the tile is then
  drawn as M x N, otherwise as one row.
* ``<name>_smem``: (thread, value) -> element offset in shared memory; drawn as a bank
  map. It may return ``(layout, elem_bytes)`` or ``(layout, elem_bytes, vec)``: each
  thread moves ``vec`` adjacent values per instruction (default 4-byte elements, vec 1).
* anything else: drawn as an offset grid, like ``python -m layouts show``.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure

import kbit_cute.layouts as kbit_layouts

from .banks import BankPhase, smem_phases
from .draw import banks_figure, grid_figure, tv_figure
from .grid import MAX_CELLS, OffsetGrid, TvGrid, offset_grid, tv_grid
from .probe import Make, evaluate, split_layout
from .text import banks_text, grid_text, tv_text

KINDS = ("gemv", "gemm", "moe")


class NotRegistered(LookupError):
    """``kbit_cute.layouts`` does not (yet) describe this kernel's layouts."""


def kernel_entries(kind: str, k: int) -> dict[str, Make]:
    """The named layout makers of kernel ``kind`` for k bits, or NotRegistered."""
    what = f"kernel layouts for {kind!r} are not registered yet"
    fn = getattr(kbit_layouts, "kernel_layouts", None)  # looked up per call: it may be added
    if fn is None:
        raise NotRegistered(f"{what} (kbit_cute.layouts has no kernel_layouts(kind, k))")
    try:
        entries = dict(fn(kind, k))
    except Exception as e:  # any failure of the registry means: nothing to draw
        raise NotRegistered(
            f"{what} (kernel_layouts({kind!r}, {k}) raised {type(e).__name__}: {e})"
        ) from e
    if not entries:
        raise NotRegistered(f"{what} (kernel_layouts({kind!r}, {k}) returned nothing)")
    return entries


@dataclass(frozen=True)
class View:
    """One drawable view of a named layout: an offset grid, a TV grid or a bank map."""

    name: str
    data: OffsetGrid | TvGrid | tuple[BankPhase, ...]
    title: str = ""

    def text(self, color: bool = False) -> str:
        if isinstance(self.data, OffsetGrid):
            return grid_text(self.data, color)
        if isinstance(self.data, TvGrid):
            return tv_text(self.data, color)
        return banks_text(self.title, self.data, color)

    def figure(self) -> Figure:
        if isinstance(self.data, OffsetGrid):
            return grid_figure(self.data)
        if isinstance(self.data, TvGrid):
            return tv_figure(self.data)
        return banks_figure(self.title, self.data)


def layout_view(name: str, make: Make) -> View:
    """Evaluate ``make`` and pick the view its name asks for (see the module docstring)."""
    layout_make, extras, n = split_layout(make)
    if n > MAX_CELLS:
        raise ValueError(f"layout {name!r} has {n} coordinates; at most {MAX_CELLS} are drawn")
    ev = evaluate(layout_make)
    if name.endswith("_tv"):
        return View(name, tv_grid(ev, extras[0] if extras else None))
    if name.endswith("_smem"):
        elem_bytes = extras[0] if extras else 4
        vec = extras[1] if len(extras) > 1 else 1
        title = f"{name}: {ev.text}, {elem_bytes}-byte elements, {vec} per access"
        return View(name, tuple(smem_phases(ev, elem_bytes, vec)), title)
    return View(name, offset_grid(ev))


def kernel_views(kind: str, k: int) -> list[View]:
    """Every registered layout of kernel ``kind``, evaluated; raises NotRegistered."""
    views = []
    for name, make in kernel_entries(kind, k).items():
        try:
            views.append(layout_view(name, make))
        except Exception as e:  # name the entry: the registry may hold many
            raise ValueError(f"kernel layout {name!r} of {kind!r} (k={k}): {e}") from e
    return views
