"""The kbit weight format on the host: codebooks, E4M4 absmax, bit planes, tiles.

Normative description: blocks of 32 consecutive weights of the row-major
weight W [N, K]; each block stores k bit-planes (one 32-bit word each: bit j of
word i is bit i of element j's codebook index) and one E4M4 byte encoding the
block's absmax. A weight is ``codebook[index] * decode_e4m4(absmax) * scale``,
where ``scale`` is one fp32 number per tensor that keeps block absmaxes inside
E4M4's range (about 6e-5..31) for weights of any magnitude.

For the kernels the flat words are repacked into tiles of TILE_K x TILE_N
(64 x 128) weights; inside a tile words are ordered [col][kb][bit], tiles are
ordered ``k_tile * n_tiles + n_tile``. The same order as a CuTe layout lives in
``kbit_cute.layouts``; this module is the pure-torch reference every test and
every kernel is checked against. Everything here runs on CPU and CUDA tensors
and gives bit-identical results on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per quantization block (one bit-plane word per bit)
TILE_K = 64  # K extent of a repack tile: 2 blocks
TILE_N = 128  # N extent of a repack tile
BLOCKS_PER_TILE_K = TILE_K // BLOCK
K_BITS = (2, 3, 4, 5)
E4M4_BIAS = 11
E4M4_MAX = 31.0  # largest decodable absmax: 2^(15-11) * (1 + 15/16)
# Rows processed at once by quantize: bounds temporary memory to a few GB on
# an 8192 x 28672 weight without costing speed.
_QUANT_CHUNK_ELEMS = 1 << 26


# --------------------------------------------------------------------------- checks


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int in 2..5, got {type(k).__name__}")
    if k not in K_BITS:
        raise ValueError(f"k must be one of 2, 3, 4, 5 (bits per weight), got {k}")
    return k


def check_codebook(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """A codebook is 2^k finite values; returned as contiguous float32."""
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"codebook must be a torch.Tensor, got {type(codebook).__name__}")
    if codebook.ndim != 1 or codebook.numel() != (1 << k):
        raise ValueError(
            f"codebook for k={k} must be 1-D with {1 << k} entries, "
            f"got shape {tuple(codebook.shape)}"
        )
    if not codebook.is_floating_point():
        raise TypeError(f"codebook must be floating point, got {codebook.dtype}")
    cb = codebook.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(cb).all()):
        raise ValueError("codebook contains NaN or Inf values")
    return cb


def _check_weight_values(w2d: torch.Tensor, what: str = "row") -> None:
    bad = ~torch.isfinite(w2d)
    if bool(bad.any()):
        first = int(bad.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"weight has NaN or Inf values; first bad {what} is {first}")


# --------------------------------------------------------------------------- codebook


def normal_float_codebook(k: int) -> torch.Tensor:
    """The 2^k normal-float codebook: normal quantiles at (i + 0.5) / 2^k, max |v| = 1.

    float32, ascending, on the CPU. Pass it (or any 2^k finite values) to ``quantize``.
    """
    n = 1 << check_k(k)
    p = torch.linspace(0.5 / n, 1.0 - 0.5 / n, n, dtype=torch.float64)
    v = torch.special.ndtri(p)
    return (v / v.abs().max()).to(torch.float32)


codebook = normal_float_codebook


# --------------------------------------------------------------------------- E4M4


def e4m4_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [256]: the decoded value of every E4M4 code; strictly increasing in the code."""
    code = torch.arange(256, dtype=torch.int64)
    e, m = code >> 4, code & 15
    mant = m.to(torch.float64) / 16
    normal = torch.pow(2.0, (e - E4M4_BIAS).to(torch.float64)) * (1 + mant)
    subnormal = 2.0**-10 * mant
    return torch.where(e > 0, normal, subnormal).to(torch.float32).to(device)


