"""``python -m layouts``: pictures of the kbit tile format and of CuTe layouts.

    python -m layouts tile --k 4 [--tile KT,NT] [--weight N,K] [--word W]
    python -m layouts show "((4,2),8):((1,32),4)" [--tv M,N | --banks [--elem-bytes B --vec V]]
    python -m layouts kernel gemv|gemm|moe --k 4 [--config NAME] [--only REGEX]

Every subcommand takes ``--format svg|png|text`` (text goes to stdout, colored on a
terminal) and ``--out DIR`` for the pictures.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

from .banks import smem_phases
from .draw import save, tile_figure
from .grid import MAX_CELLS, offset_grid, tv_grid
from .kernel import KINDS, NotRegistered, View, kernel_views
from .parse import LayoutParseError, parse_layout, size
from .probe import evaluate
from .text import tile_text
from .tile import tile_view


def _pair(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected two ints 'A,B', got {text!r}")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--format", choices=("svg", "png", "text"), default="svg")
    common.add_argument("--out", type=Path, default=Path("."), help="folder for svg/png files")
    common.add_argument("--name", help="file name stem (default: derived from the arguments)")
    common.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto",
        help="ANSI colors in text output (auto: on a terminal, unless NO_COLOR is set)",
    )  # fmt: skip
    parser = argparse.ArgumentParser(
        prog="python -m layouts",
        description="Pictures of the kbit tile format and of CuTe layouts.",
        epilog="examples:\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    tile = sub.add_parser("tile", parents=[common], help="one repack tile of the kbit format")
    tile.add_argument("--k", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight")
    tile.add_argument("--tile", type=_pair, default=(0, 0), metavar="KT,NT",
                      help="k_tile, n_tile of the tile to draw")  # fmt: skip
    tile.add_argument("--weight", type=_pair, metavar="N,K",
                      help="weight shape (default: the smallest that holds the tile)")  # fmt: skip
    tile.add_argument("--word", type=int, default=0, help="tile word whose 32 weights to mark")

    show = sub.add_parser("show", parents=[common], help="a layout given as shape:stride text")
    show.add_argument("layout", help='e.g. "((4,2),8):((1,32),4)" or "S<3,4,3> o (8,64):(64,1)"')
    as_ = show.add_mutually_exclusive_group()
    as_.add_argument(
        "--tv",
        type=_pair,
        metavar="M,N",
        help="draw as a (thread, value) -> tile index layout over an M x N tile",
    )
    as_.add_argument(
        "--banks",
        action="store_true",
        help="draw as (thread, value) -> shared-memory element offset: bank map",
    )
    show.add_argument("--elem-bytes", type=int, default=4, help="with --banks: element size")
    show.add_argument("--vec", type=int, default=1, help="with --banks: values per access")

    kernel = sub.add_parser("kernel", parents=[common], help="a kernel's registered layouts")
    kernel.add_argument("kind", choices=KINDS)
    kernel.add_argument("--k", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight")
    kernel.add_argument(
        "--config",
        help="gemm: a GemmConfig name, e.g. m64n128k64s3w1x4 (default: the dispatch table's "
        "smallest-M one); moe: gate_up, gate_up:I (I = intermediate size to draw) or down",
    )
    kernel.add_argument("--only", metavar="REGEX", help="only the layouts whose name matches")
    return parser


def _use_color(mode: str) -> bool:
    if mode != "auto":
        return mode == "always"
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _stem(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_") or "layout"


def _tile(args: argparse.Namespace, color: bool) -> list[tuple[str, str]]:
    kt, nt = args.tile
    n, k_ = args.weight or (0, 0)
    view = tile_view(args.k, kt, nt, N=n, K=k_)
    if not 0 <= args.word < view.words:
        raise ValueError(f"--word must be in 0..{view.words - 1} for k={args.k}, got {args.word}")
    if args.format == "text":
        return [("", tile_text(view, args.word, color))]
    stem = args.name or "_".join(
        [f"tile_k{args.k}"]
        + ([f"t{kt}x{nt}"] if (kt, nt) != (0, 0) else [])
        + ([f"w{args.word}"] if args.word else [])
    )
    return [(stem, tile_figure(view, args.word))]


def _show(args: argparse.Namespace, color: bool) -> list[tuple[str, object]]:
    spec = parse_layout(args.layout)
    if size(spec.shape) > MAX_CELLS:  # evaluating is one Python call per coordinate
        raise ValueError(f"{spec} has {size(spec.shape)} coordinates; at most {MAX_CELLS}")
    ev = evaluate(spec.make)
    if args.tv:
        view = View("tv", tv_grid(ev, args.tv))
    elif args.banks:
        title = f"{ev.text}: {args.elem_bytes}-byte elements, {args.vec} per access"
        view = View("banks", tuple(smem_phases(ev, args.elem_bytes, args.vec)), title)
    else:
        view = View("layout", offset_grid(ev))
    if args.format == "text":
        return [("", view.text(color))]
    return [(args.name or f"{view.name}_{_stem(str(spec))}", view.figure())]


def _kernel(args: argparse.Namespace, color: bool) -> list[tuple[str, object]]:
    """Notes (views with nothing to draw) come back as (name, text) in every format."""
    views = kernel_views(args.kind, args.k, args.config, args.only)
    if args.format == "text":
        return [("", f"== {v.name}\n{v.text(color)}") for v in views]
    cfg = f"_{_stem(args.config)}" if args.config else ""
    prefix = args.name or f"kernel_{args.kind}_k{args.k}{cfg}"
    return [
        (v.name, v.data) if v.is_note else (f"{prefix}_{_stem(v.name)}", v.figure()) for v in views
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad input or unregistered kernels)."""
    matplotlib.use("Agg")  # headless even where a display is configured
    parser = build_parser()
    args = parser.parse_args(argv)
    run = {"tile": _tile, "show": _show, "kernel": _kernel}[args.cmd]
    try:
        results = run(args, _use_color(args.color))
    except (LayoutParseError, NotRegistered, ValueError) as e:
        print(f"{parser.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    if args.format == "text":
        print("\n\n".join(text for _, text in results))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, fig in results:
        if isinstance(fig, str):  # a note: nothing to draw, say so
            print(f"{stem}: {fig}")
        else:
            print(save(fig, args.out / f"{stem}.{args.format}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
