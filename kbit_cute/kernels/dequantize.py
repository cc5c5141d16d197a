"""GPU dequantize: tiled kbit weight -> dense W [N, K] in fp32 / fp16 / bf16.

Four threads per 32-weight block, 8 weights (one 16-byte fp16/bf16 chunk) each.
Threads walk the blocks in memory order of the tiled format (coalesced word reads;
the 4 threads of a block read the same words in one transaction), so the 8
threads of a column's two blocks write one contiguous 128-byte run of its row: a
warp's store covers 4 whole lines instead of 32 pieces of 16 lines (one thread per
block measured 1.7 TB/s read + write). Used by ``kbit_cute.dequantize`` on CUDA and
by the large-M path (dequantize + cuBLAS).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from ..format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .device_helpers import codebook_lookup, decode_e4m4, load_codebook_lane, plane_index

_BLOCKS_PER_TILE = TILE_N * BLOCKS_PER_TILE_K
_THREADS_PER_BLOCK = 4
_PER_THREAD = BLOCK // _THREADS_PER_BLOCK


class DequantizeKernel:
    """Compile-time config: bits per weight ``k`` and the output dtype."""

    threads = 128

    def __init__(self, k: int, out_dtype: type[cutlass.Numeric]):
        self.k = k
        self.out_dtype = out_dtype

    @staticmethod
    def can_implement(k: int, out_dtype) -> bool:
        return k in (2, 3, 4, 5) and out_dtype in (
            cutlass.Float32,
            cutlass.Float16,
            cutlass.BFloat16,
        )

    @cute.jit
    def __call__(
        self,
        pPacked: cute.Pointer,  # int32, tiled words
        pAbsmax: cute.Pointer,  # uint8, tiled absmax
        pCodebook: cute.Pointer,  # fp32 (2^k,)
        pScale: cute.Pointer,  # fp32 (1,)
        pOut: cute.Pointer,  # (N, K) row-major, out_dtype
        N: Int32,
        K: Int32,  # a multiple of 32
        stream: cuda.CUstream,
    ):
        K = cute.assume(K, divby=BLOCK)
        n_tiles = (N + TILE_N - 1) // TILE_N
        k_tiles = (K + TILE_K - 1) // TILE_K
        # View the flat buffers through the tile-format layouts: coordinates (n, kb, bit).
        mW = cute.make_tensor(pPacked, weight_words_layout(n_tiles, k_tiles, self.k))
        mA = cute.make_tensor(pAbsmax, weight_absmax_layout(n_tiles, k_tiles))
        mCodebook = cute.make_tensor(pCodebook, cute.make_layout(1 << self.k))
        mScale = cute.make_tensor(pScale, cute.make_layout(1))
        mOut = cute.make_tensor(pOut, cute.make_layout((N, K), stride=(K, 1)))
        total = n_tiles * k_tiles * _BLOCKS_PER_TILE * _THREADS_PER_BLOCK
        self.kernel(mW, mA, mCodebook, mScale, mOut, n_tiles).launch(
            grid=[(total + self.threads - 1) // self.threads, 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mW: cute.Tensor,  # ((128, n_tiles), (2, k_tiles), k) -> word
        mA: cute.Tensor,  # ((128, n_tiles), (2, k_tiles)) -> absmax byte
        mCodebook: cute.Tensor,
        mScale: cute.Tensor,
        mOut: cute.Tensor,  # (N, K)
        n_tiles: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * self.threads + tidx
        g = t // _THREADS_PER_BLOCK  # block number in memory order of the tiled format
        part = t % _THREADS_PER_BLOCK  # this thread's 8 weights of the block
        tile, r = g // _BLOCKS_PER_TILE, g % _BLOCKS_PER_TILE
        n = (tile % n_tiles) * TILE_N + r // BLOCKS_PER_TILE_K
        kb = (tile // n_tiles) * BLOCKS_PER_TILE_K + r % BLOCKS_PER_TILE_K
        N, K = mOut.shape
        valid = n < N and kb * BLOCK < K

        cb_lane = load_codebook_lane(mCodebook, self.k)
        planes = cute.make_rmem_tensor((self.k,), Int32)
        block_scale = Float32(0.0)
        if valid:
            for i in cutlass.range_constexpr(self.k):
                planes[i] = Int32(Uint32(mW[(n, kb, i)]) >> Uint32(part * _PER_THREAD))
            block_scale = decode_e4m4(Int32(mA[(n, kb)])) * mScale[0]
        else:
            for i in cutlass.range_constexpr(self.k):
                planes[i] = Int32(0)

        vals = cute.make_rmem_tensor((_PER_THREAD,), self.out_dtype)
        for j in cutlass.range_constexpr(_PER_THREAD):
            # Every lane shuffles, valid or not: the lookup is a warp-wide exchange.
            w = codebook_lookup(cb_lane, plane_index(planes, j, self.k)) * block_scale
            vals[j] = self.out_dtype(w)
        if valid:
            # (1, 8) run of row n
            gOut = cute.local_tile(mOut, (1, _PER_THREAD), (n, kb * _THREADS_PER_BLOCK + part))
            cute.autovec_copy(vals, gOut[0, None])


_OUT_DTYPES = {"f32": cutlass.Float32, "f16": cutlass.Float16, "bf16": cutlass.BFloat16}


def dequantize_spec(k: int, out: str):
    """The compiled variant of ``DequantizeKernel`` for bits ``k`` and output dtype name."""
    from ..compile import KernelSpec, fake_ptr, fake_stream

    def build():
        kernel = DequantizeKernel(k, _OUT_DTYPES[out])
        args = (
            fake_ptr(cutlass.Int32), fake_ptr(cutlass.Uint8), fake_ptr(cutlass.Float32),
            fake_ptr(cutlass.Float32, 4), fake_ptr(_OUT_DTYPES[out]), Int32(1), Int32(32),
            fake_stream(),
        )  # fmt: skip
        return kernel, args

    return KernelSpec(f"dequantize_k{k}_{out}", build, expect=("SHFL", "STG.E.128"))


def specs():
    return [dequantize_spec(k, out) for k in (2, 3, 4, 5) for out in _OUT_DTYPES]
