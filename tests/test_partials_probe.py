"""The partials probe (verify/partials_probe.py), the ``partials`` check (verify.checks.check_partials) and what
they need from the bounds (kernel_bound's uniform_p, merge_bound's partial_dtype): what the probe batch holds, its
closed-form oracle, and that split outputs stored more coarsely than declared fail while ones stored as declared
pass, also when the pieces are of equal length."""

import dataclasses
import math

import pytest
import torch

from mla_fast.numerics import KernelNumerics
from mla_ref.decode import mla_decode_ref
from mla_ref.fp8 import WIDE_DTYPES
from verify import bounds, mutants
from verify.cases import Case
from verify.checks import check_partials, run_case
from verify.kernels import DEFAULT_NUMERICS, Kernel, from_callable
from verify.partials_probe import antisymmetric_weights, partials_probe
from verify.strategies import smoke_cases

COMBOS = {"bf16": dict(), "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8"),
          "fp8kv_fnuz": dict(kv_dtype="fp8", fp8_format="e4m3fnuz")}


def _batch(combo: str, seq_lens=(0, 37, 130, 300, 3), q_lens=(1, 2, 3, 1, 4), heads=4, page_size=16):
    """The case's batch; by default an empty request, MTP rows, splits, and a request of 3 tokens and 4 query rows
    (s0 = 0: no antisymmetric part, so the probe writes 0 there)."""
    return Case(seq_lens=seq_lens, q_lens=q_lens, heads=heads, page_size=page_size, scale_mode="static",
                **COMBOS[combo]).materialize()[0]


def _storing(stored: str, declared: str) -> Kernel:
    """The mutants' split-KV decode (pieces of 64-token blocks, at most 4 per row) with its split outputs stored in
    ``stored``, declaring ``declared`` partials."""
    def decode(batch):
        return mutants._decode(batch, partial_dtype=WIDE_DTYPES[stored])

    decode.numerics = dataclasses.replace(DEFAULT_NUMERICS, partial_dtype=WIDE_DTYPES[declared])
    return from_callable(decode, f"partials_{stored}_declared_{declared}")


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_probe_keeps_the_layout_and_the_poison_and_writes_exact_values(combo):
    batch = _batch(combo)
    probe = partials_probe(batch)
    pb, g, L = probe.batch, probe.g, batch.kv_lora_rank
    for name in ("block_table", "seq_lens", "q_lens"):
        assert torch.equal(getattr(pb, name), getattr(batch, name)), name
    assert pb.q.dtype == batch.q.dtype and pb.kv_cache.dtype == batch.kv_cache.dtype and not pb.q.double().any()
    assert (pb.q_scale, pb.kv_scale) == ((1.0 if combo == "fp8" else None), (13 / 16 if "fp8" in combo else None))
    unused = torch.isnan(batch.kv_cache.float())  # [P, ps, D] the built batch's poison
    assert unused.any() and torch.equal(torch.isnan(pb.kv_cache.float()), unused)
    assert g == (2.0**-4 if "fp8" in combo else 2.0**-8)  # the cache format's spacing in [1/2, 1)
    assert probe.period == (48 if "fp8" in combo else 3)  # offsets averaging 2^-8 / 3
    kappa = pb.kv_scale or 1.0
    for r in range(batch.batch_size):
        kv = pb.request_kv(r) / kappa  # [s, D] as stored (the codes of an fp8 cache)
        s, n = int(batch.seq_lens[r]), int(batch.q_lens[r])
        if not s:
            continue
        j = torch.arange(s)
        s0 = max(s - n + 1, 0)
        offset = g * ((j % probe.period == 0) & (s0 >= 2)).double()  # [s] none without an antisymmetric part
        y = kv[:, :L] - offset[:, None]  # [s, L] the antisymmetric part
        assert not kv[:, L:].any() and (kv[:, :L].abs() < 1).all()
        assert torch.equal(torch.remainder(kv[:, :L], g), torch.zeros_like(kv[:, :L]))  # multiples of g
        assert torch.equal(y[:s0], -y[:s0].flip(0)) and not y[s0:].any()  # mirrored over s0, 0 after it
        w = antisymmetric_weights(j[:s0], torch.full((s0,), s0))  # [s0]
        assert torch.equal(y[:s0], g * torch.round(w[:, None] * probe.alpha / g))


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
def test_the_oracle_on_the_probe_is_the_closed_form(combo):
    batch = _batch(combo)
    probe = partials_probe(batch)
    out, lse = mla_decode_ref(probe.batch)  # [T, H, L], [T, H]
    n = probe.batch.visible_tokens().double()  # [T]
    s0 = probe.batch.visible_tokens()[probe.batch.qo_indptr[:-1].long()][probe.batch.row_request()]  # [T]
    offsets = torch.div(n + probe.period - 1, probe.period, rounding_mode="floor")  # tokens j ≡ 0 mod P seen
    offsets = torch.where(s0 >= 2, offsets, 0.0)  # [T] none in a request without an antisymmetric part
    kappa = probe.batch.kv_scale or 1.0
    expected = torch.where(n > 0, kappa * probe.g * offsets / n.clamp(min=1), 0.0)  # [T] ô, the same on every channel
    assert torch.equal(out, expected[:, None, None].expand_as(out))  # exact: dyadic sums, one division
    assert torch.equal(lse, torch.where(n > 0, torch.log(n), -math.inf)[:, None].expand_as(lse))


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("declared", sorted(WIDE_DTYPES))
def test_partials_stored_more_coarsely_than_declared_fail_and_as_declared_pass(combo, declared):
    batch = _batch(combo)
    order = ["fp32", "fp16", "bf16"]  # finest first
    for stored in order:
        [out, lse] = check_partials(batch, _storing(stored, declared), workers=4)
        coarser = order.index(stored) > order.index(declared)
        assert out.ok != coarser and lse.ok, (stored, declared, out.err_over_bound, out.detail)
        if (stored, declared) == ("bf16", "fp32"):  # the common case: 2^-9 of a partial against fp32 roundings
            assert out.err_over_bound > 20, out.err_over_bound


