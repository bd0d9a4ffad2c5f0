"""The padding probe (verify/padding_probe.py) and the ``padding`` check (verify.checks.check_padding): what the
probe writes and where, the scores its tokens reach, its linear program against a closed-form optimum, and that a
max taken over the loaded slots before the length mask fails it alone while a kernel that masks first gives the
bits of its run on the NaN padding."""

import math

import pytest
import torch

from mla_ref.decode import mla_decode_ref
from mla_ref.fp8 import fp8_format
from verify import mutants
from verify.cases import Case
from verify.checks import run_case
from verify.kernels import from_callable
from verify.padding_probe import MARGIN, bounded_token, padding_probe

COMBOS = {"bf16": dict(), "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8"),
          "fp8kv_fnuz": dict(kv_dtype="fp8", fp8_format="e4m3fnuz")}


def _case(combo: str, **kw) -> Case:
    """By default an empty request, MTP rows, a full last page (64 tokens on pages of 16) and partial ones."""
    fields = dict(seq_lens=(0, 37, 64, 130, 3), q_lens=(1, 2, 1, 3, 4), heads=4, page_size=16) | kw
    return Case(**fields, **COMBOS[combo])


def _free_slots(batch) -> list[tuple[int, int, torch.Tensor]]:
    """(request, its last page, [ps] bool: that page's slots past its length) of every request with some."""
    ps, found = batch.page_size, []
    for b, s in enumerate(batch.seq_lens.tolist()):
        if s % ps:
            free = torch.arange(ps) >= s % ps  # [ps]
            found.append((b, int(batch.block_table[b, (s - 1) // ps]), free))
    return found


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_probe_writes_only_the_last_pages_unused_slots(combo):
    batch = _case(combo).materialize()[0]
    probe = padding_probe(batch, mla_decode_ref(batch)[1])
    pb = probe.batch
    for name in ("q", "block_table", "seq_lens", "q_lens"):
        assert getattr(pb, name) is getattr(batch, name), name
    assert (pb.q_scale, pb.kv_scale, pb.sm_scale) == (batch.q_scale, batch.kv_scale, batch.sm_scale)
    written = torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool)  # [P, ps]
    for _, page, free in _free_slots(batch):
        written[page] |= free
    assert probe.slots == int(written.sum()) == 11 + 14 + 13  # the requests of 37, 130 and 3 tokens
    same = pb.kv_cache.view(torch.uint8).view(*written.shape, -1) == batch.kv_cache.view(torch.uint8).view(
        *written.shape, -1)  # [P, ps, D * bytes]
    assert same[~written].all()  # every other byte as built: the tokens and the NaN of the spare pages
    assert torch.isfinite(pb.kv_cache[written].float()).all()
    assert torch.isnan(batch.kv_cache[written].float()).all()  # where the case had its NaN


def test_bf16_tokens_reach_the_margin_up_to_their_rounding():
    """In bf16 the minimum-norm token is exact before rounding (each request has at most 576 (row, head)s): every
    row's hostile score is lse + MARGIN within the rounding of the token to bf16, at most 2^-8 |σ q_d k_d| per
    channel (one bf16 unit roundoff of each k_d, products and sums in fp64)."""
    batch = _case("bf16").materialize()[0]
    lse = mla_decode_ref(batch)[1]  # [T, H]
    probe = padding_probe(batch, lse)
    q, qo = batch.dequantized_q(), batch.qo_indptr.tolist()  # [T, H, D]
    for b, page, free in _free_slots(batch):
        k = probe.batch.kv_cache[page, free].double()  # [f, D] one token in every free slot
        assert (k == k[0]).all()
        rows = batch.sm_scale * q[qo[b] : qo[b + 1]].reshape(-1, q.shape[-1])  # [m, D]
        lse_rows = lse[qo[b] : qo[b + 1]].reshape(-1)  # [m]
        target = torch.where(torch.isfinite(lse_rows), lse_rows, 0.0) + MARGIN  # [m] a row that sees nothing: 0
        rounding = 2**-8 * (rows.abs() @ k[0].abs())  # [m] one bf16 unit roundoff per channel
        assert ((rows @ k[0] - target).abs() <= rounding).all()
    assert MARGIN - 1 < probe.margin <= MARGIN + 1  # the reported smallest margin, from the rounded tokens


def test_the_linear_program_reaches_the_closed_form_optimum_of_one_row():
    """One row, |k_d| <= c: the largest score is c |a|_1 (k = c sign(a)); the program returns it while it is below
    lse + MARGIN, and a token at or above lse + MARGIN where the range reaches past it."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 576, generator=g, dtype=torch.float64) * 0.1  # [1, D]
    lse = torch.tensor([3.0], dtype=torch.float64)
    for c in (0.5, 100.0):  # |a|_1 is about 46: c |a|_1 - 3 about 20, then past MARGIN
        k = bounded_token(a, lse, c)  # [D]
        best = c * float(a.abs().sum())
        assert float(k.abs().max()) <= c * (1 + 1e-12)
        if best - 3.0 < MARGIN:
            assert float(a[0] @ k) - 3.0 == pytest.approx(best - 3.0, rel=1e-9)
        else:
            assert float(a[0] @ k) - 3.0 >= MARGIN * (1 - 1e-9)


@pytest.mark.parametrize("combo", ["fp8kv", "fp8", "fp8kv_fnuz"])
def test_fp8_tokens_stay_in_the_format_and_deal_the_rows_into_groups(combo):
    """fp8: every written code is finite, within the format's max, and with more rows than GROUP_ROWS (128 heads)
    each slot holds its group's token: several distinct tokens, and the reported margin is what they reach."""
    batch = _case(combo, seq_lens=(37,), q_lens=(2,), heads=128).materialize()[0]
    lse = mla_decode_ref(batch)[1]  # [T, H]
    probe = padding_probe(batch, lse)
    ((_, page, free),) = _free_slots(batch)
    codes = probe.batch.kv_cache[page, free].float()  # [f, D]
    assert torch.isfinite(codes).all() and float(codes.abs().max()) <= fp8_format(batch.kv_cache.dtype).max
    assert len({tuple(row.tolist()) for row in codes}) == 8  # 256 (row, head)s in groups of 32, 11 free slots
    k = codes.double() * batch.kv_scale  # [f, D]
    scores = batch.sm_scale * batch.dequantized_q().reshape(-1, 576) @ k.T  # [256, f]
    assert probe.margin == pytest.approx(float((scores.amax(dim=1) - lse.reshape(-1)).min()), abs=1e-9)


def test_no_unused_slot_skips_the_probe():
    batch = _case("bf16", seq_lens=(0, 16, 64), q_lens=(1, 1, 2)).materialize()[0]
    assert "no request has an unused slot" in padding_probe(batch, mla_decode_ref(batch)[1])
    result = run_case(_case("bf16", seq_lens=(0, 16, 64), q_lens=(1, 1, 2)), from_callable(mutants.correct))
    assert result.ok and "padding.skipped" in {c.name for c in result.checks}


@pytest.mark.parametrize("combo", ["bf16", "fp8"])
def test_a_max_over_the_padding_fails_the_padding_check_alone(combo):
    """The NaN padding hides a tile max taken over the last page's unused slots (NaN-blind, as GPU max
    instructions are): with one query row per request nothing else is masked, so only the padding check sees it;
    a kernel that masks first gives the bits of its run on the NaN padding."""
    case = _case(combo, q_lens=(1,) * 5)
    result = run_case(case, from_callable(mutants.max_before_mask))
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"padding"}, result.describe()
    assert "the slots past each request's length changed the result" in failed["padding"]
    right = run_case(case, from_callable(mutants.correct))
    detail = {c.name: c.detail for c in right.checks}["padding"]
    assert right.ok and detail.endswith("the bits of the run on the NaN-padded cache"), right.describe()
    assert math.isfinite(float(detail.split("at least ")[1].split(" ")[0]))
