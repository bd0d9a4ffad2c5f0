"""scripts/sass_barriers.py on lines of a real listing (the offline sm_90a build of the fp8 seesaw at 128 heads, pages
of 16, thirty-eighth session): a load's write barrier, a conversion's wait and reuse flag, a try-wait and the branch
that waits for it."""

from benchmark_scripts import script_module

PAD = " " * 87

LINE = "        /*{a}*/                   {text} ;      /* 0x{lo} */\n" + PAD + "/* 0x{hi} */\n"
LISTING = "".join(LINE.format(a=a, text=text, lo=lo, hi=hi) for a, text, lo, hi in [
    ("79c0", "@!P5 LDG.E.64 R86, desc[UR12][R24.64]", "0000000c1856d981", "000162000c1e1b00"),
    ("8090", "F2FP.F16.E4M3.UNPACK_B R4, R52.reuse", "00000034ff04723e", "084fe400020006ff"),
    ("8110", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x385a0], R27", "0385a01bff0075a7", "000e240008000146"),
    ("8120", "@!P0 BRA 0x152c0", "000000d000648947", "001fea0003800000"),
    ("8140", "F2FP.F16.E4M3.UNPACK_B R52, R54.reuse", "00000036ff34723e", "0a0fe400020006ff"),
])


def test_control_bits_of_real_instructions():
    sb = script_module("sass_barriers")
    ld, f2fp, trywait, bra, f2fp_5 = sb.controls(LISTING)
    assert (ld["address"], ld["wr"], ld["rd"], ld["wait"]) == (0x79C0, 5, 0, [])  # the load sets barrier 5
    assert (f2fp["wr"], f2fp["wait"], f2fp["reuse"]) == (None, [2], "b")  # R52 is operand b, flagged .reuse
    assert (trywait["wr"], bra["wait"]) == (0, [0])  # the branch waits for the try-wait's predicate
    assert f2fp_5["wait"] == [5] and f2fp_5["reuse"] == "b"  # the conversion that waits for every load on barrier 5
    assert [c["stall"] for c in (ld, f2fp, trywait, bra)] == [1, 2, 2, 5]
    assert sb.opcode(ld["text"]) == "LDG.E.64" and sb.opcode(bra["text"]) == "BRA"


def test_write_barriers_by_opcode_and_range():
    sb = script_module("sass_barriers")
    assert sb.write_barriers(LISTING, "LDG") == {5: 1}
    assert sb.write_barriers(LISTING, "SYNCS") == {0: 1}
    assert sb.write_barriers(LISTING, "F2FP") == {None: 2}
    assert sb.write_barriers(LISTING, "LDG", lo=0x8000) == {}
    assert sb.write_barriers(LISTING, "F2FP", lo=0x8100, hi=0x8140) == {None: 1}
