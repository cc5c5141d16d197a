"""Grouped expert GEMM for MoE launches with many rows per expert (prefill).

``out[rows of e] = A[rows of e] @ W_e^T`` for the E stacked weights of a ``KbitExperts``, rows
sorted by expert, ``expert_offsets`` [E + 1] on the device, as the grouped GEMV kernels
(``grouped_gemv``) compute it; those re-stream an expert's weights for every 8 of its rows,
which loses to bf16 ``torch._grouped_mm`` once experts hold tens of rows (perf/NOTES.md). This
kernel runs the dense GEMM's mainloop and epilogue (``GemmKernel.tile``: cp.async ring,
ldmatrix, dequant in registers, mma.sync) on work items (M tile of one expert, N tile):

* Work slot s enumerates the M tiles of every expert in expert order (an expert with r rows
  has ceil(r / TILE_M) of them). Each CTA finds its slot's expert and M tile by scanning
  the offsets (a prefix count over the CTA, as the grouped GEMV finds its expert), so the
  host never reads the offsets and the launch is graph-capturable. The host launches a
  bound on the slots, min(E, R) + R // TILE_M; slots past the last tile exit at once.
* The tile is the dense GEMM's with A, the output and the weights moved to the expert: M =
  the expert's rows (rows past them are neither copied nor stored), its own scale, no bias,
  no split-K (prefill launches have tiles enough to fill the SMs).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from ..format import TILE_K, TILE_N
from .gemm import _DTYPES, GemmConfig, GemmKernel
from .grouped_gemv import find_work_slot


class GroupedGemmKernel(GemmKernel):
    """``GemmKernel`` over (expert M tile, N tile) work items. Compile-time config: bits
    ``k``, dtype name, ``GemmConfig`` (``splits`` is always 1)."""

    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,  # (R, K) row-major, rows sorted by expert
        pPacked: cute.Pointer,  # int32 (E, words per expert)
        pAbsmax: cute.Pointer,  # uint8 (E, bytes per expert)
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (E,) per-expert scale
        pOffsets: cute.Pointer,  # int32 (E + 1,) row ranges
        pOut: cute.Pointer,  # (R, N) row-major
        R: Int32,
        N: Int32,
        K: Int32,  # a multiple of 32
        E: Int32,
        slots: Int32,  # bound on the (expert, M tile) work slots
        stream: cuda.CUstream,
    ):
        n_ctas = (N + self.cfg.tile_n - 1) // self.cfg.tile_n
        mOff = cute.make_tensor(pOffsets, cute.make_layout(E + 1))
        self.kernel(pA, pPacked, pAbsmax, pCodebook, pScale, mOff, pOut, R, N, K).launch(
            grid=[slots, n_ctas, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        pA: cute.Pointer,
        pPacked: cute.Pointer,
        pAbsmax: cute.Pointer,
        pCodebook: cute.Pointer,
        pScale: cute.Pointer,
        mOff: cute.Tensor,
        pOut: cute.Pointer,
        R: Int32,
        N: Int32,
        K: Int32,
    ):
        slot, n_cta, _ = cute.arch.block_idx()
        K = cute.assume(K, divby=32)
        warps = self.threads // 32
        smem = SmemAllocator()
        base_u8 = cute.recast_ptr(
            smem.allocate(self.plan["total"], byte_alignment=1024), dtype=cutlass.Uint8
        )
        sScan = smem.allocate_tensor(Int32, cute.make_layout(warps + 4), byte_alignment=4)
        find_work_slot(mOff, slot, sScan, self.threads, self.cfg.tile_m)
        expert = sScan[warps]
        if expert >= 0:
            row_begin = sScan[warps + 1]
            rows = cutlass.max(cutlass.min(sScan[warps + 2], R - row_begin), 0)  # bad offsets
            m_tile = sScan[warps + 3]
            # One expert's weights: ceil(N / 128) x ceil(K / 64) repack tiles of 256 absmax
            # bytes and k words per absmax byte, experts back to back.
            n_tiles = (N + TILE_N - 1) // TILE_N
            k_tiles = (K + TILE_K - 1) // TILE_K
            absmax_bytes = Int64(n_tiles * k_tiles * 2 * TILE_N)
            w_first = cute.assume(Int64(expert) * absmax_bytes * self.k, divby=TILE_N)
            s_first = cute.assume(Int64(expert) * absmax_bytes, divby=TILE_N)
            a_first = cute.assume(Int64(row_begin) * Int64(K), divby=32)
            o_first = cute.assume(Int64(row_begin) * Int64(N), divby=8)  # (the host: N % 8 == 0)
            # (no bias, no split-K: the bias, workspace and counter pointers are not read)
            self.tile(
                base_u8, pA + a_first, pPacked + w_first, pAbsmax + s_first, pCodebook,
                pScale + expert, pOut, pOut + o_first, pScale, mOff.iterator, rows, N, K,
                1, 0, 0, m_tile, n_cta, 0, 1,
            )  # fmt: skip


def grouped_gemm_spec(k: int, dtype: str, config: GemmConfig):
    """The compiled variant of ``GroupedGemmKernel`` (bits, dtype name, tiling)."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        dt = _DTYPES[dtype]
        args = (
            fake_ptr(dt), fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8),
            fake_ptr(cutlass.Float32, 4), fake_ptr(cutlass.Float32, 4),
            fake_ptr(cutlass.Int32, 4), fake_ptr(dt),
            Int32(5), Int32(128), Int32(64), Int32(1), Int32(1), fake_stream(),
        )  # fmt: skip
        return GroupedGemmKernel(k, dtype, config), args

    return KernelSpec(
        f"grouped_gemm_k{k}_{dtype}_{config.name}", build, expect=("HMMA", "LDGSTS", "LDSM")
    )


# The tiling of the grouped GEMM (the dense dispatch table's M = 64 row on large weights).
CONFIG = GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=4, warps_m=1, warps_n=4)


def specs():
    return [grouped_gemm_spec(k, d, CONFIG) for k in (2, 3, 4, 5) for d in _DTYPES]
