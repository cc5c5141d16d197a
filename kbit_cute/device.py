"""The CUDA driver (``cuda.bindings``): GPU properties queried once per device, and the
split-K scratch memory the kernels keep outside torch's caching allocator.

The kernels' heuristics need the SM count, L2 size and shared-memory limits, and
every entry point needs the compute capability check; asking the driver once
and caching keeps both off the hot path. Device indices are CUDA ordinals, the
same numbering torch uses (both honour ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import atexit
import functools
import threading
from dataclasses import dataclass

MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DeviceProps:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    smem_per_block_optin: int  # the most dynamic shared memory one CTA may opt in to
    smem_per_sm: int
    memory_gbs: float = 0.0  # peak DRAM bandwidth, GB/s (0: unknown)

    @property
    def arch(self) -> str:
        return arch_name(self.capability)


def arch_name(capability: tuple[int, int]) -> str:
    """The DSL's target name: sm_80, sm_86, sm_89; sm_90a, sm_100a ... (arch-specific
    features from 9.0 on, the same rule the DSL applies when it detects a GPU)."""
    major, minor = capability
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _check(result):
    """cuda.bindings calls return (error, *values): raise on error, return the values."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {err}: {msg.decode() if msg else ''}")
    return values[0] if len(values) == 1 else values


@functools.cache
def driver_version() -> tuple[int, int]:
    """The CUDA driver's version, e.g. (13, 0)."""
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    v = _check(driver.cuDriverGetVersion())
    return v // 1000, (v % 1000) // 10


@functools.cache
def device_props(index: int) -> DeviceProps:
    """Properties of CUDA device ``index``, from the driver, cached for the process."""
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    dev = _check(driver.cuDeviceGet(index))
    attr = driver.CUdevice_attribute

    def get(a) -> int:
        return int(_check(driver.cuDeviceGetAttribute(a, dev)))

    name = _check(driver.cuDeviceGetName(256, dev))
    # double data rate: 2 transfers per memory clock (kHz) over the bus (bits); a driver that
    # no longer reports the clock (deprecated in CUDA 13's runtime) leaves it unknown (0), which
    # only costs the fast-memory plans (``ops.has_fast_memory``), never the device itself
    try:
        memory_khz = get(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
        bus_bits = get(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
    except RuntimeError:
        memory_khz = bus_bits = 0
    return DeviceProps(
        index=index,
        name=name.split(b"\0", 1)[0].decode(),
        capability=(
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        smem_per_block_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        smem_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        memory_gbs=2 * memory_khz * 1e3 * bus_bits / 8 / 1e9,
    )


def check_capability(props: DeviceProps) -> None:
    """Kernels need sm_80+: say so instead of failing inside the driver."""
    if props.capability < MIN_CAPABILITY:
        major, minor = props.capability
        raise RuntimeError(
            f"kbit_cute kernels need compute capability >= 8.0; this GPU is {major}.{minor} "
            f"({props.name}). Use an Ampere or newer GPU, or run on CPU tensors "
            "(dequantize + matmul)."
        )


_checked: set[int] = set()


def check_device(index: int) -> DeviceProps:
    """``device_props`` plus the capability check (once per device)."""
    props = device_props(index)
    if index not in _checked:
        check_capability(props)
        _checked.add(index)
    return props


# ----------------------------------------------------------------------------- scratch memory
# Split-K workspaces and counters are allocated on the first call for a (device, stream),
# which under torch.compile(mode="reduce-overhead") runs inside inductor's CUDA-graph pool
# (memory there must be a graph output) and under torch.cuda.graph inside the capture. Memory
# from cuMemAlloc belongs to no torch pool, and it is never freed while the process runs, so
# a captured graph that points at an outgrown buffer stays valid.

_CAI_TYPES = {"float32": "<f4", "int32": "<i4", "uint8": "|u1"}
_allocations: list[tuple[int, int]] = []  # (device, pointer), freed at exit
_side_streams: dict[int, object] = {}
_alloc_lock = threading.Lock()


class _DriverArray:
    """``__cuda_array_interface__`` of a driver allocation, for ``torch.as_tensor``. No
    stream key: torch then synchronizes nothing."""

    def __init__(self, ptr: int, numel: int, typestr: str):
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 2,
        }


@functools.cache
def _primary_context(index: int):
    """The device's primary context: the one torch's runtime calls use."""
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    return _check(driver.cuDevicePrimaryCtxRetain(_check(driver.cuDeviceGet(index))))


def scratch_tensor(index: int, numel: int, dtype, fill_byte: int | None = None):
    """A 1-D CUDA tensor of ``numel`` elements on device ``index`` in memory from
    ``cuMemAlloc`` (not torch's caching allocator), kept until the process exits.

    Safe to call while a stream is being captured into a CUDA graph: the thread's capture
    mode is relaxed for the allocation (what torch's own allocator does), and
    ``fill_byte`` (0: zeros; 0xFF: split-K slots left empty) sets every byte on a private
    stream and waits for it, so nothing enters the graph and the memory is set before the
    caller's next launch on any stream.
    """
    import torch
    from cuda.bindings import driver

    typestr = _CAI_TYPES[str(dtype).removeprefix("torch.")]
    nbytes = max(numel, 1) * dtype.itemsize
    with _alloc_lock:
        ctx = _primary_context(index)
        relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        mode = _check(driver.cuThreadExchangeStreamCaptureMode(relaxed))
        _check(driver.cuCtxPushCurrent(ctx))
        try:
            ptr = int(_check(driver.cuMemAlloc(nbytes)))
            _allocations.append((index, ptr))
            if fill_byte is not None:
                stream = _side_streams.get(index)
                if stream is None:
                    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
                    stream = _side_streams[index] = _check(driver.cuStreamCreate(flags))
                _check(driver.cuMemsetD8Async(ptr, fill_byte, nbytes, stream))
                _check(driver.cuStreamSynchronize(stream))
            # Inside the relaxed window: torch asks the driver which device owns the pointer.
            t = torch.as_tensor(_DriverArray(ptr, numel, typestr), device=f"cuda:{index}")
        finally:
            _check(driver.cuCtxPopCurrent())
            driver.cuThreadExchangeStreamCaptureMode(mode)
    if t.data_ptr() != ptr or t.dtype != dtype or t.get_device() != index:
        raise RuntimeError(f"kbit_cute: torch did not wrap the scratch memory at {ptr:#x} as is")
    return t


@atexit.register
def _free_scratch() -> None:
    """Best effort: the driver releases everything at process exit anyway."""
    try:
        from cuda.bindings import driver

        for index in sorted({i for i, _ in _allocations}):
            _check(driver.cuCtxPushCurrent(_primary_context(index)))
            driver.cuCtxSynchronize()  # no kernel may still use the memory
            for i, ptr in _allocations:
                if i == index:
                    driver.cuMemFree(ptr)
            driver.cuCtxPopCurrent()
        _allocations.clear()
    except Exception:
        pass
