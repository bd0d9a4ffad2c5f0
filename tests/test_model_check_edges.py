"""`mla-verify model` edges found by a mutation review: the pure helpers (paged cache, attention entropy, per-token
KL statistics and their summary, JSON safety, repro line), the documented init gains, the per-path q / cache / out
roundings, the calibration target, and the CLI's report fields and exit codes."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from mla_ref.decode import DecodeBatch  # noqa: E402
from verify import model_check as mc  # noqa: E402

# The smallest model the harness takes: V3 head dims (fixed), 1 layer, hidden 64, vocab 128.
SMALL = mc.ModelSize(num_layers=1, hidden_size=64, q_lora_rank=64, intermediate_size=128, vocab_size=128,
                     batch=2, steps=6)
E4M3FN_MAX, E4M3FNUZ_MAX = 448.0, 240.0  # OCP e4m3fn and AMD e4m3fnuz largest finite values
HEADROOM = 2.0  # module docstring: calibration amax maps to fmt.max / 2
# σ of the YaRN config (factor 40, mscale_all_dim 1): 192**-0.5 · mscale², mscale = 0.1·ln(40) + 1
SIGMA = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny ops, one thread


@pytest.fixture(scope="module")
def small():
    return mc.build_model(SMALL, seed=0)


# ---- pure helpers -------------------------------------------------------------------------------------------------
def test_paged_cache_addresses_tokens_past_the_first_page():
    """Token t lives in logical page t // PAGE_SIZE at slot t % PAGE_SIZE; ceil(max_len / PAGE_SIZE) pages per
    request, plus one spare page no request uses (NaN throughout): a kernel reading outside the table sees NaN."""
    ps, B = mc.PAGE_SIZE, 2
    cache = mc._PagedCache(B, 2 * ps, 3, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert cache.block_table.shape == (B, 2)  # 2·ps tokens: exactly 2 pages, no third
    assert cache.pages.shape == (2 * B + 1, ps, 3)
    used = set(cache.block_table.flatten().tolist())
    assert len(used) == 2 * B and used <= set(range(2 * B + 1))  # distinct physical pages
    spare = (set(range(2 * B + 1)) - used).pop()
    rows = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [B, 3]
    t = ps + 3  # second page, slot 3
    cache.write(rows, t)
    for b in range(B):
        assert torch.equal(cache.pages[cache.block_table[b, 1], 3], rows[b])
        assert cache.pages[cache.block_table[b, 0]].isnan().all()  # the first page stays untouched
    assert cache.pages[spare].isnan().all()


def test_attention_entropy_by_hand():
    """Head 0: q = 0, uniform over 3 tokens: ln 3. Head 1: σ<q, k_1> = ln 2, other scores 0: p = (1/2, 1/4, 1/4),
    entropy 1.5 ln 2. σ = 0.5 and q = 2 ln 2 on k_1's channel, so a missing σ gives a different value."""
    D, L = 3, 2
    q = torch.zeros(1, 2, D, dtype=torch.float64)  # [T, H, D]
    q[0, 1, 0] = 2 * math.log(2.0)
    kv = torch.full((1, 4, D), float("nan"), dtype=torch.float64)  # [P, ps, D], slot 3 unused
    kv[0, :3] = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = DecodeBatch(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                        sm_scale=0.5, kv_lora_rank=L)
    ent = mc.attention_entropy(batch)  # [1, 2]
    expected = torch.tensor([[math.log(3.0), 1.5 * math.log(2.0)]], dtype=torch.float64)
    assert torch.allclose(ent, expected, rtol=8 * 2**-52, atol=0)  # a few fp64 ulps of a 3-term sum and logs


