"""scripts/sass_loops.py on a hand-written SASS listing: the innermost predicated backward branch with enough wgmmas
is the loop; an enclosing loop and a wait's retry stub (an unconditional branch back) are not."""

from benchmark_scripts import script_module


def _sass(lines: dict) -> str:
    return "".join(f"        /*{address:04x}*/                   {text} ;  /* 0x000000 */\n"
                   for address, text in sorted(lines.items()))


LISTING = _sass({
    0x000: "MOV R1, c[0x0][0x28]",
    0x010: "BAR.SYNC.DEFER_BLOCKING 0x0, 0x80",  # the outer loop's first instruction
    **{0x020 + 0x10 * k: "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24" for k in range(8)},  # inner loop: 0x20-0xd0
    0x0a0: "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80",
    0x0b0: "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x100], R2",
    0x0c0: "@!P0 BRA 0x200",  # to the retry stub
    0x0d0: "@P1 BRA 0x20",  # the inner loop's back edge
    0x0e0: "@P2 BRA 0x10",  # the outer loop's
    0x0f0: "EXIT",
    0x200: "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x100], R2",
    0x210: "@!P0 BRA 0x200",
    0x220: "BRA 0x60",  # back into the loop, unconditionally: not a loop of its own
})


def test_the_innermost_mma_loop_and_its_counts():
    sl = script_module("sass_loops")
    assert sl.mma_loops(LISTING) == [{"instructions": 12, "HGMMA": 8, "QGMMA": 0, "BAR": 1, "SYNCS": 1, "STL": 0,
                                      "LDL": 0}]
    # with a lower threshold the stub's unconditional branch back (0x60..0x220: 4 HGMMA) is still no loop
    assert sl.mma_loops(LISTING, min_mma=4) == sl.mma_loops(LISTING)
    assert sl.mma_loops(LISTING, min_mma=9) == []  # no loop with 9 wgmmas


def test_spill_traffic_inside_the_loop_is_counted():
    """A register spilled and reloaded inside the loop (STL / LDL) shows in its counts; outside it does not."""
    sl = script_module("sass_loops")
    inside = LISTING.replace("BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", "STL [R1+0x8], R2")
    assert sl.mma_loops(inside)[0] | {"BAR": 1, "STL": 0} == sl.mma_loops(LISTING)[0]
    assert (sl.mma_loops(inside)[0]["STL"], sl.mma_loops(inside)[0]["LDL"]) == (1, 0)
    outside = LISTING.replace("MOV R1, c[0x0][0x28]", "LDL R2, [R1+0x8]")  # before the loops
    assert sl.mma_loops(outside) == sl.mma_loops(LISTING)
