"""verify.cases and verify.strategies: validation, JSON/repro round trips, deterministic twins, the fp8 data
distributions (ties, saturation, subnormals), and the edge features the strategy and the smoke prefix must reach."""

import dataclasses
import math
import shlex

import pytest
import torch
from hypothesis import given

from mla_ref.fp8 import FORMATS
from verify.cases import (
    COHERENT_KV,
    DISTRIBUTIONS,
    HEAD_OFFSETS,
    NEAR_MAX,
    OUTLIER_GAIN,
    SCORE_STD,
    Case,
    static_scale,
)
from verify.strategies import WORK_BUDGET, cases, smoke_cases


@pytest.mark.parametrize(
    "field, value",
    [("seq_lens", ()), ("seq_lens", (3, -1)), ("q_lens", (1, 1)), ("q_lens", (0,)), ("heads", 0), ("page_size", 0),
     ("kv_dtype", "fp16"), ("q_dtype", "fp16"), ("q_dtype", "int8"), ("fp8_format", "e5m2fnuz"),
     ("scale_mode", "auto"), ("dist", "uniform"),
     ("num_workers", 0), ("seed", -1), ("sm_scale", 0.0), ("sm_scale", 1e-50), ("sm_scale", 1e300),
     ("sm_scale", 1e-40), ("sm_scale", 2.0**17), ("sm_scale", float("nan")), ("sm_scale", True), ("sm_scale", "0.1")],
)
def test_bad_field_names_itself(field, value):
    with pytest.raises(ValueError, match=f"Case.{field}"):
        dataclasses.replace(Case(), **{field: value})


def test_e5m2_near_max_is_refused_by_name():
    with pytest.raises(ValueError, match="Case.dist: near_max"):
        Case(kv_dtype="fp8", fp8_format="e5m2", dist="near_max")


@pytest.mark.parametrize("dtype, fmt, q_dtype", [("bf16", "e4m3fn", "fp16"), ("fp8", "e4m3fn", "fp8"),
                                                  ("fp8", "e4m3fnuz", "fp8")])
def test_smoke_prefix_brings_the_inputs_a_campaign_does_not_draw(dtype, fmt, q_dtype):
    """Besides its campaign's dtypes the smoke prefix holds a case of each input DecodeBatch takes that the
    campaign does not draw: fp16 q and cache (bf16), the other e4m3 format with fp8 q and an e5m2 cache with bf16 q
    (fp8); their batches hold those dtypes, an fp16 one the same values as its bf16 twin where both are exact."""
    smoke = smoke_cases(dtype, fp8_format=fmt)
    extra = [c for c in smoke if c.kv_dtype == "fp16" or (c.is_fp8 and c.fp8_format != fmt)]
    wanted = {("fp16", "fp16", fmt)} if dtype == "bf16" else {
        ("fp8", "fp8", "e4m3fnuz" if fmt == "e4m3fn" else "e4m3fn"), ("bf16", "fp8", "e5m2")}
    assert {(c.q_dtype, c.kv_dtype, c.fp8_format) for c in extra} == wanted
    names = {"fp16": torch.float16, "e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz,
             "e5m2": torch.float8_e5m2}
    for c in extra:
        kernel, exact = c.materialize()
        assert kernel.kv_cache.dtype == names["fp16" if c.kv_dtype == "fp16" else c.fp8_format]
        assert kernel.q.dtype == (names[c.fp8_format] if c.q_dtype == "fp8" else
                                  torch.float16 if c.q_dtype == "fp16" else torch.bfloat16)
        assert exact.kv_cache.dtype == (torch.float16 if c.kv_dtype == "fp16" else torch.bfloat16)