def test_token_stats_by_hand():
    """Row 0: P = (1/4, 3/4), Q uniform: KL(P||Q) = 1/4 ln(1/2) + 3/4 ln(3/2) (P's direction, not Q's), top-1 1 vs
    0, max |Δlogit| = ln 3 (a negative difference: |·| matters). Row 1: P = (0, 1), Q = softmax(0, 1e-3): the p = 0
    term adds 0 (not NaN), KL = -ln Q_1; same argmax; |Δlogit| = |0 - (-inf)| = inf."""
    ref = torch.tensor([[0.0, math.log(3.0)], [-math.inf, 0.0]], dtype=torch.float64)  # [B, V]
    cand = torch.tensor([[0.0, 0.0], [0.0, 1e-3]], dtype=torch.float64)  # row 1: argmax 1 like the reference
    stats = mc._token_stats(ref, cand)
    q1 = torch.softmax(cand[1], -1)  # Q of row 1, by its own definition
    kl = [0.25 * math.log(0.5) + 0.75 * math.log(1.5), -math.log(float(q1[1]))]
    assert torch.allclose(stats["kl"], torch.tensor(kl, dtype=torch.float64), rtol=8 * 2**-52, atol=0)
    assert stats["top1"].tolist() == [0.0, 1.0]
    assert stats["dlogit"][0] == pytest.approx(math.log(3.0), rel=2**-52)  # one fp64 subtraction
    assert stats["dlogit"][1] == math.inf  # |1e-3 - (-inf)|


def test_summary_by_hand():
    """kl = i² for i = 0..100 (skewed: mean 3350 != median 2500); linear-interpolation 99th percentile at position
    99 exactly: 99² = 9801; max 100² = 10000. top1 (1, 1, 0, 1): 0.75; dlogit max 2."""
    kl = (torch.arange(101, dtype=torch.float64) ** 2).view(101, 1)  # [N, B]
    s = mc._summary({"kl": kl, "top1": torch.tensor([[1.0, 1.0], [0.0, 1.0]]),
                     "dlogit": torch.tensor([[0.5], [2.0], [1.0]])})
    assert s["kl_mean"] == 338350 / 101  # Σ i² = 100·101·201 / 6, exact in fp64 up to the final division
    assert s["kl_median"] == 2500.0
    assert s["kl_p99"] == pytest.approx(9801.0, rel=4 * 2**-52)  # quantile's interpolation in fp64
    assert s["kl_max"] == 10000.0
    assert s["top1_agreement"] == 0.75
    assert s["max_logit_diff"] == 2.0


def test_json_safe_writes_non_finite_floats_as_strings_everywhere():
    """+inf -> "inf", -inf -> "-inf", NaN -> "nan", inside dicts, lists and tuples alike: the strict dump works."""
    x = {"a": [math.inf, -math.inf, math.nan, 1.5], "b": (math.inf, {"c": -math.inf})}
    safe = mc._json_safe(x)
    assert safe == {"a": ["inf", "-inf", "nan", 1.5], "b": ["inf", {"c": "-inf"}]}
    json.dumps(safe, allow_nan=False)


def test_label_names_a_planted_scale():
    """A path with its own σ says so in the report's label (the planted-bug path must not read as the real one)."""
    assert mc.AttentionPath("e4m3fn", "emulated", sm_scale=0.125).label == "e4m3fn q+KV via emulated, sm_scale=0.125"
    assert mc.AttentionPath("bf16", "ref").label == "bf16 q+KV via ref"


