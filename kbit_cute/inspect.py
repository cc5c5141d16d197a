"""Compile-only kernel report: ``python -m kbit_cute.inspect --arch sm_90a``.

Compiles every registered kernel variant without a GPU, disassembles its
cubin with ``nvdisasm`` and prints, per variant: registers, static shared
memory, stack frame, spill instructions (LDL/STL) and counts of the SASS
classes that tell whether a kernel is on its fast path (LDG.E.128, LDGSTS,
LDSM, HMMA, SHFL, STG.E.128). Exits 1 when a variant spills or lacks a class
it declares in its ``KernelSpec.expect``; CI runs it for sm_90a and sm_80.

It also counts the SASS of one iteration of the kernel's innermost loop that
issues tensor-core instructions (``loop_mix``: the K loop of the GEMV and the
GEMM mainloop), by the pipe each instruction occupies. The dequantizing kernels
are bound by the issue slots, the integer ALU pipe (half rate) and the
shared-memory pipe (perf/NOTES.md, session 18), so these counts predict a
change's effect before any GPU time: ``loop`` and ``loop_alu`` in the table,
the whole mix with ``--loops``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from tabulate import tabulate

COUNTED = ("LDG.E.128", "LDGSTS", "LDSM", "HMMA", "HGMMA", "SHFL", "STG.E.128")
SPILL_OPS = ("LDL", "STL")
# .nv.info attribute codes (CUDA ELF), each (symbol, value) per function.
_EIATTR_FRAME_SIZE, _EIATTR_MAX_STACK_SIZE, _EIATTR_REGCOUNT = 0x11, 0x23, 0x2F


def find_nvdisasm() -> str:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH / CUDA_HOME."""
    try:
        import nvidia.cu13 as cu13  # the wheel's namespace package

        for root in cu13.__path__:
            cand = os.path.join(root, "bin", "nvdisasm")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    cand = shutil.which("nvdisasm") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm"
    )
    if not os.path.exists(cand):
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return cand


def _elf_sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (offset, size, sh_info) of every section of a 64-bit ELF."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = heads[shstrndx][4]

    def name(off: int) -> str:
        return data[str_off + off : data.index(b"\0", str_off + off)].decode()

    return {name(h[0]): (h[4], h[5], h[7]) for h in heads}


def cubin_resources(data: bytes) -> dict[str, int]:
    """Registers, static shared memory and stack bytes of the (single) kernel in a cubin."""
    sections = _elf_sections(data)
    regs = 0
    smem = sum(size for n, (_, size, _) in sections.items() if n.startswith(".nv.shared."))
    stack = 0
    for n, (off, size, _) in sections.items():
        if n != ".nv.info":
            continue
        pos = off
        while pos + 4 <= off + size:  # records: format byte, attribute byte, payload
            fmt, attr = data[pos], data[pos + 1]
            if fmt == 0x04:  # sized value: u16 length + payload
                length = struct.unpack_from("<H", data, pos + 2)[0]
                value = struct.unpack_from("<I", data, pos + 8)[0] if length >= 8 else 0
                if attr in (_EIATTR_FRAME_SIZE, _EIATTR_MAX_STACK_SIZE):
                    stack = max(stack, value)
                elif attr == _EIATTR_REGCOUNT:
                    regs = max(regs, value)
                pos += 4 + length
            else:
                pos += 4 if fmt in (0x02, 0x03) else 2
    return {"regs": regs, "smem": smem, "stack": stack}


# One SASS instruction line: address comment, optional predicate, opcode (group 1), operands.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$", re.M)


def sass_counts(sass: str) -> dict[str, int]:
    ops = [m.group(1) for m in _INSTRUCTION.finditer(sass)]
    base = [op.split(".")[0] for op in ops]
    classes = ("LDGSTS", "LDSM", "HMMA", "HGMMA", "SHFL")
    counts = {c: sum(1 for b in base if b == c) for c in classes}
    wide = [b for b, op in zip(base, ops, strict=True) if ".128" in op]
    counts["LDG.E.128"] = wide.count("LDG")
    counts["STG.E.128"] = wide.count("STG")
    counts["spill_ops"] = sum(1 for b in base if b in SPILL_OPS)
    return counts


