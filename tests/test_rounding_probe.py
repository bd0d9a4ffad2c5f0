"""The rounding probe (verify/rounding_probe.py) and the ``rounding`` check (verify.checks.check_rounding): what the
probe batch holds, its closed-form oracle, and that a kernel which rounds P more coarsely than it declares fails
while one that rounds as declared passes."""

import dataclasses

import pytest
import torch

from mla_ref.decode import make_decode_batch, mla_decode_ref
from mla_ref.fp8 import round_p
from verify import mutants
from verify.cases import SM_SCALE, Case
from verify.checks import _tier1_bound, check_rounding, check_tier1, run_case
from verify.kernels import DEFAULT_NUMERICS, Kernel, from_callable
from verify.rounding_probe import T_RANGE, probe_x, rounding_probe
from verify.strategies import smoke_cases

COMBOS = {"bf16": dict(), "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8"),
          "fp8kv_fnuz": dict(kv_dtype="fp8", fp8_format="e4m3fnuz")}


def _batch(combo: str, seq_lens=(0, 37, 130), q_lens=(1, 2, 3), heads=16, page_size=16):
    return Case(seq_lens=seq_lens, q_lens=q_lens, heads=heads, page_size=page_size, scale_mode="static",
                **COMBOS[combo]).materialize()[0]


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_probe_keeps_the_layout_and_the_poison_and_writes_exact_values(combo):
    batch = _batch(combo)
    probe = rounding_probe(batch)
    pb = probe.batch
    for name in ("block_table", "seq_lens", "q_lens"):
        assert torch.equal(getattr(pb, name), getattr(batch, name)), name
    assert pb.sm_scale == batch.sm_scale and pb.q.dtype == batch.q.dtype and pb.kv_cache.dtype == batch.kv_cache.dtype
    assert (pb.q_scale, pb.kv_scale) == ((1.0 if combo == "fp8" else None), (1.0 if "fp8" in combo else None))
    unused = torch.isnan(batch.kv_cache.float())  # [P, ps, D] the built batch's poison
    assert unused.any() and torch.equal(torch.isnan(pb.kv_cache.float()), unused)  # every unused slot still NaN
    q = pb.q.double()  # [T, H, D]
    L = batch.kv_lora_rank
    assert torch.equal(q[:, :, L], -probe.x.expand(batch.num_tokens, -1))  # x exact in q's format
    assert not q[:, :, :L].any() and not q[:, :, L + 1:].any()
    H = batch.num_heads
    b = torch.where((torch.arange(L) // H) % 2 == 0, 1.0, -1.0).double()  # [L]
    fmt = {"bf16": "bf16"}.get(combo, "e4m3fnuz" if combo.endswith("fnuz") else "e4m3fn")
    a = -b * round_p(probe.p[torch.arange(L) % H], fmt)  # [L]
    pairs_seen = 0
    for r in range(batch.batch_size):
        kv = pb.request_kv(r)  # [s, D] dequantized (scale 1)
        s = kv.shape[0]
        assert s == int(batch.seq_lens[r])
        pairs = 2 if s - int(batch.q_lens[r]) + 1 >= 4 else 1  # the second pair where every row sees tokens 2, 3
        pairs_seen += pairs
        for j in range(0, 2 * pairs, 2):
            if s > j:
                assert torch.equal(kv[j, :L], a) and not kv[j, L:].any()
            if s > j + 1:
                assert torch.equal(kv[j + 1, :L], b) and kv[j + 1, L] == 1 and not kv[j + 1, L + 1:].any()
        rest = kv[2 * pairs:]
        assert not rest[:, :L].any() and (rest[:, L] == 1).all() and not rest[:, L + 1:].any()
    assert pairs_seen == 5  # lengths 0, 37, 130 at q_lens 1, 2, 3: one pair in the empty request, two in the others
    t = batch.sm_scale * probe.x  # [H]
    assert (t >= T_RANGE[0]).all() and (t <= T_RANGE[1]).all() and torch.equal(probe.p, torch.exp(-t))


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_the_oracle_on_the_probe_is_the_closed_form(combo):
    """ô_c = n b_c (p_h - Q(p_h)) / l_h on head h = c mod H (b_c, Q as written), l_h = n + (s - n) p_h, for every
    row that sees s >= 2 tokens, n = 2 pairs where every row of its request sees 4 tokens, else 1; the probe's
    premise that outputs cancel to Q's rounding of p."""
    batch = _batch(combo, seq_lens=(0, 37, 130, 5, 3), q_lens=(1, 2, 3, 3, 1))  # s0 = 0, 36, 128, 3, 3
    probe = rounding_probe(batch)
    out, lse = mla_decode_ref(probe.batch)  # [T, H, L], [T, H]
    L, H = batch.kv_lora_rank, batch.num_heads
    c = torch.arange(L)
    b = torch.where((c // H) % 2 == 0, 1.0, -1.0).double()  # [L]
    Q = round_p(probe.p, "bf16" if combo == "bf16" else "e4m3fn")  # [H]
    seen = batch.visible_tokens()  # [T]
    s0 = (batch.seq_lens - batch.q_lens + 1).repeat_interleave(batch.q_lens)  # [T] s0 of each row's request
    checked = {1: 0, 2: 0}
    for row in range(batch.num_tokens):
        s = int(seen[row])
        if s < 2:
            continue
        n = 2 if int(s0[row]) >= 4 else 1  # pairs (a, b) the row sees
        l = n + (s - n) * probe.p  # [H]
        mine = c % H  # [L] each channel's head
        expected = n * b * (probe.p[mine] - Q[mine]) / l[mine]  # [L] on the channel's own head
        got = out[row][mine, c]  # [L]
        # fp64 evaluation of s + 2 <= 2^8 terms of magnitude <= 1: a few hundred fp64 ulps of 1
        assert torch.allclose(got, expected, rtol=0, atol=2**-44), row
        assert torch.allclose(lse[row], torch.log(l), rtol=0, atol=2**-44)  # scores 0 and -t_h (lse natural log)
        u = 2**-8 if combo == "bf16" else 2**-4  # unit roundoff of the cache format (bf16, e4m3fn)
        assert (expected.abs() <= n * u * probe.p[mine] / l[mine]).all()  # a cancellation: p's rounding in Q
        checked[n] += 1
    assert checked[1] >= 4 and checked[2] >= 4, checked  # rows of 3 and 5 tokens (s0 3) see one pair


def _declaring(p_fmt_kernel: str | None, p_fmt_declared: str | None) -> Kernel:
    """The mutants' reference decode rounding P to p_fmt_kernel before P.V, declaring p_fmt_declared."""
    numerics = dataclasses.replace(DEFAULT_NUMERICS, p_fmt=p_fmt_declared)

    def decode(batch):
        return mutants._decode(batch, p_fmt=p_fmt_kernel)

    return Kernel(f"P {p_fmt_kernel} declared {p_fmt_declared}", decode, lambda batch: numerics)


COARSENESS = {None: 0, "fp16": 1, "bf16": 2, "e4m3fn": 3}  # unit roundoff 2^-24, 2^-11, 2^-9, 2^-4


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("declared", [None, "fp16", "bf16"])
def test_p_rounded_more_coarsely_than_declared_fails_and_as_declared_passes(combo, declared):
    """Every (kernel P format, declared P format) pair on a varlen MTP batch (lengths 0, 37, 130): the check passes
    iff the kernel's P is no coarser than declared."""
    batch = _batch(combo)
    for actual in COARSENESS:
        results = check_rounding(batch, _declaring(actual, declared), workers=1)
        ok = all(r.ok for r in results)
        assert ok == (COARSENESS[actual] <= COARSENESS[declared]), (actual, declared, results[0].detail)
        if not ok:
            assert "more coarsely than declared" in results[0].detail


def test_bf16_p_under_fp32_fails_the_probe_at_4096_tokens():
    """The probe's sensitivity falls with the row's length (the declared per-token P.V charge grows): a request of
    4096 tokens still fails bf16 P declared as fp32, on bf16 and fp8 caches."""
    for combo in ("bf16", "fp8kv"):
        batch = _batch(combo, seq_lens=(4096,), q_lens=(1,), heads=4, page_size=64)
        results = check_rounding(batch, _declaring("bf16", None), workers=1)
        assert not results[0].ok and results[0].err_over_bound > 2, results[0].detail
        assert all(r.ok for r in check_rounding(batch, _declaring(None, None), workers=1))


def test_the_mutant_fails_the_rounding_check_on_every_smoke_case_with_two_tokens():
    """p_rounded_bf16 on the bf16 smoke prefix: the rounding check fails on every case that has a request of two
    tokens, the tier-1 comparison on drawn data on fewer; the correct kernel passes both."""
    probed = rounding = tier1 = 0
    for case in smoke_cases("bf16"):
        result = run_case(case, from_callable(mutants.p_rounded_bf16), "cpu")
        failed = {c.name for c in result.checks if not c.ok}
        has_probe = max(case.seq_lens) >= 2
        probed += has_probe
        rounding += "rounding.out" in failed
        tier1 += "tier1.out" in failed
        assert ("rounding.out" in failed) == has_probe, result.describe()
        assert run_case(case, from_callable(mutants.correct), "cpu").ok
    assert probed >= 6 and rounding == probed and tier1 < probed, (probed, rounding, tier1)


def test_no_probe_without_two_tokens_or_a_score_gap():
    batch = _batch("bf16", seq_lens=(0, 1), q_lens=(1, 1))
    assert rounding_probe(batch).startswith("no request has two tokens")
    results = check_rounding(batch, from_callable(mutants.correct), workers=1)
    assert [(r.name, r.ok) for r in results] == [("rounding.skipped", True)]
    assert "no rounding probe" in results[0].detail
    # σ = 10^4 with e4m3fn q: t in [2^-8, 2^-4] needs x below e4m3fn's least subnormal, 2^-9
    assert probe_x(1e4, 4, torch.float8_e4m3fn) is None
    assert rounding_probe(_batch("fp8").replace(sm_scale=1e4)).startswith("no x exact in q's")
    [r] = check_rounding(_batch("fp8").replace(sm_scale=1e4), from_callable(mutants.correct), workers=1)
    assert r.ok and "no x exact in q's torch.float8_e4m3fn puts sm_scale 10000 x in [2^-8, 2^-4]" in r.detail
    # no rope channel: the scores have nowhere to go (a batch the oracle and the kernels take; found by a review)
    q, kv = torch.zeros(1, 2, 8, dtype=torch.bfloat16), [torch.zeros(5, 8, dtype=torch.bfloat16)]
    flat = make_decode_batch(q, kv, sm_scale=0.1, kv_lora_rank=8, page_size=4,
                             generator=torch.Generator().manual_seed(0))
    assert rounding_probe(flat).startswith("no rope channel")
    [r] = check_rounding(flat, from_callable(mutants.correct), workers=1)
    assert r.ok and "no rope channel" in r.detail


def test_probe_x_orders_the_gaps_by_distance_from_bf16_fp16_and_e4m3fn_values():
    x = probe_x(SM_SCALE, 64, torch.bfloat16)  # [64] cyclic over the candidates
    n = len(set(x.tolist()))
    assert n >= 8 and torch.equal(x[:n], x[n : 2 * n])
    p = torch.exp(-SM_SCALE * x[:n])  # [n] in [0.5, 1): the largest rounding errors are 2^-9, 2^-12, 2^-5
    far = torch.stack([(round_p(p, f) - p).abs() / h for f, h in (("bf16", 2**-9), ("fp16", 2**-12),
                                                                  ("e4m3fn", 2**-5))]).amin(dim=0)  # [n]
    assert (far[:-1] >= far[1:]).all() and far[0] > 0.3  # best first: the first head's p is far from all three
    mantissa = x / 2 ** torch.floor(torch.log2(x))  # [64] in [1, 2)
    assert all(float(m) in (1.0, 1.25, 1.5, 1.75) for m in mantissa)
    assert (SM_SCALE * x >= T_RANGE[0]).all() and (SM_SCALE * x <= T_RANGE[1]).all()


@pytest.mark.parametrize("sm_scale", [SM_SCALE, 192**-0.5, 1.0, 3.0, 5.0])
@pytest.mark.parametrize("heads", [1, 2])
def test_one_or_two_heads_still_tell_each_coarser_format(sm_scale, heads):
    """With one or two heads only the first candidates are used: each P one format coarser than declared (e4m3fn
    under bf16, bf16 under fp16, fp16 under fp32) fails for the σ of DeepSeek-V3, 192^-1/2 and 1, 3, 5 (found by a
    review: ordered by bf16 and fp16 alone, the first candidate's p could lie next to an e4m3fn value, 0.65-0.75)."""
    batch = Case(seq_lens=(37,), heads=heads).materialize()[0].replace(sm_scale=sm_scale)
    for actual, declared in (("e4m3fn", "bf16"), ("bf16", "fp16"), ("fp16", None)):
        [out, _] = check_rounding(batch, _declaring(actual, declared), workers=1)
        assert not out.ok and out.err_over_bound > 1, (actual, declared, out.err_over_bound)


def test_a_kernel_that_breaks_on_the_probe_fails_the_check():
    """The probe is a second run of the kernel: a raise, or a result that breaks the contract, fails the check with
    its message (a first run that passed does not excuse it)."""
    batch = _batch("bf16")
    calls = []

    def flaky(b):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("second call")
        return mutants.correct(b)

    def bad_shape(b):
        return torch.zeros(1)

    flaky(batch)
    [r] = check_rounding(batch, from_callable(flaky), workers=1)
    assert not r.ok and "raised RuntimeError: second call" in r.detail
    [r] = check_rounding(batch, from_callable(bad_shape), workers=1)
    assert not r.ok and "kernel out: expected shape" in r.detail


def _tiled_from_the_end(p_fmt: str | None) -> Kernel:
    """The mutants' split decode over each row's tokens in reverse order (pages of one token, q_len 1: the block
    table's used entries reversed), so that its tiles and splits are aligned to the row's end: on a row of 65 tokens
    the boundary falls between tokens 0 and 1. P rounded to p_fmt before P.V, fp32 P declared."""
    def decode(batch):
        assert batch.page_size == 1 and bool((batch.q_lens == 1).all())
        table = batch.block_table.clone()  # [B, max_pages]
        for r, s in enumerate(batch.seq_lens.tolist()):
            table[r, :s] = table[r, :s].flip(0)
        return mutants._decode(batch.replace(block_table=table), p_fmt=p_fmt)

    return Kernel(f"tiled from the end, P {p_fmt}", decode, lambda batch: DEFAULT_NUMERICS)


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_a_boundary_between_tokens_0_and_1_leaves_the_second_pair_to_tell(combo):
    """A kernel tiling from the row's end cuts rows of 64 k + 1 tokens between the probe's tokens 0 and 1, where
    token 1 is its piece's maximum (P = 1, exact) and the first pair shows nothing; the second pair (tokens 2 and 3)
    lies inside one piece: bf16 P under an fp32 declaration fails (it passed with one pair, numerics.md §5(h)), fp32 P
    passes."""
    batch = _batch(combo, seq_lens=(65, 129), q_lens=(1, 1), heads=4, page_size=1)
    bf16 = check_rounding(batch, _tiled_from_the_end("bf16"), workers=1)
    assert not bf16[0].ok and bf16[0].err_over_bound > 2, bf16[0].detail
    assert all(r.ok for r in check_rounding(batch, _tiled_from_the_end(None), workers=1))


def test_a_failed_probe_lse_names_the_lse_not_p():
    """P's rounding does not reach the lse: a base-2 lse fails rounding.lse with the lse's hint, and its out (right)
    passes without the P hint."""
    result = run_case(smoke_cases("bf16")[0], from_callable(mutants.lse_base2))
    checks = {c.name: c for c in result.checks}
    assert not checks["rounding.lse"].ok and "its base, its scale" in checks["rounding.lse"].detail
    assert "P rounded more coarsely" not in checks["rounding.lse"].detail
    assert checks["rounding.out"].ok and "P rounded more coarsely" not in checks["rounding.out"].detail


def _l_from(rounded: bool, declared: bool, p_fmt: str = "bf16", p_scale: float = 1.0) -> Kernel:
    """The mutants' split-KV decode with P rounded to ``p_fmt`` (× ``p_scale``) for P.V, its row sum l from the
    rounded P (``rounded``) or the unrounded one, declaring ``l_from_rounded_p=declared``."""
    def decode(batch):
        return mutants._decode(batch, p_fmt=p_fmt, p_scale=p_scale, l_rounded=rounded)

    decode.numerics = dataclasses.replace(DEFAULT_NUMERICS, p_fmt=p_fmt, p_scale=p_scale, l_from_rounded_p=declared)
    return from_callable(decode, f"l_rounded_{rounded}_declared_{declared}_{p_fmt}_x{p_scale:g}")


@pytest.mark.parametrize("case", smoke_cases("bf16")[:3], ids=lambda c: c.describe())
def test_a_row_sum_of_the_rounded_p_is_declared_or_fails_the_probes_lse(case):
    """A row sum taken from the bf16 P moves the lse by up to 2^-9, which the default declaration (l from the
    unrounded P) does not charge: the rounding probe's lse fails it (exact scores leave nothing else to hide it), and
    the rescale probe's may too (its P of e^-t is not a bf16 value either).
    Declared (``l_from_rounded_p``), it passes every check, and so does a kernel that sums the unrounded P under
    that looser declaration."""
    undeclared = run_case(case, _l_from(True, False))
    failed = {c.name for c in undeclared.checks if not c.ok}
    assert "rounding.lse" in failed and failed <= {"rounding.lse", "rescale.lse", "tier1.lse", "rerun.lse"}, (
        undeclared.describe())
    declared = run_case(case, _l_from(True, True))
    assert declared.ok, declared.describe()
    assert "row sum from rounded P" in declared.numerics
    assert run_case(case, _l_from(False, True)).ok


@pytest.mark.parametrize(("n", "k"), [(1024, 4.4), (4096, 1.0)])
def test_a_row_sum_of_flushed_p_stays_in_its_declared_bound(n, k):
    """e4m3fn P without a scale flushes p < 2^-10 to 0: a row whose every split starts with a token of score 0 and
    value +1 and whose other tokens score -7 (flushed) with value -k loses their whole mass from a rounded row sum,
    while its output nearly cancels. The declared bound charges the division by that row sum on the bound itself,
    not only on |ô| (a review's rows: err/bound 1.02 and 1.61 before)."""
    q = torch.zeros(1, 1, 576)
    q[..., 512] = 1.0  # [1, 1, D] the score is the token's first rope channel
    kv = torch.zeros(n, 576)
    kv[:, :512], kv[:, 512] = -k, -7.0
    dominant = torch.arange(0, n, n // 4)  # one per split of the mutants' decode (4 splits)
    kv[dominant, :512], kv[dominant, 512] = 1.0, 0.0
    batch = make_decode_batch(q.bfloat16(), [kv.bfloat16()], sm_scale=1.0, kv_lora_rank=512, page_size=64,
                              generator=torch.Generator().manual_seed(0))
    kernel = _l_from(True, True, "e4m3fn")
    ref = mla_decode_ref(batch)
    results = check_tier1(*kernel.run(batch), ref, _tier1_bound(batch, kernel, kernel.numerics(batch), ref),
                          torch.bfloat16)
    assert all(r.ok for r in results), [r.detail for r in results]


def test_a_row_sum_of_scaled_p_carries_its_common_factor_into_the_partials_lse():
    """Under the partials probe every P is one value, so a row sum of the rounded P is n P: P's rounding, a common
    factor of the output (which cancels), moves the lse by ln(P / p̃). With p_scale 100 (not a value of e4m3fn
    after × 1) that is up to 2^-4; the declared bound charges it (a review: partials.lse 32613 before)."""
    kernel = _l_from(True, True, "e4m3fn", p_scale=100.0)
    result = run_case(smoke_cases("bf16")[0], kernel)
    assert result.ok, result.describe()
    assert {c.name for c in result.checks} >= {"partials.out", "partials.lse"}


def test_a_batch_whose_longest_request_has_two_tokens_is_probed():
    """Two tokens are enough (the second's P is e^-t, no value of bf16): a batch whose longest request has two tokens
    is probed, and bf16 P under an fp32 declaration fails it there."""
    batch = _batch("bf16", seq_lens=(0, 2), q_lens=(1, 1), heads=4)
    assert not isinstance(rounding_probe(batch), str)
    [out, lse] = check_rounding(batch, _declaring("bf16", None), workers=1)
    assert not out.ok and lse.ok, out.detail
    assert all(r.ok for r in check_rounding(batch, _declaring(None, None), workers=1))