# ---- init and attention paths -------------------------------------------------------------------------------------
def test_build_model_init_gains(small):
    """build_model's documented gains, as sample standard deviations: embeddings 1, RMSNorm weights 1 ± 0.1,
    lm_head LOGIT_STD/√in, q_b_proj and the k_pe / W_UK rows g/√in with σ·g²·√192 = SCORE_STD, the c_kv / W_UV
    rows 1/√in. Tolerance: 6 standard errors of a std estimate from n Gaussian draws, 6/√(2n) relative."""
    sd = dict(small.named_parameters())
    g = math.sqrt(mc.SCORE_STD / (SIGMA * math.sqrt(192)))
    H, L, d, D = mc.NUM_HEADS, 512, 128, SMALL.hidden_size

    def check(w, std):
        w = w.detach().double().flatten()
        assert abs(float(w.std()) / std - 1) <= 6 / math.sqrt(2 * w.numel()), (float(w.std()), std)

    check(sd["model.embed_tokens.weight"], 1.0)
    norms = torch.cat([p.detach().flatten() for p in small.parameters() if p.dim() == 1])
    assert abs(float(norms.mean()) - 1) <= 6 * 0.1 / math.sqrt(norms.numel())  # mean 1, 6 standard errors
    check(norms - 1, 0.1)
    check(sd["lm_head.weight"], mc.LOGIT_STD / math.sqrt(D))
    attn = "model.layers.0.self_attn."
    check(sd[attn + "q_b_proj.weight"], g / math.sqrt(SMALL.q_lora_rank))
    kv_a = sd[attn + "kv_a_proj_with_mqa.weight"]
    check(kv_a[:L], 1 / math.sqrt(D))
    check(kv_a[L:], g / math.sqrt(D))
    kv_b = sd[attn + "kv_b_proj.weight"].view(H, -1, L)
    check(kv_b[:, :d], g / math.sqrt(L))
    check(kv_b[:, d:], 1 / math.sqrt(L))


def _capturing_run(model, path, scales=None):
    """A _Run whose backend records each batch and returns out = 1 + 2**-12 per element (fp64, between bf16
    values: bf16 has 8 significant bits, so 1 + 2**-12 rounds to 1)."""
    run = mc._Run(model, mc._layers(model), path, 2, 4, scales, seed=0)
    seen = []

    def backend(batch):
        seen.append(batch)
        B, H = batch.q.shape[:2]
        return torch.full((B, H, batch.kv_lora_rank), 1 + 2**-12, dtype=torch.float64), None

    run.backend = backend
    return run, seen


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q = 100 * torch.randn(2, mc.NUM_HEADS, 576, generator=gen)  # [B, H, L+R] amax ~ 500
    row = 0.01 * torch.randn(2, 576, generator=gen)  # [B, L+R] amax ~ 0.04: 4 orders below q
    return q, row


def test_bf16_path_rounds_q_cache_and_out(small):
    """bf16 path: the backend sees bf16 q and cache, and its output is rounded to bf16 (1 + 2**-12 -> 1)."""
    run, seen = _capturing_run(small, mc.AttentionPath("bf16", "ref"))
    q, row = _inputs(1)
    out = run._attend(0, q, row, 0)
    assert seen[0].q.dtype == torch.bfloat16 and seen[0].kv_cache.dtype == torch.bfloat16
    assert torch.equal(seen[0].q, q.to(torch.bfloat16))
    assert (out == 1.0).all()


def test_fp8_path_uses_each_scale_and_rounds_out(small):
    """fp8 path: q is quantized with the layer's q_scale and the cache row with its kv_scale (scales 4 orders
    apart here, so a swap saturates or flushes), the batch carries them in that order, and out is rounded to bf16.
    Dequantized q within half an e4m3 ulp (2**-4 relative, 3 mantissa bits) or half the smallest subnormal
    (2**-10 · scale)."""
    q, row = _inputs(2)
    s_q, s_kv = float(q.abs().max()) / 224, float(row.abs().max()) / 224  # amax at max / 2: no saturation
    run, seen = _capturing_run(small, mc.AttentionPath("e4m3fn", "emulated"), scales=[(s_q, s_kv)])
    out = run._attend(0, q, row, 0)
    b = seen[0]
    assert b.q_scale == pytest.approx(s_q, rel=2**-23) and b.kv_scale == pytest.approx(s_kv, rel=2**-23)  # fp32
    assert ((b.dequantized_q(torch.float64) - q.double()).abs() <= 2**-4 * q.double().abs() + 2**-10 * s_q).all()
    kv = b.request_kv(0, torch.float64)[0]  # [L+R] token 0 of request 0
    assert ((kv - row[0].double()).abs() <= 2**-4 * row[0].double().abs() + 2**-10 * s_kv).all()
    assert (out == 1.0).all()