# The pipe a SASS instruction occupies (Hopper/Ampere): the integer ALU pipe issues a warp
# instruction every 2 cycles per scheduler, the FMA pipe every cycle (IMAD: 2), the
# shared-memory (MIO) pipe serves about one wavefront per SM cycle.
_ALU = {"LOP3", "PRMT", "SHF", "LEA", "IADD3", "ISETP", "SEL", "VIADD", "VIMNMX", "VIADDMNMX",
        "IMNMX", "MOV", "BMSK", "SGXT", "FLO", "POPC", "PLOP3", "P2R", "R2P", "IABS"}  # fmt: skip
_FMA = {"IMAD", "HMUL2", "HFMA2", "HADD2", "FFMA", "FMUL", "FADD", "HMNMX2", "FMNMX"}
_MIO = {"LDS", "STS", "LDSM", "SHFL", "LDGSTS", "LDC", "ATOMS"}
_MMA = {"HMMA", "HGMMA"}
_LABEL = re.compile(r"^(\.L_x_\d+):")


def loop_mix(sass: str) -> dict[str, int]:
    """Instructions of one iteration of the innermost loop that holds HMMA/HGMMA, by pipe:
    {"loop", "alu", "fma", "mio", "mma", "uniform", "other"}; all zero if no loop issues
    tensor-core instructions. The loop is the natural loop of a branch back to a label: every
    block that reaches the branch without passing the label, so blocks that ptxas placed
    outside the label..branch range (e.g. a ring refill it moved above the loop) count too,
    and a block that a forward branch may skip counts as taken."""
    blocks = _basic_blocks(sass)
    loops = []
    for tail, block in enumerate(blocks):
        for head in block["succ"]:
            if head <= tail:  # a back edge: the loop is what reaches ``tail`` avoiding ``head``
                body, todo = {head, tail}, [tail]
                while todo:
                    b = todo.pop()
                    for pred in blocks[b]["pred"]:
                        if pred not in body:
                            body.add(pred)
                            todo.append(pred)
                ops = [o for b in sorted(body) for o in blocks[b]["ops"]]
                if any(o in _MMA for o in ops):
                    loops.append(ops)
    mix = dict.fromkeys(("loop", "alu", "fma", "mio", "mma", "uniform", "other"), 0)
    if loops:
        body = min(loops, key=len)
        mix["loop"] = len(body)
        for o in body:
            mix[_pipe(o)] += 1
    return mix


def _basic_blocks(sass: str) -> list[dict]:
    """SASS -> basic blocks [{"ops": base opcodes, "succ": [block], "pred": [block]}]: a block
    starts at a label or after a branch; an unpredicated BRA (or EXIT) does not fall through."""
    blocks: list[dict] = [{"ops": [], "label": None, "branch": None}]
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            if blocks[-1]["ops"] or blocks[-1]["label"]:
                blocks.append({"ops": [], "label": None, "branch": None})
            blocks[-1]["label"] = m.group(1)
        elif m := _INSTRUCTION.match(line):
            op = m.group(1).split(".")[0]
            blocks[-1]["ops"].append(op)
            if op in ("BRA", "EXIT"):
                target = re.search(r"\((\.L_x_\d+)\)", m.group(2))
                predicated = re.match(r"^\s*/\*[0-9a-f]+\*/\s+@", line) is not None
                blocks[-1]["branch"] = (target.group(1) if target else None, predicated)
                blocks.append({"ops": [], "label": None, "branch": None})
    at = {b["label"]: i for i, b in enumerate(blocks) if b["label"]}
    for i, b in enumerate(blocks):
        b["succ"], b["pred"] = [], []
        target, predicated = b["branch"] or (None, True)
        if target in at:
            b["succ"].append(at[target])
        if predicated and i + 1 < len(blocks):
            b["succ"].append(i + 1)
    for i, b in enumerate(blocks):
        for j in b["succ"]:
            blocks[j]["pred"].append(i)
    return blocks


def _pipe(op: str) -> str:
    for pipe, ops in (("alu", _ALU), ("fma", _FMA), ("mio", _MIO), ("mma", _MMA)):
        if op in ops:
            return pipe
    return "uniform" if op.startswith("U") else "other"


