"""The tiled kbit format and the kernels' tilings as CuTe layouts.

One module for the kernels (which call these functions while they are traced,
with dynamic tile counts) and for the host side (tests and the ``layouts``
visualization tools evaluate them with static sizes through ``layout_offsets``).
The pure-torch reference of the same order is ``kbit_cute.format.tiled_word_offset``;
``tests/test_layouts.py`` proves that both give the same offsets.

Coordinates follow the weight W [N, K]: ``n`` is the output row, ``kb`` the
32-wide K block, ``bit`` the bit plane. Hierarchical modes (col, n_tile) and
(kb_in_tile, k_tile) let a plain row index ``n`` or block index ``kb`` address
the tiled memory, CuTe's colexicographic order splitting them for us.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import cutlass.cute as cute

from .format import BLOCKS_PER_TILE_K, TILE_N


def tile_words_layout(k: int) -> cute.Layout:
    """One repack tile: (col, kb, bit) -> word offset, ordered [col][kb][bit]."""
    return cute.make_layout((TILE_N, BLOCKS_PER_TILE_K, k), stride=(BLOCKS_PER_TILE_K * k, k, 1))


def tile_absmax_layout() -> cute.Layout:
    """One repack tile: (col, kb) -> absmax byte offset, ordered [col][kb]."""
    return cute.make_layout((TILE_N, BLOCKS_PER_TILE_K), stride=(BLOCKS_PER_TILE_K, 1))


def weight_words_layout(n_tiles, k_tiles, k: int) -> cute.Layout:
    """Whole tiled weight: ((col, n_tile), (kb, k_tile), bit) -> word offset.

    Tiles are ordered k_tile * n_tiles + n_tile. ``n_tiles``/``k_tiles`` may be
    dynamic (kernel) or static (host).
    """
    words_per_tile = TILE_N * BLOCKS_PER_TILE_K * k
    return cute.make_layout(
        ((TILE_N, n_tiles), (BLOCKS_PER_TILE_K, k_tiles), k),
        stride=(
            (BLOCKS_PER_TILE_K * k, words_per_tile),
            (k, n_tiles * words_per_tile),
            1,
        ),
    )


def weight_absmax_layout(n_tiles, k_tiles) -> cute.Layout:
    """Whole tiled weight: ((col, n_tile), (kb, k_tile)) -> absmax byte offset."""
    bytes_per_tile = TILE_N * BLOCKS_PER_TILE_K
    return cute.make_layout(
        ((TILE_N, n_tiles), (BLOCKS_PER_TILE_K, k_tiles)),
        stride=((BLOCKS_PER_TILE_K, bytes_per_tile), (1, n_tiles * bytes_per_tile)),
    )


# --------------------------------------------------------------------------- host side


def layout_offsets(make: Callable[[], cute.Layout]) -> tuple[tuple, list[int]]:
    """Evaluate a static layout on the host: (shape, offset of every linear index).

    CuTe layouts exist only while a function is traced, so ``make`` is called
    inside a throw-away ``cute.jit`` trace; static layouts fold to Python ints
    there. Only ints and tuples leave the trace (MLIR objects must not).
    """
    result: dict = {}

    @cute.jit
    def _probe():
        layout = make()
        result["shape"] = _to_ints(layout.shape)
        result["offsets"] = [int(layout(i)) for i in range(cute.size(layout))]

    _probe()
    return result["shape"], result["offsets"]


def layout_string(make: Callable[[], cute.Layout]) -> str:
    """The layout's ``shape:stride`` text, as CuTe prints it."""
    result: dict = {}

    @cute.jit
    def _probe():
        result["text"] = str(make())

    _probe()
    return result["text"]


def _to_ints(t):
    return tuple(_to_ints(x) for x in t) if isinstance(t, tuple) else int(t)


# --------------------------------------------------------------------------- kernels' layouts

KERNEL_KINDS = ("gemv", "gemm", "moe")
MOE_CONFIGS = ("gate_up", "down")
MOE_INTERMEDIATE = 512  # gate_up pictures: the up half starts this many columns on


