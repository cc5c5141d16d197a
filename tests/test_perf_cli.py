"""Argument parsing, shape resolution and the rotation arithmetic of the perf suite (CPU)."""

import random
from pathlib import Path

import pytest
import torch

from perf import common
from perf.__main__ import build_parser, main
from perf.gemm import DEFAULT_MS, parse_shape, resolve_shapes


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_gemm_defaults():
    a = parse("gemm")
    assert a.model is None and a.shape is None
    assert a.m == list(DEFAULT_MS) and a.k == [2, 3, 4, 5] and a.dtype == "fp16"
    assert a.peers == ["tinygemm", "bnb", "gemlite", "floor"]
    assert a.budget_s == 450 and a.repeats == 9
    assert not a.cpu_smoke


def test_gemm_arguments():
    a = parse("gemm", "--model", "llama3-70b", "qwen3-coder-next", "--shape", "4096x14336",
              "--k", "2", "4", "--m", "1", "16", "--dtype", "bf16", "--peers")  # fmt: skip
    assert a.model == ["llama3-70b", "qwen3-coder-next"] and a.shape == ["4096x14336"]
    assert a.k == [2, 4] and a.m == [1, 16] and a.dtype == "bf16" and a.peers == []


@pytest.mark.parametrize(
    "argv",
    [
        ("gemm", "--k", "6"),
        ("gemm", "--k", "1"),
        ("gemm", "--m", "0"),
        ("gemm", "--m", "x"),
        ("gemm", "--shape", "100x64"),
        ("gemm", "--shape", "4096*14336"),
        ("gemm", "--dtype", "fp32"),
        ("gemm", "--model", "llama4"),
        ("gemm", "--peers", "marlin"),
        ("decode", "--model", "llama3-70b"),
        ("decode", "--batch", "0"),
        ("decode", "--moe", "grouped"),
        (),
    ],
)
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_decode_defaults():
    a = parse("decode")
    assert a.model == ["llama3-8b", "qwen3-coder-next"] and a.batch == [1, 4]
    assert a.k == [2, 3, 4, 5] and a.context == 512 and a.moe == "auto"


def test_parse_shape():
    assert parse_shape("4096x14336") == (4096, 14336)
    assert parse_shape(" 512 X 2048 ") == (512, 2048)
    for bad in ("4096", "4096x", "33x64", "0x64", "64x0", "ax b"):
        with pytest.raises(ValueError, match="shape"):
            parse_shape(bad)


def test_resolve_shapes_dedupes_and_labels():
    specs = resolve_shapes(["llama3-8b", "llama3-70b"], ["4096x14336", "64x64"])
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys)) == 9  # 4 + 4 model shapes + 64x64
    gate = next(s for s in specs if s.key == "4096x14336")
    assert gate.models == {"llama3-8b": ["gate_proj", "up_proj"], "custom": ["--shape"]}
    with pytest.raises(ValueError, match="no shapes"):
        resolve_shapes([], [])


def test_rotation_spans_four_l2():
    rng = random.Random(0)
    for _ in range(200):
        nbytes, l2 = rng.randint(1, 2**31), rng.choice([4096, 40 * 2**20, 50 * 2**20])
        n = common.copies_for(nbytes, l2)
        assert n >= 2 and (n - 1) * nbytes >= 4 * l2
        for est in (0.5, 5.0, 300.0, 1e5):
            calls = common.calls_for(n, est)
            assert calls >= n  # one replay reads every copy
            assert calls >= min(common.CALLS_PER_GRAPH, 5000 / est)
    with pytest.raises(ValueError, match="positive"):
        common.copies_for(0)


def test_default_out_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert common.default_out_dir("gemm") == tmp_path
    monkeypatch.delenv("OUT")
    d = common.default_out_dir("gemm")
    assert d.parent == Path(common.REPO_ROOT) / "perf" / "results" and d.name.startswith("run-")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_run_without_gpu_says_how_to_smoke(tmp_path):
    with pytest.raises(RuntimeError, match="--cpu-smoke"):
        main(["gemm", "--shape", "64x64", "--out", str(tmp_path)])


def test_repeats_below_method_minimum_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="repeats"):
        main(["gemm", "--shape", "64x64", "--repeats", "3", "--out", str(tmp_path)])


def test_host_overhead_mock_runs_without_a_gpu(tmp_path):
    """``python -m perf.bench_host_overhead --mock`` (the README's way to time the Python path
    on a CPU box) runs every row; in its own process, since it stubs the launch path."""
    import json
    import subprocess
    import sys

    out = tmp_path / "host.json"
    subprocess.run(
        [sys.executable, "-m", "perf.bench_host_overhead", "--mock", "--json", str(out)],
        check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    rows = json.loads(out.read_text())
    text = json.dumps(rows)
    assert "launcher, stream given" in text and "KbitLinear" in text


def test_gemv_kernel_check_times_configs_round_robin():
    """``--passes N``: every configuration once per pass, the passes in turn (a drift of the
    clock reaches each alike), N times each; the median is what the table shows."""
    from perf.gemv_kernel_check import round_robin

    calls = []
    fake_us = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def time_one(config):
        calls.append(config)
        return next(fake_us[config])

    times = round_robin(["a", "b"], time_one, 3)
    assert calls == ["a", "b"] * 3
    assert times == {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]}
    assert round_robin(["a"], lambda c: 7.0, 1) == {"a": [7.0]}


def test_gemv_kernel_check_refuses_zero_passes(monkeypatch, capsys):
    from perf import gemv_kernel_check

    monkeypatch.setattr("sys.argv", ["gemv_kernel_check", "--no-check", "--passes", "0"])
    with pytest.raises(SystemExit):
        gemv_kernel_check.main()
    assert "--passes" in capsys.readouterr().err