def _decoded_amax(model, tokens):
    """(max |q|, max |cache row|) the exact decode loop of a one-layer model hands its backend."""
    run = mc._Run(model, mc._layers(model), mc.AttentionPath("exact", "ref"), *tokens.shape, None, seed=0)
    backend, amax_q = run.backend, []
    run.backend = lambda batch: (amax_q.append(float(batch.q.abs().max())), backend(batch))[1]
    for t in range(tokens.shape[1]):
        run.step(tokens[:, t], t)
    return max(amax_q), float(run.caches[0].pages.nan_to_num(0.0).abs().max())


def test_calibrated_scales_map_the_decoded_amax_to_half_the_format_max():
    """calibrate_scales: max |absorbed q| (resp. |cache row|) of the layer / (fmt.max / 2). Checked against the amax
    of what the exact decode loop itself feeds the attention (q and the written cache rows), on an fp64 model: the
    HF prefill and the token-by-token loop agree to HF_PARITY_REL = 2**-16 relative (test_model_check). Run again
    with q_b_proj and kv_a_proj_with_mqa negated (q and cache rows change sign): the amax is of |x|, whichever sign
    holds the extreme."""
    model = mc.build_model(SMALL, seed=5, dtype=torch.float64)
    tokens = torch.randint(SMALL.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))  # [B, N]
    attn = model.model.layers[0].self_attn
    for _ in range(2):
        scales = mc.calibrate_scales(model, mc._layers(model), tokens, "e4m3fn")
        q_amax, kv_amax = _decoded_amax(model, tokens)
        assert scales[0][0] == pytest.approx(q_amax / (E4M3FN_MAX / HEADROOM), rel=2**-16)
        assert scales[0][1] == pytest.approx(kv_amax / (E4M3FN_MAX / HEADROOM), rel=2**-16)
        with torch.no_grad():
            attn.q_b_proj.weight.neg_()
            attn.kv_a_proj_with_mqa.weight.neg_()


def test_uniform_attention_entropy_equals_mean_log_context(small):
    """With q_b_proj zeroed every score is 0: each step's attention is uniform over its t + 1 tokens, entropy
    ln(t + 1), so the reported attention entropy (steps with context >= 2) equals mean_log_context; the next-token
    entropy is the mean entropy of the reference logits. Tolerance: fp64 rounding of log_softmax over <= 6 terms and
    the means, 64 fp64 units of ln 6."""
    model = mc.build_model(SMALL, seed=7)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_b_proj.weight.zero_()
    tokens = torch.randint(SMALL.vocab_size, (2, 6), generator=torch.Generator().manual_seed(8))  # [B, N]
    res = mc.compare_paths(model, tokens, mc.REFERENCE, [])
    expected = sum(math.log(c) for c in range(2, 7)) / 5
    assert res["mean_log_context"] == pytest.approx(expected, abs=64 * 2**-52 * math.log(6))
    assert res["attention_entropy"] == pytest.approx(expected, abs=64 * 2**-52 * math.log(6))
    logits = mc.decode_logits(model, tokens, mc.REFERENCE).double()  # [B, N, V]
    p = torch.softmax(logits, -1)
    h = float(-(p * p.log()).sum(-1).mean())
    assert res["next_token_entropy"] == pytest.approx(h, rel=64 * 2**-52)  # same logits, fp64 sums over V


