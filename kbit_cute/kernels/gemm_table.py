"""Dispatch table of the mma.sync GEMM (``kbit_cute.gemm_dispatch``).

Measured: written by perf/bench_gemm.py from L2-cold CUDA-graph timings of every
candidate tiling x worker density on the shapes its command names (default: TUNE_SHAPES;
geometric mean per (k, M bucket)); regenerate with the command below and commit it.

RULES[k]: rows (m_max, config name, CTAs per SM, max splits: ``plan_workers``); the
first row with M <= m_max applies. CUBLAS_FROM_M[k]: smallest M from which dequantize
+ cuBLAS was measured faster than the kernel (None: the kernel always won).
RULES_OVER_L2 / CUBLAS_FROM_M_OVER_L2: the same for weights larger than the L2, tuned
on such weights only; where they have no row for M, RULES applies.
CUBLAS_FROM_M_SMALL: rows (N x K elements, {k: M}) for weights that fit the L2: the
first row whose size holds the weight lowers k's threshold to M (a small weight
dequantizes in a few microseconds; the kernel's few tiles leave the GPU idle).
RULES_SMALL: rows like RULES for weights of at most SMALL_WEIGHT_ELEMENTS (N x K) that
fit the L2, tuned on such weights only; where they have no row for M, RULES applies.
"""

