"""kbit_cute perf suite: GEMM tables vs cuBLAS and peers, a decode-step benchmark, README tables.

    python -m perf gemm   [--model NAME ...] [--shape KxN ...] [--k 2 3 4 5] [--m 1 2 4 ...]
                          [--dtype fp16|bf16] [--peers tinygemm bnb gemlite floor] [--out DIR]
    python -m perf decode [--model llama3-8b qwen3-coder-next] [--batch 1 4] [--k 2 3 4 5]
    python -m perf moe    [--model NAME ...] [--t 1 4 16 64] [--k 4] [--dtype bf16|fp16]
    python -m perf merge  RUN.json ... --out perf/results/h100.json
    python -m perf readme [--check]

Method (perf/common.py): L2-cold weight rotation over > 4x L2, CUDA-graph replays, median of
>= 7 replays, eager time with host overhead next to it, read bandwidth and matmul peak
measured in the same run. Output (``--out``, default $OUT, else perf/results/run-<date>-<kind>):
gemm.json / decode.json / moe.json (environment and every number), gemm.md / decode.md /
moe.md (tables), PNG plots; the tables are also printed (the per-model summary last).

Time budget: with no --model/--shape, ``gemm`` sweeps llama3-70b and qwen3-coder-next over
the default M and k (9 shapes x 8 implementations x 6 M, before the read floor joined the
peers): 443 s measured on the H100, and
``--budget-s`` (default 450 s) records whatever is left as skipped, so the run always ends
within ~8 min and reports. (The cost model printed at the start underestimates: ~100 s.)

``moe`` (issue 7; method in perf/moe.py) times the kbit grouped experts and the KbitMoE
layer against bf16 ``torch._grouped_mm`` and an ``F.linear`` loop on the same routings, for
Qwen3-Coder-Next, GLM-4.7-Flash and DeepSeek-V2-Lite at T = 1, 4, 16, 64 and k = 4 (pass
``--k 2 3 4 5`` for all); ``--budget-s`` (default 200 s) guards it like ``gemm``.

``--cpu-smoke`` runs the whole pipeline (sweep, peers, JSON, tables, plots; decode with
toy-sized models) on the CPU with host-clock timing stubs. Its numbers are meaningless; it
exists so CI (tests/test_perf_smoke.py) exercises every code path that does not need a GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from . import models
from .gemm import DEFAULT_MS, DTYPES, parse_shape
from .moe import DEFAULT_TS
from .peers import PEER_NAMES


def _shape(text: str) -> str:
    try:
        parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5], choices=[2, 3, 4, 5],
                   help="kbit bit widths (default 2 3 4 5)")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default $OUT, else perf/results/run-<date>-<kind>)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the pipeline on the CPU with timing stubs (CI; numbers meaningless)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("gemm", help="GEMM sweep vs cuBLAS and peers")
    g.add_argument("--model", nargs="+", choices=list(models.MODELS), default=None,
                   help="models whose linear shapes to sweep (default: llama3-70b qwen3-coder-next "
                   "unless --shape is given)")  # fmt: skip
    g.add_argument(
        "--shape", nargs="+", type=_shape, default=None, help="K x N shapes, e.g. 4096x14336"
    )
    g.add_argument("--m", type=_positive, nargs="+", default=list(DEFAULT_MS), help="rows of A")
    g.add_argument("--peers", nargs="*", choices=PEER_NAMES, default=list(PEER_NAMES),
                   help="peers besides cuBLAS (default all; none with an empty list)")  # fmt: skip
    g.add_argument("--budget-s", type=float, default=450.0,
                   help="stop timing after this many seconds; the rest is recorded as skipped (0: none)")  # fmt: skip
    g.add_argument("--repeats", type=int, default=9, help="timed graph replays per point (>= 7)")
    _common(g)

    d = sub.add_parser("decode", help="decode-step tokens/s for k = 2..5 vs fp16")
    d.add_argument(
        "--model", nargs="+", choices=list(models.DECODE_MODELS), default=list(models.DECODE_MODELS)
    )
    d.add_argument("--batch", type=_positive, nargs="+", default=[1, 4])
    d.add_argument("--context", type=_positive, default=512, help="KV-cache length")
    d.add_argument("--moe", choices=["auto", "loop", "kbit-moe"], default="auto",
                   help="routed experts: kbit_cute.moe.KbitMoE when it exists (auto), or the expert loop")  # fmt: skip
    d.add_argument(
        "--moe-experts", type=_positive, default=64, help="expert pool per layer for KbitMoE"
    )
    d.add_argument("--quantize-lm-head", action="store_true")
    d.add_argument("--repeats", type=int, default=9, help="timed graph replays (>= 7)")
    _common(d)

    mo = sub.add_parser("moe", help="MoE layer: kbit grouped experts and KbitMoE vs "
                        "torch._grouped_mm and an F.linear loop")  # fmt: skip
    moe_models = [n for n, c in models.MODELS.items() if c.experts and c.seed_shapes is None]
    mo.add_argument("--model", nargs="+", choices=moe_models, default=list(models.MOE_MODELS),
                    help="models with routed experts (default: all)")  # fmt: skip
    mo.add_argument("--t", type=_positive, nargs="+", default=list(DEFAULT_TS),
                    help="tokens per call (default 1 4 16 64)")  # fmt: skip
    mo.add_argument("--k", type=int, nargs="+", default=[4], choices=[2, 3, 4, 5],
                    help="kbit bit widths (default 4)")  # fmt: skip
    mo.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="activations and the peers' weights (default bf16: torch._grouped_mm's)")  # fmt: skip
    mo.add_argument("--budget-s", type=float, default=200.0,
                    help="stop timing after this many seconds; the rest is recorded as skipped (0: none)")  # fmt: skip
    mo.add_argument("--repeats", type=int, default=9, help="timed graph replays per point (>= 7)")
    mo.add_argument("--out", type=Path, default=None,
                    help="output folder (default $OUT, else perf/results/run-<date>-<kind>)")  # fmt: skip
    mo.add_argument("--seed", type=int, default=0)
    mo.add_argument("--cpu-smoke", action="store_true",
                    help="run every path on the CPU with toy experts (CI; numbers meaningless)")  # fmt: skip

    m = sub.add_parser(
        "merge", help="collect run JSONs into one results file (perf/results/h100.json)"
    )
    m.add_argument("runs", nargs="+", type=Path)
    m.add_argument("--out", type=Path, required=True)

    sub.add_parser("readme", help="regenerate (or --check) the README performance section; "
                   "options: python -m perf readme --help")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["readme"]:  # its own parser (argparse's REMAINDER drops leading options)
        from .readme_tables import main as readme_main

        return readme_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd == "merge":
        return _merge(args)
    if args.repeats < 7 and not args.cpu_smoke:
        raise SystemExit(f"--repeats must be >= 7 (the published method), got {args.repeats}")
    args.command = "python -m perf " + " ".join(shlex.quote(a) for a in argv)
    from .common import default_out_dir, make_timer

    timer = make_timer(args.cpu_smoke, max(args.repeats, 7))
    out = args.out or default_out_dir(args.cmd)
    run = {"gemm": _gemm, "decode": _decode, "moe": _moe}[args.cmd]
    return run(args, timer, out)


def _print_table(headers, rows) -> None:
    try:
        from tabulate import tabulate

        print(tabulate(rows, headers=headers, tablefmt="github"))
    except ImportError:
        from .tables import md_table

        print(md_table(headers, rows))


def _gemm(args, timer, out: Path) -> int:
    from . import plots, tables
    from .common import dump_json
    from .gemm import run_gemm

    run = run_gemm(args, timer)
    dump_json(run, out / "gemm.json")
    (out / "gemm.md").write_text(tables.gemm_markdown(run))
    written = [out / "gemm.json", out / "gemm.md"]
    if not args.no_plots:
        for model in run["config"]["models"]:
            written += _plot(plots.speedup, run, model, out / f"speedup-{model}.png")
            written += _plot(plots.roofline, run, model, out / f"roofline-{model}.png")
    print()
    _print_table(*tables.gemm_detail(run))
    print()
    print(tables.run_header(run))
    for model in run["config"]["models"]:
        print(f"\n{model}: speedup vs cuBLAS ({run['config']['dtype']}); cuBLAS column in us")
        _print_table(*tables.gemm_summary(run, model))
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    if run["aborted"]:
        print(f"run stopped early: {run['aborted']}", file=sys.stderr)
        return 1
    return 0


def _decode(args, timer, out: Path) -> int:
    from . import plots, tables
    from .common import dump_json
    from .decode import run_decode

    run = run_decode(args, timer)
    dump_json(run, out / "decode.json")
    (out / "decode.md").write_text(tables.decode_markdown(run))
    written = [out / "decode.json", out / "decode.md"]
    if not args.no_plots:
        written += _plot(plots.decode, run, None, out / "decode.png")
    print()
    print(tables.run_header(run))
    _print_table(*tables.decode_table(run))
    for note in run["config"]["notes"]:
        print(f"- {note}")
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    if run["aborted"]:
        print(f"run stopped early: {run['aborted']}", file=sys.stderr)
        return 1
    return 0


def _moe(args, timer, out: Path) -> int:
    from . import tables
    from .common import dump_json
    from .moe import detail_table, markdown, run_moe, summary_table

    run = run_moe(args, timer)
    dump_json(run, out / "moe.json")
    (out / "moe.md").write_text(markdown(run))
    print()
    _print_table(*detail_table(run))
    print()
    print(tables.run_header(run))
    print(f"\nMoE layer ({run['config']['dtype']}): us per call; x target = kbit us / (touched "
          "kbit bytes / read bandwidth + 5 us); vs = peer us / kbit-experts us")  # fmt: skip
    _print_table(*summary_table(run))
    print(f"\nwrote {out / 'moe.json'}, {out / 'moe.md'}")
    if run["aborted"]:
        print(f"run stopped early: {run['aborted']}", file=sys.stderr)
        return 1
    return 0


def _plot(fn, run, model, path: Path) -> list[Path]:
    """A plot that fails is reported, never fatal: the JSON and tables are already written."""
    try:
        res = fn(run, model, path) if model is not None else fn(run, path)
    except Exception as exc:
        print(f"plot {path.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []
    return [res] if res else []


def _merge(args) -> int:
    from .common import dump_json
    from .schema import COLLECTION_SCHEMA, as_collection, validate_collection

    runs = []
    for path in args.runs:
        runs += as_collection(json.loads(path.read_text()))["runs"]
    coll = validate_collection({"schema": COLLECTION_SCHEMA, "runs": runs})
    dump_json(coll, args.out)
    print(f"wrote {args.out}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