@dataclass(frozen=True)
class SmemAccess:
    """A kernel's shared-memory access, for a bank-conflict map; evaluated on the host.

    ``evaluate()`` returns ``(access_bytes, addresses)``: every access moves
    ``access_bytes`` (1..16) adjacent bytes, and ``addresses`` has one list per
    instruction (pass, vector, ...) holding, per thread of the CTA, the byte address it
    accesses (None: idle in that instruction).
    """

    caption: str
    evaluate: Callable[[], tuple[int, list[list[int | None]]]]


Entry = Callable[[], object] | SmemAccess | str


def kernel_layouts(kind: str, k: int, config: str | None = None) -> dict[str, Entry]:
    """The layouts kernel ``kind`` uses for ``k`` bits, for ``python -m layouts kernel``.

    Name -> entry (see ``layouts/kernel.py``): a zero-argument maker called inside a trace
    (``*_tv`` makers return ``(tile_mn, layout_tv)``, ``*_smem`` makers ``(layout,
    elem_bytes, vec)``, others a layout, optionally with a caption string), an
    ``SmemAccess`` (a bank map), or a string (a note: e.g. why there is no map). Every
    entry calls the functions the kernel itself builds its objects with, so the pictures
    cannot drift from the code. ``config``: gemm, a ``GemmConfig`` name (default the
    dispatch table's smallest-M config for ``k``); moe, ``gate_up[:I]`` or ``down``
    (default both; I, the drawn intermediate size, default ``MOE_INTERMEDIATE``).
    """
    if kind not in KERNEL_KINDS:
        raise ValueError(f"kernel kind must be one of {KERNEL_KINDS}, got {kind!r}")
    if k not in (2, 3, 4, 5):
        raise ValueError(f"k must be 2..5, got {k}")
    if kind == "gemv":
        if config is not None:
            raise ValueError("the gemv kernel has no configs; drop --config")
        return _gemv_layouts(k)
    if kind == "moe":
        return _moe_layouts(config)
    return _gemm_layouts(k, config)


def _mma_tv(tiled_mma) -> dict[str, Entry]:
    """A/B/C thread-value layouts of a tiled MMA over its tiles (M x K, N x K, M x N)."""

    def tile(a: int, b: int) -> tuple[int, int]:
        return int(tiled_mma().get_tile_size(a)), int(tiled_mma().get_tile_size(b))

    return {
        "mma_a_tv": lambda: (tile(0, 2), tiled_mma().tv_layout_A_tiled),
        "mma_b_tv": lambda: (tile(1, 2), tiled_mma().tv_layout_B_tiled),
        "mma_c_tv": lambda: (tile(0, 1), tiled_mma().tv_layout_C_tiled),
    }


GEMV_SMEM_NOTE = (
    "no shared-memory tile, so no bank map: each warp copies its 32 columns' K tiles as they "
    "lie in the format (plane words, absmax bytes, activation rows) into a cp.async ring of "
    "its own in shared memory, and a CTA's quads of warps share a lookup table there "
    "(GemvKernel)"
)


def _gemv_layouts(k: int) -> dict[str, Entry]:
    import cutlass

    from .kernels.gemv import gemv_mma

    entries = _mma_tv(lambda: gemv_mma(cutlass.Float16)[1])
    entries["weight_words"] = lambda: weight_words_layout(1, 1, k)  # one repack tile
    entries["weight_absmax"] = lambda: weight_absmax_layout(1, 1)
    entries["smem"] = GEMV_SMEM_NOTE
    return entries