PROVISIONAL = False
MEASURED_ON = "NVIDIA H100 80GB HBM3"
COMMAND = (
    "python -m perf.bench_gemm --tune --k 2 --json /root/out/tune_k2.json; python -m "
    "perf.bench_gemm --tune --k 3 --json /root/out/tune_k3.json; python -m perf.bench_gemm "
    "--tune --k 4 --json /root/out/tune_k4.json; python -m perf.bench_gemm --tune --k 5 "
    "--json /root/out/tune_k5.json; python -m perf.bench_gemm --write-table-from tune_k2.json "
    "tune_k3.json tune_k4.json tune_k5.json; then python -m perf.bench_gemm --tune "
    "--candidates table --buckets 16 32 64 --k 2 3 4 5 --json /root/out/tune_sk.json; python "
    "-m perf.bench_gemm --write-table-from tune_sk.json; then python -m perf.bench_gemm "
    "--tune --candidates table --buckets 64 128 256 --k 2 3 4 5 --json "
    "/root/out/tune_sk2.json; python -m perf.bench_gemm --write-table-from tune_sk2.json; "
    "then python -m perf.bench_gemm --tune --buckets 16 32 --k 2 3 4 5 --json "
    "/root/out/tune_b1632.json; python -m perf.bench_gemm --write-table-from tune_b1632.json; "
    "then python -m perf.bench_gemm --tune --candidates table --buckets 128 256 --k 2 3 4 5 "
    "--json /root/out/tune_b128.json; python -m perf.bench_gemm --write-table-from "
    "tune_b128.json; then python -m perf.bench_gemm --tune --candidates table --buckets 16 32 "
    "64 --k 2 3 4 5 --json /root/out/tune_det.json; python -m perf.bench_gemm "
    "--write-table-from tune_det.json; then python -m perf.bench_gemm --tune --buckets 16 32 "
    "64 128 256 --k 2 3 4 5 --json /root/out/tune.json; python -m perf.bench_gemm "
    "--write-table-from tune.json; then python -m perf.bench_gemm --tune --buckets 64 128 256 "
    "512 --k 2 3 4 5 --json /root/out/tune.json; python -m perf.bench_gemm --write-table-from "
    "tune.json; then python -m perf.bench_gemm --tune --shapes 8192x28672 28672x8192 "
    "--buckets 16 32 64 128 256 512 --k 4 --json /root/out/tune_big_k4.json; python -m "
    "perf.bench_gemm --tune --shapes 8192x28672 28672x8192 --buckets 16 32 64 128 256 512 --k "
    "2 3 5 --json /root/out/tune_big_k235.json; python -m perf.bench_gemm --tune --shapes "
    "8192x28672 28672x8192 --buckets 2147483648 --k 2 3 4 5 --json "
    "/root/out/tune_big_last.json; python -m perf.bench_gemm --write-table-from "
    "tune_big_k4.json tune_big_k235.json tune_big_last.json; then python -m perf.bench_gemm "
    "--tune --shapes 4096x14336 14336x4096 2048x10240 10240x2048 --buckets 16 32 64 128 256 "
    "512 --k 2 3 4 5 --json /root/out/tune_l2.json; python -m perf.bench_gemm "
    "--write-table-from tune_l2.json --keep-tilings; then python -m perf.bench_gemm --tune "
    "--candidates table --with m128n256k128s3w1x8rg m128n128k128s3w1x8rg m128n256k128s3w1x8g "
    "m128n128k128s3w1x8g --buckets 128 256 512 --k 4 5 --json /root/out/tune_k128_k45.json; "
    "python -m perf.bench_gemm --tune --candidates table --with m128n256k128s3w1x8rg "
    "m128n128k128s3w1x8rg m128n256k128s3w1x8g m128n128k128s3w1x8g --buckets 128 256 512 --k 2 "
    "3 --json /root/out/tune_k128_k23.json; python -m perf.bench_gemm --write-table-from "
    "tune_k128_k45.json tune_k128_k23.json; then python -m perf.bench_gemm --tune "
    "--candidates table --with m128n128k64s4w1x8rg m256n128k64s5w1x8lg --buckets 512 --k 3 4 "
    "--jobs 16 --json /root/out/tune512.json; python -m perf.bench_gemm --write-table-from "
    "tune512.json; then python -m perf.bench_gemm --k 2 3 4 5 --m 64 128 256 512 --no-qwen "
    "--shapes 2048x512 512x2048 4096x2048 2048x4096 2048x8192 4096x4096 5120x2048 --json "
    "/root/out/small.json; python -m perf.bench_gemm --write-small-from small.json; then "
    "python -m perf.bench_gemm --k 2 3 4 5 --m 64 128 256 512 --no-qwen --shapes 2048x512 "
    "512x2048 2048x2048 4096x2048 2048x4096 2048x5120 2048x8192 4096x4096 --json "
    "/root/out/small2.json; python -m perf.bench_gemm --write-small-from small2.json; then "
    "python -m perf.bench_gemm --tune --candidates table --buckets 256 512 --k 2 3 4 5 --jobs "
    "16 --json /root/out/tune_dq2.json; python -m perf.bench_gemm --write-table-from "
    "/tmp/tune_dq2.json; then python -m perf.bench_gemm --tune --shapes 2048x512 512x2048 "
    "2048x2048 4096x2048 2048x4096 2048x8192 --buckets 16 32 64 --k 2 3 4 5 --jobs 16 --json "
    "/root/out/tune_small.json; python -m perf.bench_gemm --write-table-from tune_small.json; "
    "then python -m perf.bench_gemm --k 2 3 4 5 --m 16 32 64 128 256 512 --no-qwen --shapes "
    "2048x512 512x2048 2048x2048 4096x2048 2048x4096 2048x5120 2048x8192 4096x4096 --json "
    "/root/out/small3.json; python -m perf.bench_gemm --write-small-from small3.json; then "
    "python -m perf.bench_gemm --tune --candidates table --with m64n256k64s6w1x8rgc "
    "m64n256k64s6w1x8gc m128n128k64s4w1x8rgc m128n256k64s4w1x8rgc m128n256k64s4w1x8gc "
    "m128n128k128s3w1x8gc m256n128k64s4w1x8gc --buckets 64 128 256 --k 2 3 4 5 --jobs 16 "
    "--json /root/out/tune_gc.json; python -m perf.bench_gemm --write-table-from "
    "tune_gc.json; then python -m perf.bench_gemm --tune --candidates table --with "
    "m16n128k128s3w1x4h m16n128k64s4w1x4h m16n128k64s3w1x4h m16n256k128s3w1x8h "
    "m16n128k128s3w1x4hg m32n128k64s4w1x4hg m32n128k64s4w1x4h m32n128k128s3w1x4h "
    "m32n256k64s4w1x8h m64n128k64s4w1x4hg m64n128k64s3w1x4h m64n256k64s6w1x8hgc "
    "m64n256k64s4w1x8hg --buckets 16 32 64 --k 4 --shapes 8192x28672 4096x14336 14336x4096 "
    "--jobs 16 --json /root/out/tune_h.json; python -m perf.bench_gemm --tune --candidates "
    "table --with m16n128k128s3w1x4h m16n128k64s4w1x4h m16n128k64s3w1x4h m16n256k128s3w1x8h "
    "m16n128k128s3w1x4hg m32n128k64s4w1x4hg m32n128k64s4w1x4h m32n128k128s3w1x4h "
    "m32n256k64s4w1x8h m64n128k64s4w1x4hg m64n128k64s3w1x4h m64n256k64s6w1x8hgc "
    "m64n256k64s4w1x8hg --buckets 16 32 64 --k 4 --shapes 28672x8192 --jobs 16 --json "
    "/root/out/tune_h2.json; python -m perf.bench_gemm --tune --candidates table --with "
    "m32n128k64s4w1x4hg m32n128k64s4w1x4rg --buckets 32 --k 4 --shapes 4096x14336 14336x4096 "
    "2048x10240 10240x2048 --jobs 16 --json /root/out/tune_m32.json; python -m "
    "perf.bench_gemm --write-table-from /tmp/tune_h.json /tmp/tune_h2.json /tmp/tune_m32.json"
)