# ---- CLI -----------------------------------------------------------------------------------------------------------
def test_cli_report_fields_follow_the_flags(tmp_path, monkeypatch):
    """--batch / --steps land in data, backend auto is the emulation on CPU, --fp8-format picks the candidate's
    format and the calibration's fmt.max (q_scale ratio e4m3fn / e4m3fnuz = 240 / 448 on the same tokens), tokens
    come from Generator(seed + 1), log_vocab is ln(vocab), and repro parses back to the same flags (no --json)."""
    seen = []
    compare = mc.compare_paths
    monkeypatch.setattr(mc, "compare_paths", lambda model, tokens, *a, **k: (seen.append(tokens),
                                                                            compare(model, tokens, *a, **k))[1])
    reports = {}
    for fmt in ("e4m3fnuz", "e4m3fn"):
        path = tmp_path / f"{fmt}.json"
        argv = ["--steps", "3", "--batch", "2", "--seed", "4", "--fp8-format", fmt, "--json", str(path)]
        assert mc.main(argv) == 0
        reports[fmt] = r = json.loads(path.read_text())
        assert r["data"]["sequences"] == 2 and r["data"]["steps"] == 3 and r["data"]["tokens_compared"] == 6
        assert r["candidate"] == f"{fmt} q+KV via emulated"
        assert r["log_vocab"] == pytest.approx(math.log(mc.SIZES["ci"].vocab_size), rel=2**-52)
        repro = r["repro"].split()
        assert repro[:2] == ["mla-verify", "model"] and "--json" not in repro
        back, want = vars(mc._parser().parse_args(repro[2:])), vars(mc._parser().parse_args(argv))
        assert back == {**want, "json": None}
    expected = torch.randint(mc.SIZES["ci"].vocab_size, (2, 3), generator=torch.Generator().manual_seed(5))
    assert torch.equal(seen[0], expected)
    for k in range(mc.SIZES["ci"].num_layers):
        ratio = reports["e4m3fn"]["scales"][k]["q_scale"] / reports["e4m3fnuz"]["scales"][k]["q_scale"]
        assert ratio == pytest.approx(E4M3FNUZ_MAX / E4M3FN_MAX, rel=4 * 2**-53)  # same amax, 3 fp64 roundings


def test_max_kl_bar_boundaries(capsys):
    """--max-kl nan is refused (exit 2: no KL is <= NaN); --max-kl 0 is a valid bar that a zero KL meets (exit 0)."""
    assert mc.main(["--max-kl", "nan", "--steps", "1", "--batch", "1"]) == 2
    assert "--max-kl: expected a number >= 0" in capsys.readouterr().err
    argv = ["--dtype", "bf16", "--backend", "ref", "--steps", "2", "--batch", "1", "--max-kl", "0"]
    assert mc.main(argv) == 0  # reference bf16 via ref against itself: KL exactly 0


def test_zero_steps_is_a_usage_error(capsys):
    """--steps 0 would otherwise fall back to the size's default ('0 or default'): refused with exit 2."""
    assert mc.main(["--steps", "0", "--batch", "1"]) == 2
    assert "--steps: expected an integer >= 1" in capsys.readouterr().err


def _fake_report(kl):
    return {"model": {"source": "fake"}, "data": {"sequences": 1, "steps": 1}, "reference": "r", "candidate": "c",
            "kl_mean": kl, "kl_p99": kl, "kl_max": kl, "top1_agreement": 1.0, "max_logit_diff": 0.0,
            "next_token_entropy": 1.0, "log_vocab": 2.0, "attention_entropy": 0.5, "mean_log_context": 1.0,
            "elapsed_s": 0.0}


def test_non_finite_kl_exits_1_and_the_report_is_still_written(monkeypatch, capsys, tmp_path):
    """A NaN mean KL fails (exit 1) even without --max-kl; the JSON report goes to stdout for '-' and to a file
    otherwise, NaN written as "nan"."""
    monkeypatch.setattr(mc, "run_model_check", lambda args: _fake_report(math.nan))
    assert mc.main(["--json", "-"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["kl_mean"] == "nan" and "non-finite KL" in err
    path = tmp_path / "r.json"
    assert mc.main(["--json", str(path)]) == 1
    assert json.loads(path.read_text())["kl_mean"] == "nan"


def test_weights_dir_that_is_not_a_loadable_mla_model(tmp_path, capsys):
    """--weights: a config.json that is not JSON (OSError inside transformers) and a non-MLA (Llama) checkpoint
    are exit-2 input errors naming the cause."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert mc.main(["--weights", str(bad), "--steps", "1", "--batch", "1"]) == 2
    assert "cannot load a model from" in capsys.readouterr().err
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    assert mc.main(["--weights", str(tmp_path / "llama"), "--steps", "1", "--batch", "1"]) == 2
    assert "is not an MLA (DeepSeek-V2/V3) model" in capsys.readouterr().err
