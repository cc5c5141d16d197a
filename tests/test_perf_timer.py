"""The CUDA timer's control flow (warm-up, eager passes, graph sequence, the capture-failure
path) with torch.cuda's events/graphs replaced by host fakes, so it runs without a GPU.
The real timing semantics are exercised on the H100; this catches logic and API slips."""

import time
import types

import pytest
import torch

from perf import common


class FakeEvent:
    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # ms, as torch reports it


class FakeCuda:
    """Capture runs the callables once and remembers them; replay runs them again."""

    def __init__(self):
        self.capturing = False
        self.replays = 0

    def install(self, monkeypatch):
        fake = self

        class Graph:
            def __init__(self):
                self.fns = []

            def replay(self):
                fake.replays += 1

        class GraphCtx:
            def __init__(self, graph):
                self.graph = graph

            def __enter__(self):
                fake.capturing = True

            def __exit__(self, *exc):
                fake.capturing = False
                return False

        props = types.SimpleNamespace(L2_cache_size=50 * 2**20, multi_processor_count=132)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", GraphCtx)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
        return self


def test_time_calls_structure(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    timer = common.CudaTimer(repeats=7, eager_repeats=5)
    assert timer.l2_bytes == 50 * 2**20
    counts = [0, 0, 0]
    captured = [0, 0, 0]

    def make(i):
        def fn():
            counts[i] += 1
            captured[i] += fake.capturing

        return fn

    t = timer.time_calls([make(i) for i in range(3)])
    assert t.error is None and t.graph_us is not None and t.eager_us > 0 and t.warm_s >= 0
    assert t.calls == common.CALLS_PER_GRAPH  # cheap calls: 20 per graph, rotating
    assert sum(captured) == t.calls and max(captured) - min(captured) <= 1
    assert all(c >= 1 + 5 for c in (n - cap for n, cap in zip(counts, captured, strict=True)))
    assert fake.replays == 1 + 7


def test_capture_failure_is_reported_with_the_eager_time(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    timer = common.CudaTimer(repeats=7)

    def fn():
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")

    t = timer.time_calls([fn, fn])
    assert t.graph_us is None and t.eager_us > 0
    assert t.error.startswith("graph: RuntimeError: operation not permitted")


def test_eager_passes_rotate_over_all_copies(monkeypatch):
    FakeCuda().install(monkeypatch)
    seen = []
    fns = [lambda i=i: seen.append(i) for i in range(7)]
    common.cuda_loop_us(fns, repeats=3, max_calls=3)
    assert seen == [0, 1, 2, 3, 4, 5, 6, 0, 1]  # passes continue where the last one stopped


def test_method_minimum_repeats(monkeypatch):
    FakeCuda().install(monkeypatch)
    with pytest.raises(ValueError, match=">= 7"):
        common.CudaTimer(repeats=5)


def test_graph_time_us_covers_every_copy(monkeypatch):
    """bench_gemv's helper: one graph holds >= n_copies calls (L2-cold for small weights)."""
    fake = FakeCuda().install(monkeypatch)
    used = set()

    def make_call(i):
        return lambda: used.add(i) if fake.capturing else None

    common.graph_time_us(make_call, 57)
    assert used == set(range(57))