def test_sm_scale_round_trips_scales_q_and_is_what_the_batch_takes():
    """Case.sm_scale (default DeepSeek-V3's): stored as a float (1 and 1.0 are one case), named by describe() when
    not the default, round-tripped by the JSON (an old repro line without it takes the default), handed to the
    batch; q is drawn so that the scores' std is the distribution's whatever σ is (gauss1: 1, gauss4: 4)."""
    from verify.cases import SM_SCALE, V2_LITE_SM_SCALE

    assert Case(sm_scale=1) == Case(sm_scale=1.0) and isinstance(Case(sm_scale=1).sm_scale, float)
    case = Case(seq_lens=(300,), heads=4, sm_scale=V2_LITE_SM_SCALE, dist="gauss4", seed=3)
    assert Case.from_json(case.to_json()) == case and "σ0.1147" in case.describe()
    assert Case.from_json('{"seq_lens": [3]}').sm_scale == SM_SCALE and "σ" not in Case().describe()
    stds = []
    for sigma in (SM_SCALE, V2_LITE_SM_SCALE, 192**-0.5, 1.0):
        batch, _ = dataclasses.replace(case, sm_scale=sigma).materialize()
        assert batch.sm_scale == sigma
        kv = batch.request_kv(0)  # [300, D]
        stds.append(float((sigma * torch.einsum("thd,sd->ths", batch.q.double(), kv)).std()))
    # 1 row x 4 heads x 300 tokens = 1200 scores: a sample std has a standard error of 4 / sqrt(2 x 1200) = 0.082;
    # 0.4 is about 5 of them
    assert all(abs(s - 4) < 0.4 for s in stds), stds


def test_fp8_q_needs_fp8_kv():
    with pytest.raises(ValueError, match="Case.q_dtype"):
        Case(q_dtype="fp8", kv_dtype="bf16")


def test_json_and_repro_round_trip():
    case = Case(seq_lens=(0, 65), q_lens=(2, 1), kv_dtype="fp8", q_dtype="fp8", dist="near_max", seed=9)
    assert Case.from_json(case.to_json()) == case
    argv = shlex.split(case.repro("--backend emulated"))  # what a shell hands to mla-verify
    assert argv[0] == "mla-verify" and argv[1] == "--case" and argv[3:] == ["--backend", "emulated"]
    assert Case.from_json(argv[2]) == case
    with pytest.raises(ValueError, match="unknown fields"):
        Case.from_json('{"seq_len": [3]}')
    with pytest.raises(ValueError, match="JSON object"):
        Case.from_json("[1, 2]")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_materialize_is_deterministic_and_twins_share_layout():
    case = Case(seq_lens=(0, 1, 70), q_lens=(1, 2, 3), heads=2, page_size=16, kv_dtype="fp8", q_dtype="fp8", seed=5)
    (k1, x1), (k2, _) = case.materialize(), case.materialize()
    assert torch.equal(_bits(k1.kv_cache), _bits(k2.kv_cache)) and torch.equal(_bits(k1.q), _bits(k2.q))
    other, _ = dataclasses.replace(case, seed=6).materialize()
    assert not torch.equal(_bits(other.kv_cache), _bits(k1.kv_cache))
    assert torch.equal(k1.block_table, x1.block_table) and torch.equal(k1.seq_lens, x1.seq_lens)
    assert k1.kv_cache.dtype == torch.float8_e4m3fn and x1.kv_cache.dtype == torch.bfloat16
    # unused slots hold NaN in both twins, and only there
    assert torch.equal(torch.isnan(k1.kv_cache.float()), torch.isnan(x1.kv_cache.float()))
    assert int(torch.isnan(x1.kv_cache.float()).any(-1).logical_not().sum()) == sum(case.seq_lens)


@pytest.mark.parametrize("dist", ["gauss1", "gauss4", "outlier", "sink", "coherent", "near_max"])
@pytest.mark.parametrize("scale_mode", ["dynamic", "static", "unit", "kv_unit"])
def test_fp8_twin_within_element_error_model(dist, scale_mode):
    """|dequant(fp8) - exact| <= u|x| + η s + max(|x| - max·s, 0) elementwise (numerics.md §4, saturating)."""
    case = Case(seq_lens=(40, 100), q_lens=(1, 2), heads=2, kv_dtype="fp8", q_dtype="fp8", dist=dist,
                scale_mode=scale_mode, seed=11)
    kernel, exact = case.materialize()
    f = FORMATS[case.fp8_format]
    for b in range(2):
        x, s = exact.request_kv(b), kernel.kv_scale  # [s_b, D] fp64
        err = (kernel.request_kv(b) - x).abs()
        assert bool((err <= f.u * x.abs() + f.eta * s + (x.abs() - f.max * s).clamp(min=0)).all())
    q, s = exact.dequantized_q(), kernel.q_scale
    err = (kernel.dequantized_q() - q).abs()
    assert bool((err <= f.u * q.abs() + f.eta * s + (q.abs() - f.max * s).clamp(min=0)).all())


