"""Parse CuTe's layout text, ``shape:stride`` with nested int tuples, into a buildable spec.

Accepted, as CuTe prints them:  ``8:1``, ``(8,8):(8,1)``, ``((4,2),8):((1,32),4)``,
a shape alone (``(8,8)``, CuTe's default column-major strides) and a swizzled layout
``S<3,4,3> o (8,64):(64,1)`` (also ``S<3,4,3> o 0 o ...``, ``Sw<...>``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NoReturn

import cutlass.cute as cute

IntTuple = int | tuple  # nested tuples of ints

_TOKEN = re.compile(r"\s*(-?\d+|Sw|S|o|[(),:<>])")


class LayoutParseError(ValueError):
    """A layout expression that is not ``shape:stride`` text; the message points at the spot."""


@dataclass(frozen=True)
class LayoutSpec:
    """A parsed layout: ``make()`` builds it inside a ``cute.jit`` trace."""

    shape: IntTuple
    stride: IntTuple | None = None  # None: CuTe's default (column-major) strides
    swizzle: tuple[int, int, int] | None = None  # Swizzle<B, M, S> applied to the offsets
    swizzle_offset: int = 0

    def make(self) -> cute.Layout | cute.ComposedLayout:
        layout = cute.make_layout(self.shape, stride=self.stride)
        if self.swizzle is None:
            return layout
        return cute.make_composed_layout(
            cute.make_swizzle(*self.swizzle), self.swizzle_offset, layout
        )

    def __str__(self) -> str:
        text = (
            _fmt(self.shape) if self.stride is None else f"{_fmt(self.shape)}:{_fmt(self.stride)}"
        )
        if self.swizzle is None:
            return text
        b, m, s = self.swizzle
        return f"S<{b},{m},{s}> o {self.swizzle_offset} o {text}"


def parse_layout(text: str) -> LayoutSpec:
    """``"((4,2),8):((1,32),4)"`` -> LayoutSpec; raises LayoutParseError with the position."""
    p = _Parser(text)
    swizzle, offset = None, 0
    if p.peek() in ("S", "Sw"):
        p.take()
        p.expect("<")
        b = p.integer()
        p.expect(",")
        m = p.integer()
        p.expect(",")
        s = p.integer()
        p.expect(">")
        p.expect("o")
        swizzle = (b, m, s)
        if _is_int(p.peek()) and p.peek(1) == "o":
            offset = p.integer()
            p.expect("o")
        if b < 0 or m < 0 or abs(s) < b:
            p.fail(f"swizzle S<{b},{m},{s}> needs B >= 0, M >= 0 and |S| >= B")
    shape_at = p.pos
    shape = p.int_tuple()
    stride = None
    if p.peek() == ":":
        p.take()
        stride_at = p.pos
        stride = p.int_tuple()
    if p.peek() is not None:
        p.fail(f"unexpected {p.peek()!r} after the layout")
    if any(x <= 0 for x in _flat(shape)):
        p.fail("shape entries must be positive", shape_at)
    if stride is not None and not _congruent(shape, stride):
        p.fail(f"stride {_fmt(stride)} does not have the nesting of shape {_fmt(shape)}", stride_at)
    return LayoutSpec(shape, stride, swizzle, offset)


def size(shape: IntTuple) -> int:
    """Number of coordinates of a (nested) shape."""
    return math.prod(_flat(shape))


def _flat(t: IntTuple) -> list[int]:
    return [x for e in t for x in _flat(e)] if isinstance(t, tuple) else [t]


def _congruent(a: IntTuple, b: IntTuple) -> bool:
    if isinstance(a, tuple) != isinstance(b, tuple):
        return False
    if not isinstance(a, tuple):
        return True
    return len(a) == len(b) and all(_congruent(x, y) for x, y in zip(a, b, strict=True))


def _fmt(t: IntTuple) -> str:
    return "(" + ",".join(_fmt(x) for x in t) + ")" if isinstance(t, tuple) else str(t)


def _is_int(tok: str | None) -> bool:
    return tok is not None and tok.lstrip("-").isdigit()


class _Parser:
    """Recursive descent over the tokens; remembers each token's column for the messages."""

    def __init__(self, text: str):
        self.text = text
        self.toks: list[tuple[str, int]] = []
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            m = _TOKEN.match(stripped, pos)
            if m is None:
                col = len(stripped) - len(stripped[pos:].lstrip())
                self.fail(f"unexpected character {stripped[col]!r}", col)
            self.toks.append((m.group(1), m.start(1)))
            pos = m.end()
        self.i = 0
        if not self.toks:
            self.fail("empty layout expression", 0)

    @property
    def pos(self) -> int:
        return self.toks[self.i][1] if self.i < len(self.toks) else len(self.text.rstrip())

    def peek(self, ahead: int = 0) -> str | None:
        j = self.i + ahead
        return self.toks[j][0] if j < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            self.fail("unexpected end of the expression")
        self.i += 1
        return tok

    def expect(self, tok: str) -> None:
        if self.peek() != tok:
            found = "the end" if self.peek() is None else repr(self.peek())
            self.fail(f"expected {tok!r}, found {found}")
        self.i += 1

    def integer(self) -> int:
        if not _is_int(self.peek()):
            found = "the end" if self.peek() is None else repr(self.peek())
            self.fail(f"expected an integer, found {found}")
        return int(self.take())

    def int_tuple(self) -> IntTuple:
        if self.peek() != "(":
            return self.integer()
        self.take()
        items = [self.int_tuple()]
        while self.peek() == ",":
            self.take()
            items.append(self.int_tuple())
        self.expect(")")
        return tuple(items)

    def fail(self, why: str, col: int | None = None) -> NoReturn:
        col = self.pos if col is None else col
        raise LayoutParseError(
            f"bad layout expression: {why}\n  {self.text}\n  {' ' * col}^\n"
            "  expected shape:stride of nested int tuples, e.g. ((4,2),8):((1,32),4)"
        )
