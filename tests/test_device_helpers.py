"""The SWAR plane -> index-field transform, run on host ints (the same code the kernels trace)."""

import pytest
import torch

from kbit_cute import format as fmt
from kbit_cute.kernels.device_helpers import field_bits, planes_to_fields


@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_fields_give_every_index_to_a_shuffle(k, gen):
    idx = torch.randint(0, 1 << k, (50, 32), generator=gen, dtype=torch.uint8)
    packed = fmt.pack_bitplanes(idx, k).view(50, k)
    width = field_bits(k)
    for b in range(50):
        planes = [int(w) & 0xFFFFFFFF for w in packed[b].tolist()]
        seen = []
        for word, elems in planes_to_fields(planes, k):
            for f, j in enumerate(elems):
                lane = (word >> (f * width)) & 31  # what shfl.idx reads of its lane operand
                assert lane % (1 << k) == idx[b, j].item(), (k, b, j)
                seen.append(j)
        assert sorted(seen) == list(range(32))