RULES = {
    2: [
        (16, "m16n128k128s4w1x4", 4, 16),
        (32, "m32n128k64s4w1x4rg", 3, 16),
        (64, "m64n256k64s6w1x8gc", 1, 16),
        (128, "m128n128k64s4w1x8rg", 1, 16),
        (256, "m256n128k64s4w1x8g", 1, 16),
        (512, "m128n128k64s4w1x8rg", 1, 16),
        (2147483648, "m64n128k64s3w1x4", 1, 16),
    ],
    3: [
        (16, "m16n128k128s3w1x4r", 2, 16),
        (32, "m32n128k64s4w1x4rg", 2, 16),
        (64, "m64n128k64s4w1x4rg", 2, 16),
        (128, "m128n128k64s4w1x8rg", 2, 16),
        (256, "m256n128k64s5w1x8lg", 1, 16),
        (512, "m128n128k64s4w1x8rg", 1, 16),
        (2147483648, "m64n128k64s3w1x4l", 1, 16),
    ],
    4: [
        (16, "m16n128k128s3w1x4r", 2, 16),
        (32, "m32n128k64s4w1x4rg", 2, 16),
        (64, "m64n256k64s6w1x8rgc", 1, 16),
        (128, "m128n128k64s4w1x8rg", 1, 16),
        (256, "m256n128k64s5w1x8lg", 1, 16),
        (512, "m256n128k64s5w1x8lg", 1, 16),
        (2147483648, "m64n128k64s3w1x4l", 1, 16),
    ],
    5: [
        (16, "m16n256k128s3w1x8l", 1, 16),
        (32, "m32n256k64s4w1x8l", 1, 16),
        (64, "m64n256k64s3w1x8l", 1, 16),
        (128, "m128n128k128s3w1x8gc", 1, 16),
        (256, "m256n128k64s4w1x8g", 1, 16),
        (512, "m256n128k64s4w1x8g", 2, 16),
        (2147483648, "m64n256k64s3w1x8l", 1, 16),
    ],
}
CUBLAS_FROM_M = {2: 512, 3: 512, 4: 512, 5: 512}
RULES_OVER_L2 = {
    2: [
        (16, "m16n128k128s4w1x4", 4, 16),
        (32, "m32n128k64s4w1x4rg", 4, 16),
        (64, "m64n256k64s6w1x8rgc", 1, 16),
        (128, "m128n256k64s4w1x8rgc", 1, 16),
        (256, "m128n256k64s4w1x8rgc", 1, 16),
        (512, "m128n128k64s4w1x8rg", 1, 16),
        (2147483648, "m128n256k64s4w1x8g", 1, 16),
    ],
    3: [
        (16, "m16n128k128s3w1x4r", 3, 16),
        (32, "m32n128k64s4w1x4rg", 4, 16),
        (64, "m64n128k64s4w1x4rg", 3, 16),
        (128, "m128n256k64s4w1x8rgc", 1, 16),
        (256, "m256n128k64s4w1x8g", 1, 16),
        (512, "m128n128k64s4w1x8rg", 4, 16),
        (2147483648, "m256n128k64s5w1x8lg", 1, 16),
    ],
    4: [
        (16, "m16n128k128s3w1x4h", 3, 16),
        (32, "m32n128k64s4w1x4hg", 3, 16),
        (64, "m64n256k64s6w1x8rgc", 1, 16),
        (128, "m128n256k64s4w1x8rgc", 1, 16),
        (256, "m256n128k64s4w1x8rg", 1, 16),
        (512, "m256n128k64s5w1x8lg", 1, 16),
        (2147483648, "m256n128k64s4w1x8rg", 1, 16),
    ],
    5: [
        (16, "m16n256k128s3w1x8l", 1, 16),
        (32, "m32n256k64s4w1x8l", 1, 16),
        (64, "m64n256k64s3w1x8l", 1, 16),
        (128, "m128n256k128s3w1x8g", 1, 16),
        (256, "m256n128k64s4w1x8g", 1, 16),
        (512, "m256n128k64s4w1x8g", 1, 16),
        (2147483648, "m256n128k64s4w1x8g", 1, 16),
    ],
}
CUBLAS_FROM_M_OVER_L2 = {2: 1024, 3: 1024, 4: 512, 5: 512}
CUBLAS_FROM_M_SMALL = [
    (1048576, {2: 64, 3: 64, 4: 32, 5: 32}),
    (4194304, {2: 64, 3: 64, 4: 64, 5: 32}),
    (8388608, {2: 128, 3: 128, 4: 128, 5: 64}),
    (10485760, {2: 128, 3: 128, 4: 64, 5: 64}),
    (16777216, {2: 256, 3: 256, 4: 256, 5: 256}),
]
SMALL_WEIGHT_ELEMENTS = 16777216
RULES_SMALL = {
    2: [
        (16, "m16n128k128s3w1x4r", 4, 16),
        (32, "m32n128k128s3w1x4r", 2, 16),
        (64, "m32n128k64s4w1x4r", 2, 16),
    ],
    3: [
        (16, "m16n128k128s3w1x4l", 4, 16),
        (32, "m32n128k128s3w1x4r", 2, 16),
        (64, "m32n128k64s4w1x4r", 2, 16),
    ],
    4: [
        (32, "m32n128k128s3w1x4l", 2, 16),
        (64, "m32n128k64s4w1x4r", 1, 16),
    ],
    5: [
        (16, "m16n128k64s4w1x4", 2, 16),
        (32, "m32n128k64s4w1x4", 2, 16),
        (64, "m64n128k64s3w1x4l", 1, 16),
    ],
}
