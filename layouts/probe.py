"""Host probes that evaluate CuTe layouts and return plain Python ints.

Same contract as ``kbit_cute.layouts.layout_offsets``: ``make`` is a zero-argument
callable that builds a static layout; it runs inside a throw-away ``cute.jit``
trace, and only ints and tuples leave the trace (MLIR values outliving it crash Python).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute

from kbit_cute.layouts import layout_offsets, layout_string

from .parse import IntTuple, size

Make = Callable[[], object]


@dataclass(frozen=True)
class Evaluated:
    """A static layout on the host: its text, shape and the offset of every linear index."""

    text: str
    shape: IntTuple
    offsets: tuple[int, ...]  # colexicographic linear index -> offset


def evaluate(make: Callable[[], cute.Layout]) -> Evaluated:
    """Text, shape and all offsets of the layout that ``make`` builds."""
    shape, offsets = layout_offsets(make)
    return Evaluated(layout_string(make), shape, tuple(offsets))


def layout_at(make: Callable[[], cute.Layout], coords: Sequence[IntTuple]) -> list[int]:
    """The layout's offset at each coordinate (ints or nested tuples, as CuTe accepts them)."""
    out: list[int] = []

    @cute.jit
    def _probe():
        layout = make()
        out.extend(int(layout(c)) for c in coords)

    _probe()
    return out


class Split(NamedTuple):
    """What ``split_layout`` learns from one trace of a maker."""

    make: Callable[[], cute.Layout]  # builds the layout alone
    extras: tuple  # the other items ``make`` returned (ints, or a caption str), in order
    size: int  # the layout's number of coordinates: check it before evaluating


def split_layout(make: Make) -> Split:
    """``make`` may return a layout or a tuple holding one layout beside plain ints (as
    ``cute.make_layout_tv`` returns ``(tiler_mn, layout_tv)``) and strings (captions)."""
    found: dict = {}

    @cute.jit
    def _probe():
        found["at"], found["extras"], found["size"] = _classify(make())

    _probe()
    at = found["at"]

    def layout_only():
        result = make()
        return result[at] if isinstance(result, tuple) else result

    return Split(layout_only, found["extras"], found["size"])


def _classify(result) -> tuple[int, tuple, int]:
    """Position and size of the one layout in ``result``, the other items as ints.

    Kept out of the ``cute.jit`` body: the DSL stages ``if``/``raise`` written there.
    """
    items = result if isinstance(result, tuple) else (result,)
    is_layout = [isinstance(x, (cute.Layout, cute.ComposedLayout)) for x in items]
    if sum(is_layout) != 1:
        raise TypeError(f"expected a layout or a tuple of one layout and ints, got {result!r}")
    at = is_layout.index(True)
    extras = tuple(
        x if isinstance(x, str) else _to_ints(x)
        for x, lay in zip(items, is_layout, strict=True)
        if not lay
    )
    return at, extras, int(cute.size(items[at]))


def idx2crd(idx: int, shape: IntTuple) -> IntTuple:
    """Colexicographic linear index -> natural (nested) coordinate, as CuTe splits it."""
    if not isinstance(shape, tuple):
        return idx
    crd = []
    for mode in shape:
        n = size(mode)
        crd.append(idx2crd(idx % n, mode))
        idx //= n
    return tuple(crd)


def _to_ints(t):
    return tuple(_to_ints(x) for x in t) if isinstance(t, tuple) else int(t)