def test_coherent_values_are_ties():
    """With unit scale every cache value 1.0625 sits halfway between e4m3 neighbours and rounds (to even) to 1."""
    kernel, exact = Case(seq_lens=(30,), dist="coherent", kv_dtype="fp8", scale_mode="unit").materialize()
    x = exact.request_kv(0)
    assert bool((x.abs() == COHERENT_KV).all())
    assert bool((kernel.request_kv(0).abs() == 1.0).all())


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_near_max_values_saturate(fmt):
    """near_max puts entries in (max·s, NEAR_MAX top·s]: torch's cast would round them to max, ours saturates."""
    case = Case(seq_lens=(600,), kv_dtype="fp8", fp8_format=fmt, dist="near_max", scale_mode="static", seed=2)
    kernel, exact = case.materialize()
    s, top = static_scale(case, "kv"), FORMATS[fmt].max
    x = exact.request_kv(0).abs() / s
    beyond = x > top
    assert int(beyond.sum()) > 0 and bool((x[beyond] <= max(NEAR_MAX[fmt])).all())
    assert bool((kernel.request_kv(0).abs()[beyond] == top * s).all())


def test_outlier_pushes_the_rest_into_subnormals():
    kernel, exact = Case(seq_lens=(200,), kv_dtype="fp8", dist="outlier").materialize()
    f = FORMATS["e4m3fn"]
    assert exact.request_kv(0).abs().amax() > OUTLIER_GAIN  # the outlier channels set the dynamic scale
    codes = kernel.kv_cache.float()[~torch.isnan(kernel.kv_cache.float())].abs()
    assert float((codes < f.min_normal).double().mean()) > 0.2  # numerics.md §5.1: ~36% subnormal


@given(case=cases("fp8", max_seq_len=2048))
def test_drawn_cases_respect_limits(case):
    assert max(case.seq_lens) <= 2048
    assert case.work <= WORK_BUDGET or case.heads == 1
    assert case.kv_dtype == "fp8"
    if case.dist == "near_max":
        assert case.scale_mode == "static"


@given(case=cases("bf16", max_seq_len=1))
def test_drawn_lengths_respect_a_limit_of_one(case):
    assert max(case.seq_lens) <= 1  # the short lengths' floor of 2 drew 2 (found by a review)


def _features(cs: list[Case]) -> set[str]:
    found = set()
    for c in cs:
        pages = [math.ceil(s / c.page_size) for s in c.seq_lens]
        found |= {"empty"} if 0 in c.seq_lens else set()
        found |= {"len1"} if 1 in c.seq_lens else set()
        found |= {"mtp"} if max(c.q_lens) > 1 else set()
        found |= {"q_len>seq_len"} if any(n > s for n, s in zip(c.q_lens, c.seq_lens)) else set()
        found |= {"long"} if max(c.seq_lens) >= 2048 else set()
        found |= {"partial_page"} if any(s % c.page_size for s in c.seq_lens) else set()
        found |= {"workers>blocks"} if c.num_workers > sum(pages) else set()
        found |= {"heads:not_pow2"} if c.heads & (c.heads - 1) else set()
        found |= {"sigma:other"} if c.sm_scale != Case().sm_scale else set()
        found |= {"dims:other"} if (c.kv_lora_rank, c.rope_dim) != (512, 64) else set()
        found |= {"mtp:whole_tiles"} if any(n > 1 and s and s % 64 == 0 for n, s in zip(c.q_lens, c.seq_lens)) \
            else set()
        found |= {"heads:past_64_not_whole"} if c.heads > 64 and c.heads % 64 else set()
        found |= {"pages:past_256_not_pow2"} if c.page_size > 256 and c.page_size & (c.page_size - 1) else set()
        found |= {"mtp:past_8"} if max(c.q_lens) > 8 else set()
        found |= {f"dist:{c.dist}", f"scale:{c.scale_mode}", f"q:{c.q_dtype}"}
    return found


