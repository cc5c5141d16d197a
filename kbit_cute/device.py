"""GPU properties from the CUDA driver (``cuda.bindings``), queried once per device.

The kernels' heuristics need the SM count, L2 size and shared-memory limits, and
every entry point needs the compute capability check; asking the driver once
and caching keeps both off the hot path. Device indices are CUDA ordinals, the
same numbering torch uses (both honour ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import functools
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