def decode_e4m4(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 values: e>0: 2^(e-11)(1+m/16); e=0: 2^-10 m/16."""
    if code.dtype != torch.uint8:
        raise TypeError(f"E4M4 codes must be uint8, got {code.dtype}")
    return e4m4_table(code.device)[code.long()]


def encode_e4m4(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 code whose decoded value is nearest to x (x clamped to [0, 31]).

    Exact ties (midpoints between two codes, all exactly representable in fp32)
    go to the smaller code.
    """
    if not x.is_floating_point():
        raise TypeError(f"encode_e4m4 takes a floating point tensor, got {x.dtype}")
    table = e4m4_table(x.device)
    mid = (table[1:] + table[:-1]) * 0.5  # exact: neighbours share an exponent or differ by one
    xc = x.to(torch.float32).clamp(0.0, E4M4_MAX)
    return torch.bucketize(xc, mid, right=False).to(torch.uint8)


# --------------------------------------------------------------------------- bit planes


def pack_bitplanes(indices: torch.Tensor, k: int) -> torch.Tensor:
    """indices [nb, 32] (0..2^k-1) -> int32 [nb * k]: word b*k+i holds bit i, element j in bit j."""
    check_k(k)
    if indices.ndim != 2 or indices.shape[1] != BLOCK:
        raise ValueError(f"indices must be [n_blocks, 32], got {tuple(indices.shape)}")
    nb = indices.shape[0]
    idx = indices.to(torch.uint8)
    bit = torch.arange(k, device=idx.device, dtype=torch.uint8).view(1, k, 1)
    planes = (idx.view(nb, 1, BLOCK) >> bit) & 1  # [nb, k, 32]
    # Little-endian bytes: byte q of a word holds elements 8q..8q+7.
    weights = (1 << torch.arange(8, device=idx.device, dtype=torch.int32)).to(torch.uint8)
    byte = (planes.view(nb, k, 4, 8) * weights).sum(-1, dtype=torch.uint8)  # [nb, k, 4]
    return byte.contiguous().view(torch.int32).reshape(nb * k)


def unpack_bitplanes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [nb * k] -> indices uint8 [nb, 32]; the inverse of ``pack_bitplanes``."""
    check_k(k)
    if packed.dtype != torch.int32 or packed.ndim != 1 or packed.numel() % k:
        raise ValueError(f"packed must be 1-D int32 with a multiple of k={k} words")
    nb = packed.numel() // k
    byte = packed.contiguous().view(torch.uint8).view(nb, k, 4, 1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = ((byte >> shifts) & 1).view(nb, k, BLOCK)  # [nb, k, 32]
    plane = torch.arange(k, device=packed.device, dtype=torch.uint8).view(1, k, 1)
    return (bits << plane).sum(1, dtype=torch.uint8)


# --------------------------------------------------------------------------- flat format


def nearest_index(x: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """uint8 index of the codebook entry nearest to each x (ties to the lower sorted entry)."""
    sorted_cb, order = torch.sort(cb)
    mid = (sorted_cb[1:] + sorted_cb[:-1]) * 0.5
    return order.to(torch.uint8)[torch.bucketize(x, mid, right=False)]


def quantize_blocks(w: torch.Tensor, cb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [nb, 32] -> (int32 [nb*k] planes, uint8 [nb] absmax). No checks, no scale."""
    absmax = encode_e4m4(w.abs().amax(dim=1))
    scale = decode_e4m4(absmax).unsqueeze(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    normed = torch.where(scale > 0, w / safe, torch.zeros_like(w))
    return pack_bitplanes(nearest_index(normed, cb.to(w.device)), k), absmax


def quantize_kbit(
    w_flat: torch.Tensor, codebook: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat format of a 1-D weight of n = 32*nb elements: (int32 [nb*k], uint8 [nb]).

    Block b is elements [32b, 32b+32); its absmax byte encodes max|w|; each
    element's index is the nearest codebook entry to w / decode(absmax).
    """
    check_k(k)
    cb = check_codebook(codebook, k)
    if not isinstance(w_flat, torch.Tensor) or not w_flat.is_floating_point():
        raise TypeError("w_flat must be a floating point torch.Tensor")
    if w_flat.ndim != 1:
        raise ValueError(f"w_flat must be 1-D, got shape {tuple(w_flat.shape)}")
    if w_flat.numel() % BLOCK:
        raise ValueError(f"w_flat has {w_flat.numel()} elements, not a multiple of {BLOCK}")
    w = w_flat.to(torch.float32).view(-1, BLOCK)
    _check_weight_values(w, "block")
    return _quantize_flat(w, cb, k)


def _quantize_flat(w: torch.Tensor, cb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [nb, 32] -> flat format, in chunks that bound temporary memory."""
    packed, absmax = [], []
    rows = max(1, _QUANT_CHUNK_ELEMS // BLOCK)
    for start in range(0, w.shape[0], rows):
        p, a = quantize_blocks(w[start : start + rows], cb, k)
        packed.append(p)
        absmax.append(a)
    if not packed:
        return w.new_empty(0, dtype=torch.int32), w.new_empty(0, dtype=torch.uint8)
    return torch.cat(packed), torch.cat(absmax)


def dequantize_kbit(
    packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, k: int
) -> torch.Tensor:
    """Flat format -> float32 [nb*32] (without the per-tensor scale)."""
    cb = check_codebook(codebook, k).to(packed.device)
    idx = unpack_bitplanes(packed, k)
    return (cb[idx.long()] * decode_e4m4(absmax).unsqueeze(1)).reshape(-1)


# --------------------------------------------------------------------------- tiles


def padded_shape(K: int, N: int) -> tuple[int, int]:
    """(K, N) rounded up to whole repack tiles."""
    return -(-K // TILE_K) * TILE_K, -(-N // TILE_N) * TILE_N


def tiled_word_offset(n: torch.Tensor, kb: torch.Tensor, bit: torch.Tensor, K: int, N: int, k: int):
    """Seed formula: offset in the tiled words of bit `bit` of block (row n, K-block kb)."""
    Kp, Np = padded_shape(K, N)
    n_tiles, kb_per_tile = Np // TILE_N, BLOCKS_PER_TILE_K
    words_per_tile = TILE_N * kb_per_tile * k
    tile = (kb // kb_per_tile) * n_tiles + n // TILE_N
    col, kbt = n % TILE_N, kb % kb_per_tile
    return tile * words_per_tile + col * kb_per_tile * k + kbt * k + bit


def tiled_absmax_offset(n: torch.Tensor, kb: torch.Tensor, K: int, N: int):
    """Seed formula: offset in the tiled absmax bytes of block (row n, K-block kb)."""
    Kp, Np = padded_shape(K, N)
    n_tiles, kb_per_tile = Np // TILE_N, BLOCKS_PER_TILE_K
    tile = (kb // kb_per_tile) * n_tiles + n // TILE_N
    return tile * TILE_N * kb_per_tile + (n % TILE_N) * kb_per_tile + kb % kb_per_tile


def _check_flat(packed: torch.Tensor, absmax: torch.Tensor, K: int, N: int, k: int) -> None:
    check_k(k)
    if K <= 0 or N <= 0 or K % BLOCK:
        raise ValueError(
            f"K must be a positive multiple of {BLOCK} and N positive; got K={K}, N={N}"
        )
    if packed.dtype != torch.int32 or absmax.dtype != torch.uint8:
        raise TypeError(
            f"packed must be int32 and absmax uint8, got {packed.dtype}, {absmax.dtype}"
        )
    nb = N * K // BLOCK
    if packed.numel() != nb * k or absmax.numel() != nb:
        raise ValueError(
            f"for N={N}, K={K}, k={k} expected {nb * k} words and {nb} absmax bytes, "
            f"got {packed.numel()} and {absmax.numel()}"
        )


def repack_kbit(
    packed: torch.Tensor, absmax: torch.Tensor, K: int, N: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat format of W [N, K] -> tiled (int32 words, uint8 absmax), zero-padded to whole tiles.

    Padding blocks have zero words and absmax code 0, so they dequantize to 0.
    """
    _check_flat(packed, absmax, K, N, k)
    Kp, Np = padded_shape(K, N)
    kbp, kb = Kp // BLOCK, K // BLOCK
    words = packed.new_zeros(Np, kbp, k)
    words[:N, :kb] = packed.view(N, kb, k)
    amax = absmax.new_zeros(Np, kbp)
    amax[:N, :kb] = absmax.view(N, kb)
    nt, kt = Np // TILE_N, Kp // TILE_K
    # [n_tile, col, k_tile, kb, bit] -> [k_tile, n_tile, col, kb, bit]
    words = words.view(nt, TILE_N, kt, BLOCKS_PER_TILE_K, k).permute(2, 0, 1, 3, 4)
    amax = amax.view(nt, TILE_N, kt, BLOCKS_PER_TILE_K).permute(2, 0, 1, 3)
    return words.contiguous().view(-1), amax.contiguous().view(-1)


def unrepack_kbit(
    packed_tiled: torch.Tensor, absmax_tiled: torch.Tensor, K: int, N: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``repack_kbit``: tiled -> flat (padding dropped)."""
    Kp, Np = padded_shape(K, N)
    nt, kt = Np // TILE_N, Kp // TILE_K
    words = packed_tiled.view(kt, nt, TILE_N, BLOCKS_PER_TILE_K, k).permute(1, 2, 0, 3, 4)
    amax = absmax_tiled.view(kt, nt, TILE_N, BLOCKS_PER_TILE_K).permute(1, 2, 0, 3)
    words = words.reshape(Np, Kp // BLOCK, k)[:N, : K // BLOCK]
    amax = amax.reshape(Np, Kp // BLOCK)[:N, : K // BLOCK]
    return words.contiguous().view(-1), amax.contiguous().view(-1)


# --------------------------------------------------------------------------- weights


@dataclass
class KbitWeight:
    """A quantized weight W [N, K] in the tiled kbit format.

    Plain tensors and ints only, so it can be saved, moved with ``.to()`` and
    passed to torch ops. ``packed`` and ``absmax`` cover the zero-padded
    weight (whole 64 x 128 tiles); N and K are the true sizes.
    """

    packed: torch.Tensor  # int32 [k_tiles * n_tiles * 128 * 2 * k]
    absmax: torch.Tensor  # uint8 [k_tiles * n_tiles * 128 * 2]
    codebook: torch.Tensor  # float32 [2^k]
    scale: torch.Tensor  # float32 [1]: per-tensor scale (a power of two)
    k: int
    N: int
    K: int
    dtype: torch.dtype  # dtype of the original weight

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams: tiled words + absmax bytes (codebook and scale are tiny)."""
        return self.packed.numel() * 4 + self.absmax.numel()

    def to(self, device: torch.device | str) -> KbitWeight:
        return KbitWeight(
            self.packed.to(device), self.absmax.to(device), self.codebook.to(device),
            self.scale.to(device), self.k, self.N, self.K, self.dtype,
        )  # fmt: skip


def tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scale putting max|w| / scale in (8, 16]: every block absmax then
    lies in E4M4's normal range unless it is 2^14 times smaller than the tensor's."""
    amax = float(w.abs().amax()) if w.numel() else 0.0
    exp = 0 if amax == 0.0 else math.ceil(math.log2(amax)) - 4
    return torch.tensor([2.0**exp], dtype=torch.float32, device=w.device)


def quantize(W: torch.Tensor, k: int = 4, codebook: torch.Tensor | None = None) -> KbitWeight:
    """Quantize W [N, K] (fp32/fp16/bf16, CPU or CUDA) to the tiled kbit format."""
    check_k(k)
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"W must be a torch.Tensor, got {type(W).__name__}")
    if W.ndim != 2:
        raise ValueError(f"W must be 2-D [N, K], got shape {tuple(W.shape)}")
    if W.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"W must be float32, float16 or bfloat16, got {W.dtype}")
    N, K = W.shape
    if N == 0 or K == 0 or K % BLOCK:
        raise ValueError(
            f"W's K (columns) must be a positive multiple of {BLOCK}, got shape {(N, K)}"
        )
    cb = check_codebook(normal_float_codebook(k) if codebook is None else codebook, k)
    # Contiguous: a transposed or sliced W must still view as blocks of 32. ``.to`` alone is
    # not enough: a float32 W comes back as itself, strides and all (one copy at most).
    w = W.detach().to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    _check_weight_values(w)
    scale = tensor_scale(w)
    flat, amax = _quantize_flat((w / scale).view(-1, BLOCK), cb, k)
    packed, absmax = repack_kbit(flat, amax, K, N, k)
    return KbitWeight(packed, absmax, cb.to(W.device), scale, k, N, K, W.dtype)


def dequantize(qw: KbitWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Tiled kbit weight -> dense [N, K] in `dtype` (default: the original dtype)."""
    flat, amax = unrepack_kbit(qw.packed, qw.absmax, qw.K, qw.N, qw.k)
    w = dequantize_kbit(flat, amax, qw.codebook, qw.k) * qw.scale.to(flat.device)
    return w.view(qw.N, qw.K).to(dtype or qw.dtype)