def test_smoke_prefix_reaches_every_feature():
    bf16 = _features(smoke_cases("bf16"))
    fp8 = _features(smoke_cases("fp8"))
    for f in ["empty", "len1", "mtp", "q_len>seq_len", "long", "partial_page", "workers>blocks", "dist:gauss4",
              "dist:sink", "dist:outlier", "dist:coherent", "dist:shifted", "dist:heads", "heads:not_pow2",
              "dims:other", "mtp:whole_tiles", "heads:past_64_not_whole", "pages:past_256_not_pow2", "mtp:past_8"]:
        assert f in bf16 and f in fp8, f
    for f in ["dist:near_max", "scale:dynamic", "scale:static", "scale:unit", "scale:kv_unit", "q:fp8", "q:bf16"]:
        assert f in fp8, f
    for cases_ in (smoke_cases("bf16"), smoke_cases("fp8")):  # σ other than V3's (V2-Lite's, no YaRN, MiniCPM3's)
        assert len({c.sm_scale for c in cases_}) == 4
    assert any(c.q_dtype == "fp8" and c.sm_scale != Case().sm_scale for c in smoke_cases("fp8"))


def test_strategy_reaches_the_edges():
    from verify.cli import _draw

    # 400: the draws of one seed depend on the modules loaded before (Hypothesis mixes constants from their source
    # into generation), so other test orders draw other cases; 150 once drew no near_max case in the full suite
    found = _features(_draw(cases("fp8"), 400, seed=0))
    for f in ["empty", "len1", "mtp", "q_len>seq_len", "long", "partial_page", "workers>blocks", "scale:dynamic",
              "scale:static", "scale:unit", "q:fp8", "q:bf16", "heads:not_pow2", "sigma:other",
              "pages:past_256_not_pow2", "mtp:past_8"] + [
                  f"dist:{d}" for d in DISTRIBUTIONS]:
        assert f in found, f


def test_short_cases_draw_the_head_counts_past_64():
    """96 and 128 heads fit the work budget only beside few tokens: drawn cases of up to 40 tokens reach both."""
    from verify.cli import _draw

    drawn = {c.heads for c in _draw(cases("bf16", max_seq_len=40), 200, seed=0)}
    assert {96, 128} <= drawn, sorted(drawn)


def test_drawn_sigma_is_a_configs():
    """A drawn σ is DeepSeek-V3's or d_qk^-1/2 · m(factor, mscale_all_dim)² of a config on the strategy's grid
    (mla_ref.config's formula, recomputed here from the grid), and others than V3's come up."""
    from mla_ref.config import yarn_get_mscale
    from verify.cli import _draw
    from verify.strategies import MSCALE_ALL_DIMS, QK_HEAD_DIMS, YARN_FACTORS

    grid = {d**-0.5 * yarn_get_mscale(f, m) ** 2 for d in QK_HEAD_DIMS for m in MSCALE_ALL_DIMS
            for f in range(YARN_FACTORS[0], YARN_FACTORS[1] + 1)}
    drawn = [c.sm_scale for c in _draw(cases("bf16"), 200, seed=3)]
    assert all(x in grid or x == Case().sm_scale for x in drawn), sorted(set(drawn) - grid)
    other = {x for x in drawn if x != Case().sm_scale}
    assert len(other) >= 3 and min(grid) >= 0.072 and max(grid) <= 0.22  # the range the strategy's docstring gives


def _scores(case: Case) -> list[torch.Tensor]:
    """Per request, the last query row's scores σ <q, k_j> over its tokens, fp64: [H, s_b] each."""
    batch, _ = case.materialize()
    q, kv = batch.dequantized(torch.float64)  # [T, H, D], [P, page, D]
    qo = batch.qo_indptr.tolist()
    return [batch.sm_scale * torch.einsum("hd,sd->hs", q[qo[b + 1] - 1], batch.request_kv(b, torch.float64))
            for b in range(batch.batch_size)]


@pytest.mark.parametrize("dist, j", [("sink", 0), ("recent", -1)])
def test_sink_and_recent_data_weight_one_token(dist, j):
    """sink gives token 0 of each request a +12 logit over the rest, recent the newest token, which only a
    request's last query row reads: a kernel that skips it is off by most of the output (the sink at token 0 hid
    that past ~1000 tokens, where the derived bound is widest; found by a review)."""
    for scores in _scores(Case(seq_lens=(300, 2000), q_lens=(2, 1), heads=2, dist=dist, seed=3)):
        rest = scores[:, 1:] if j == 0 else scores[:, :-1]  # [H, s - 1] the other tokens
        assert (scores[:, j] - rest.max(dim=1).values).min() > 12 - 2 * 4  # +12 against the N(0, ~1.4) rest