def _moe_layouts(config: str | None) -> dict[str, Entry]:
    import cutlass

    from .kernels.gemv import gemv_mma

    try:  # the grouped kernels reuse the GEMV's mma and add their column layouts
        grouped_gemv = importlib.import_module(".kernels.grouped_gemv", __package__)
    except ImportError as e:
        raise NotImplementedError(
            f"cannot import the grouped expert kernel (kbit_cute/kernels/grouped_gemv.py): {e}"
        ) from e
    configs = [_moe_config(config)] if config else [("gate_up", MOE_INTERMEDIATE), ("down", 0)]
    entries = _mma_tv(lambda: gemv_mma(cutlass.Float16)[1])
    kinds = [
        ("cta", "CTA", "cta_column_layout", "warps 0-1 gate, 2-3 up"),
        ("stream", "stream quad", "stream_column_layout",
         "each warp 16 gate columns (r = 0) and the same 16 of up (r = 1)"),
    ]  # fmt: skip
    for name, inter in configs:
        for prefix, who, fn_name, gate_up_note in kinds:
            caption = (
                f"{who} columns: cell = weight column - the {who}'s first column ({fn_name}); "
                "row = (g, w): lanes 4g..4g+3 of warp w (thread 32w + 4g + t, t = 0..3 share "
                "the column); column = (h, r): the mma values of column half h, row tile r"
            )
            if name == "gate_up":
                caption += f"; drawn with intermediate = {inter}: {gate_up_note}"

            def columns(gate_up=name == "gate_up", inter=inter, caption=caption, fn=fn_name):
                lay = getattr(grouped_gemv, fn)(gate_up, inter)  # dense: inter not used
                # (g, h, r, w) -> ((g, w), (h, r)): rows are the threads, columns their values
                lay = cute.select(lay, [0, 3, 1, 2])
                return cute.group_modes(cute.group_modes(lay, 0, 2), 1, 3), caption

            entries[f"{prefix}_columns_{name}"] = columns
    entries["smem"] = (
        "shared memory: as in the GEMV, each warp streams its 32 columns' plane words, absmax "
        "bytes and activation rows through its own cp.async ring (kernel gemv); besides, the "
        "CTA kernel holds the slot -> expert scan and the epilogue's rows, the stream kernel "
        "the pair table its quads share and the slot table (expert, first row | rows)"
    )
    return entries


def _moe_config(config: str) -> tuple[str, int]:
    """``gate_up``, ``gate_up:I`` or ``down`` -> (name, intermediate size to draw)."""
    name, _, inter = config.partition(":")
    if name not in MOE_CONFIGS or (inter and name != "gate_up"):
        raise ValueError(f"moe config must be 'gate_up[:I]' or 'down', got {config!r}")
    if not inter:
        return name, MOE_INTERMEDIATE if name == "gate_up" else 0
    if not inter.isdigit() or int(inter) < 64 or int(inter) % 64:
        raise ValueError(f"gate_up:I needs I a positive multiple of 64, got {inter!r}")
    return name, int(inter)


# GEMM plans the shared-memory access map needs (gemm.py, issue 8); before they exist the
# map is a note naming them instead of a redrawing of the kernel's arithmetic.
GEMM_PLANS = (
    "a_copy_plan",
    "w_copy_passes",
    "w_copy_plan",
    "absmax_copy_plan",
    "table_passes",
    "table_plan",
    "table_store_bytes",
    "c_smem_layout",
)


def _gemm_layouts(k: int, config: str | None) -> dict[str, Entry]:
    from .gemm_dispatch import table_configs
    from .kernels.gemm import GemmConfig, GemmKernel

    cfg = GemmConfig.parse(config) if config else table_configs(k)[0]
    kern = GemmKernel(k, "f16", cfg)  # raises ValueError naming a bad config
    plan = kern.plan
    # The maps show stage 0 and repack tile 0; the other stages and tiles start at
    # multiples of 128 bytes (whole bank rows), so they hit the same banks.
    for key in ("a_stage", "w_stage", "s_stage", "w", "s", "table"):
        if plan[key] % 128:
            raise ValueError(
                f"{cfg.name}: smem region {key} at {plan[key]} is not 128-byte aligned"
            )
    if kern.tile_words * 4 % 128:
        raise ValueError(f"{cfg.name}: repack tiles are not 128-byte multiples")

    def a_stage0():  # one pipeline stage of the swizzled A ring: (TILE_M, TILE_K)
        return cute.slice_(kern.a_smem_layout(), (None, None, 0))

    def ldsm_a_tv():  # the A copy's TiledCopy: (thread, value) -> its (M, 16) source tile
        ldsm = kern.make_a_ldsm(kern.make_tiled_mma())
        return tuple(int(cute.size(t)) for t in ldsm.tiler_mn), ldsm.layout_src_tv_tiled

    entries = _mma_tv(kern.make_tiled_mma)
    entries["ldsm_a_tv"] = ldsm_a_tv
    entries["a_smem_layout"] = a_stage0  # drawn as offsets: the swizzle
    entries["ldsm_a_smem"] = SmemAccess(
        "A fragments, shared -> registers: ldmatrix.x4 (thr_ldsm.partition_S(sA)), stage 0, "
        "one instruction per (MI, KS) step",
        lambda: _ldsm_a_addresses(kern, a_stage0),
    )
    missing = [m for m in GEMM_PLANS if not hasattr(kern, m)]
    if missing:
        entries["smem_stores"] = (
            "store maps not drawn: gemm.py computes these addresses inline; they need "
            f"GemmKernel.{', .'.join(missing)} (issue 8), shared by the kernel and the maps"
        )
        return entries
    entries.update(_gemm_stores(kern, a_stage0))
    return entries


