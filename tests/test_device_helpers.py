"""The SWAR plane -> index-field transform, run on host ints (the same code the kernels trace)."""

import pytest
import torch

from kbit_cute import format as fmt
from kbit_cute.kernels import device_helpers as dh
from kbit_cute.kernels.device_helpers import field_bits, planes_to_fields


@pytest.mark.parametrize("select_widths", [(), (1, 2, 4), (1,)])
@pytest.mark.parametrize("zero_fill", [True, False])
@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_fields_give_every_index_to_a_shuffle(k, zero_fill, select_widths, gen):
    """Every element's index in the low k bits of its field (shfl.idx reads bits 4:0 of its
    lane operand, lanes hold codebook[lane % 2^k]); with ``zero_fill`` the bits above it are
    zero. The bit-select merges give the same words as the and-or ones."""
    idx = torch.randint(0, 1 << k, (50, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k).view(50, k)
    width = field_bits(k)
    for b in range(50):
        planes = [int(w) & 0xFFFFFFFF for w in packed[b].tolist()]
        seen = []
        fields = planes_to_fields(planes, k, 1, zero_fill, select_widths)
        assert [w for w, _ in fields] == [
            w for w, _ in planes_to_fields(planes, k, 1, zero_fill, ())
        ]
        for word, elems in fields:
            for f, j in enumerate(elems):
                lane = (word >> (f * width)) & 31  # what shfl.idx reads of its lane operand
                assert lane % (1 << k) == idx[b, j].item(), (k, b, j)
                if zero_fill:
                    assert (word >> (f * width)) & ((1 << width) - 1) == idx[b, j].item()
                seen.append(j)
        assert sorted(seen) == list(range(32))


def test_bit_select_takes_each_bit_from_one_side():
    x, y, mask = 0x1234_5678, 0x9ABC_DEF0, 0x0F0F_0F0F
    assert dh.bit_select(mask, x, y) == 0x92B4_D6F8
    assert dh.bit_select(0xFFFF_FFFF, x, y) == x and dh.bit_select(0, x, y) == y


_prmt = dh._prmt_host  # host model of prmt.b32, shared with the GEMM's tests


def _gemv_lookups():
    from kbit_cute.kernels.gemv import GEMV_LOOKUP, LOOKUP, GemvKernel

    names = sorted(set(LOOKUP.values()) | set(GEMV_LOOKUP.values()) | {"pair_table5"})
    return [(k, lk) for k in (2, 3, 4, 5) for lk in names if GemvKernel.lookup_fits(lk, k)]


@pytest.mark.parametrize("m", (1, 4))
@pytest.mark.parametrize("k, lookup", _gemv_lookups())
def test_gemv_lookups_give_the_mma_pairs(k, lookup, m, gen):
    """The GEMV's trace-time plan, emulated on host ints: each of a thread's 8 register
    pairs per column holds two distinct K positions, the 16 positions are covered once, the
    second column's fields mirror the first's, and every lookup that serves this k (pair
    shuffle, quad table, byte tables, pair table or single shuffles) returns those
    positions' indices from the fields as the kernel merges them at this M."""
    from kbit_cute.kernels.device_helpers import (
        pair5_entry_indices,
        pair5_high_bytes,
        pair5_selectors,
    )
    from kbit_cute.kernels.gemv import THREAD_K, GemvKernel, _pairs_of

    kern = GemvKernel(k, m, None, lookup=lookup)
    W = kern.field_width
    idx = torch.randint(0, 1 << k, (1, 32), generator=gen, dtype=torch.uint8)
    planes = [int(w) & 0xFFFFFFFF for w in fmt.pack_bitplanes(idx, k).tolist()]
    idx = idx[0].tolist()
    if kern.high_plane:  # planes 0-3 as k = 4; plane 4 into the address (lanes 0, 5, 31)
        fields = planes_to_fields(planes[:4], 4, W, False, kern.select_widths)
        highs = {
            lane: pair5_high_bytes(planes[4], fields, lane * 0x04040404) for lane in (0, 5, 31)
        }
    else:
        fields = planes_to_fields(planes, k, W, kern.byte_tables, kern.select_widths)  # as traced
    pairs = _pairs_of(fields, W)
    positions = sorted(e for _, (_, ea), (_, eb) in pairs for e in (ea, eb))
    assert positions == list(range(THREAD_K))
    codes = list(range(1, (1 << k) + 1))  # distinct 16-bit "values" per index
    for word, (fa, ea), (fb, eb) in pairs:
        for half, (fa2, fb2) in enumerate([(fa, fb), (fa + 16 // W, fb + 16 // W)]):
            ja, jb = ea + 16 * half, eb + 16 * half
            if kern.lookup == "pair_shuffle":
                lane = (word >> (fa2 * W)) & 31
                got = (codes[lane & 3], codes[(lane >> 2) & 3])
            elif kern.lookup == "byte_tables":
                tables = [0, 0, 0, 0]  # lo0, lo1, hi0, hi1 bytes of codes 0-3, 4-7
                for i, c in enumerate(codes):
                    tables[i // 4] |= (c & 0xFF) << (8 * (i % 4))
                    tables[2 + i // 4] |= (c >> 8) << (8 * (i % 4))
                sel = word if fa2 < 4 else word >> 16
                lo = _prmt(tables[0], tables[1], sel & 0xFFFF)
                hi = _prmt(tables[2], tables[3], sel & 0xFFFF)
                pair = _prmt(lo, hi, dh.byte_pair_selector(fa2 % 4, fb2 % 4))
                got = (pair & 0xFFFF, pair >> 16)
            elif kern.lookup == "quad_table":
                # row v of the table: (codes of fields 0, 1 of v), (fields 2, 3); the address
                # is a prmt of the word's byte and lane 5's copy offset
                first = fa2 - fa2 % 4  # the quad's first field: the pair is its low or high half
                addr = _prmt(word, 5 * 8, 0x5504 | (first // 4) << 4)
                assert addr % 256 == 5 * 8 and addr < 256 * 256
                v = addr >> 8
                quad = [codes[(v >> (2 * i)) & 3] for i in range(4)]
                got = tuple(quad[2 * (fa2 % 4 // 2) : 2 * (fa2 % 4 // 2) + 2])
                assert fb2 == fa2 + 1
            elif kern.high_plane:
                # byte address hb << 16 | fields' byte << 8 | ha << 7 | lane << 2
                q = next(q for q, (w, _) in enumerate(fields) if w is word)
                first, second = pair5_selectors(fa2 // 2)
                for lane, high in highs.items():
                    ha_bytes, hb_bytes = high[q]
                    addr = _prmt(_prmt(word, ha_bytes, first), hb_bytes, second)
                    assert addr % 128 == lane * 4 and addr < 2 * 65536 and fb2 == fa2 + 1
                    # the entry the table fill wrote there (row of 256 bytes, 16-byte slice)
                    lo, hi = pair5_entry_indices(addr >> 8, addr % 256 // 16)
                    got = (codes[lo], codes[hi])
                    assert got == (codes[idx[ja]], codes[idx[jb]]), (lane, ja, jb)
            else:
                got = tuple(codes[(word >> (f * W)) & 31 & ((1 << k) - 1)] for f in (fa2, fb2))
            assert got == (codes[idx[ja]], codes[idx[jb]]), (k, ja, jb)


# k with the lookup ``GemvKernel.row_roles`` serves (k = 3: the pair table's layout, which
# ``gemv.ROLE_MAX_M`` does not take yet)
_ROLE_KS = [2, 3, 4]


def _role_fields(k, idx_row):
    """(kernel config, fields of the planes of 32 indices: 16 K positions of two columns)."""
    from kbit_cute.kernels.gemv import GemvKernel

    kern = GemvKernel(k, 1, None)
    packed = fmt.pack_bitplanes(torch.tensor([idx_row], dtype=torch.uint8), k)
    planes = [int(w) & 0xFFFFFFFF for w in packed.tolist()]
    return kern, planes_to_fields(planes, k, kern.field_width, False, kern.select_widths)


def _role_entry(k, word, byte, half):
    """The indices of the table row the (prmt-built) address of ``byte`` of a fields word
    selects: a pair entry (fields 0, 1: 4 bits each), or half 0 / 1 of a quad entry (fields
    0, 1 | 2, 3: 2 bits each)."""
    v = (word >> (8 * byte)) & 0xFF
    mask = (1 << k) - 1  # (the tables repeat the codebook modulo 2^k)
    if half is None:
        return [v & mask, (v >> 4) & mask]
    return [(v >> (4 * half + 2 * i)) & 3 for i in range(2)]


@pytest.mark.parametrize("k", _ROLE_KS)
def test_gemv_row_roles_give_the_mma_rows(k, gen):
    """Row roles, emulated on host ints (16 random draws): for each column of a thread's
    row-tile pair and each mma step, the A fragment's row g registers hold role 0's K
    positions (those read_activations loads) and its row g + 8 registers the same positions
    + the role shift, which a role 1 lane's activations start at; each column's 16 positions
    are covered once, and the entries hold the indices the planes hold there."""
    from kbit_cute.kernels.gemv import ROLE_RUNS, THREAD_K, _role_steps

    for idx in torch.randint(0, 1 << k, (16, 32), generator=gen, dtype=torch.uint8).tolist():
        kern, fields = _role_fields(k, idx)
        shift, runs = ROLE_RUNS[kern.lookup]
        words = [w for w, _ in fields]
        steps = _role_steps(fields, kern.lookup)
        role0 = sorted(e for _, ks in steps for pair in ks for e in pair)
        assert role0 == [e for first, n in runs for e in range(first, first + n)]
        for h in range(2):  # the row-tile pair's column: bits 16 h .. 16 h + 15 of the planes
            seen = []
            for sources, ks in steps:
                regs = [_role_entry(k, words[w], b + 2 * h, half) for w, b, half in sources]
                for i, (ea, eb) in enumerate(ks):  # slot pair i: rows g (role 0), g + 8
                    assert regs[2 * i] == [idx[16 * h + ea], idx[16 * h + eb]]
                    assert regs[2 * i + 1] == [idx[16 * h + ea + shift], idx[16 * h + eb + shift]]
                    seen += [ea, eb, ea + shift, eb + shift]
            assert sorted(seen) == list(range(THREAD_K))


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("k", _ROLE_KS)
def test_gemv_row_roles_sum_each_rows_blocks(k, M, gen):
    """A whole warp's K tile with row roles, emulated on host ints with mma.sync m16n8k16's
    fragment layout (lane 4 g + t: A rows g, g + 8 at K slots 2 t, 2 t + 1, 2 t + 8, 2 t + 9;
    B column g; C[g, 2 t], C[g + 8, 2 t + 1] its values 0 and 3): the lanes that load
    activations (mma column 4 m + 2 b + role: row m's block b, role 1 shifted), each lane's
    c0 + c3 times its column's block t % 2 scale, and ``combine_roles``' shuffles give lane
    (g, t < M) row t's dot product of each of its 4 columns, exactly."""
    from kbit_cute.kernels.gemv import ROLE_RUNS, _role_steps

    cols, K = 32, 64  # a warp's columns, one K tile: thread t's run is K positions 16 t..
    idx = torch.randint(0, 1 << k, (cols, K), generator=gen).tolist()
    cb = torch.randint(-8, 9, (1 << k,), generator=gen).tolist()  # small ints: exact sums
    scale = torch.randint(1, 5, (cols, 2), generator=gen).tolist()  # per column and block
    x = torch.randint(-4, 5, (M, K), generator=gen).tolist()
    kern, _ = _role_fields(k, idx[0][:32])
    shift, runs = ROLE_RUNS[kern.lookup]
    role0 = [e for first, n in runs for e in range(first, first + n)]
    acc = {}  # (lane, column) -> sum
    for r in range(2):  # row tile pairs: columns 16 r + g and 16 r + 8 + g of lane group g
        lane_fields = {}
        for g in range(8):
            for t in range(4):
                a, b = 16 * r + g, 16 * r + 8 + g
                lane_fields[g, t] = _role_fields(
                    k, idx[a][16 * t : 16 * t + 16] + idx[b][16 * t : 16 * t + 16]
                )[1]
        for h in range(2):
            C = [[0] * 8 for _ in range(16)]
            for s in range(2):  # the column's two mma steps
                A = [[0] * 16 for _ in range(16)]
                B = [[0] * 8 for _ in range(16)]
                for g in range(8):
                    for t in range(4):
                        fields = lane_fields[g, t]
                        sources, ks = _role_steps(fields, kern.lookup)[s]
                        words = [w for w, _ in fields]
                        regs = [_role_entry(k, words[w], b + 2 * h, half) for w, b, half in sources]
                        for i, (row, slot) in enumerate([(g, 0), (g + 8, 0), (g, 8), (g + 8, 8)]):
                            A[row][2 * t + slot : 2 * t + slot + 2] = [cb[v] for v in regs[i]]
                        m, blk, role = g // 4, g // 2 % 2, g % 2  # B column g
                        act = [0] * 16
                        if m < M and blk == t // 2:
                            for e in role0:
                                act[e] = x[m][16 * t + e + role * shift]
                        for i, (ea, eb) in enumerate(ks):
                            B[2 * t + 8 * i][g], B[2 * t + 8 * i + 1][g] = act[ea], act[eb]
                for i in range(16):
                    for n in range(8):
                        C[i][n] += sum(A[i][j] * B[j][n] for j in range(16))
            for g in range(8):
                for t in range(4):
                    c = 16 * r + 8 * h + g
                    acc[4 * g + t, c] = scale[c][t % 2] * (C[g][2 * t] + C[g + 8][2 * t + 1])
    for g in range(8):
        for t in range(4):
            lane = 4 * g + t
            for r in range(2):
                for h in range(2):
                    c = 16 * r + 8 * h + g
                    # combine_roles: both blocks (xor 1), then row t from lane 4 g + 2 t
                    src = lane // 4 * 4 + lane % 4 * 2 % 4 if M > 1 else lane
                    v_src = acc[src, c] + acc[src ^ 1, c]
                    if t < M:
                        want = sum(cb[idx[c][j]] * scale[c][j // 32] * x[t][j] for j in range(K))
                        assert v_src == want, (k, M, lane, c)


def test_pair_selector_joins_halves():
    a, b = 0x2222_1111, 0x4444_3333
    assert _prmt(a, b, dh.pair_selector(0, 0)) == 0x3333_1111
    assert _prmt(a, b, dh.pair_selector(1, 1)) == 0x4444_2222
    assert _prmt(a, b, dh.pair_selector(0, 1)) == 0x4444_1111


def test_absmax_pair_reads_both_codes_as_exact_fp16_sixteenths():
    # absmax_pair_f32: bytes 0, 1 of a column's codes -> PRMT 0x4140 puts them in the two
    # 16-bit halves, << 6 makes each an fp16 whose value is the E4M4 value / SPLIT_FACTOR,
    # for every code (subnormal ones too).
    codes = torch.arange(256, dtype=torch.int64)
    pairs = codes | (codes.flip(0) << 8)  # a column's block 0 and block 1 codes
    for x, c0, c1 in zip(pairs.tolist(), codes.tolist(), codes.flip(0).tolist(), strict=True):
        half2 = (_prmt(x, 0, 0x4140) << 6) & 0xFFFFFFFF
        lo, hi = half2 & 0xFFFF, half2 >> 16
        as_fp16 = torch.tensor([lo, hi], dtype=torch.int32).to(torch.int16).view(torch.float16)
        want = fmt.decode_e4m4(torch.tensor([c0, c1], dtype=torch.uint8)) / dh.SPLIT_FACTOR
        assert torch.equal(as_fp16.float(), want), (c0, c1)


def test_codebook_pair_selector_picks_two_entries():
    """k = 2's quad-table fill: prmt over the codebook's two pair registers (entries 0, 1 |
    2, 3, 16 bits each) with ``codebook_pair_selector(i, j)`` gives entry i low, entry j
    high, for every pair of indices."""
    entries = [0x1A2B, 0x3C4D, 0x5E6F, 0x7081]
    lo, hi = entries[0] | entries[1] << 16, entries[2] | entries[3] << 16
    for i in range(4):
        for j in range(4):
            got = _prmt(lo, hi, dh.codebook_pair_selector(i, j))
            assert got == entries[i] | entries[j] << 16, (i, j)


def test_gemv_quad_skew_stays_under_half_a_run(monkeypatch):
    """The crossing variants' runs skewed by quad (``gemv.QUAD_SKEW``): quad q of n starts
    ``skew_shift`` K tiles early, none at a CTA's ends (q = 0, n), the same for q and n - q,
    and under half a mean run, so that a unit's worker is its equal run's or the next
    (``skewed_worker``); a skew that would shift more is refused."""
    from kbit_cute.kernels import gemv

    kern = gemv.GemvKernel(3, 1, None, crossing=True)
    assert kern.skew16 == round(gemv.QUAD_SKEW[3] / 2 * 65536) > 0
    assert gemv.GemvKernel(3, 1, None).skew16 == 0  # only the crossing variants
    for units, workers in [(28672, 924), (7168, 528), (2048, 264), (1280, 1000), (64, 5)]:
        mean = units / workers
        unit = kern.skew16 * units // workers  # (``skew_unit``)
        for n in range(1, kern.quads + 1):
            shifts = [gemv.GemvKernel.skew_shift(q, n, unit) for q in range(n + 1)]
            assert shifts[0] == shifts[n] == 0
            assert shifts == shifts[::-1]
            assert max(shifts) < max(0.5 * mean, 1)
    monkeypatch.setitem(gemv.QUAD_SKEW, 3, 0.2)
    with pytest.raises(ValueError, match="QUAD_SKEW"):
        gemv.GemvKernel(3, 1, None, crossing=True)
