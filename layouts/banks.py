"""Shared-memory bank-conflict maps: which 4-byte banks each warp access phase touches.

Model (NVIDIA GPUs since Volta): 32 banks of 4 bytes; bank = (address // 4) % 32. A warp's
access is served in phases of 128 bytes: 32 threads for accesses up to 4 bytes, 16 for
8-byte and 8 for 16-byte vectors. Threads reading the same 4-byte word share it
(broadcast), so a phase costs as many wavefronts as the most distinct words any one
bank must deliver: 1 is conflict-free, 32 is a 32-way conflict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .parse import size
from .probe import Evaluated

BANKS = 32
BANK_BYTES = 4
WARP = 32
PHASE_BYTES = BANKS * BANK_BYTES


@dataclass(frozen=True)
class BankPhase:
    """One phase of one warp access: the distinct words each of the 32 banks serves."""

    label: str
    threads: tuple[int, ...]
    words_per_bank: tuple[int, ...]  # 32 counts

    @property
    def ways(self) -> int:
        """Wavefronts this phase needs: 1 = conflict-free, n = n-way conflict."""
        return max(self.words_per_bank)


def bank_phases(
    addresses: Sequence[int | None], access_bytes: int = 4, label: str = ""
) -> list[BankPhase]:
    """One access instruction: ``addresses[t]`` is the byte address thread ``t`` accesses
    (None: the thread sits this instruction out).

    Threads are split into warps of 32 and each warp into 128-byte phases; phases with
    no active thread are left out.
    """
    if access_bytes not in (1, 2, 4, 8, 16):
        raise ValueError(f"access_bytes must be 1, 2, 4, 8 or 16, got {access_bytes}")
    for t, a in enumerate(addresses):
        if a is not None and (a < 0 or a % access_bytes):
            raise ValueError(f"thread {t}: address {a} is negative or not {access_bytes}-aligned")
    per_phase = min(WARP, PHASE_BYTES // access_bytes)
    phases = []
    for first in range(0, len(addresses), per_phase):
        lanes = range(first, min(first + per_phase, len(addresses)))
        threads = tuple(t for t in lanes if addresses[t] is not None)
        if not threads:
            continue
        words: set[int] = set()
        for t in threads:
            start = addresses[t] // BANK_BYTES
            words.update(range(start, start + max(1, access_bytes // BANK_BYTES)))
        counts = [0] * BANKS
        for w in words:
            counts[w % BANKS] += 1
        warp, phase = divmod(first, WARP)
        name = f"{label}warp {warp}" + (f" phase {phase // per_phase}" if per_phase < WARP else "")
        phases.append(BankPhase(name, threads, tuple(counts)))
    return phases


def conflict_ways(addresses: Sequence[int], access_bytes: int = 4) -> int:
    """The worst phase of one access instruction: 1 = conflict-free, 32 = 32-way."""
    return max(p.ways for p in bank_phases(addresses, access_bytes))


def access_phases(
    instructions: Sequence[Sequence[int | None]], access_bytes: int
) -> list[BankPhase]:
    """Bank map of a kernel's access: ``instructions[a][t]`` is the byte address thread t
    touches in instruction a (None: idle), each access ``access_bytes`` wide."""
    phases = []
    for a, addresses in enumerate(instructions):
        phases += bank_phases(addresses, access_bytes, label=f"access {a}, ")
    if not phases:
        raise ValueError("no thread accesses shared memory in any instruction")
    return phases


def smem_phases(ev: Evaluated, elem_bytes: int = 4, vec: int = 1) -> list[BankPhase]:
    """Bank map of a (thread, value) -> element offset shared-memory layout.

    Each thread moves ``vec`` consecutive values per instruction (one vector access of
    ``elem_bytes * vec`` bytes); value group ``a`` of all threads is one instruction.
    """
    if not isinstance(ev.shape, tuple) or len(ev.shape) != 2:
        raise ValueError(f"a shared-memory access layout has modes (thread, value); got {ev.text}")
    threads, values = size(ev.shape[0]), size(ev.shape[1])
    if values % vec:
        raise ValueError(f"{values} values per thread do not split into vectors of {vec}")
    phases = []
    for a in range(values // vec):
        addresses = []
        for t in range(threads):
            first = ev.offsets[t + threads * a * vec]
            vector = [ev.offsets[t + threads * (a * vec + i)] for i in range(vec)]
            # A vector instruction needs its elements adjacent in memory.
            if vector != list(range(first, first + vec)):
                raise ValueError(
                    f"thread {t}'s values {a * vec}..{a * vec + vec - 1} sit at offsets "
                    f"{vector}, not {vec} adjacent elements: no {vec}-wide vector access"
                )
            addresses.append(first * elem_bytes)
        phases += bank_phases(addresses, elem_bytes * vec, label=f"access {a}, ")
    return phases