def _gemm_stores(kern, a_stage0) -> dict[str, Entry]:
    """Bank maps of the GEMM's shared-memory stores, from the kernel's own store plans."""
    threads, plan, cfg = kern.threads, kern.plan, kern.cfg

    def by_pass(plan_of, passes: int, address, access_bytes: int):
        # plan_of(t, i) -> (destination, active) of thread t in pass i: one instruction
        def evaluate():
            out = []
            for i in range(passes):
                plans = [plan_of(t, i) for t in range(threads)]
                out.append([address(dst) if active else None for dst, active in plans])
            return access_bytes, out

        return evaluate

    def a_stores():
        _, stage = layout_offsets(a_stage0)  # (TILE_M, TILE_K) colex -> element offset

        def address(crd):
            row, kk = crd
            return plan["a"] + 2 * stage[row + cfg.tile_m * kk]

        return by_pass(kern.a_copy_plan, kern.a_passes(), address, 16)()

    return {
        "a_store_smem": SmemAccess(
            "A tile, global -> shared: cp.async 16 B per thread and pass (a_copy_plan) into the "
            "swizzled stage (a_smem_layout)",
            a_stores,
        ),
        "w_store_smem": SmemAccess(
            "kbit words of a repack tile, global -> shared: cp.async 16 B per thread and pass "
            "(w_copy_plan)",
            by_pass(kern.w_copy_plan, kern.w_copy_passes(), lambda w: plan["w"] + 4 * w, 16),
        ),
        "absmax_store_smem": SmemAccess(
            "absmax bytes of a repack tile, global -> shared: cp.async 16 B (absmax_copy_plan)",
            by_pass(lambda t, _: kern.absmax_copy_plan(t), 1, lambda b: plan["s"] + b, 16),
        ),
        "table_store_smem": SmemAccess(
            f"pair table, 2^{2 * kern.k} packed codebook pairs"
            + (", one copy per lane: 16 B (4 lanes' copies)" if cfg.copy_per_lane else ": 4 B")
            + " per thread and pass (table_plan)",
            by_pass(
                kern.table_plan,
                kern.table_passes(),
                lambda dst: plan["table"] + dst[1],
                kern.table_store_bytes(),
            ),
        ),
        "c_store_smem": SmemAccess(
            "epilogue staging, registers -> shared: thr_mma.partition_C(sC) (c_smem_layout), "
            "autovec_copy of the output fragment",
            lambda: _c_store_addresses(kern),
        ),
    }


