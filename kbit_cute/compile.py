"""Compile each kernel variant once, load it everywhere: specs, the launcher, the JIT cache.

Kernels take raw pointers, Int32 sizes and a stream, so one compile serves every
shape. Compile arguments are fake pointers (address 0, the alignment the kernel
may assume) and placeholder ints; no GPU is needed to compile.

``launcher(spec)`` is the one entry point the ops use::

    fn = launcher(gemv_spec(4, 1, "f16"))  # compiled once per machine, cached
    fn(A, packed, absmax, codebook, scale, bias, out, ws, counters, M, N, K, splits, has_bias)

Arguments follow the kernel's ``@cute.jit __call__`` without its trailing
stream: a torch CUDA tensor for each ``cute.Pointer``, a python int for each
``Int32``. The launch goes to torch's current stream of the first tensor's
device. The launcher checks that every pointer honours the alignment its
``fake_ptr`` promised the compiler (``MisalignedError``, a ValueError, otherwise) and that the first
tensor is on a CUDA device; the caller guarantees dtypes, extents and that all
tensors share that device (``KBIT_CUTE_CHECK_LAUNCH=1`` checks dtypes and
devices too, for debugging). ``stream_launcher(spec)`` is the same launch for hot
paths that already hold the stream: ``fn(*args, stream)``, device made current by
the caller.

Host path: variants are compiled with TVM-FFI (``--enable-tvm-ffi``), exported
to an object file and loaded back as a ``tvm_ffi.Function``; a call is a few
``data_ptr()`` reads and one FFI call (about 1 us of Python), where the DSL's
generic call path costs ~80 us. The same object file is the disk cache entry:

* directory: ``$KBIT_CUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kbit_cute``, else
  ``~/.cache/kbit_cute``; unwritable -> memory only (one warning);
* key: sha256 of the target arch, the source of the kernel's module and every
  ``kbit_cute`` module it imports, the DSL and tvm-ffi versions, the compile
  options and the variant name (which encodes its config); never an address;
* writes go to a temporary file in the same directory, then ``os.replace``:
  readers never see a partial file, concurrent writers of one key are harmless.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch
from cutlass.base_dsl.enums import AddressSpace
from cutlass.cute.runtime import make_fake_stream, make_ptr

from .device import arch_name, check_capability, device_props

log = logging.getLogger("kbit_cute")

# tvm_ffi, on import, JIT-builds a torch C++ extension for fast DLPack exchange when torch
# lacks the native one (torch < 2.10): a compiler run in every process that cannot cache it.
# Our kernels take raw pointers, never DLPack tensors, so that extension buys nothing here.
if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__") and not hasattr(
    torch.Tensor, "__c_dlpack_exchange_api__"
):
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

CACHE_ENV = "KBIT_CUTE_CACHE_DIR"
CHECK_ENV = "KBIT_CUTE_CHECK_LAUNCH"
# Bump when the way entries are built or loaded changes: old entries are then ignored.
CACHE_FORMAT = 1
COMPILE_OPTIONS = "--enable-tvm-ffi"

TORCH_TO_CUTLASS = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.uint8: cutlass.Uint8,
}
_CUTLASS_TO_TORCH = {v: k for k, v in TORCH_TO_CUTLASS.items()}


def _no_cuda(*_):
    raise RuntimeError("this torch build has no CUDA support")


# torch's own C entry points for the current device and stream (what inductor's generated
# code calls): a fraction of torch.cuda.current_stream()'s cost. Absent from CPU-only builds,
# where no tensor is on a CUDA device: -2 matches no tensor's get_device() (CPU gives -1).
current_device = getattr(torch._C, "_cuda_getDevice", lambda: -2)
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: a name, how to build it, and what its SASS must contain.

    ``build()`` returns (jit callable, compile arguments); ``expect`` lists SASS
    instruction classes (e.g. "SHFL", "LDG.E.128") that ``kbit_cute.inspect``
    requires, so a refactor that loses vector loads or shuffles fails CI. The
    name must encode the whole compile-time config: it keys both caches.
    """

    name: str
    build: Callable[[], tuple[Callable, tuple]]
    expect: tuple[str, ...]


def fake_ptr(dtype: type[cutlass.Numeric], align: int = 16):
    """A compile-time pointer argument; ``align`` (bytes) is what the kernel may assume."""
    return make_ptr(dtype, 0, AddressSpace.gmem, assumed_align=align)


def fake_stream():
    """The stream argument. Explicit, not TVM-FFI's env stream: that is read from a tensor
    argument, and the kernels take raw pointers only."""
    return make_fake_stream()


# ----------------------------------------------------------------------------- target


