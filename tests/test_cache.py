"""The compile cache and the launcher, without a GPU: fingerprints, disk entries written
atomically and shared by processes, and the generated launch function (stubbed FFI)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kbit_cute import compile as kc
from kbit_cute.kernels.dequantize import dequantize_spec
from kbit_cute.kernels.gemv import gemv_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache directory (never the user's)."""
    d = tmp_path / "cache"
    monkeypatch.setenv(kc.CACHE_ENV, str(d))
    return d


def run_py(code: str, cache_dir: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, kc.CACHE_ENV: str(cache_dir), "CUTE_DSL_ARCH": "sm_90a"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_separates_arch_name_and_config():
    keys = {
        kc.fingerprint(gemv_spec(4, 1, "f16"), "sm_90a"),
        kc.fingerprint(gemv_spec(4, 1, "f16"), "sm_80"),
        kc.fingerprint(gemv_spec(4, 2, "f16"), "sm_90a"),
        kc.fingerprint(gemv_spec(3, 1, "f16"), "sm_90a"),
        kc.fingerprint(gemv_spec(4, 1, "bf16"), "sm_90a"),
        kc.fingerprint(dequantize_spec(4, "f16"), "sm_90a"),
    }
    assert len(keys) == 6


def test_source_closure_follows_kbit_imports():
    deps = kc._imported_kbit_modules("kbit_cute.kernels.gemv")
    assert {
        "kbit_cute.format",
        "kbit_cute.layouts",
        "kbit_cute.kernels.device_helpers",
    } <= deps
    assert "kbit_cute" not in deps and not any(d.startswith("cutlass") for d in deps)


def test_editing_a_dependency_changes_the_key(tmp_path, monkeypatch):
    """A change to device_helpers.py (imported by the kernel) must give a new cache key."""
    spec = gemv_spec(4, 1, "f16")
    before = kc.fingerprint(spec, "sm_90a")
    helpers = importlib.util.find_spec("kbit_cute.kernels.device_helpers")
    edited = tmp_path / "device_helpers.py"
    edited.write_text(Path(helpers.origin).read_text() + "\n# edited\n")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *a):
        s = real_find_spec(name, *a)
        if name == "kbit_cute.kernels.device_helpers":
            s = importlib.util.spec_from_file_location(name, edited)
        return s

    monkeypatch.setattr(kc.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(kc, "_source_digests", {})
    assert kc.fingerprint(spec, "sm_90a") != before


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path / "x"))
    assert kc.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(kc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.cache_dir() == tmp_path / "xdg" / "kbit_cute"


# ----------------------------------------------------------------------------- disk entries


def test_compile_writes_one_entry_and_a_new_process_loads_it(cache):
    """...with the same key, computed independently, and without compiling."""
    spec = dequantize_spec(3, "bf16")
    before = dict(kc.stats)
    fn = kc.ffi_function(spec, "sm_90a")
    assert kc.stats["compiled"] == before["compiled"] + 1
    assert callable(fn)
    files = sorted(p.name for p in cache.iterdir())
    assert files == [kc.entry_path(spec, "sm_90a").name], files  # no temporary left over
    assert (cache / files[0]).read_bytes()[:4] == b"\x7fELF"
    assert (cache / files[0]).stat().st_mode & 0o777 == 0o644

    code = """
        import json, time
        from kbit_cute import compile as kc
        from kbit_cute.kernels.dequantize import dequantize_spec
        t0 = time.perf_counter()
        kc.ffi_function(dequantize_spec(3, "bf16"), "sm_90a")
        first_s = time.perf_counter() - t0
        key = kc.fingerprint(dequantize_spec(3, "bf16"), "sm_90a")
        print(json.dumps({**kc.stats, "first_s": first_s, "key": key}))
    """
    stats = json.loads(finish(run_py(code, cache)).strip().splitlines()[-1])
    assert stats["key"] == kc.fingerprint(spec, "sm_90a")  # stable across processes
    print(f"warm first load in a new process: {stats['first_s'] * 1e3:.1f} ms")
    assert stats["compiled"] == 0 and stats["disk_hits"] == 1
    assert stats["first_s"] < 2.0  # ~0.05 s here; a compile would take ~0.5 s and count


def test_processes_compiling_one_variant_at_once_agree(cache):
    code = """
        from kbit_cute import compile as kc
        from kbit_cute.kernels.dequantize import dequantize_spec
        kc.ffi_function(dequantize_spec(5, "f32"), "sm_90a")
        print("ok")
    """
    procs = [run_py(code, cache) for _ in range(2)]
    assert [finish(p).strip() for p in procs] == ["ok"] * 2
    files = sorted(p.name for p in cache.iterdir())
    assert files == [kc.entry_path(dequantize_spec(5, "f32"), "sm_90a").name], files
    kc.load_variant(dequantize_spec(5, "f32"), cache / files[0])  # complete and loadable


def test_damaged_entry_is_rebuilt(cache, caplog):
    spec = dequantize_spec(2, "f16")
    path = kc.entry_path(spec, "sm_90a")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF" + os.urandom(3000))
    before = kc.stats["compiled"]
    kc.ffi_function(spec, "sm_90a")
    assert kc.stats["compiled"] == before + 1
    assert "unloadable cache entry" in caplog.text
    kc.load_variant(spec, path)


def test_unusable_cache_dir_falls_back_to_memory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(kc.CACHE_ENV, str(blocker))
    monkeypatch.setattr(kc, "_warned_unwritable", False)
    fn = kc.ffi_function(dequantize_spec(2, "bf16"), "sm_90a")
    assert callable(fn)
    assert "unusable" in caplog.text


# ----------------------------------------------------------------------------- launcher


def test_kernel_params_follow_the_signature_and_fake_pointers():
    params = kc.kernel_params(gemv_spec(4, 1, "f16"))
    names = [p.name for p in params]
    assert names[:3] == ["pA", "pPacked", "pAbsmax"] and names[-1] == "has_bias"
    assert "stream" not in names
    kinds = {p.name: (p.kind, p.align, p.dtype) for p in params}
    assert kinds["pA"] == ("ptr", 16, torch.float16)
    assert kinds["pScale"] == ("ptr", 4, torch.float32)
    assert kinds["pOut"] == ("ptr", 2, torch.float16)
    assert kinds["M"][0] == "int"


def stub_launch(check=False, current=-7):
    """A launch function over a recording stub FFI; device index -7 stands in for a GPU."""
    calls = []
    params = kc.kernel_params(dequantize_spec(4, "f16"))
    fn = kc.make_launch(
        "dq_test",
        params,
        lambda *a: calls.append(a),
        current_device=lambda: current,
        raw_stream=lambda dev: 1000 + dev,
        check=check,
    )
    return fn, calls


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports device index 7 (the launcher only asks get_device())."""

    def get_device(self):
        return 7


def dq_args(k=4, N=128, K=64, out_dtype=torch.float16):
    words, blocks = kc_sizes(k, N, K)
    t = [
        torch.zeros(words, dtype=torch.int32),
        torch.zeros(blocks, dtype=torch.uint8),
        torch.zeros(1 << k, dtype=torch.float32),
        torch.ones(1, dtype=torch.float32),
        torch.empty(N, K, dtype=out_dtype),
    ]
    return [x.as_subclass(FakeCuda) for x in t], N, K


def kc_sizes(k, N, K):
    from kbit_cute.ops import tiled_sizes

    return tiled_sizes(k, N, K)


def test_launch_passes_pointers_ints_and_the_stream_in_order():
    fn, calls = stub_launch(current=7)
    tensors, N, K = dq_args()
    fn(*tensors, N, K)
    assert calls == [(*[t.data_ptr() for t in tensors], N, K, 1007)]
    assert fn.__name__ == "dq_test"


def test_launch_rejects_a_misaligned_pointer_by_name():
    fn, calls = stub_launch(current=7)
    tensors, N, K = dq_args()
    base = torch.empty(N * K + 1, dtype=torch.float16)
    tensors[4] = base[1:].view(N, K).as_subclass(FakeCuda)  # 2 bytes past a 16-byte boundary
    with pytest.raises(kc.MisalignedError, match="'pOut' must be 16-byte aligned"):
        fn(*tensors, N, K)
    assert calls == []


def test_launch_rejects_cpu_tensors():
    fn, calls = stub_launch(current=0)
    tensors, N, K = dq_args()
    cpu = [t.as_subclass(torch.Tensor) for t in tensors]
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        fn(*cpu, N, K)
    assert calls == []


def test_checked_launch_names_a_wrong_dtype():
    fn, calls = stub_launch(check=True, current=7)
    tensors, N, K = dq_args(out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="'pOut' must be torch.float16"):
        fn(*tensors, N, K)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        fn(*tensors)
    assert calls == []


def test_stream_arg_launch_takes_the_callers_stream():
    """``stream_arg=True``: the stream is the last argument; no device lookup (the caller
    made the device current); alignment is still checked."""
    calls = []
    params = kc.kernel_params(dequantize_spec(4, "f16"))

    def no_device():
        raise AssertionError("a stream_arg launch must not ask for the current device")

    fn = kc.make_launch("dq_s", params, lambda *a: calls.append(a), no_device, stream_arg=True)
    tensors, N, K = dq_args()
    fn(*tensors, N, K, 4242)
    assert calls == [(*[t.data_ptr() for t in tensors], N, K, 4242)]
    base = torch.empty(N * K + 1, dtype=torch.float16)
    tensors[4] = base[1:].view(N, K).as_subclass(FakeCuda)
    with pytest.raises(kc.MisalignedError, match="'pOut'"):
        fn(*tensors, N, K, 4242)
    assert len(calls) == 1


def test_checked_stream_arg_launch_names_a_wrong_device():
    calls = []
    params = kc.kernel_params(dequantize_spec(4, "f16"))
    fn = kc.make_launch(
        "dq_s", params, lambda *a: calls.append(a), lambda: 3, check=True, stream_arg=True
    )
    tensors, N, K = dq_args()
    with pytest.raises(ValueError, match="device 7, not the current one"):
        fn(*tensors, N, K, 1)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        fn(*tensors, N, 1)
    assert calls == []


def test_stream_launcher_shares_the_loaded_variant(cache, monkeypatch):
    for name in ("_loaded", "_launchers", "_stream_launchers"):
        monkeypatch.setattr(kc, name, {})
    spec = dequantize_spec(3, "f32")
    before = dict(kc.stats)
    fn = kc.stream_launcher(spec)
    assert kc.stream_launcher(spec) is fn and fn.__name__ == spec.name
    kc.launcher(spec)
    loads = kc.stats["compiled"] + kc.stats["disk_hits"]
    assert loads == before["compiled"] + before["disk_hits"] + 1  # one compile or load for both
    assert "stream" in fn.__doc__


def test_launcher_compiles_once_and_caches_in_memory(cache):
    spec = dequantize_spec(2, "f32")
    fn = kc.launcher(spec)
    assert kc.launcher(spec) is fn
    assert fn.__name__ == spec.name
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        tensors, N, K = dq_args(k=2, out_dtype=torch.float32)
        fn(*[t.as_subclass(torch.Tensor) for t in tensors], N, K)


def test_env_report_runs_without_a_gpu(cache, capsys):
    from kbit_cute import env

    assert env.main() == 0
    out = capsys.readouterr().out
    for part in ("nvidia-cutlass-dsl 4.8.1", "apache-tvm-ffi", "torch", str(cache)):
        assert part in out, out
    assert "test kernel dequantize_k4_f16:" in out and "FAILED" not in out


def test_precompile_builds_a_gemm_tiling_outside_the_table(cache):
    """Tune candidates are not registered variants: ``precompile.build`` rebuilds their
    spec from the name in its worker (``gemm_spec_named``) and caches it like any other."""
    from kbit_cute import precompile
    from kbit_cute.kernels import gemm

    name = "m16n128k64s3w1x4"  # a tiling the table does not use for k = 5
    assert name not in {r[1] for r in gemm.table_rows(5)}
    spec = gemm.gemm_spec(5, "f16", gemm.GemmConfig.parse(name))
    assert gemm.gemm_spec_named(spec.name).name == spec.name
    for bad in ("gemm_k6_f16_" + name, "gemv_k4_f16_" + name, "gemm_k4_f32_" + name, "gemm_k4"):
        with pytest.raises(ValueError, match="GEMM variant name"):
            gemm.gemm_spec_named(bad)
    got = precompile.build([spec], "sm_90a", jobs=1)
    assert got["compiled"] == 1 and not got["failed"], got
    assert kc.entry_path(spec, "sm_90a").is_file()