def test_requests_without_an_antisymmetric_part_say_nothing_of_partials_stored_more_finely():
    """With offsets alone, a request of 3 tokens and 4 query rows has an output and pieces' means of one size: fp32
    partials declared as bf16 read 0.25 of the bound there from the output's rounding alone, above the report's
    PARTIALS_MATCHED warning line (a review; drawn once σ was drawn). Such requests hold 0 now: the split request
    beside them shows the same finer storage far below that line, and bf16 partials under fp32 still fail."""
    from verify.cli import PARTIALS_MATCHED

    batch = _batch("bf16", seq_lens=(3, 200), q_lens=(4, 1), page_size=1)
    [finer] = [r for r in check_partials(batch, _storing("fp32", "bf16"), workers=132) if r.name == "partials.out"]
    [coarser] = [r for r in check_partials(batch, _storing("bf16", "fp32"), workers=132) if r.name == "partials.out"]
    assert finer.ok and finer.err_over_bound < PARTIALS_MATCHED and not coarser.ok, (finer.detail, coarser.detail)


@pytest.mark.parametrize("seq_len,pieces", [(128, 2), (256, 4), (4096, 4)])
def test_pieces_of_equal_length_do_not_cancel(seq_len, pieces):
    # without the offsets two equal pieces hold o_2 = -o_1 and mirrored ones cancel in pairs (module docstring)
    batch = _batch("bf16", seq_lens=(seq_len,), q_lens=(1,))
    blocks = seq_len // mutants.BLOCK
    assert min(mutants.MAX_SPLITS, blocks) == pieces and blocks % pieces == 0  # the mutants' decode: equal pieces
    [out, _] = check_partials(batch, _storing("bf16", "fp32"), workers=4)
    assert not out.ok, out.err_over_bound  # 128 and 256 tokens: about 60; 4096: 7 (the per-token charge grows)


def test_the_mutant_fails_the_partials_check_on_every_smoke_case_it_splits():
    kernel = from_callable(mutants.bf16_partials, "bf16_partials")
    split = 0
    for case in smoke_cases("bf16"):
        result = {c.name: c for c in run_case(case, kernel).checks}
        probe = partials_probe(case.materialize()[0])
        splits = any(s > mutants.BLOCK and s - n + 1 >= 2 for s, n in zip(case.seq_lens, case.q_lens))
        if isinstance(probe, str) or not splits:
            continue
        split += 1
        assert not result["partials.out"].ok, (case, result["partials.out"].detail)
    assert split >= 3


def test_correct_kernels_pass_with_p_rounded_and_the_bound_is_not_loose():
    # P rounded to bf16 or to scaled fp8 is one value per row on the probe: the check passes with fp32 partials,
    # and its bound is mostly the output's own rounding of ô (a correct kernel sits near half of it, not far below)
    batch = _batch("bf16")
    for fmt, scale in (("bf16", 1.0), ("e4m3fn", 256.0)):
        def decode(b, fmt=fmt):
            return mutants._decode(b, p_fmt=fmt)

        decode.numerics = dataclasses.replace(DEFAULT_NUMERICS, p_fmt=fmt, p_scale=scale)
        [out, lse] = check_partials(batch, from_callable(decode, fmt), workers=4)
        assert out.ok and lse.ok and 0.1 < out.err_over_bound <= 1, out.err_over_bound


