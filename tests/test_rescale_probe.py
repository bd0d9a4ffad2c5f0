"""The rescale probe (verify/rescale_probe.py) and the ``rescale`` check (verify.checks.check_rescale): the values it
writes are exact and cancel, its riser's place, and that a running output rescaled by a bf16 factor fails it alone
(the rounding probe's max never rises) while a kernel that rescales in fp32 passes."""

import pytest
import torch

from mla_ref.decode import mla_decode_ref
from verify import mutants
from verify.cases import Case
from verify.checks import run_case
from verify.kernels import from_callable
from verify.rescale_probe import rescale_probe
from verify.rounding_probe import rounding_probe

COMBOS = {"bf16": dict(), "fp16": dict(q_dtype="fp16", kv_dtype="fp16"), "fp8kv": dict(kv_dtype="fp8"),
          "fp8": dict(kv_dtype="fp8", q_dtype="fp8"), "e5m2": dict(kv_dtype="fp8", fp8_format="e5m2"),
          "fnuz": dict(kv_dtype="fp8", q_dtype="fp8", fp8_format="e4m3fnuz")}


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_the_probe_cancels_to_the_cache_formats_rounding(combo):
    """Each probed request's rows see r tokens of value ±α (α = 2^-floor(log2 r)) on a staircase of levels
    k = floor(j / 16) mod K (score 16 t k / K) and a riser at score 16 t whose value cancels them up to the cache
    format's rounding of α S (the riser at s0 - 1, or s0 - 2 where s0 - 1 is a multiple of 16): the oracle's output
    on each head's own channels (c mod H = h, whose riser value was made with that head's t) is at most
    2^-(p + 1) α on every row (p the format's mantissa bits: ô = ±(α S - Q(α S)) e^(16 t) / l with
    l >= e^(16 t) (S + 1)), while Σ p|v| / l is about 2 α; the levels are exact in the cache's format; rows that see
    fewer than 2 tokens, and empty requests, are not probed (r = -1)."""
    case = Case(seq_lens=(0, 1, 18, 40, 300), q_lens=(1, 1, 2, 1, 3), heads=4, page_size=16, **COMBOS[combo])
    batch = case.materialize()[0]
    probe = rescale_probe(batch)
    s0 = [0, 1, 17, 40, 298]  # what each request's first row sees
    assert probe.risers.tolist() == [-1, -1, 15, 39, 297]  # 17 - 1 = 16, a multiple of 16: the riser one earlier
    out, lse = mla_decode_ref(probe.batch)
    mantissa = {"bf16": 7, "fp16": 10, "fp8kv": 3, "fp8": 3, "e5m2": 2, "fnuz": 3}[combo]
    qo = probe.batch.qo_indptr.tolist()
    for b, r in enumerate(probe.risers.tolist()):
        rows = out[qo[b] : qo[b + 1]]  # [n, H, L]
        if r <= 0:
            continue
        alpha = 2.0 ** -int(torch.tensor(float(r)).log2().floor())
        H = rows.shape[1]
        own = torch.arange(batch.kv_lora_rank)[None, :] % H == torch.arange(H)[:, None]  # [H, L] head h's channels
        # half an ulp of the format, relative, of r α e^-t over l >= r; 1 + 2^-20: the fp64 oracle's own rounding
        assert rows[:, own].abs().max() <= 2.0 ** -(mantissa + 1) * alpha * (1 + 2**-20), b
        kv = probe.batch.request_kv(b)  # [s, D] dequantized
        assert torch.equal(kv[:r, : batch.kv_lora_rank].abs(), torch.full_like(kv[:r, : batch.kv_lora_rank], alpha))
        assert kv[r, batch.kv_lora_rank] == 1 and (kv[r + 1 :] == 0).all()
        # codes k / (K scale) exact: e5m2 has 3 significant bits, e4m3 4, fp16 and bf16 8 or more
        assert probe.levels == {"e5m2": 8, "fp8kv": 16, "fp8": 16, "fnuz": 16}.get(combo, 256)
        levels = torch.arange(r) // 16 % probe.levels  # [r] the staircase, 16 tokens a level
        assert torch.equal(kv[:r, batch.kv_lora_rank] * probe.levels, levels.double())
        assert (kv[:r, batch.kv_lora_rank + 1 :] == 0).all()
    assert s0[2] - 2 == probe.risers[2] and "rescale probe: 3 requests" in probe.describe()


