"""The Gluon kernels, and the Triton kernel's pair merge, compile for sm_90a on this CPU (scripts/offline_compile.py:
a stand-in driver, ptxas from the triton wheel). The interpreter runs neither, so without this CI would not see their
compile errors: the GPU tests skip here. One process per compile (the stand-in driver replaces Triton's active
driver)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
MAX_REGISTERS = 255  # sm_90: registers per thread an instruction can name


def _compile(kernel: str, combo: str, heads: int, q_len: int = 1, page_size: int = 64, sass=None, ptx=None,
             fp8_in_place: bool = False, shared: bool = False) -> dict:
    """scripts/offline_compile.py in a process of its own -> its report (the SASS / PTX written to `sass` / `ptx` if
    given; fp8_in_place: the seesaw without its fp8 loader partition on any page size; shared: with the
    shared-memory buffers' offsets)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "offline_compile.py"), kernel, "--combo", combo, "--heads",
           str(heads), "--q-len", str(q_len), "--page-size", str(page_size)] + (["--sass", str(sass)] if sass else [])
    cmd += (["--ptx", str(ptx)] if ptx else []) + (["--fp8-in-place"] if fp8_in_place else [])
    cmd += ["--shared"] if shared else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("kernel, combo, heads, q_len, page_size", [
    ("seesaw", "bf16", 16, 4, 64),  # bf16 MTP rows, 4 x 16 heads (128 heads at q_len 1: the grouped-layout test)
    ("seesaw", "fp8", 16, 4, 64),  # e4m3fn q, MTP rows
    ("seesaw", "fp8kv", 128, 1, 16),  # the fp8 loader partition
    ("gluon_fp8", "fp8kv", 16, 2, 64),
])
def test_gluon_kernel_compiles_for_sm90(kernel, combo, heads, q_len, page_size):
    report = _compile(kernel, combo, heads, q_len, page_size)
    assert (report["kernel"], report["combo"]) == (kernel, combo)
    assert 0 < report["registers"] <= MAX_REGISTERS, report
    assert report["opcodes"] and report["instructions"] > 1000, report  # a real kernel, not an empty stub


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_shared_allocations_place_every_seesaw_buffer_apart_inside_its_shared_memory():
    """`--shared` (Triton's allocation pass on the compiled TTGIR): the fp8 seesaw allocates every buffer once, for
    the whole kernel, so the offsets must keep all of them apart and inside the shared memory the kernel launches
    with; its two tile slots (c_kv [2, 64, 512] fp16, 128 KB) and its three barrier arrays of [slot x 3 + group] are
    among them."""
    report = _compile("seesaw", "fp8kv", 128, 1, 16, shared=True)
    buffers = report["shared_allocations"]  # by offset
    for before, after in zip(buffers, buffers[1:]):
        assert before["offset"] + before["bytes"] <= after["offset"], (before, after)
    assert buffers[-1]["offset"] + buffers[-1]["bytes"] <= report["shared_bytes"]
    types = [b["type"] for b in buffers]
    assert {"type": "2x64x512xf16", "bytes": 2 * 64 * 512 * 2} in [{k: b[k] for k in ("type", "bytes")}
                                                                  for b in buffers]
    assert types.count("6x1xi64") == 3, types  # kv_full, xbar, kv_empty


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("combo, q_len, fp8_mmas", [("fp8", 1, 18), ("fp8", 4, 18), ("fp8kv", 1, 0)])
def test_gluon_fp8_scores_of_fp8_q_compile_to_fp8_wgmmas(combo, q_len, fp8_mmas, tmp_path):
    """With e4m3fn q the Gluon fp8 kernel's default (KernelConfig.qk_fp8) multiplies the scores with e4m3 x e4m3
    wgmmas on shared memory: 9 accumulators x 2 k32 steps per tile, no spills (the fp16 path spills 8 bytes); bf16
    q keeps fp16 operands."""
    sass = tmp_path / "g8.sass"
    report = _compile("gluon_fp8", combo, 16, q_len, sass=sass)
    assert report["spill_stores"] == 0 or not fp8_mmas, report
    assert len(re.findall(r"\bQGMMA\.64x16x32\.F32\.E4M3\.E4M3\b", sass.read_text())) == fp8_mmas


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("combo", ["fp8kv", "fp8"])
def test_gluon_fp8_copies_a_page_of_c_kv_in_one_tma_box(combo, tmp_path):
    """The grouped layout (gluon_fp8.FP8_GROUPED_PAGES): each page of a tile is one 4-D copy of its c_kv (8-token
    groups x 4 quarters) and one 2-D copy of its k_pe, at the 3 places a tile is issued (the two first tiles of an
    item and in the loop): 12 of each on pages of 16, 3 of each on pages of 64 (one page per tile; 15 2-D copies in
    the standard layout's quarter boxes). With fp8 q the score wgmmas read c_kv through the grouped layout's shared
    linear layout."""
    counts = {}
    for page_size in (64, 16):
        sass, ptx = tmp_path / f"p{page_size}.sass", tmp_path / f"p{page_size}.ptx"
        report = _compile("gluon_fp8", combo, 16, page_size=page_size, sass=sass, ptx=ptx)
        assert 0 < report["registers"] <= MAX_REGISTERS, report
        text = sass.read_text()
        counts[page_size] = tuple(len(re.findall(rf"\bUTMALDG\.{d}D\b", text)) for d in (2, 4))
        # the PTX (--ptx, without debug records: no line or file entries) issues the same 4-D copies
        code = ptx.read_text()
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.4d", code)) == counts[page_size][1], counts
        assert ".entry _mla_decode_fp8_kernel" in code and not re.search(r"^\s*\.(loc|file)\s|\.debug_", code, re.M)
    assert counts == {64: (3, 3), 16: (12, 12)}, counts


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_seesaw_copies_bf16_pages_in_the_grouped_layout_without_spills(page_size, tmp_path):
    """bf16 at 128 heads (gluon_decode.GROUPED_PAGES, pages of 64k as 64): each c_kv half of a tile is
    max(64 / page_size, 1) four-dimensional TMA boxes (a page's 8-token groups x 4 chunks) at each of the 8 places a
    half is issued (both slots at an item's start, and in the loop); the 2-D copies are q's 9 chunk boxes and k_pe's
    page boxes at its 4 places (pages of 64 in the standard layout: 45 2-D copies). With the score operands indexed
    by an unprovable zero nothing spills (200 bytes at page 16 without it: the hoisted wgmma descriptors)."""
    sass = tmp_path / f"p{page_size}.sass"
    report = _compile("seesaw", "bf16", 128, page_size=page_size, sass=sass)
    assert 0 < report["registers"] <= MAX_REGISTERS and report["spill_stores"] == 0, report
    text = sass.read_text()
    pages = max(64 // page_size, 1)
    assert len(re.findall(r"\bUTMALDG\.4D\b", text)) == 8 * pages
    assert not re.search(r"\bUTMALDG\.3D\b", text)
    assert len(re.findall(r"\bUTMALDG\.2D\b", text)) == 9 + 4 * pages


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_seesaw_stages_an_fp8_page_of_a_c_kv_half_in_one_tma_box(tmp_path):
    """e4m3fn cache on pages of 16 expanded in place (SEESAW_FP8_LOADER_PAGES emptied; the in-place path's staging,
    gluon_decode.SEESAW_FP8_GROUPED_PAGES): each c_kv half's fp8 bytes are staged one 4-D copy per page (8 places a
    half is issued x 4 pages), k_pe one 2-D copy per page (4 places x 4); per-page boxes of each chunk had been 36
    copies per tile. (The fp8 seesaw's own spills, 196 bytes here, are not the staging's: 240 with per-page
    boxes.)"""
    sass = tmp_path / "f8p16.sass"
    report = _compile("seesaw", "fp8kv", 128, page_size=16, sass=sass, fp8_in_place=True)
    assert 0 < report["registers"] <= MAX_REGISTERS, report
    text = sass.read_text()
    assert len(re.findall(r"\bUTMALDG\.4D\b", text)) == 32
    assert len(re.findall(r"\bUTMALDG\.2D\b", text)) == 16


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("combo, heads, q_len, page_size", [("fp8kv", 128, 1, 16), ("fp8", 64, 1, 32),
                                                            ("fp8kv", 16, 4, 16), ("fp8kv", 128, 1, 64)])
def test_fp8_seesaw_loader_partition(combo, heads, q_len, page_size, tmp_path):
    """e4m3fn caches (gluon_decode.SEESAW_FP8_LOADER_PAGES: pages of 16, 32 and 64k): the tiles come through the
    loader partition, not TMA: no tensor copy at all (q is loaded by warpgroup 0 with an fp8 cache), the cache read
    with plain loads (18 chunks x 4 eight-byte loads per thread and pair, three groups in flight), the L2 asked for
    the pages by bulk prefetches: 8 places for an item's first pair (a thread's 4 tokens per tile, `_prefetch_pages`)
    and 1 for each next pair (a thread's unit of `_next_pair_units`); the L1 asked for slot 0's R group at each pair's
    start (`_l1_prefetch_group`: one CCTL.E.PF1 per token of a thread, 4);
    three partitions (the loader at 112 registers, gluon_decode.LOADER_REGS); the warpgroups' MMA loops store nothing
    to local memory and warpgroup 1's reloads at most 4 values per tile (their score operands at a runtime zero; 36
    bytes of spills at (200, 112), 44 before the L1 prefetch, 12 with two groups in flight at (208, 96), which was
    6-11 % slower on one H200)."""
    sass = tmp_path / "loader.sass"
    report = _compile("seesaw", combo, heads, q_len, page_size, sass=sass)
    assert 0 < report["registers"] <= MAX_REGISTERS and report["spill_stores"] <= 48, report
    text = sass.read_text()
    assert not re.search(r"\bUTMALDG\b", text)
    assert len(re.findall(r"\bLDG\.E\.64\b", text)) >= 72
    assert len(re.findall(r"\bUBLKPF\.L2\b", text)) == 9
    assert len(re.findall(r"\bCCTL\.E\.PF1\b", text)) == 4
    assert re.search(r"\bUSETMAXREG\.DEALLOC\.CTAPOOL\s+0x70\b", text)  # the loader's 112
    loops = report["mma_loops"]
    assert [loop["HGMMA"] for loop in loops] == [48, 44], loops
    assert [loop["STL"] for loop in loops] == [0, 0] and loops[0]["LDL"] == 0 and loops[1]["LDL"] <= 4, loops


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_fp8_seesaw_at_64_and_128_heads_is_one_compile(tmp_path):
    """With an e4m3fn cache the seesaw reads its head split at run time (HEAD_SPLIT=0, gluon_decode.launch_decode),
    so 64 heads (one program per worker) and 128 heads (two) at q_len 1 run the same PTX: a constexpr split gave
    64 heads a kernel of its own that ptxas allocated worse. Here on pages of 64, both through the loader partition
    (plain loads: no tensor copy) and expanded in place (SEESAW_FP8_LOADER_PAGES emptied), whose fp8 staging is
    grouped (gluon_decode.SEESAW_FP8_GROUPED_PAGES): one 4-D copy per c_kv half at the 8 places a half is issued, k_pe
    one 2-D copy at its 4 (the chunk boxes were 4 per half: 36 2-D copies)."""
    code = {}
    for in_place in (False, True):
        for heads in (64, 128):
            ptx = tmp_path / f"h{heads}_{in_place}.ptx"
            report = _compile("seesaw", "fp8kv", heads, ptx=ptx, fp8_in_place=in_place)
            assert 0 < report["registers"] <= MAX_REGISTERS and report["instructions"] > 1000, report
            code[heads, in_place] = ptx.read_text()
        assert ".entry _mla_decode_seesaw_kernel" in code[64, in_place] and code[64, in_place] == code[128, in_place]
    assert "cp.async.bulk.tensor" not in code[64, False]
    copies = [len(re.findall(rf"cp\.async\.bulk\.tensor\.{d}d", code[64, True])) for d in (2, 4)]
    assert copies == [4, 8], copies
    # one MMA loop per warpgroup (scripts/sass_loops.py), each with a tile's 36 score and 8 P.V wgmmas
    assert [loop["HGMMA"] for loop in report["mma_loops"]] == [44, 44], report["mma_loops"]


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_triton_pair_merge_compiles_for_sm90_with_its_cluster_instructions(combo, tmp_path):
    """The Triton kernel with PAIR_MERGE (mla_fast.dsmem): ptxas takes its inline PTX, and the SASS has the cluster
    barrier, the distributed-shared-memory bulk copy and the mbarrier's transaction wait; the staged halves are
    written and read with 8-byte accesses (dsmem.ROW_PAD), 16 of each per thread at 16 heads (2 slices x 16 fp32)."""
    sass = tmp_path / "pair.sass"
    report = _compile("triton_pair", combo, 16, sass=sass)
    assert 0 < report["registers"] <= MAX_REGISTERS and report["spill_stores"] == 0, report
    text = sass.read_text()
    for opcode in ("UCGABAR_ARV", "UCGABAR_WAIT", "UBLKCP.S.S", "SYNCS.PHASECHK.TRANS"):
        assert opcode in text, opcode
    assert len(re.findall(r"\bSTS\.64\b", text)) == 16 and len(re.findall(r"\bLDS\.64\b", text)) == 16