def embedded_cubin(obj: bytes) -> bytes:
    """The cubin inside the host object written by ``export_to_c`` (the second ELF in it)."""
    start = obj.find(b"\x7fELF", 1)
    if start < 0:
        raise RuntimeError("no embedded cubin in the exported object")
    elf = obj[start:]
    phoff, shoff = struct.unpack_from("<QQ", elf, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for off, size, _ in _elf_sections(elf).values():
        end = max(end, off + size)
    return elf[:end]


def inspect_variant(name: str) -> dict:
    """Compile one registered variant in this (worker) process and report on its SASS."""
    from .kernels import all_specs

    return inspect_spec(next(s for s in all_specs() if s.name == name))


def inspect_spec(spec) -> dict:
    """Compile a ``KernelSpec`` (registered or not, e.g. a perf probe) for the target of
    this process and report on its SASS."""
    import cutlass.cute as cute

    name = spec.name
    jit_fn, args = spec.build()
    compiled = cute.compile(jit_fn, *args)
    with tempfile.TemporaryDirectory() as tmp:
        compiled.export_to_c(tmp, name)
        with open(os.path.join(tmp, f"{name}.o"), "rb") as f:
            data = embedded_cubin(f.read())
        cubin = os.path.join(tmp, f"{name}.cubin")
        with open(cubin, "wb") as f:
            f.write(data)
        sass = subprocess.run(
            [find_nvdisasm(), "-c", cubin], capture_output=True, check=True, text=True
        ).stdout
    sass_dir = os.environ.get("KBIT_CUTE_SASS_DIR")
    if sass_dir:  # keep the disassembly for reading (``--sass DIR``)
        os.makedirs(sass_dir, exist_ok=True)
        with open(os.path.join(sass_dir, f"{name}.sass"), "w") as f:
            f.write(sass)
    arch = re.search(r"\.target\s+(sm_\w+)", sass)
    row = {"variant": name, **cubin_resources(data), **sass_counts(sass)}
    row.update({f"loop_{k}" if k != "loop" else k: v for k, v in loop_mix(sass).items()})
    row["arch"] = arch.group(1) if arch else "?"
    missing = [c for c in spec.expect if row.get(c, 0) == 0]
    row["missing"] = ",".join(missing)
    row["ok"] = not missing and row["spill_ops"] == 0 and row["stack"] == 0
    return row


def run_report(arch: str, jobs: int, only: str | None = None) -> list[dict]:
    from .kernels import all_specs

    names = [s.name for s in all_specs(arch) if only is None or re.search(only, s.name)]
    # The DSL reads the target when cutlass is first imported, which in a worker happens
    # while it unpickles its task: the target must be in the environment it starts with.
    saved = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = arch
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            rows = list(pool.map(inspect_variant, names))
    finally:
        if saved is None:
            del os.environ["CUTE_DSL_ARCH"]
        else:
            os.environ["CUTE_DSL_ARCH"] = saved
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90a", help="target, e.g. sm_90a or sm_80")
    p.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    p.add_argument("--only", help="regex: only variants whose name matches")
    p.add_argument("--sass", metavar="DIR", help="also write each variant's SASS to DIR")
    p.add_argument("--loops", action="store_true",
                   help="the whole pipe mix of each variant's MMA loop iteration")  # fmt: skip
    args = p.parse_args(argv)
    if args.sass:
        os.environ["KBIT_CUTE_SASS_DIR"] = os.path.abspath(args.sass)  # workers inherit it
    rows = run_report(args.arch, args.jobs, args.only)
    cols = ["variant", "arch", "regs", "smem", "stack", "spill_ops", *COUNTED, "loop",
            "loop_alu", "missing", "ok"]  # fmt: skip
    if args.loops:
        cols[-2:-2] = ["loop_fma", "loop_mio", "loop_mma", "loop_uniform", "loop_other"]
    print(f"kbit_cute kernels, compile-only, {args.arch}")
    print(tabulate([[r[c] for c in cols] for r in rows], headers=cols, tablefmt="github"))
    bad = [r["variant"] for r in rows if not r["ok"]]
    if bad:
        print(f"FAILED: {len(bad)} variant(s) spill or lack a declared instruction class: {bad}")
        return 1
    print(f"all {len(rows)} variants: no spills, every declared instruction class present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