def test_uniform_p_needs_q_zero_and_its_factor_is_exp_error_when_p_scale_is_exact():
    batch = _batch("bf16")
    with pytest.raises(ValueError, match="uniform_p: expected q = 0"):
        bounds.kernel_bound(batch, DEFAULT_NUMERICS, uniform_p=True)
    exact = 3 * bounds.EXP32_REL / (1 - bounds.EXP32_REL)  # three roundings no farther than exp's error
    fp8_p = KernelNumerics("e4m3fn", 256.0, torch.float8_e4m3fn, torch.float8_e4m3fn, 0.0, 0.0)
    assert bounds._uniform_p_factor(fp8_p) == exact
    assert bounds._uniform_p_factor(dataclasses.replace(fp8_p, p_scale=100.0)) == bounds._p_rounding(
        dataclasses.replace(fp8_p, p_scale=100.0))[0] == 2.0**-4  # 100 is no e4m3fn value: the declared u_P
    probe = partials_probe(batch).batch
    fp8_p_bf16_mma = dataclasses.replace(fp8_p, qk_operand=torch.bfloat16, pv_operand=torch.bfloat16)  # V exact
    loose, tight = (bounds.kernel_bound(probe, fp8_p_bf16_mma, uniform_p=u).out for u in (False, True))
    # u_P Σ p|v| is gone; where Σ p|v| = 0 (the request the probe writes 0 into) tight is B (1 + δ) against B
    assert (tight <= loose * (1 + exact)).all() and (tight.amax() < loose.amax() / 100)


def test_merge_bound_charges_the_declared_partial_dtype_once():
    batch = _batch("bf16")
    fp32, bf16 = (bounds.merge_bound(batch, 4, partial_dtype=d).out for d in (torch.float32, torch.bfloat16))
    pv = bounds.merge_bound(batch, 4).out  # partial_dtype None: accum (fp32)
    assert torch.equal(pv, fp32)
    seen = fp32 > 0
    ratio = (bf16[seen] - fp32[seen]) / fp32[seen]  # (2^-9 - 2^-24) / (ξ + 5 u) per unit: large
    assert (ratio > 10).all()
    assert torch.equal(bounds.merge_bound(batch, 1, partial_dtype=torch.bfloat16).out, torch.zeros_like(fp32))


def test_no_probe_without_a_split_or_two_tokens_and_a_broken_run_fails():
    kernel = _storing("fp32", "fp32")
    splitting = dataclasses.replace(kernel, max_splits=lambda b: 4)  # a kernel that may cut any row
    [r] = check_partials(_batch("bf16", seq_lens=(1, 2, 0), q_lens=(1, 2, 1)), splitting, workers=4)
    assert r.ok and r.name == "partials.skipped"
    assert "no partials probe: no request whose every query row sees two tokens" in r.detail
    unsplit = dataclasses.replace(kernel, max_splits=lambda b: 1)
    [r] = check_partials(_batch("bf16"), unsplit, workers=4)
    assert r.ok and r.name == "partials.skipped" and "declares no split" in r.detail

    def breaks_on_zero_q(b):
        if not b.q.double().any():
            raise RuntimeError("probe broke it")
        return mutants._decode(b)

    [r] = check_partials(_batch("bf16"), from_callable(breaks_on_zero_q, "breaks"), workers=4)
    assert not r.ok and "probe broke it" in r.detail and r.name == "partials"


@pytest.mark.parametrize("combo", ["fp8kv", "fp8", "fp8kv_fnuz"])
@pytest.mark.parametrize("seq_len", [128, 512])
def test_fp16_partials_under_fp32_fail_on_fp8_caches(combo, seq_len):
    # with kv_scale 1 these pieces' means have few enough bits for fp16 to hold them: err/bound 0.0 (a review);
    # kv_scale 13/16, applied before the partials are stored, adds four
    batch = _batch(combo, seq_lens=(seq_len,), q_lens=(1,))
    [out, _] = check_partials(batch, _storing("fp16", "fp32"), workers=4)
    assert not out.ok, out.err_over_bound
    [out, _] = check_partials(batch, _storing("fp16", "fp16"), workers=4)
    assert out.ok, out.err_over_bound


