"""Tables from a run's JSON dict: what the CLI prints, the run's .md file and the README use.

``md_table`` is our own fixed markdown formatter, so the README check in CI does not depend
on the installed tabulate version; the CLI prints the same rows through tabulate.
"""

from __future__ import annotations

STATUS_SHORT = {"failed": "failed", "unavailable": "n/a", "skipped": "skipped"}


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    return "" if x is None else f"{x:{spec}}{suffix}"


def impl_labels(run: dict) -> dict[str, str]:
    return {i["key"]: i["label"] for i in run["config"]["impls"]}


def _key(r: dict) -> str:
    return r["impl"] if r.get("k") is None else f"{r['impl']}{r['k']}"


def _cell(r: dict | None, value: str) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return STATUS_SHORT.get(r["status"], r["status"])
    return value


# ----------------------------------------------------------------------------- gemm


def gemm_detail(run: dict) -> tuple[list[str], list[list]]:
    """Every point: time (graph and eager), GB/s, % of roofline, speedup, status."""
    labels = impl_labels(run)
    headers = ["K x N", "M", "implementation", "us (graph)", "us (eager)", "GB/s",
               "% roofline", "vs cuBLAS", "status"]  # fmt: skip
    rows = []
    for r in run["results"]:
        status = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:80]}"
        rows.append([r["shape"], r["M"], labels.get(_key(r), _key(r)), fmt(r["graph_us"]),
                     fmt(r["eager_us"]), fmt(r.get("gbs"), ".0f"), fmt(r.get("pct_roofline"), ".0f", "%"),
                     fmt(r.get("speedup"), ".2f", "x"), status])  # fmt: skip
    return headers, rows


def gemm_summary(run: dict, model: str, ms=None) -> tuple[list[str], list[list]]:
    """One row per (shape, M) of a model: cuBLAS us, then every other implementation's
    speedup over it (``failed`` / ``n/a`` / ``skipped`` where it has no number)."""
    labels = impl_labels(run)
    keys = [i["key"] for i in run["config"]["impls"] if i["impl"] != "cublas"]
    headers = ["K x N", "layers", "M", "cuBLAS us", *(labels[k] for k in keys)]
    by = {(r["shape"], r["M"], _key(r)): r for r in run["results"]}
    rows = []
    for s in run["config"]["shapes"]:
        if model not in s["models"]:
            continue
        layers = layer_names(s["models"][model])
        first = True
        for M in run["config"]["ms"]:
            if ms is not None and M not in ms:
                continue
            base = by.get((s["shape"], M, "cublas"))
            row = [
                s["shape"],
                layers if first else "",
                M,
                _cell(base, fmt(base and base["graph_us"])),
            ]
            first = False
            for k in keys:
                r = by.get((s["shape"], M, k))
                row.append(_cell(r, fmt(r and r.get("speedup"), ".2f", "x")))
            rows.append(row)
    return headers, rows


def layer_names(layers: list[str]) -> str:
    """Compact layer list: 'self_attn.k_proj', 'self_attn.v_proj' -> 'k/v_proj'."""
    groups: dict[str, list[str]] = {}
    for name in layers:
        for prefix in ("self_attn.", "mlp."):
            name = name.removeprefix(prefix)
        head, _, leaf = name.rpartition(".")
        groups.setdefault(head + "." if head else "", []).append(leaf)
    parts = []
    for head, leaves in groups.items():
        if len(leaves) > 1 and all(leaf.endswith("_proj") for leaf in leaves):
            parts.append(head + "/".join(leaf[: -len("_proj")] for leaf in leaves) + "_proj")
        else:
            parts += [head + leaf for leaf in leaves]
    return ", ".join(parts)


def gemm_markdown(run: dict) -> str:
    """The run's gemm.md: header, per-model summaries, then every point."""
    out = [run_header(run)]
    for model in run["config"]["models"]:
        h, rows = gemm_summary(run, model)
        out += [f"\n### {model}: speedup vs cuBLAS ({run['config']['dtype']})\n", md_table(h, rows)]
    h, rows = gemm_detail(run)
    out += ["\n### All points\n", md_table(h, rows)]
    return "\n".join(out) + "\n"


def run_header(run: dict) -> str:
    env, roof = run["env"], run["roofline"]
    smi = env.get("nvidia_smi") or {}
    clocks = ", ".join(
        f"{k.replace(' [MHz]', '')} {v}" for k, v in smi.items() if k.startswith("clocks")
    )
    lines = [
        f"{env.get('gpu')}, driver {smi.get('driver_version', '?')}, CUDA {env.get('cuda')}, "
        f"torch {env.get('torch')}, nvidia-cutlass-dsl {env.get('cutlass_dsl')}"
        + (f"; {clocks}" if clocks else "")
        + f"; {run['date']}.",
        f"Command: `{run['command']}` (commit {env.get('git_commit') or 'unknown'}).",
        f"Measured in the same run: read bandwidth {roof['read_gbs']:.0f} GB/s"
        + (
            f", {run['config']['dtype']} matmul {roof['tflops']:.0f} TFLOP/s."
            if "tflops" in roof
            else "."
        ),
    ]
    if run.get("aborted"):
        lines.append(f"**Run stopped early:** {run['aborted']}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- decode


def decode_table(run: dict) -> tuple[list[str], list[list]]:
    headers = ["model", "batch", "weights", "step us", "tokens/s", "vs fp16",
               "in linears", "weight MB/step", "% roofline", "status"]  # fmt: skip
    rows = []
    for r in run["results"]:
        status = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:80]}"
        frac = r.get("linear_frac")
        rows.append([r["model"], r["batch"], r["variant"], fmt(r.get("step_us")),
                     fmt(r.get("tokens_per_s"), ".0f"), fmt(r.get("speedup"), ".2f", "x"),
                     fmt(None if frac is None else 100 * frac, ".0f", "%"),
                     fmt(None if r.get("weight_bytes") is None else r["weight_bytes"] / 1e6, ".0f"),
                     fmt(r.get("pct_roofline"), ".0f", "%"), status])  # fmt: skip
    return headers, rows


def decode_markdown(run: dict) -> str:
    h, rows = decode_table(run)
    notes = "\n".join(f"- {n}" for n in run["config"].get("notes", []))
    return "\n".join([run_header(run), "", md_table(h, rows), "", notes]).rstrip() + "\n"
