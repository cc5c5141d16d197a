"""GPU dequantize: tiled kbit weight -> dense W [N, K] in fp32 / fp16 / bf16.

Used by ``kbit_cute.dequantize`` on CUDA and by the large-M path (dequantize + cuBLAS).
Bound by memory: H100, 28672 x 8192 fp16, k = 4: 213 us, 2.8 TB/s read + write. One
block per thread took 258 us, bound by the issue slots (~28 instructions per weight, 84%
of the cycles issued); this version issues 7-8 per weight, 23% of the cycles.

Threads and stores: a thread takes 8 weights (16 bytes of fp16) of 4 blocks, one K block
of 4 adjacent columns of a tile, block i in round i. The 8 threads of a group, 4 parts x
the tile's 2 K blocks, write in every round one contiguous 128-byte run of a row, so a
warp's store covers 4 whole lines (one thread per block, 32 pieces of 16 lines, measured
1.7 TB/s). CTAs (64 columns of a tile each) go K tiles first, so that the CTAs resident
at a time write whole rows rather than 128 bytes of every row (235 us in the tiled
format's order).

Per thread, for its 32 weights:

* Loads: k words per block (k = 4: one LDG.128), the group's 8 absmax bytes in one
  LDG.64, the codebook lane and the scale.
* Indices: a PRMT tree per plane gathers the thread's byte of that plane from its 4
  blocks into one word (bit 8 i + j: element 8 part + j of block i), and
  ``planes_to_fields`` merges the k words into index fields, SWAR style: 3k PRMT and
  2 instructions per word and stage in all. A lookup is then a shift and a shuffle: shfl
  reads bits [4:0] only and the lanes repeat the codebook modulo 2^k, so the bits above
  an index need no mask.
* Scales: ``decode_e4m4_byte`` straight from the absmax bytes, times the tensor scale.
* Per weight a shift, the shuffle, the fp32 multiply and half a conversion (two values
  round to fp16x2 / bf16x2 in one); per block one predicated STG.128 (fp32: two).

The arithmetic is the reference's: ``codebook[index] * (absmax * scale)`` in fp32, one
rounding to the output dtype, bit-identical to the CPU path. Blocks past N or K (N not a
multiple of 128, K % 64 == 32) are read, the tiled format being padded to whole tiles,
and shuffled (the shuffle is warp-wide), but not stored.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ..format import BLOCK, BLOCKS_PER_TILE_K, TILE_K, TILE_N
from ..layouts import weight_absmax_layout, weight_words_layout
from .device_helpers import (
    codebook_lookup,
    decode_e4m4_byte,
    f32_to_bits,
    field_bits,
    load_codebook_lane,
    pack_x2,
    planes_to_fields,
    prmt,
    store_global_if,
)

_THREADS_PER_BLOCK = 4
_PER_THREAD = BLOCK // _THREADS_PER_BLOCK  # weights per thread and block: 16 bytes of fp16
_ROUNDS = 4  # blocks per thread: one K block of 4 adjacent columns
_LANES_PER_GROUP = _THREADS_PER_BLOCK * BLOCKS_PER_TILE_K  # (part, K block) of 4 columns


class DequantizeKernel:
    """Compile-time config: bits per weight ``k`` and the output dtype."""

    threads = 128
    # Threads of a CTA: (part, K block, group of 4 columns) = (4, 2, 16): 64 columns of a tile.
    cols_per_cta = threads // _LANES_PER_GROUP * _ROUNDS
    ctas_per_tile = TILE_N // cols_per_cta

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
        # K tiles first (the module docstring says why); grid y <= 65535: N <= MAX_ROWS.
        self.kernel(mW, mA, mCodebook, mScale, mOut).launch(
            grid=[k_tiles, n_tiles * self.ctas_per_tile, 1],
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
    ):
        k = self.k
        tidx, _, _ = cute.arch.thread_idx()
        k_tile, bidx, _ = cute.arch.block_idx()
        part = tidx % _THREADS_PER_BLOCK  # this thread's 8 weights of each block
        kbt = tidx // _THREADS_PER_BLOCK % BLOCKS_PER_TILE_K  # its K block of the tile
        n_tile = bidx // self.ctas_per_tile
        col = (bidx % self.ctas_per_tile) * self.cols_per_cta + tidx // _LANES_PER_GROUP * _ROUNDS

        # The tile's words and absmax bytes. A tile is k KB and the base 16-byte aligned (the
        # launcher checks it), but the slice's dynamic offset hides that from the DSL.
        gW = _aligned(mW[(None, n_tile), (None, k_tile), None], 16)  # (128, 2, k)
        gA = _aligned(mA[(None, n_tile), (None, k_tile)], 16)  # (128, 2)
        # Blocks (col + i, kbt), i = 0..3: k consecutive words each (one LDG.128 for k = 4).
        tWgW = cute.local_tile(gW, (_ROUNDS, 1, k), (col // _ROUNDS, kbt, 0))  # (4, 1, k)
        tWrW = cute.make_fragment_like(tWgW)
        cute.autovec_copy(tWgW, tWrW)
        # The absmax bytes of columns col .. col + 3, both K blocks: 8 bytes, one LDG.64.
        tAgA = cute.local_tile(gA, (_ROUNDS, BLOCKS_PER_TILE_K), (col // _ROUNDS, 0))
        tAgA32 = cute.make_tensor(cute.recast_ptr(tAgA.iterator, dtype=Uint32), 2)
        tArA32 = cute.make_fragment_like(tAgA32)
        cute.autovec_copy(tAgA32, tArA32)
        cb_lane = load_codebook_lane(mCodebook, k)
        scale = mScale[0]

        # Bit 8 i + j of plane word b: bit b of the index of element 8 part + j of block i,
        # byte ``part`` of block i's plane word b, picked out by a PRMT tree.
        pick = Uint32(part) * Uint32(0x11) + Uint32(0x40)  # bytes 0, 1 <- byte part of a, b
        planes = []
        for b in cutlass.range_constexpr(k):
            lo = prmt(Uint32(tWrW[0, 0, b]), Uint32(tWrW[1, 0, b]), pick)
            hi = prmt(Uint32(tWrW[2, 0, b]), Uint32(tWrW[3, 0, b]), pick)
            planes.append(prmt(lo, hi, 0x5410))
        width = field_bits(k)
        field_of = {}  # bit of ``planes`` -> (word, shift) of its index field
        for word, elems in planes_to_fields(planes, k, zero_fill=False):
            for f, e in enumerate(elems):
                field_of[e] = (word, f * width)
        # Byte i: the absmax code of block i (bytes 2 i + kbt of the 8).
        codes = prmt(tArA32[0], tArA32[1], Uint32(0x6420) + Uint32(kbt) * Uint32(0x1111))

        N, K = mOut.shape
        n0 = n_tile * TILE_N + col
        kb = k_tile * BLOCKS_PER_TILE_K + kbt
        # Row n0, this thread's 8 weights of K block kb; block i is row n0 + i. The group's 8
        # threads write all of a row's 128 bytes of the tile.
        pOut = mOut.iterator + (Int64(n0) * Int64(K) + kb * BLOCK + part * _PER_THREAD)
        kb_ok = kb * BLOCK < K  # K % 64 == 32: the last tile has one K block
        for i in cutlass.range_constexpr(_ROUNDS):
            block_scale = decode_e4m4_byte(codes, i) * scale
            w = []
            for j in cutlass.range_constexpr(_PER_THREAD):
                word, shift = field_of[8 * i + j]
                idx = word if shift == 0 else word >> Uint32(shift)
                # Every lane shuffles, stored or not: the lookup is a warp-wide exchange.
                w.append(codebook_lookup(cb_lane, Int32(idx)) * block_scale)
            if cutlass.const_expr(self.out_dtype is cutlass.Float32):
                bits = [f32_to_bits(x) for x in w]
            else:
                bits = [pack_x2(w[2 * m], w[2 * m + 1], self.out_dtype) for m in range(4)]
            store_global_if(pOut + i * K, bits, Int32(n0 + i < N and kb_ok))


# Rows the launch's grid y (column CTAs, at most 65535) covers: ``ops.dequantize`` checks.
MAX_ROWS = 65535 // DequantizeKernel.ctas_per_tile * TILE_N


def _aligned(t: cute.Tensor, align: int) -> cute.Tensor:
    """``t`` with its base pointer known to be ``align``-byte aligned."""
    ptr = cute.make_ptr(
        t.element_type, t.iterator.toint(), t.iterator.memspace, assumed_align=align
    )
    return cute.make_tensor(ptr, t.layout)


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