@pytest.mark.parametrize("dtype, scale_mode", [("bf16", "dynamic"), ("fp8", "dynamic"), ("fp8", "static")])
def test_heads_data_shifts_each_heads_scores_by_its_own_offset(dtype, scale_mode):
    """heads shifts head h's scores by HEAD_OFFSETS[h mod 5] (0, +120, -120, +60, -60 nats) for every token alike,
    so heads 1 and 2 lie 240 nats apart (exp of one's max overflows or flushes the other's tokens) while the spread
    within a head stays the N(0, ~1) of the rest; with fp8 q the static scale covers the offsets (8 stds of the
    rest would saturate them to 3.5 / σ)."""
    case = Case(seq_lens=(300, 40), q_lens=(2, 1), heads=6, dist="heads", kv_dtype=dtype,
                q_dtype=dtype, scale_mode=scale_mode, seed=4)
    for scores in _scores(case):  # [H, s_b]
        centre = scores.median(dim=1).values  # [H]
        offsets = torch.tensor(HEAD_OFFSETS, dtype=torch.float64)[torch.arange(6) % 5]  # [H]
        # two e4m3 half-ulps (2^-4 each: 1.0 in the cache, c_h / σ in q) of 120, plus the rest's median: < 1
        assert (centre - offsets).abs().max() < 120 * 2 * 2**-4 + 1
        assert (scores - centre[:, None]).abs().max() < 8  # STD_RANGE stds of the rest's N(0, ~1) scores, unshifted
        assert float(centre[1] - centre[2]) > 200


def test_wide_data_reaches_logits_past_fp32_exp_overflow():
    """The wide distribution (score std 32) puts logits past 88.7, where exp overflows fp32: a softmax without the
    running max subtracted fails on it (the no_max_subtraction mutant); no other distribution got past ~18."""
    top = max(float(s.max()) for s in _scores(Case(seq_lens=(90, 5, 130), q_lens=(1, 2, 1), heads=128, dist="wide",
                                                    seed=9)))
    assert top > math.log(torch.finfo(torch.float32).max)  # 88.72


def test_smoke_prefix_takes_other_latent_and_rope_sizes():
    """The smoke cases' latent and rope are DeepSeek's but in MiniCPM3's case; given, they override every case."""
    assert {(c.kv_lora_rank, c.rope_dim) for c in smoke_cases("bf16")} == {(512, 64), (256, 32)}
    assert {(c.kv_lora_rank, c.rope_dim) for c in smoke_cases("fp8", kv_lora_rank=128, rope_dim=16)} == {(128, 16)}


def test_kv_unit_takes_a_cache_scale_of_1_and_qs_dynamic_one():
    """scale_mode "kv_unit" (vLLM's default k_scale 1.0 beside a dynamically quantized fp8 q): the cache's scale is
    exactly 1 and q's is its amax over the format's max, as "dynamic" gives it for the same case."""
    kv_unit = Case(seq_lens=(40, 100), q_lens=(1, 2), heads=2, kv_dtype="fp8", q_dtype="fp8", scale_mode="kv_unit")
    dynamic = dataclasses.replace(kv_unit, scale_mode="dynamic")
    (a, _), (b, _) = kv_unit.materialize(), dynamic.materialize()
    assert a.kv_scale == 1.0 and b.kv_scale != 1.0 and a.q_scale == b.q_scale != 1.0
    assert "kv_unit" in kv_unit.describe() and Case.from_json(kv_unit.to_json()) == kv_unit


# the source-mutation review of the cases and strategies (sixty-fourth session): each test fails on the edit it
# names (C.., S..)