def thread_coords(
    make_partition: Callable[[], Callable[[int], object]], threads: int
) -> list[list[tuple]]:
    """``coords[t][v]``: coordinate of value ``v`` of thread t's partition of an identity
    tensor; ``make_partition()`` (called in a trace) builds the tiled copy or MMA and
    returns ``t -> partition``, as the kernel partitions its tensor with its thread index.

    Partitions of one tensor differ between threads only by their first coordinate, so
    thread 0's values are evaluated one by one (slow: ~2 ms each) and shifted for the rest;
    the last thread's are evaluated too, as a check.
    """
    out: dict = {}

    def body():
        partition = make_partition()
        parts = [partition(t) for t in range(threads)]
        first, last = parts[0], parts[-1]
        out["values"] = [_to_ints(first[i]) for i in range(cute.size(first))]
        out["last"] = [_to_ints(last[i]) for i in range(cute.size(last))]
        out["bases"] = [_to_ints(p.iterator) for p in parts]

    @cute.jit
    def _probe():
        body()  # a plain function: the DSL would stage the loops of a jit body

    _probe()
    base0 = out["bases"][0]
    deltas = [tuple(c - b for c, b in zip(v, base0, strict=True)) for v in out["values"]]
    coords = [
        [tuple(b + d for b, d in zip(base, delta, strict=True)) for delta in deltas]
        for base in out["bases"]
    ]
    if coords[-1] != out["last"]:
        raise ValueError("thread partitions differ by more than their first coordinate")
    return coords


def _colex(crd: tuple, shape: tuple) -> int:
    idx, mult = 0, 1
    for c, n in zip(crd, shape, strict=True):
        idx, mult = idx + c * mult, mult * n
    return idx


def _vector_accesses(
    offsets: list[list[int]], vec: int, elem_bytes: int, base: int = 0
) -> list[list[int]]:
    """[instruction][thread] byte address, each thread's values cut into vectors of ``vec``
    (the kernel's value order); raises unless every vector is ``vec`` adjacent elements."""
    values = len(offsets[0])
    out = []
    for a in range(values // vec):
        row = []
        for t, offs in enumerate(offsets):
            v = offs[a * vec : (a + 1) * vec]
            if v != list(range(v[0], v[0] + vec)):
                raise ValueError(f"thread {t}: values {a * vec}.. sit at {v}, not one vector")
            row.append(base + v[0] * elem_bytes)
        out.append(row)
    return out


def _ldsm_a_addresses(kern, a_stage0) -> tuple[int, list[list[int]]]:
    """ldmatrix of the A fragments: the kernel's ``thr_ldsm.partition_S(sA)``, stage 0."""
    cfg = kern.cfg
    shape = (cfg.tile_m, cfg.tile_k, cfg.stages)
    per_copy: dict = {}

    def make_partition():
        ldsm = kern.make_a_ldsm(kern.make_tiled_mma())
        sA = cute.make_identity_tensor(shape)  # coordinates instead of the smem tensor
        # values per thread and instruction: mode 0 of a copy partition
        per_copy["n"] = int(cute.size(ldsm.get_slice(0).partition_S(sA), mode=[0]))
        return lambda t: ldsm.get_slice(t).partition_S(sA)

    coords = thread_coords(make_partition, kern.threads)
    _, stage = layout_offsets(a_stage0)
    flat = (cfg.tile_m, cfg.tile_k)
    offsets = [[stage[_colex(c[:2], flat)] for c in row if c[2] == 0] for row in coords]
    n = per_copy["n"]
    return 2 * n, _vector_accesses(offsets, n, 2, kern.plan["a"])


def _c_store_addresses(kern) -> tuple[int, list[list[int]]]:
    """The epilogue's ``autovec_copy(tCrD, thr_mma.partition_C(sC))``: the vector is the
    longest aligned run of adjacent elements in every thread's partition (16 B at most)."""
    cfg = kern.cfg
    shape = (cfg.tile_m, cfg.tile_n)

    def make_partition():
        tiled_mma, sC = kern.make_tiled_mma(), cute.make_identity_tensor(shape)
        return lambda t: tiled_mma.get_slice(t).partition_C(sC)

    coords = thread_coords(make_partition, kern.threads)
    _, sc = layout_offsets(kern.c_smem_layout)
    offsets = [[sc[_colex(c, shape)] for c in row] for row in coords]

    def fits(vec: int) -> bool:
        return all(
            offs[a] % vec == 0 and offs[a : a + vec] == list(range(offs[a], offs[a] + vec))
            for offs in offsets
            for a in range(0, len(offs), vec)
        )

    vec = next(v for v in (8, 4, 2, 1) if len(offsets[0]) % v == 0 and fits(v))
    return 2 * vec, _vector_accesses(offsets, vec, 2)
