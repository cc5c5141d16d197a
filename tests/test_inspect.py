"""The compile-only kernel gate: every registered variant compiles for sm_90a and sm_80
without a GPU, with no spills and every instruction class it declares."""

import os

import pytest

from kbit_cute import inspect as kinspect

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/               @P0 SHFL.IDX PT, R9, R2, R9, 0x1f ;
        /*0030*/                   STL [R1], R4 ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0050*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0060*/                   STG.E.U16 desc[UR4][R4.64], R7 ;
"""


def test_sass_counts_parses_classes():
    c = kinspect.sass_counts(SASS)
    assert c["LDG.E.128"] == 1 and c["SHFL"] == 1 and c["LDGSTS"] == 1 and c["HMMA"] == 1
    assert c["LDSM"] == 0 and c["STG.E.128"] == 0 and c["spill_ops"] == 1


LOOPS = """
.L_x_0:
        /*0000*/                   LDS R2, [R3] ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R24+URZ], R7 ;
        /*0020*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0030*/                   LDS.64 R4, [R5] ;
        /*0040*/                   PRMT R6, R4, 0x5410, R5 ;
        /*0050*/               @P1 BRA `(.L_x_3) ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
.L_x_3:
        /*0070*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0080*/                   HMUL2 R6, R6, R8 ;
        /*0090*/                   LOP3.LUT R9, R9, 0x3, RZ, 0xc0, !PT ;
        /*00a0*/                   HMMA.16816.F32 R12, R16, R6, R12 ;
        /*00b0*/              @!P2 BRA `(.L_x_2) ;
        /*00c0*/                   HMMA.16816.F32 R12, R16, R6, R12 ;
        /*00d0*/              @!P3 BRA `(.L_x_0) ;
"""


# ptxas may place a block of the loop above its first label (here the refill at .L_x_1,
# entered from the loop and leaving back into it).
OUTLINED = """
        /*0000*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0020*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0030*/                   LDS.64 R4, [R5] ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
.L_x_3:
        /*0050*/                   HMMA.16816.F32 R12, R16, R6, R12 ;
        /*0060*/              @!P2 BRA `(.L_x_2) ;
        /*0070*/                   EXIT ;
"""


def test_loop_mix_counts_the_innermost_mma_loop_by_pipe():
    # .L_x_2's loop, not the wait loop (no MMA) nor the outer one; the refill block counts.
    m = kinspect.loop_mix(LOOPS)
    assert m == {"loop": 9, "alu": 2, "fma": 1, "mio": 2, "mma": 1, "uniform": 1, "other": 2}
    assert kinspect.loop_mix(SASS)["loop"] == 0  # no loop at all
    m = kinspect.loop_mix(OUTLINED)  # the refill above the loop's label counts too
    assert m == {"loop": 6, "alu": 0, "fma": 0, "mio": 2, "mma": 1, "uniform": 0, "other": 3}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_variant_passes_the_gate(arch):
    rows = kinspect.run_report(arch, jobs=max(1, min(4, os.cpu_count() or 1)))
    assert rows, "no kernel variants registered"
    bad = [(r["variant"], r["missing"], r["spill_ops"], r["stack"]) for r in rows if not r["ok"]]
    assert not bad, bad
    assert all(r["regs"] > 0 for r in rows)
    assert {r["arch"] for r in rows} == {arch}  # the workers compiled for the asked target