@pytest.mark.parametrize("dims", [(512, 64), (256, 32)])
def test_q_std_gives_the_distributions_score_std_over_the_whole_head_dim(dims):
    """C05: q is drawn with std SCORE_STD / (σ sqrt(L + R)), the whole q·k head dim (scores of unit-variance cache
    rows then have the distribution's std); sqrt(L) instead is 6 % off. Measured on the n = T·H·D iid q entries of the
    exact (bf16) batch: a sample std's relative standard error is 1 / sqrt(2 (n - 1)); allowed 5 of them plus one
    bf16 unit roundoff (2^-8 relative per entry, from the bf16 cast)."""
    L_, R_ = dims
    for dist in ("gauss1", "gauss4"):
        case = Case(seq_lens=(8,), q_lens=(4,), heads=16, kv_lora_rank=L_, rope_dim=R_, dist=dist, seed=7)
        _, exact = case.materialize()
        q = exact.q.double().flatten()
        want = SCORE_STD.get(dist, 1.0) / (case.sm_scale * math.sqrt(L_ + R_))
        tol = 5 / math.sqrt(2 * (q.numel() - 1)) + 2.0**-8
        assert abs(float(q.std()) / want - 1) < tol


def test_outlier_scores_keep_the_typical_std():
    """C07: outlier multiplies two latent cache channels by OUTLIER_GAIN and divides q there by it, so the scores
    keep std 1 (the module docstring's table); without the division the two channels add a std of about
    OUTLIER_GAIN sqrt(2 / D) ~ 177. Tolerance: 5 relative standard errors of a std counted over the T·H independent
    query vectors only (1 / sqrt(2 T H)), a conservative count."""
    case = Case(seq_lens=(300,), q_lens=(4,), heads=16, dist="outlier", seed=5)
    batch, _ = case.materialize()
    q = batch.dequantized_q(torch.float64)  # [T, H, D]
    s = batch.sm_scale * torch.einsum("thd,sd->ths", q, batch.request_kv(0, torch.float64))
    n_q = q.shape[0] * q.shape[1]
    assert abs(float(s.std()) - 1) < 5 / math.sqrt(2 * n_q)


@pytest.mark.parametrize("dist", ["sink", "recent", "shifted"])
def test_one_token_distributions_build_batches_with_empty_requests(dist):
    """C09: sink / recent / shifted lift one token of each request; an empty request has none, and the batch must
    still build (the strategy draws empty requests beside every distribution)."""
    batch, _ = Case(seq_lens=(0, 40, 0), q_lens=(1, 2, 3), heads=4, dist=dist, seed=1).materialize()
    assert batch.seq_lens.tolist() == [0, 40, 0]


def test_shifted_rows_that_miss_the_newest_token_flush_a_max_started_at_0():
    """C10: shifted puts every token at about -120 but the newest (+120): a row that cannot see the newest token
    (an earlier MTP row) has all its scores below ln(fp32's smallest normal) = -87.3, where exp(s - 0) of a running
    max started at 0 flushes to zero (the max_init_zero mutant's failure); the last row's newest token lies past
    fp32 exp's overflow (+87.3)."""
    floor = math.log(torch.finfo(torch.float32).tiny)  # -87.34
    batch, _ = Case(seq_lens=(300,), q_lens=(2,), heads=8, dist="shifted", seed=2).materialize()
    q = batch.dequantized_q(torch.float64)
    s = batch.sm_scale * torch.einsum("thd,sd->ths", q, batch.request_kv(0, torch.float64))  # [2, H, 300]
    assert float(s[0, :, :-1].max()) < floor  # row 0 sees tokens 0..298 only
    assert float(s[1, :, -1].min()) > -floor  # the newest token, which only row 1 sees, past fp32 exp's overflow


def test_near_max_places_values_of_both_signs():
    """C11: near_max sets entries to ±scale·v (its docstring): the saturated entries come in both signs, so a
    kernel that saturates only one side fails."""
    case = Case(seq_lens=(600,), kv_dtype="fp8", dist="near_max", scale_mode="static", seed=2)
    _, exact = case.materialize()
    x = exact.request_kv(0) / static_scale(case, "kv")
    beyond = x.abs() > FORMATS[case.fp8_format].max
    assert bool((x[beyond] > 0).any()) and bool((x[beyond] < 0).any())


def _drawn(dtype="fp8", n=400, seed=0, **kw):
    from verify.cli import _draw

    return _draw(cases(dtype, **kw), n, seed=seed)


