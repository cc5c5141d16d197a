"""Split-K scratch memory without a GPU: the driver calls of ``device.scratch_tensor`` (against
a recording stand-in for ``cuda.bindings.driver``) and the GEMM's per-stream buffers."""

import types

import pytest
import torch

from kbit_cute import device as kdev
from kbit_cute import gemm_dispatch


class FakeDriver(types.SimpleNamespace):
    """Records the driver calls scratch_tensor makes; ``fail`` names a call that errors."""

    def __init__(self, fail=None):
        ok = "SUCCESS"
        super().__init__(
            calls=[],
            fail=fail,
            CUresult=types.SimpleNamespace(CUDA_SUCCESS=ok),
            CUstreamCaptureMode=types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED="relaxed"),
            CUstream_flags=types.SimpleNamespace(CU_STREAM_NON_BLOCKING="nonblocking"),
        )
        mode = ["global"]

        def call(name, *result):
            def f(*args):
                self.calls.append((name, *args))
                if name == self.fail:
                    return ("ERROR",)
                if name == "cuThreadExchangeStreamCaptureMode":
                    old, mode[0] = mode[0], args[0]
                    return (ok, old)
                return (ok, *result)

            return f

        for name, result in {
            "cuInit": (),
            "cuDeviceGet": ("dev",),
            "cuDevicePrimaryCtxRetain": ("ctx",),
            "cuThreadExchangeStreamCaptureMode": (),
            "cuCtxPushCurrent": (),
            "cuCtxPopCurrent": ("ctx",),
            "cuMemAlloc": (0x7000,),
            "cuStreamCreate": ("side",),
            "cuMemsetD8Async": (),
            "cuStreamSynchronize": (),
        }.items():
            setattr(self, name, call(name, *result))
        self.cuGetErrorString = lambda err: ("SUCCESS", b"fake failure")
        self.mode = mode


@pytest.fixture
def driver(monkeypatch):
    import cuda.bindings

    fake = FakeDriver()
    monkeypatch.setattr(cuda.bindings, "driver", fake)
    monkeypatch.setattr(kdev, "_allocations", [])
    monkeypatch.setattr(kdev, "_side_streams", {})
    kdev._primary_context.cache_clear()
    wrapped = []

    def as_tensor(obj, device):
        wrapped.append((obj.__cuda_array_interface__, device))
        fake.calls.append(("as_tensor",))
        cai = obj.__cuda_array_interface__
        dtype = {"<f4": torch.float32, "<i4": torch.int32}[cai["typestr"]]
        return types.SimpleNamespace(
            data_ptr=lambda: cai["data"][0], dtype=dtype, get_device=lambda: int(device[5:])
        )

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    fake.wrapped = wrapped
    yield fake
    kdev._primary_context.cache_clear()


def names(calls):
    return [c[0] for c in calls]


def test_zeroed_scratch_is_cleared_and_waited_for_in_relaxed_capture_mode(driver):
    t = kdev.scratch_tensor(3, 1000, torch.int32, fill_byte=0)
    assert t.data_ptr() == 0x7000 and t.get_device() == 3
    calls = names(driver.calls)
    start = calls.index("cuThreadExchangeStreamCaptureMode")
    assert calls[start:] == [
        "cuThreadExchangeStreamCaptureMode",  # relaxed: allowed while a stream captures
        "cuCtxPushCurrent",  # the device's primary context, whatever is current
        "cuMemAlloc",
        "cuStreamCreate",  # a private non-blocking stream: nothing enters a captured graph
        "cuMemsetD8Async",
        "cuStreamSynchronize",  # zero before the caller's next launch on any stream
        "as_tensor",
        "cuCtxPopCurrent",
        "cuThreadExchangeStreamCaptureMode",
    ]
    assert driver.calls[start][1] == "relaxed" and driver.mode[0] == "global"  # restored
    assert ("cuMemAlloc", 4000) in driver.calls
    assert ("cuMemsetD8Async", 0x7000, 0, 4000, "side") in driver.calls
    cai, device = driver.wrapped[0]
    assert device == "cuda:3" and cai["shape"] == (1000,) and "stream" not in cai
    assert kdev._allocations == [(3, 0x7000)]


def test_plain_scratch_skips_the_memset_and_reuses_the_context(driver):
    kdev.scratch_tensor(0, 16, torch.float32)
    kdev.scratch_tensor(0, 16, torch.float32)
    calls = names(driver.calls)
    assert calls.count("cuDevicePrimaryCtxRetain") == 1
    assert "cuMemsetD8Async" not in calls and calls.count("cuMemAlloc") == 2


def test_a_driver_error_restores_the_capture_mode_and_context(driver):
    driver.fail = "cuMemAlloc"
    with pytest.raises(RuntimeError, match="CUDA driver error.*fake failure"):
        kdev.scratch_tensor(0, 16, torch.float32)
    assert names(driver.calls)[-2:] == ["cuCtxPopCurrent", "cuThreadExchangeStreamCaptureMode"]
    assert driver.mode[0] == "global" and kdev._allocations == []


def test_gemm_buffers_grow_by_powers_of_two_and_zero_what_the_kernel_keeps_zero(monkeypatch):
    made = []

    def scratch(index, n, dtype, fill_byte=None):
        made.append((n, dtype, fill_byte))
        return torch.zeros(n, dtype=dtype)

    monkeypatch.setattr(kdev, "scratch_tensor", scratch)
    bufs = gemm_dispatch._SplitKBuffers(0)
    ws, cnt = bufs.get(5000, 10, atomic=False)
    assert made == [(8192, torch.float32, None), (4096, torch.int32, 0)]
    assert bufs.get(8192, 4096, atomic=False) == (ws, cnt)  # big enough: nothing new
    sums, _ = bufs.get(70_000, 10, atomic=True)
    assert made[-1] == (1 << 17, torch.float32, 0) and sums is not ws  # zeroed sums
    assert bufs.get(1, 1, atomic=False)[0] is ws  # partials and sums are separate
    bufs.get(1, 5000, atomic=False)
    assert made[-1] == (8192, torch.int32, 0)
