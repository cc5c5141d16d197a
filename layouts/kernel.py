"""The kernels' layouts, as ``kbit_cute.layouts.kernel_layouts(kind, k[, config])`` registers them.

Contract (the kernels module provides the function; this package only reads it)::

    kernel_layouts(kind: str, k: int, config: str | None = None) -> dict[str, Entry]

An entry is one of:

* a zero-argument maker that builds a static layout inside a trace; its name says how
  it is drawn. It may return the layout alone, or a tuple of the layout, plain ints and
  at most one string (a caption for the picture):

  * ``<name>_tv``: a thread-value layout, (thread, value) -> index in a tile. It may
    return ``(tiler_mn, layout_tv)`` as ``cute.make_layout_tv`` does; the tile is then
    drawn as M x N, otherwise as one row.
  * ``<name>_smem``: (thread, value) -> element offset in shared memory; drawn as a bank
    map. It may return ``(layout, elem_bytes)`` or ``(layout, elem_bytes, vec)``: each
    thread moves ``vec`` adjacent values per instruction (default 4-byte elements, vec 1).
  * anything else: drawn as an offset grid, like ``python -m layouts show``.

* a ``kbit_cute.layouts.SmemAccess``: per instruction and thread, the byte address a
  kernel's shared-memory access touches (evaluated on the host); drawn as a bank map.
* a string: a note, printed instead of a picture (e.g. why a kernel has no bank map).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from matplotlib.figure import Figure

import kbit_cute.layouts as kbit_layouts

from .banks import BankPhase, access_phases, smem_phases
from .draw import banks_figure, grid_figure, tv_figure
from .grid import MAX_CELLS, OffsetGrid, TvGrid, offset_grid, tv_grid
from .probe import evaluate, split_layout
from .text import banks_text, grid_text, tv_text

KINDS = ("gemv", "gemm", "moe")


class NotRegistered(LookupError):
    """``kbit_cute.layouts`` does not (yet) describe this kernel's layouts."""


def kernel_entries(kind: str, k: int, config: str | None = None) -> dict[str, object]:
    """The named layout entries of kernel ``kind`` for k bits, or NotRegistered.

    A ValueError of the registry (a bad ``k`` or ``config``) is passed on as it is.
    """
    what = f"kernel layouts for {kind!r} are not registered yet"
    fn = getattr(kbit_layouts, "kernel_layouts", None)  # looked up per call: it may be added
    if fn is None:
        raise NotRegistered(f"{what} (kbit_cute.layouts has no kernel_layouts(kind, k))")
    call = f"kernel_layouts({kind!r}, {k}" + (f", {config!r})" if config else ")")
    try:
        entries = dict(fn(kind, k) if config is None else fn(kind, k, config))
    except ValueError:
        raise
    except Exception as e:  # any other failure of the registry means: nothing to draw
        raise NotRegistered(f"{what} ({call} raised {type(e).__name__}: {e})") from e
    if not entries:
        raise NotRegistered(f"{what} ({call} returned nothing)")
    return entries


@dataclass(frozen=True)
class View:
    """One drawable view of a named entry: an offset grid, a TV grid, a bank map or a note."""

    name: str
    data: OffsetGrid | TvGrid | tuple[BankPhase, ...] | str
    title: str = ""  # bank maps: the heading; grids: a caption line above the layout's text

    @property
    def is_note(self) -> bool:
        return isinstance(self.data, str)

    def text(self, color: bool = False) -> str:
        if isinstance(self.data, str):
            return f"note: {self.data}"
        if isinstance(self.data, OffsetGrid):
            return self._captioned(grid_text(self.data, color))
        if isinstance(self.data, TvGrid):
            return self._captioned(tv_text(self.data, color))
        return banks_text(self.title, self.data, color)

    def figure(self) -> Figure | None:
        """The picture; None for a note (there is nothing to draw)."""
        if isinstance(self.data, str):
            return None
        if isinstance(self.data, OffsetGrid):
            return grid_figure(self.data, self.title)
        if isinstance(self.data, TvGrid):
            return tv_figure(self.data, self.title)
        return banks_figure(self.title, self.data)

    def _captioned(self, text: str) -> str:
        return f"{self.title}\n{text}" if self.title else text


def layout_view(name: str, entry: object) -> View:
    """Evaluate ``entry`` and pick the view its type and name ask for (module docstring)."""
    if isinstance(entry, str):
        return View(name, entry)
    if isinstance(entry, kbit_layouts.SmemAccess):
        access_bytes, addresses = entry.evaluate()
        title = f"{name}: {entry.caption}; {access_bytes}-byte accesses"
        return View(name, tuple(access_phases(addresses, access_bytes)), title)
    layout_make, extras, n = split_layout(entry)
    if n > MAX_CELLS:
        raise ValueError(f"layout {name!r} has {n} coordinates; at most {MAX_CELLS} are drawn")
    captions = [x for x in extras if isinstance(x, str)]
    ints = [x for x in extras if not isinstance(x, str)]
    caption = captions[0] if captions else ""
    ev = evaluate(layout_make)
    if name.endswith("_tv"):
        return View(name, tv_grid(ev, ints[0] if ints else None), caption)
    if name.endswith("_smem"):
        elem_bytes = ints[0] if ints else 4
        vec = ints[1] if len(ints) > 1 else 1
        title = f"{name}: {ev.text}, {elem_bytes}-byte elements, {vec} per access"
        title = f"{title}; {caption}" if caption else title
        return View(name, tuple(smem_phases(ev, elem_bytes, vec)), title)
    return View(name, offset_grid(ev), caption)


def kernel_views(
    kind: str, k: int, config: str | None = None, only: str | None = None
) -> list[View]:
    """Every registered entry of kernel ``kind`` (names matching regex ``only``), evaluated;
    raises NotRegistered, or ValueError for bad input."""
    entries = kernel_entries(kind, k, config)
    if only is not None:
        entries = {n: e for n, e in entries.items() if re.search(only, n)}
        if not entries:
            raise ValueError(f"no layout of {kind!r} matches --only {only!r}")
    views = []
    for name, entry in entries.items():
        try:
            views.append(layout_view(name, entry))
        except Exception as e:  # name the entry: the registry may hold many
            raise ValueError(f"kernel layout {name!r} of {kind!r} (k={k}): {e}") from e
    return views