def test_a_kernel_that_writes_into_the_probe_fails_the_check_and_the_verifier_does_not_raise():
    # the oracle and bound are computed on the probe as built, before the kernel runs (a review: a q written to
    # nonzero made kernel_bound(uniform_p=True) raise inside the verifier)
    def writes_q(b):
        b.q.add_(1)
        return mutants._decode(b)

    [r] = check_partials(_batch("bf16"), from_callable(writes_q, "writes_q"), workers=4)
    assert not r.ok and "wrote into its inputs: q" in r.detail, r.detail


def test_tiny_fp16_partials_are_charged_their_subnormal_step():
    # values of 2^-22 give fp16 split outputs below 2^-14, rounded on an absolute 2^-24 grid: merge_bound's η_o
    # (a review: err/bound 89.6 on a correct kernel before it)
    batch = _batch("bf16", seq_lens=(256,), q_lens=(1,))
    L = batch.kv_lora_rank
    kv = batch.kv_cache.clone()
    kv[..., :L] = (kv[..., :L].double() * 2.0**-22).to(kv.dtype)
    batch = batch.replace(kv_cache=kv)
    ref = mla_decode_ref(batch)
    kernel = _storing("fp16", "fp16")
    out, _ = kernel.run(batch)
    bound = bounds.kernel_bound(batch, kernel.numerics(batch), ref=ref) + bounds.merge_bound(
        batch, kernel.max_splits(batch), partial_dtype=torch.float16)
    assert torch.isfinite(out).all()  # so that nan_to_num below only turns 0 / 0 (exact rows, bound 0) into 0
    ratio = float(((out.double() - ref[0]).abs() / bound.out).nan_to_num(0.0).max())
    assert 0.1 < ratio <= 1, ratio


def test_fp16_partials_that_overflow_and_saturating_p_scales_are_refused():
    batch = _batch("bf16", seq_lens=(130,), q_lens=(1,))
    kv = batch.kv_cache.clone()
    kv[0, 0, 0] = 7e4  # a value past fp16's 65504
    with pytest.raises(ValueError, match="merge_bound.partial_dtype: split outputs up to max"):
        bounds.merge_bound(batch.replace(kv_cache=kv), 2, partial_dtype=torch.float16)
    with pytest.raises(ValueError, match="KernelNumerics.p_scale: expected at most e4m3fn's max 448"):
        KernelNumerics("e4m3fn", 512.0, torch.float8_e4m3fn, torch.float8_e4m3fn, 0.0, 0.0)
    with pytest.raises(ValueError, match="KernelNumerics.p_fmt: fmt must be None"):
        KernelNumerics("e9", 1.0, torch.float16, torch.float16, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"KernelNumerics.partial_dtype: expected one of \[torch.float32, "):
        dataclasses.replace(DEFAULT_NUMERICS, partial_dtype=torch.float64)  # no bound for it


@pytest.mark.parametrize("field, value", [("qk_operand", "bf16"), ("pv_operand", torch.int8),
                                          ("out_dtype", torch.int8), ("out_dtype", None)])
def test_numerics_refuse_a_dtype_field_that_is_no_floating_dtype(field, value):
    """A plug-in's declaration with "bf16" (p_fmt's string form) or an integer dtype where a torch floating dtype
    belongs: ValueError naming the field when declared, not a traceback from inside the bound later."""
    with pytest.raises(ValueError, match=rf"KernelNumerics.{field} must be a floating-point torch.dtype"):
        dataclasses.replace(DEFAULT_NUMERICS, **{field: value})


def test_numerics_refuse_a_scale_then_round_that_is_no_bool():
    with pytest.raises(ValueError, match="KernelNumerics.scale_then_round must be a bool, got 'False'"):
        dataclasses.replace(DEFAULT_NUMERICS, scale_then_round="False")  # truthy: it would have loosened the bound


def test_a_plug_in_that_cuts_finer_than_64_tokens_declares_it_and_is_probed(monkeypatch):
    # rows of 60 tokens cut in 16-token pieces with bf16 partials: under the default max_splits (64-token pieces:
    # one) the check does not run; declared, it does and fails
    monkeypatch.setattr(mutants, "BLOCK", 16)
    batch = _batch("bf16", seq_lens=(60, 40), q_lens=(1, 2))
    fine = _storing("bf16", "fp32")
    [r] = check_partials(batch, fine, workers=4)
    assert r.ok and r.name == "partials.skipped" and "declares no split" in r.detail
    decode = fine.run
    decode.max_splits = 4
    [r, _] = check_partials(batch, from_callable(decode, "fine"), workers=4)
    assert not r.ok and r.err_over_bound > 20, r.err_over_bound
    decode.max_splits = "4"
    with pytest.raises(ValueError, match=r"\.max_splits must be an int >= 1 or a callable"):
        from_callable(decode, "fine")
