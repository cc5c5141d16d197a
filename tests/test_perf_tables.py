"""Tables, derived columns, the JSON schema and the README section, from synthetic runs (CPU)."""

import json

import pytest

from perf import readme_tables, schema, tables
from perf.common import dump_json, round_floats
from perf.gemm import derive


def synthetic_gemm_run():
    """Two shapes, cuBLAS + kbit k=4 + a failed and an unavailable peer, M in {1, 16}."""
    results = []

    def rec(shape, M, impl, k, status, graph_us=None, weight=None, error=None):
        K, N = map(int, shape.split("x"))
        b = None if weight is None else weight + 2 * M * (K + N)
        results.append(
            dict(
                shape=shape,
                M=M,
                impl=impl,
                k=k,
                status=status,
                error=error,
                graph_us=graph_us,
                eager_us=None if graph_us is None else 2 * graph_us,
                calls=20,
                copies=3,
                weight_bytes=weight,
                bytes=b,
                warm_s=0.1,
            )
        )

    for shape, t in (("8192x28672", 160.0), ("2048x512", 5.0)):
        K, N = map(int, shape.split("x"))
        for M in (1, 16):
            rec(shape, M, "cublas", None, "ok", t, 2 * K * N)
            rec(shape, M, "kbit", 4, "ok", t / 2, K * N // 2)
            rec(shape, M, "tinygemm", None, "failed", error="RuntimeError: boom")
            rec(shape, M, "bnb", None, "unavailable", error="ModuleNotFoundError")
    run = {
        "schema": schema.RUN_SCHEMA,
        "kind": "gemm",
        "command": "python -m perf gemm --x",
        "date": "2026-11-22 10:00:00 UTC",
        "env": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "cuda": "13.0",
            "torch": "2.11.0",
            "cutlass_dsl": "4.8.1",
            "git_commit": "abc",
            "nvidia_smi": {"driver_version": "580.1", "clocks.sm [MHz]": "1980 MHz"},
        },
        "method": {},
        "roofline": {"read_gbs": 3000.0, "tflops": 600.0},
        "config": {
            "dtype": "fp16",
            "ks": [4],
            "ms": [1, 16],
            "models": ["llama3-70b", "qwen3-coder-next"],
            "impls": [
                dict(key="cublas", impl="cublas", k=None, label="cuBLAS F.linear", note=""),
                dict(key="kbit4", impl="kbit", k=4, label="kbit k=4", note=""),
                dict(key="tinygemm", impl="tinygemm", k=None, label="tinygemm", note=""),
                dict(key="bnb", impl="bnb", k=None, label="bnb NF4", note=""),
            ],
            "shapes": [
                dict(shape="8192x28672", K=8192, N=28672, models={"llama3-70b": ["gate_proj"]}),
                dict(
                    shape="2048x512",
                    K=2048,
                    N=512,
                    models={"qwen3-coder-next": ["mlp.experts.gate_proj"]},
                ),
            ],
        },
        "aborted": None,
        "results": results,
    }
    derive(results, 3000.0, 600.0)
    return run


def synthetic_decode_run():
    results = []
    for variant, k, t in (("fp16", None, 6000.0), ("k=4", 4, 2000.0)):
        results.append(
            dict(
                model="llama3-8b",
                batch=1,
                variant=variant,
                k=k,
                status="ok",
                error=None,
                step_us=t,
                tokens_per_s=1e6 / t,
                speedup=6000.0 / t,
                linear_frac=0.8,
                weight_bytes=int(1.5e10 if k is None else 4e9),
                pct_roofline=50.0,
            )
        )
    return {
        "schema": schema.RUN_SCHEMA,
        "kind": "decode",
        "command": "python -m perf decode",
        "date": "2026-11-22 10:05:00 UTC",
        "env": {"gpu": "NVIDIA H100 80GB HBM3"},
        "method": {},
        "roofline": {"read_gbs": 3000.0},
        "config": {
            "models": ["llama3-8b"],
            "batches": [1],
            "ks": [4],
            "dtype": "fp16",
            "notes": ["a note"],
        },
        "aborted": None,
        "results": results,
    }


def test_derive_speedup_and_roofline():
    run = synthetic_gemm_run()
    by = {(r["shape"], r["M"], r["impl"]): r for r in run["results"]}
    kb = by[("8192x28672", 1, "kbit")]
    assert kb["speedup"] == pytest.approx(2.0)
    mem_us = kb["bytes"] / 3000e3
    assert kb["roofline_us"] == pytest.approx(mem_us)  # M = 1: bandwidth-bound
    assert kb["pct_roofline"] == pytest.approx(100 * mem_us / 80.0)
    assert kb["gbs"] == pytest.approx(kb["bytes"] / 80e3)
    big = by[("8192x28672", 16, "cublas")]
    assert big["roofline_us"] == pytest.approx(
        max(big["bytes"] / 3000e3, 2 * 16 * 8192 * 28672 / 600e6)
    )
    failed = by[("2048x512", 1, "tinygemm")]
    assert failed["speedup"] is None and failed["pct_roofline"] is None


