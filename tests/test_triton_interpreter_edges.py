"""Edge cases of our Triton kernel under the interpreter that a second source-mutation review (sixty-eighth session)
found untested: e4m3fn's negative NaN code, exact bf16 output ties, rows that are not a power of two, items that
start mid-tile, idle workers of a one-item plan, and MTP rows that see no token in a split request.

The checks run in one worker subprocess (TRITON_INTERPRET must be set before triton is imported: this file run as a
script); each pytest test reads its check's verdict, "ok" or the failing assertion. Tolerances are the repo's:
`check` (verify.bounds' kernel and merge bounds, tests/triton_cases.py), `nan_masks_match` against the fp64 oracle,
and test_interpreter_rounds_bf16_output_to_nearest's rule (bf16 out is torch's rounding of the fp32 out).
"""

import json
import os
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from triton_cases import INTERPRETER_TILES, TritonCase, check, nan_masks_match

from mla_ref.decode import make_decode_batch, mla_decode_ref

HERE = Path(__file__).resolve().parent



def _config(combo, heads, q_len, **kw):
    from mla_fast import triton_decode as td

    return replace(td.default_config(combo, heads, q_len), **INTERPRETER_TILES, **kw)


def check_negative_e4m3fn_nan_code_gives_nan_out_and_lse():
    """e4m3fn has two NaN codes, 0x7F and 0xFF (sign set). The interpreter's plain cast reads both as +-480
    (`_mma_operand`'s fix); a NaN in a valid cache token must give NaN out and lse in the rows that see it, as the
    oracle does, split or not. Mutant T01 (`& 0xFF` instead of `& 0x7F`) fixes only the positive code: the
    negative NaN was read as -480, a finite wrong answer."""
    from mla_fast import triton_decode as td

    case = TritonCase((64, 40), (2, 1), heads=4, page_size=16, combo="fp8kv")
    batch = case.batch()
    pages, slots = batch.token_slots(0)
    kv = batch.kv_cache.clone()
    kv.view(torch.uint8)[pages[50], slots[50], 5] = 0xFF  # negative NaN code of a token both rows of request 0 see
    batch = batch.replace(kv_cache=kv)
    ref_out, ref_lse = mla_decode_ref(batch)
    assert torch.isnan(ref_lse[:2]).all() and not torch.isnan(ref_lse[2:]).any()  # the oracle reads 0xFF as NaN
    config = td.KernelConfig(head_group=4, mma="fp16", **INTERPRETER_TILES)
    for workers in (1, 3):
        plan = td.make_plan(batch, config, workers)
        out, lse = td.decode(batch, plan=plan, config=config)
        assert nan_masks_match(out, lse, ref_out, ref_lse), workers
        assert (plan.num_partial_rows > 0) == (workers == 3)


