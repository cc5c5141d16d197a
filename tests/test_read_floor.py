"""The read-floor probe (perf/read_floor.py): it compiles to 16-byte loads without a GPU,
and on the GPU it reads every vector it is given and no other."""

import pytest
import torch

from kbit_cute.inspect import inspect_spec
from perf import read_floor as rf


@pytest.mark.parametrize("threads,unroll,pdl,runs", [(512, 4, True, False), (896, 8, False, True)])
def test_probe_compiles_to_vector_loads(threads, unroll, pdl, runs):
    row = inspect_spec(rf.probe_spec(threads, unroll, pdl, runs))
    assert row["LDG.E.128"] == unroll and row["spill_ops"] == 0 and row["ok"]


def test_floor_reads_the_weights_bytes():
    """The floor peer reads what a kbit weight holds (``gemm_dispatch.weight_bytes``, the
    tiled words and absmax of the padded shape), in whole 16-byte vectors."""
    from kbit_cute.gemm_dispatch import weight_bytes
    from perf.peers import ReadFloor

    assert weight_bytes(28672, 8192, 4) == 8192 * 28672 // 2 + 8192 * 28672 // 32
    assert weight_bytes(32, 64, 3) == 64 * 128 * 3 // 8 + 64 * 128 // 32  # N padded to 128
    floor = ReadFloor(3)
    floor.prepare(torch.zeros(32, 64), lambda nbytes: 2)
    assert floor.nbytes == weight_bytes(32, 64, 3) and len(floor.copies) == 2
    assert all(c.numel() * 4 == -(-floor.nbytes // 16) * 16 for c in floor.copies)
    assert float(floor.make_call(0, None)()) == float(floor.copies[0].sum())  # CPU: a plain read


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("n_vec", [1, 1000, 123457])
def test_probe_reads_every_vector(n_vec, runs):
    """A thread stores only if the xor of what it read is the magic value. In a buffer of
    zeros (here the background of the signal, not test data) with the magic value planted
    in one vector, the probe stores iff the thread that owns that vector read it: planted
    at the first, the last and random positions, for every configuration."""
    from kbit_cute.compile import launcher

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.zeros(n_vec * 4, dtype=torch.int32, device="cuda")
    positions = {0, n_vec - 1, *torch.randint(0, n_vec, (6,)).tolist()}
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    for threads, unroll, per_sm in rf.RUN_CONFIGS if runs else rf.CONFIGS:
        for pdl in (False, True):
            fn = launcher(rf.probe_spec(threads, unroll, pdl, runs))
            for pos in positions:
                src[4 * pos + pos % 4] = rf._MAGIC
                sink.zero_()
                fn(src, sink, n_vec, per_sm * sm_count)
                torch.cuda.synchronize()
                assert sink[0].item() == rf._MAGIC, (threads, unroll, per_sm, pdl, pos)
                if pos > 0:  # not read when the buffer ends before it
                    sink.zero_()
                    fn(src, sink, pos, per_sm * sm_count)
                    torch.cuda.synchronize()
                    assert sink[0].item() == 0, (threads, unroll, per_sm, pdl, pos)
                src[4 * pos + pos % 4] = 0
