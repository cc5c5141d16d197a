"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- ``speedup``: per shape of a model, speedup vs cuBLAS against M, kbit k = 2..5 and peers.
- ``roofline``: per k, % of roofline against M, one line per shape.
- ``decode``: tokens/s per weight format and batch.

Each returns the written path, or None when matplotlib is missing (the run still reports).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .tables import layer_names


def _plt():
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int, ncols: int = 3) -> tuple[int, int]:
    ncols = min(ncols, n)
    return math.ceil(n / ncols), ncols


def _series(results, shape, key_of):
    """{impl key: (Ms, values)} of the ok points of one shape."""
    out: dict[str, tuple[list, list]] = {}
    for r in results:
        if r["shape"] != shape:
            continue
        xs, ys = out.setdefault(key_of(r), ([], []))
        if r["status"] == "ok" and r.get("speedup"):
            xs.append(r["M"])
            ys.append(r["speedup"])
    return out


def _m_axis(ax, ms) -> None:
    """log2 M axis labelled with the swept M values themselves."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ms))
    ax.set_xticklabels([str(m) for m in ms], fontsize=7, rotation=45)
    ax.minorticks_off()
    ax.set_xlabel("M")


def _key(r: dict) -> str:
    return r["impl"] if r.get("k") is None else f"{r['impl']}{r['k']}"


def speedup(run: dict, model: str, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    shapes = [s for s in run["config"]["shapes"] if model in s["models"]]
    if not shapes:
        return None
    labels = {i["key"]: i["label"] for i in run["config"]["impls"]}
    rows, cols = _grid(len(shapes))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, s in zip(axes.flat, shapes, strict=False):
        for key, (xs, ys) in _series(run["results"], s["shape"], _key).items():
            if key == "cublas":
                continue
            kbit = key.startswith("kbit")
            label = labels.get(key, key) + ("" if xs else " (no data)")
            ax.plot(xs, ys, marker="o" if kbit else "s", ms=3, lw=1.6 if kbit else 1.0,
                    ls="-" if kbit else "--", label=label)  # fmt: skip
        ax.axhline(1.0, color="black", lw=0.8)
        _m_axis(ax, run["config"]["ms"])
        ax.set_title(f"{s['shape']} ({layer_names(s['models'][model])[:56]})", fontsize=9)
        ax.set_ylabel("speedup vs cuBLAS")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shapes) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{model}: speedup vs cuBLAS {run['config']['dtype']} ({run['env'].get('gpu')})")
    return _save(fig, plt, path)


def roofline(run: dict, model: str, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    ks = run["config"]["ks"]
    shapes = [s["shape"] for s in run["config"]["shapes"] if model in s["models"]]
    if not ks or not shapes:
        return None
    rows, cols = _grid(len(ks), 4)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, k in zip(axes.flat, ks, strict=False):
        for shape in shapes:
            pts = [(r["M"], r["pct_roofline"]) for r in run["results"]
                   if r["shape"] == shape and r["impl"] == "kbit" and r["k"] == k
                   and r["status"] == "ok" and r.get("pct_roofline")]  # fmt: skip
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=shape)
        _m_axis(ax, run["config"]["ms"])
        top = max([100.0] + [r["pct_roofline"] * 1.05 for r in run["results"]
                             if r["impl"] == "kbit" and r["k"] == k and r.get("pct_roofline")])  # fmt: skip
        ax.set_ylim(0, top)  # > 100% means L2 hits: the rotation failed for that point
        ax.set_title(f"kbit k={k}", fontsize=9)
        ax.set_ylabel("% of roofline")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(ks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{model}: % of the measured roofline (max of bandwidth and matmul peak)")
    return _save(fig, plt, path)


def decode(run: dict, path: Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    groups = sorted({(r["model"], r["batch"]) for r in run["results"]})
    variants = list(dict.fromkeys(r["variant"] for r in run["results"]))
    if not groups:
        return None
    by = {(r["model"], r["batch"], r["variant"]): r.get("tokens_per_s") for r in run["results"]}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * len(variants) / 3), 4))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        xs = [i + j * width for i in range(len(groups))]
        ax.bar(xs, [by.get((m, b, v)) or 0 for m, b in groups], width, label=v)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{m}\nbatch {b}" for m, b in groups], fontsize=8)
    ax.set_ylabel("tokens/s (decode step, CUDA graph)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