_arch: str | None = None


def target_arch() -> str:
    """The arch this process compiles for: ``CUTE_DSL_ARCH`` if set (compile-only machines),
    else that of the current CUDA device (which must be sm_80 or newer)."""
    global _arch
    if _arch is None:
        env = os.environ.get("CUTE_DSL_ARCH")
        if env:
            _arch = env
        else:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "no CUDA GPU: set CUTE_DSL_ARCH (e.g. sm_90a) to compile kernels without one"
                )
            props = device_props(torch.cuda.current_device())
            check_capability(props)
            _arch = arch_name(props.capability)
    return _arch


# ----------------------------------------------------------------------------- fingerprint


def _imported_kbit_modules(name: str) -> set[str]:
    """``kbit_cute`` modules that module ``name`` imports (from its source, not by importing)."""
    origin = importlib.util.find_spec(name).origin
    tree = ast.parse(Path(origin).read_text(), origin)
    package = name if origin.endswith("__init__.py") else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases, names = [a.name for a in node.names], []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1])
                bases = [f"{root}.{node.module}" if node.module else root]
            else:
                bases = [node.module or ""]
            names = [a.name for a in node.names]
        else:
            continue
        for base in bases:
            if base != "kbit_cute" and not base.startswith("kbit_cute."):
                continue
            for cand in [base, *(f"{base}.{n}" for n in names)]:
                try:
                    spec = importlib.util.find_spec(cand)
                except (ImportError, ValueError):
                    spec = None
                if spec is not None and spec.origin and spec.origin.endswith(".py"):
                    found.add(cand)
    found.discard("kbit_cute")  # the package __init__ holds no kernel code
    return found


_source_digests: dict[str, str] = {}


def source_digest(module: str) -> str:
    """sha256 of the source of ``module`` and of every ``kbit_cute`` module it imports,
    transitively: any edit to a kernel or to what it is built from changes the key."""
    digest = _source_digests.get(module)
    if digest is None:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(_imported_kbit_modules(m) - seen)
        h = hashlib.sha256()
        for m in sorted(seen):
            h.update(m.encode() + b"\0" + Path(importlib.util.find_spec(m).origin).read_bytes())
        digest = _source_digests[module] = h.hexdigest()
    return digest


def _versions() -> str:
    out = []
    for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi"):
        try:
            out.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist}=?")
    return ",".join(out)


_versions_str: str | None = None


def fingerprint(spec: KernelSpec, arch: str) -> str:
    """The disk cache key of a variant: stable across processes and machines."""
    global _versions_str
    if _versions_str is None:
        _versions_str = _versions()
    module = getattr(spec.build, "__module__", None) or "kbit_cute.kernels"
    parts = [
        f"format={CACHE_FORMAT}",
        f"name={spec.name}",
        f"arch={arch}",
        f"options={COMPILE_OPTIONS}",
        _versions_str,
        f"source={source_digest(module)}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# ----------------------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    """Where compiled variants are kept (see the module docstring)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kbit_cute"


def entry_path(spec: KernelSpec, arch: str) -> Path:
    return cache_dir() / f"{spec.name}-{arch}-{fingerprint(spec, arch)[:20]}.o"


def _symbol(spec: KernelSpec) -> str:
    """The exported function's name: unique per variant, a C identifier."""
    return "kbit_" + "".join(c if c.isalnum() else "_" for c in spec.name)


def compile_variant(spec: KernelSpec, arch: str, path: Path | None = None):
    """Compile ``spec`` for ``arch``; with ``path``, also write its object file there."""
    jit_fn, args = spec.build()
    compiled = cute.compile(jit_fn, *args, options=f"--gpu-arch {arch} {COMPILE_OPTIONS}")
    if path is not None:
        export_variant(spec, compiled, path)
    return compiled


def export_variant(spec: KernelSpec, compiled, path: Path) -> None:
    """Write a compiled variant's object file to ``path`` atomically (temporary + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The export picks the format from the suffix: the temporary name must end in ".o".
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp.o")
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; entries are plain build outputs
        compiled.export_to_c(tmp, function_name=_symbol(spec))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_variant(spec: KernelSpec, path: Path):
    """The ``tvm_ffi.Function`` of a compiled variant's object file."""
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, _symbol(spec))


stats = {"compiled": 0, "disk_hits": 0, "compile_s": 0.0, "load_s": 0.0}
_warned_unwritable = False