def test_layer_names_are_compacted():
    names = ["self_attn.k_proj", "self_attn.v_proj", "mlp.experts.gate_proj", "mlp.experts.up_proj"]
    assert tables.layer_names(names) == "k/v_proj, experts.gate/up_proj"
    assert tables.layer_names(["q_proj", "o_proj"]) == "q/o_proj"
    assert tables.layer_names(["linear_attn.in_proj_qkvz"]) == "linear_attn.in_proj_qkvz"
    assert tables.layer_names(["mlp.gate_proj (dense)", "--shape"]) == "gate_proj (dense), --shape"


def test_md_table_is_aligned():
    text = tables.md_table(["a", "long header"], [[1, None], ["wide cell", 2.5]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].startswith("|---") and "| wide cell | 2.5" in lines[3]


def test_gemm_summary_cells():
    run = synthetic_gemm_run()
    h, rows = tables.gemm_summary(run, "llama3-70b")
    assert h == ["K x N", "layers", "M", "cuBLAS us", "kbit k=4", "tinygemm", "bnb NF4"]
    assert rows == [
        ["8192x28672", "gate_proj", 1, "160.0", "2.00x", "failed", "n/a"],
        ["8192x28672", "", 16, "160.0", "2.00x", "failed", "n/a"],
    ]
    _, rows = tables.gemm_summary(run, "qwen3-coder-next", ms=[16])
    assert rows == [["2048x512", "experts.gate_proj", 16, "5.0", "2.00x", "failed", "n/a"]]
    _, detail = tables.gemm_detail(run)
    assert len(detail) == len(run["results"])
    assert any("failed: RuntimeError: boom" in row[-1] for row in detail)


def test_decode_table():
    h, rows = tables.decode_table(synthetic_decode_run())
    assert rows[1][:7] == ["llama3-8b", 1, "k=4", "2000.0", "500", "3.00x", "80%"]
    assert "a note" in tables.decode_markdown(synthetic_decode_run())


def test_schema_accepts_and_rejects():
    run = synthetic_gemm_run()
    schema.validate_run(json.loads(json.dumps(run)))
    bad = json.loads(json.dumps(run))
    bad["results"][0]["status"] = "great"
    with pytest.raises(ValueError, match="status"):
        schema.validate_run(bad)
    bad = json.loads(json.dumps(run))
    del bad["results"][3]["graph_us"]
    with pytest.raises(ValueError, match="graph_us"):
        schema.validate_run(bad)
    bad = json.loads(json.dumps(run))
    bad["results"][0]["graph_us"] = None  # ok without a time
    with pytest.raises(ValueError, match="no time"):
        schema.validate_run(bad)
    bad = json.loads(json.dumps(run))
    bad["results"][0]["impl"] = "marlin"
    with pytest.raises(ValueError, match="not in the config"):
        schema.validate_run(bad)
    with pytest.raises(ValueError, match="missing keys"):
        schema.validate_run({"schema": schema.RUN_SCHEMA})
    with pytest.raises(ValueError, match="non-empty"):
        schema.validate_collection({"schema": schema.COLLECTION_SCHEMA, "runs": []})
    schema.validate_run(synthetic_decode_run())


def test_dump_json_round_trips_rounded(tmp_path):
    run = synthetic_gemm_run()
    dump_json(run, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == json.loads(json.dumps(round_floats(run)))
    assert round_floats(1.23456789) == 1.235 and round_floats(float("nan")) is None
    schema.validate_run(back)


def test_readme_section_replace_and_extract():
    coll = schema.as_collection(synthetic_gemm_run())
    coll["runs"].append(synthetic_decode_run())
    section = readme_tables.render_section(coll)
    assert "`python -m perf gemm --x`" in section and "NVIDIA H100 80GB HBM3" in section
    assert "| 8192x28672 | gate_proj | 1  | 160.0" in section
    assert "h100-speedup.png" in section and "**Decode step**" in section
    text = "intro\n<!-- perf:begin -->\nold\n<!-- perf:end -->\noutro\n"
    new = readme_tables.replace_section(text, section)
    assert readme_tables.extract_section(new) == section.strip("\n")
    assert new.startswith("intro\n") and new.endswith("<!-- perf:end -->\noutro\n")
    with pytest.raises(ValueError, match="perf:begin"):
        readme_tables.extract_section("no markers")
    with pytest.raises(ValueError, match="perf:begin"):
        readme_tables.replace_section("<!-- perf:end --> <!-- perf:begin -->", section)