def _tie_batch(tokens: int):
    """One request of `tokens` tokens, q = 0 (every score 0, p = 1): the first half of the tokens hold 1 in latent
    channel 0, the second half 1 + 2^-7 (adjacent bf16 values), so out[..., 0] = 1 + 2^-8 exactly in fp32: a tie
    between bf16 1.0 (even) and 1 + 2^-7 (odd); also as the merge of two 16-token pieces of outputs 1 and 1 + 2^-7
    and equal LSEs."""
    H, L, R = 16, 64, 32
    q = torch.zeros(1, H, L + R, dtype=torch.bfloat16)
    kv = torch.zeros(tokens, L + R)
    kv[: tokens // 2, 0] = 1.0
    kv[tokens // 2 :, 0] = 1.0 + 2.0**-7
    return make_decode_batch(q, [kv.bfloat16()], sm_scale=0.1352338, kv_lora_rank=L, page_size=16,
                             generator=torch.Generator().manual_seed(0))


def check_bf16_output_ties_round_to_even_in_decode_and_reduce():
    """The interpreter's bf16 output rounding (`_to_out`, `_round_to_bf16`) is round-to-nearest-even as the device's
    cvt.rn: an exact fp32 tie goes to the even bf16 value, out bf16 == torch's rounding of out fp32 (the rule of
    test_interpreter_rounds_bf16_output_to_nearest, whose random data has no exact tie). Unsplit (decode kernel)
    and in two pieces (reduce kernel). Mutant T04 (`(bits >> 15) & 1`: round half up) moved the tie to 1 + 2^-7."""
    from mla_fast import triton_decode as td

    batch = _tie_batch(32)
    T, H, L = 1, batch.num_heads, batch.kv_lora_rank
    config = _config("bf16", H, 1)
    for workers in (1, 2):
        plan = td.make_plan(batch, config, workers)
        out32, _ = td.decode(batch, plan=plan, config=config, out=torch.empty(T, H, L))
        out16, _ = td.decode(batch, plan=plan, config=config)
        assert (plan.num_partial_rows > 0) == (workers == 2)
        assert torch.all(out32[..., 0] == 1.0 + 2.0**-8)  # an exact tie (not vacuous)
        assert torch.equal(out16, out32.bfloat16()), (workers, out16[0, :2, 0])


def check_items_starting_mid_tile_gather_their_pages():
    """Tiles of 32 tokens on pages of 32 with the planner's 16-token blocks: a split item may start at token 16 of a
    page, so its tiles straddle pages and must gather each token's page (`tiles_in_pages` false). Mutant T18
    (tiles_in_pages ignoring plan_block_n) read such a tile as 32 contiguous rows from its first page: the next
    page's (or a NaN page's) slots."""
    from mla_fast import triton_decode as td

    case = TritonCase((100, 40), (1, 1), page_size=32, seed=60)
    batch = case.batch()
    config = replace(_config("bf16", 16, 1), block_n=32)
    assert not td.tiles_in_pages(config, 32, INTERPRETER_TILES["plan_block_n"])
    starts = set()
    for workers in (3, 5):
        plan = td.make_plan(batch, config, workers)
        starts |= {int(s) for s in plan.work_items[:, td.planner.KV_START].tolist()}
        out, lse = td.decode(batch, plan=plan, config=config)
        r = check(out, lse, batch, td.kernel_numerics(config, "bf16"), plan.stats()["pieces_per_tile"]["max"])
        assert r["finite"] and r["out_ratio"] <= 1 and r["lse_ratio"] <= 1, (workers, r)
    assert any(s % 32 for s in starts), starts  # some item starts mid-tile (not vacuous)


def check_rows_that_are_not_a_power_of_two_take_the_next_tile():
    """q_len 3 x 8 heads = 24 packed rows: the launcher's M tile is the next power of two (32; tl.arange takes
    powers of two only). Mutant T30 (block_m = max(16, max_rows)) launched BLOCK_M = 24 and failed to compile."""
    from mla_fast import triton_decode as td

    case = TritonCase((40, 20), (3, 1), heads=8, page_size=16, seed=61)
    batch = case.batch()
    config = _config("bf16", 8, 3)
    assert config.head_group * 3 == 24
    plan = td.make_plan(batch, config, 3)
    out, lse = td.decode(batch, plan=plan, config=config)
    r = check(out, lse, batch, td.kernel_numerics(config, "bf16"), plan.stats()["pieces_per_tile"]["max"])
    assert r["finite"] and r["out_ratio"] <= 1 and r["lse_ratio"] <= 1 and r["empty_ok"], r


def check_one_item_per_worker_idle_workers_read_no_item():
    """A one-item-per-worker plan (ONE_ITEM) with more workers than items: idle worker w >= num_items runs nothing
    and reads no work item (`item_end = worker` there). The work-item array is given as the first rows of a wider
    buffer whose next row is a live-looking item (the same request's rows over only its first token, unsplit):
    mutant T32 (item_end = worker + 1 for every worker) ran it on the idle worker and overwrote the output."""
    from mla_fast import triton_decode as td

    case = TritonCase((16,), (1,), page_size=16, seed=62)
    batch = case.batch()
    config = _config("bf16", 16, 1)
    plan = td.make_plan(batch, config, 3)
    n = plan.work_items.shape[0]
    assert n == 1, plan.work_items
    # item 0 on worker 0, workers 1 and 2 idle (the planner's one-item layout: worker w runs item w, idle ones last)
    plan = replace(plan, worker_indptr=torch.tensor([0, 1, 1, 1], dtype=torch.int32), one_item_per_worker=True)
    wide = torch.zeros(n + 3, 8, dtype=plan.work_items.dtype)
    wide[:n] = plan.work_items
    decoy = plan.work_items[0].clone()
    decoy[td.planner.PARTIAL_ROW], decoy[td.planner.KV_START], decoy[td.planner.KV_END] = -1, 0, 1
    wide[n:] = decoy
    plan = replace(plan, work_items=wide[:n])
    out, lse = td.decode(batch, plan=plan, config=config)
    r = check(out, lse, batch, td.kernel_numerics(config, "bf16"), plan.stats()["pieces_per_tile"]["max"])
    assert r["finite"] and r["out_ratio"] <= 1 and r["lse_ratio"] <= 1, r


def check_a_split_request_with_rows_that_see_no_token_gives_out_0():
    """MTP rows that see no token (q_len 32 > seq_len 20, so rows 0-11 see none) of a request split over several
    workers: every piece is empty for them and the reduce's weight sum is 0; out must be 0 and lse -inf there
    (the empty-row convention), not 0 / 0. Mutant T34 (o = acc / w_sum) gave NaN."""
    from mla_fast import triton_decode as td

    case = TritonCase((20, 30), (32, 1), heads=2, page_size=16, seed=63)
    batch = case.batch()
    config = _config("bf16", 2, 32)
    plan = td.make_plan(batch, config, 4)
    assert plan.num_partial_rows > 0
    out, lse = td.decode(batch, plan=plan, config=config)
    r = check(out, lse, batch, td.kernel_numerics(config, "bf16"), plan.stats()["pieces_per_tile"]["max"])
    assert r["empty_rows"] >= 2 * 12 and r["empty_ok"] and r["finite"], r
    assert r["out_ratio"] <= 1 and r["lse_ratio"] <= 1, r


CHECKS = [check_negative_e4m3fn_nan_code_gives_nan_out_and_lse,
          check_bf16_output_ties_round_to_even_in_decode_and_reduce,
          check_items_starting_mid_tile_gather_their_pages,
          check_rows_that_are_not_a_power_of_two_take_the_next_tile,
          check_one_item_per_worker_idle_workers_read_no_item,
          check_a_split_request_with_rows_that_see_no_token_gives_out_0]


def _worker() -> dict:
    """Each check's verdict: "ok", or its traceback (one check's failure does not hide the others')."""
    from mla_fast import triton_decode as td

    assert td.INTERPRET, "the worker runs the kernels under TRITON_INTERPRET=1"
    verdicts = {}
    for fn in CHECKS:
        try:
            fn()
            verdicts[fn.__name__] = "ok"
        except Exception:
            verdicts[fn.__name__] = traceback.format_exc(limit=3)
    return verdicts


@pytest.fixture(scope="module")
def verdicts():
    pytest.importorskip("triton", reason="needs triton (pip install triton==3.6.0, as .ci/run does)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fn", CHECKS, ids=lambda fn: fn.__name__.removeprefix("check_"))
def test_interpreter_edge(verdicts, fn):
    assert verdicts[fn.__name__] == "ok", f"{fn.__doc__}\n{verdicts[fn.__name__]}"


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(_worker()))