def ffi_function(spec: KernelSpec, arch: str | None = None):
    """Load ``spec`` from the disk cache, compiling it into the cache first if missing."""
    global _warned_unwritable
    arch = arch or target_arch()
    path = entry_path(spec, arch)
    if path.is_file():
        t0 = time.perf_counter()
        try:
            fn = load_variant(spec, path)
            stats["disk_hits"] += 1
            stats["load_s"] += time.perf_counter() - t0
            return fn
        except Exception as e:  # a foreign or damaged file: rebuild it
            log.warning("kbit_cute: ignoring unloadable cache entry %s (%s)", path, e)
    t0 = time.perf_counter()
    compiled = compile_variant(spec, arch)
    stats["compiled"] += 1
    stats["compile_s"] += time.perf_counter() - t0
    log.info("kbit_cute: compiled %s for %s in %.2fs", spec.name, arch, time.perf_counter() - t0)
    try:
        export_variant(spec, compiled, path)
    except OSError as e:
        if not _warned_unwritable:
            log.warning("kbit_cute: cache dir %s unusable (%s); caching in memory", path.parent, e)
            _warned_unwritable = True
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / path.name
            export_variant(spec, compiled, path)
            return load_variant(spec, path)  # the object is read into memory: tmp may go
    return load_variant(spec, path)


# ----------------------------------------------------------------------------- launcher


_FAKE_STREAM = type(make_fake_stream())


@dataclass(frozen=True)
class _Param:
    name: str
    kind: str  # "ptr", "int" or "stream"
    align: int = 0
    dtype: torch.dtype | None = None


def kernel_params(spec: KernelSpec) -> list[_Param]:
    """The kernel's call parameters, from its signature and its compile arguments."""
    jit_fn, args = spec.build()
    try:
        names = list(inspect.signature(jit_fn).parameters)
    except (TypeError, ValueError):
        names = []
    if len(names) != len(args):
        names = [f"arg{i}" for i in range(len(args))]
    params = []
    for name, arg in zip(names, args, strict=True):
        if isinstance(arg, cute.Pointer):
            dt = _CUTLASS_TO_TORCH.get(arg.dtype)
            # The runtime pointer has no public accessor for the alignment it was made with.
            params.append(_Param(name, "ptr", int(arg._assumed_align or 1), dt))
        elif isinstance(arg, _FAKE_STREAM):
            params.append(_Param(name, "stream"))
        else:
            params.append(_Param(name, "int"))
    if not params or params[-1].kind != "stream" or any(p.kind == "stream" for p in params[:-1]):
        raise TypeError(f"{spec.name}: the kernel's last (only last) parameter must be a stream")
    if params[0].kind != "ptr":
        raise TypeError(f"{spec.name}: the kernel's first parameter must be a pointer")
    return params[:-1]


class MisalignedError(ValueError):
    """A tensor's data_ptr breaks the alignment its kernel was compiled to assume (raised
    before anything is launched, so the caller may copy the tensor and call again)."""


def _misaligned(name: str, params: list[_Param], ptrs: tuple[int, ...]) -> None:
    pointer_params = [p for p in params if p.kind == "ptr"]
    for p, addr in zip(pointer_params, ptrs, strict=True):
        if addr % p.align:
            raise MisalignedError(
                f"{name}: argument '{p.name}' must be {p.align}-byte aligned, its data_ptr is "
                f"{addr:#x} (pass a fresh or .contiguous() tensor)"
            )


def _check_args(name: str, params: list[_Param], args: tuple) -> None:
    """Debug checks (``KBIT_CUTE_CHECK_LAUNCH=1``): types, dtypes and one device."""
    if len(args) != len(params):
        raise TypeError(f"{name} takes {len(params)} arguments, got {len(args)}")
    device = None
    for p, a in zip(params, args, strict=True):
        if p.kind == "ptr":
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{name}: '{p.name}' must be a torch.Tensor, got {type(a)}")
            if p.dtype is not None and a.dtype != p.dtype:
                raise TypeError(f"{name}: '{p.name}' must be {p.dtype}, got {a.dtype}")
            if device is None:
                device = a.device
            elif a.device != device:
                raise ValueError(f"{name}: '{p.name}' is on {a.device}, expected {device}")
        elif not isinstance(a, int):
            raise TypeError(f"{name}: '{p.name}' must be an int, got {type(a)}")


def _wrong_device(name: str, dev: int, call: Callable, args: tuple):
    """Slow path: the tensors are on a CUDA device other than the current one (or none)."""
    if dev < 0:
        raise ValueError(f"{name}: tensors must be on a CUDA device, got a CPU tensor")
    with torch.cuda.device(dev):
        return call(*args)