def test_a_request_of_one_visible_token_is_not_probed():
    batch = Case(seq_lens=(1, 0), q_lens=(1, 2), heads=2).materialize()[0]
    assert "no request whose first query row sees two tokens" in rescale_probe(batch)
    result = run_case(Case(seq_lens=(1, 0), q_lens=(1, 2), heads=2), from_callable(mutants.correct), "cpu")
    assert result.ok and "rescale.skipped" in {c.name for c in result.checks}


@pytest.mark.parametrize("combo", ["bf16", "fp16", "fp8kv", "fp8"])
def test_a_bf16_rescale_factor_fails_the_rescale_check_alone(combo):
    """mutants.alpha_bf16 rescales its running output by exp(m_old - m_new) rounded to bf16 (its row sum by the
    fp32 one): on the probe, whose max rises at the riser after many tokens in the riser's split, it fails
    rescale.out and nothing else (the rounding probe's max never rises: there the factor is 1); the correct
    kernel passes. (Its last split of a request of 1000 tokens holds 232, so 168 of them rescaled at the riser.)"""
    case = Case(seq_lens=(1000, 129), q_lens=(4, 1), heads=4, dist="gauss4", num_workers=1, seed=3, **COMBOS[combo])
    bad = run_case(case, from_callable(mutants.alpha_bf16), "cpu")
    assert {c.name for c in bad.checks if not c.ok} == {"rescale.out"}, bad.describe()
    assert "rounded more coarsely than declared" in {c.name: c.detail for c in bad.checks}["rescale.out"]
    right = run_case(case, from_callable(mutants.correct), "cpu")
    assert right.ok, right.describe()
    batch = case.materialize()[0]
    assert torch.equal(mutants.alpha_bf16(rounding_probe(batch).batch)[0].view(torch.int16),
                       mutants.correct(rounding_probe(batch).batch)[0].view(torch.int16))  # no rise there


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_the_staircase_sees_a_rescale_where_the_risers_piece_is_one_tile(combo):
    """mutants.alpha_bf16 cuts a request of 300 tokens into pieces [0, 128), [128, 256), [256, 300) of 64-token
    tiles: the riser's piece is one tile, so its max never rose before the riser's tile, and the first probe (one
    rise, at the riser) passed it with the correct kernel's err/bound (0.645 bf16, 0.46 fp8kv, measured before the
    staircase). On the staircase the first piece's max rises from its first tile (levels 0-3) to its second (4-7):
    rescale.out fails alone, and the correct kernel passes."""
    case = Case(seq_lens=(300, 5), q_lens=(1, 2), heads=4, dist="gauss1", num_workers=1, seed=3, **COMBOS[combo])
    bad = run_case(case, from_callable(mutants.alpha_bf16), "cpu")
    assert {c.name for c in bad.checks if not c.ok} == {"rescale.out"}, bad.describe()
    right = run_case(case, from_callable(mutants.correct), "cpu")
    assert right.ok, right.describe()


def test_a_first_row_of_two_tokens_is_probed_and_the_riser_scores_16_t():
    """A request whose first row sees s0 = 2 tokens is probed (the riser at token 1, one token before it), and q
    carries the scores of the module docstring: 16 x_h on the first rope channel, so that the riser (k_pe[0] = 1)
    scores 16 t_h and token j below it 16 t_h k_j / K."""
    batch = Case(seq_lens=(2, 40), q_lens=(1, 1), heads=4).materialize()[0]
    probe = rescale_probe(batch)
    assert probe.risers.tolist() == [1, 39]
    L = batch.kv_lora_rank
    q = probe.batch.q.double()  # [T, H, D]
    assert not q[..., :L].any() and not q[..., L + 1 :].any()
    scores = batch.sm_scale * q[..., L]  # [T, H] each row's score of k_pe[0] = 1
    assert torch.equal(scores, 16 * probe.t.expand_as(scores))  # exact: scaling by 16 is exact in fp64