def test_strategy_draws_the_edges_on_pages_past_one_token():
    """S01 / S02 / S03 / S04 / S06 / S12 / S22: the strategy's docstring edges on pages of 16, 32 and 64 tokens
    (on pages of 1 or 3, page - 1 and page + 1 are small lengths the uniform draw hits anyway, which hides a dropped
    edge): empty requests, page - 1 and page + 1 on each; pages of 3 (no power of two); ordinary MTP rows of 2-4;
    132 workers; the unit fp8 scale outside the coherent distribution (which always draws it)."""
    found = set()
    for c in _drawn():
        P = c.page_size
        found |= {"empty"} if P > 1 and 0 in c.seq_lens else set()
        found |= {f"{P}-1"} if P - 1 in c.seq_lens else set()
        found |= {f"{P}+1"} if P + 1 in c.seq_lens else set()
        found |= {"pages:3"} if P == 3 else set()
        found |= {"mtp:2-4"} if any(2 <= n <= 4 for n in c.q_lens) else set()
        found |= {"workers:132"} if c.num_workers == 132 else set()
        found |= {"unit:not_coherent"} if c.scale_mode == "unit" and c.dist != "coherent" else set()
    wanted = {"empty", "pages:3", "mtp:2-4", "workers:132", "unit:not_coherent"}
    wanted |= {f"{P}{d}" for P in (16, 32, 64) for d in ("-1", "+1")}
    assert wanted <= found, sorted(wanted - found)


def test_strategy_puts_the_long_request_and_the_long_mtp_rows_anywhere():
    """S17 / S18: the long request and the request of 5-16 MTP rows are drawn at any index, not only first (a kernel
    that handles only request 0 specially passes otherwise)."""
    long_at, mtp_at = set(), set()
    for c in _drawn():
        if max(c.seq_lens) > 512:
            long_at.add(c.seq_lens.index(max(c.seq_lens)) > 0)
        if max(c.q_lens) > 4:
            mtp_at.add(c.q_lens.index(max(c.q_lens)) > 0)
    assert True in long_at and True in mtp_at


def test_strategy_draws_distinct_seeds_and_full_batches():
    """S13 / S19: the seed is drawn (a constant seed repeats the same tensors for a shape; Hypothesis favours small
    integers, so only more than one distinct seed is asked), and batches reach max_batch requests (8 by default)."""
    drawn = _drawn("bf16", 200)
    assert len({c.seed for c in drawn}) >= 2
    assert max(len(c.seq_lens) for c in drawn) == 8


def test_strategy_and_smoke_prefix_keep_the_given_heads_pages_and_length_limit():
    """S09 / S10 / S15 / S16: heads and page_size fix every drawn and every smoke case; max_seq_len clips the smoke
    prefix's lengths."""
    for c in _drawn("bf16", 50, heads=2, page_size=16):
        assert (c.heads, c.page_size) == (2, 16)
    smoke = smoke_cases("bf16", heads=2, page_size=16, max_seq_len=100)
    assert {(c.heads, c.page_size) for c in smoke} == {(2, 16)} and max(max(c.seq_lens) for c in smoke) <= 100


def test_smoke_prefix_has_requests_with_tokens_past_index_255():
    """S20: the smoke prefix's big batch reads tokens of requests past index 255 (an 8-bit request index wraps)."""
    for dtype in ("bf16", "fp8"):
        assert any(any(s > 0 for s in c.seq_lens[256:]) for c in smoke_cases(dtype))


def test_a_campaign_format_other_than_e4m3_is_refused_by_name():
    """A campaign's fp8_format is one of FP8_FORMATS, as `mla-verify --fp8-format`: the smoke prefix and the draws
    place values past e4m3's max (near_max), which an e5m2 Case refuses, so e5m2 raised a Case error from inside
    Hypothesis (found by a review); e5m2 caches stay in the smoke prefix as its other formats."""
    from verify.testing import mla_property_test

    for make in (lambda: smoke_cases("fp8", fp8_format="e5m2"), lambda: _drawn(n=1, fp8_format="e5m2"),
                 lambda: mla_property_test(lambda batch: None, "fp8", fp8_format="e5m2")):
        with pytest.raises(ValueError, match=r"fp8_format: expected one of \('e4m3fn', 'e4m3fnuz'\)"):
            make()
    assert any(c.fp8_format == "e5m2" for c in smoke_cases("fp8"))