def make_launch(
    name: str,
    params: list[_Param],
    ffi_fn: Callable,
    current_device: Callable[[], int] | None = None,
    raw_stream: Callable[[int], int] | None = None,
    check: bool = False,
    stream_arg: bool = False,
) -> Callable[..., None]:
    """A python function ``name(*args)`` that launches ``ffi_fn`` on the current stream.

    Generated source, one line per argument, because it runs on every kernel
    call: a loop over a parameter table costs several microseconds more.
    ``current_device`` / ``raw_stream`` default to torch's; tests pass stubs.

    ``stream_arg``: the function takes the raw stream as one more, last argument and
    skips the device check: for a caller that has already read the stream (for its
    split-K scratch, say) and made the tensors' device the current one.
    """
    xs = [f"x{i}" for i in range(len(params))]
    ptr_idx = [i for i, p in enumerate(params) if p.kind == "ptr"]
    body = [f"    a{i} = x{i}.data_ptr()" for i in ptr_idx]
    aligned = [f"(a{i} & {params[i].align - 1})" for i in ptr_idx if params[i].align > 1]
    if aligned:
        body.append(f"    if {' | '.join(aligned)}:")
        ptrs = ", ".join(f"a{i}" for i in ptr_idx)
        body.append(f"        _misaligned(_name, _params, ({ptrs},))")
    call = [f"a{i}" if p.kind == "ptr" else f"x{i}" for i, p in enumerate(params)]
    if stream_arg:
        xs.append("stream")
        body.append(f"    _ffi({', '.join(call)}, stream)")
    else:
        body.append(f"    dev = x{ptr_idx[0]}.get_device()")
        body.append("    if dev != _current_device():")
        body.append(f"        return _wrong_device(_name, dev, _self, ({', '.join(xs)},))")
        body.append(f"    _ffi({', '.join(call)}, _raw_stream(dev))")
    src = f"def launch({', '.join(xs)}):\n" + "\n".join(body) + "\n"
    scope = {
        "_name": name,
        "_params": params,
        "_ffi": ffi_fn,
        "_misaligned": _misaligned,
        "_wrong_device": _wrong_device,
        "_current_device": current_device or globals()["current_device"],
        "_raw_stream": raw_stream or current_raw_stream,
    }
    exec(compile(src, f"<kbit_cute launcher {name}>", "exec"), scope)
    fast = scope["launch"]
    fast.__name__ = fast.__qualname__ = name
    where = "on the given stream" if stream_arg else "on the current stream"
    fast.__doc__ = f"Launch {name}({', '.join(p.name for p in params)}) {where}."
    scope["_self"] = fast
    if not check:
        return fast
    device_now = scope["_current_device"]

    def checked(*args):
        _check_args(name, params, args[:-1] if stream_arg else args)
        if stream_arg and (dev := args[ptr_idx[0]].get_device()) != device_now():
            raise ValueError(f"{name}: the tensors are on device {dev}, not the current one")
        return fast(*args)

    scope["_self"] = checked
    checked.__name__ = name
    return checked


_launchers: dict[str, Callable[..., None]] = {}
_stream_launchers: dict[str, Callable[..., None]] = {}
_loaded: dict[str, tuple[list[_Param], Callable]] = {}  # name -> (params, tvm_ffi.Function)
_lock = threading.Lock()


def _load(spec: KernelSpec) -> tuple[list[_Param], Callable]:
    got = _loaded.get(spec.name)
    if got is None:
        got = _loaded[spec.name] = (kernel_params(spec), ffi_function(spec))
    return got


def launcher(spec: KernelSpec) -> Callable[..., None]:
    """The launch function of a variant: compiled once per machine (disk cache), loaded
    once per process (memory cache). See the module docstring for the calling contract."""
    fn = _launchers.get(spec.name)
    if fn is None:
        with _lock:
            fn = _launchers.get(spec.name)
            if fn is None:
                params, ffi = _load(spec)
                check = os.environ.get(CHECK_ENV, "") not in ("", "0")
                fn = _launchers[spec.name] = make_launch(spec.name, params, ffi, check=check)
    return fn


def stream_launcher(spec: KernelSpec) -> Callable[..., None]:
    """``launcher(spec)`` for hot paths that already hold the raw stream: call it as
    ``fn(*args, stream)`` with the tensors' device current (``make_launch(stream_arg=True)``;
    ``KBIT_CUTE_CHECK_LAUNCH=1`` checks the device). Shares the loaded variant."""
    fn = _stream_launchers.get(spec.name)
    if fn is None:
        with _lock:
            fn = _stream_launchers.get(spec.name)
            if fn is None:
                params, ffi = _load(spec)
                check = os.environ.get(CHECK_ENV, "") not in ("", "0")
                fn = make_launch(spec.name, params, ffi, check=check, stream_arg=True)
                _stream_launchers[spec.name] = fn
    return fn
