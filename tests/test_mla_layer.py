"""MLA layer: naive == absorbed in fp64, weight views, positions, parity with transformers' DeepseekV3/V2Attention."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_ref.config import MLAConfig, YaRN
from mla_ref.mla import MLAWeights, absorb_output, absorbed_query, latent_cache_row, mla_forward, project_q
from mla_ref.rope import hf_to_interleaved, interleaved_to_hf, rope_angles

FP64_UNIT = 2**-52  # one float64 ulp at 1.0
# Naive vs absorbed: absorption reassociates fp64 dot products of at most K = 1536 terms (q_lora_rank; the other
# contractions are shorter), which moves results by ≲ γ_K ≈ K·2**-53 relative (numerics.md §1.2 measured 3e-15; this
# file's tiny layers at most 8.6 units of 2**-53 over 3000 drawn layers). Issue #2 asked for 1e-10, 6e2x looser: a
# relative 5e-11 error in absorb_output had passed it.
NAIVE_VS_ABSORBED = 1536 * 2**-53
# Same math, different summation order (batching, HF's op order): ≤ 1024 fp64 units, reassociation over ≤ 64-term
# sums in ~10 chained ops
FP64_REASSOC = 1024 * FP64_UNIT


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (normwise relative difference)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def hidden(cfg: MLAConfig, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, cfg.hidden_size, generator=g, dtype=torch.float64)  # [B, S, D]


# -- naive vs absorbed ----------------------------------------------------------------------------------------------


def test_naive_equals_absorbed_v3_dims():
    # DeepSeek-V3 head dims (128/64/128, kv_lora 512, q_lora 1536) and YaRN; hidden 256 and 4 heads (not 7168/128)
    # keep it under a second: the per-head algebra is what absorption changes.
    cfg = dataclasses.replace(MLAConfig.deepseek_v3(), hidden_size=256, num_heads=4)
    w = MLAWeights.random(cfg, seed=0)
    x = hidden(cfg, batch=2, seq=24, seed=1)  # [B, S, D]
    positions = torch.arange(5000, 5024)  # [S] past the original 4096 context
    naive = mla_forward(x, w, cfg, positions, mode="naive")  # [B, S, D]
    absorbed = mla_forward(x, w, cfg, positions, mode="absorbed")  # [B, S, D]
    assert naive.shape == x.shape
    assert rel_diff(absorbed, naive) <= NAIVE_VS_ABSORBED


@dataclasses.dataclass(frozen=True)
class TinyLayer:
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope_half: int
    v: int
    yarn: bool
    seq: int
    seed: int

    def config(self) -> MLAConfig:
        yarn = YaRN(factor=8.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5)
        return MLAConfig(hidden_size=32, num_heads=self.heads, q_lora_rank=self.q_lora_rank,
                         kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.nope,
                         qk_rope_head_dim=2 * self.rope_half, v_head_dim=self.v,
                         rope_scaling=yarn if self.yarn else None)


tiny_layers = st.builds(
    TinyLayer,
    heads=st.integers(1, 4),
    q_lora_rank=st.one_of(st.none(), st.integers(1, 24)),
    kv_lora_rank=st.integers(1, 24),
    nope=st.integers(1, 12),
    rope_half=st.integers(1, 6),
    v=st.integers(1, 12),
    yarn=st.booleans(),
    seq=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)


@given(layer=tiny_layers)
def test_naive_equals_absorbed_tiny(layer):
    cfg = layer.config()
    w = MLAWeights.random(cfg, seed=layer.seed)
    x = hidden(cfg, batch=2, seq=layer.seq, seed=layer.seed + 1)  # [B, S, D]
    positions = torch.arange(layer.seq) * 37  # [S] spread over several YaRN wavelengths
    naive = mla_forward(x, w, cfg, positions, mode="naive")  # [B, S, D]
    absorbed = mla_forward(x, w, cfg, positions, mode="absorbed")  # [B, S, D]
    assert rel_diff(absorbed, naive) <= NAIVE_VS_ABSORBED


def test_absorbed_pieces_reproduce_naive_scores():
    """q_abs · cache_row == q_nope · (W_UK c_kv) + q_pe · k_pe, and W_UV after the latent sum == sum of values."""
    cfg = dataclasses.replace(MLAConfig.deepseek_v3(), hidden_size=64, num_heads=3)
    w = MLAWeights.random(cfg, seed=3)
    x = hidden(cfg, batch=1, seq=5, seed=4)[0]  # [T, D]
    positions = torch.arange(5)  # [T]
    q_nope, q_pe = project_q(x, w, cfg, positions)  # [T, H, 128], [T, H, 64]
    row = latent_cache_row(x, w, cfg, positions)  # [T, 576]
    assert row.shape == (5, 576)
    q = absorbed_query(q_nope, q_pe, w)  # [T, H, 576]
    k_nope = torch.einsum("tc,hdc->thd", row[:, :512], w.W_UK)  # [T, H, 128]
    naive = torch.einsum("shd,thd->sht", q_nope, k_nope) + torch.einsum("shr,tr->sht", q_pe, row[:, 512:])
    absorbed = torch.einsum("shc,tc->sht", q, row)  # [S, H, T]
    assert rel_diff(absorbed, naive) <= NAIVE_VS_ABSORBED
    p = torch.softmax(naive, dim=-1)  # [S, H, T]
    o_naive = torch.einsum("sht,thd->shd", p, torch.einsum("tc,hdc->thd", row[:, :512], w.W_UV))  # [S, H, 128]
    o_absorbed = absorb_output(torch.einsum("sht,tc->shc", p, row[:, :512]), w)  # [S, H, 128]
    assert rel_diff(o_absorbed, o_naive) <= NAIVE_VS_ABSORBED


# -- weights and inputs ---------------------------------------------------------------------------------------------


def test_weight_views_are_per_head_row_blocks():
    cfg = TinyLayer(heads=3, q_lora_rank=8, kv_lora_rank=6, nope=4, rope_half=2, v=5, yarn=False, seq=1,
                    seed=0).config()
    w = MLAWeights.random(cfg, seed=5)
    for h in range(3):
        block = w.wkv_b[h * 9:(h + 1) * 9]  # [d+v, L]: head h's rows
        assert torch.equal(w.W_UK[h], block[:4])
        assert torch.equal(w.W_UV[h], block[4:])
    assert w.W_UK.shape == (3, 4, 6) and w.W_UV.shape == (3, 5, 6)


def test_random_weights_are_deterministic_and_seeded():
    cfg = MLAConfig.deepseek_v2_lite()
    small = dataclasses.replace(cfg, hidden_size=64, num_heads=2)
    a, b, c = MLAWeights.random(small, 7), MLAWeights.random(small, 7), MLAWeights.random(small, 8)
    assert a.wq is not None and a.wq_a is None
    assert torch.equal(a.wkv_b, b.wkv_b) and not torch.equal(a.wkv_b, c.wkv_b)


def test_batched_positions_equal_per_row_forward():
    cfg = TinyLayer(heads=2, q_lora_rank=8, kv_lora_rank=8, nope=4, rope_half=2, v=4, yarn=True, seq=6,
                    seed=0).config()
    w = MLAWeights.random(cfg, seed=6)
    x = hidden(cfg, batch=2, seq=6, seed=7)  # [B, S, D]
    positions = torch.stack((torch.arange(6), torch.arange(300, 306)))  # [B, S]
    batched = mla_forward(x, w, cfg, positions, mode="absorbed")  # [B, S, D]
    for b in range(2):
        row = mla_forward(x[b:b + 1], w, cfg, positions[b], mode="absorbed")  # [1, S, D]
        assert rel_diff(batched[b:b + 1], row) <= FP64_REASSOC
    assert not torch.equal(batched[1], mla_forward(x[1:2], w, cfg, positions[0])[0])  # positions matter


def test_bad_inputs_raise_value_error():
    cfg = TinyLayer(heads=2, q_lora_rank=8, kv_lora_rank=8, nope=4, rope_half=2, v=4, yarn=False, seq=3,
                    seed=0).config()
    w = MLAWeights.random(cfg, seed=0)
    x = hidden(cfg, batch=1, seq=3, seed=0)  # [1, S, D]
    with pytest.raises(ValueError, match="mode"):
        mla_forward(x, w, cfg, torch.arange(3), mode="flash")
    with pytest.raises(ValueError, match="positions"):
        mla_forward(x, w, cfg, torch.arange(4))
    with pytest.raises(ValueError, match="wkv_b"):
        mla_forward(x, dataclasses.replace(w, wkv_b=w.wkv_b[:-1]), cfg, torch.arange(3))
    with pytest.raises(ValueError, match="wq"):
        mla_forward(x, dataclasses.replace(w, wq_a=None, q_norm=None, wq_b=None), cfg, torch.arange(3))


# -- parity with transformers ---------------------------------------------------------------------------------------

# HF's fp64 module still rounds to fp32 at three places: the rope tables (inv_freq, t·θ, cos/sin built in fp32),
# the q/kv RMSNorms (`hidden_states.to(torch.float32)`) and the eager softmax (`dtype=torch.float32`).
# Measured floor (positions 0..7, these tiny dims): 1.1e-7 (rope_interleave True), 1.3e-7 (False); with fp64 rope
# tables 8.3e-8; with all three removed 4e-16. The rope-table part grows with position: 4e-7 at t ≈ 100, 3–5e-6 at
# 1000, 2–3e-5 at 1e4, 2–3e-4 at 1e5, so the bar below holds only for positions ≲ 1000.
HF_FP32_BAR = 1e-5  # issue #2's acceptance bar, ≈ 168 fp32 units (2**-24), ~80× the measured floor; the tests
# below without HF's fp32 roundings (V3 and V2) hold the same layers to fp64 reassociation, FP64_REASSOC

HF_DIMS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=16, v_head_dim=8, max_position_embeddings=4096 * 40, num_hidden_layers=1)
# YaRN on; with R = 16 the ramp spans pairs 2..6 of 8; mscale != mscale_all_dim so the cos/sin amplitude is 0.95
HF_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), from a local generator (HF's init leaves norms at 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[1] ** -0.5)


def causal_mask(seq: int) -> torch.Tensor:
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # [S, T]
    return torch.zeros(seq, seq, dtype=torch.float64).masked_fill(future, float("-inf"))[None, None]  # [1, 1, S, T]


def hf_v3_layer(rope_interleave: bool, q_lora_rank: int | None, seed: int):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    hf_config = transformers.DeepseekV3Config(**HF_DIMS, q_lora_rank=q_lora_rank, rope_parameters=dict(HF_YARN),
                                              rope_interleave=rope_interleave)
    hf_config._attn_implementation = "eager"
    attention = hf.DeepseekV3Attention(hf_config, layer_idx=0).to(torch.float64).eval()
    randomize_(attention, seed)
    return hf, hf_config, attention


def rms_norm_fp64(self, h):  # HF's DeepseekV3/V2RMSNorm.forward without `.to(torch.float32)`
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def eager_fp64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):  # HF's, softmax in fp64
    p = (query @ key.transpose(2, 3) * scaling + attention_mask).softmax(dim=-1)  # [B, H, S, T]
    return (p @ value).transpose(1, 2).contiguous(), p


def hf_v2_layer(seed: int):
    """transformers' DeepseekV2Attention, tiny dims, YaRN, no q LoRA (V2-Lite style), random fp64 weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    hf_config = transformers.DeepseekV2Config(
        **HF_DIMS, q_lora_rank=None, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=0.707, mscale_all_dim=0.707),
    )
    hf_config._attn_implementation = "eager"
    attention = hf.DeepseekV2Attention(hf_config, layer_idx=0).to(torch.float64).eval()
    randomize_(attention, seed)
    return hf, hf_config, attention


V3_CASES = [(True, 24), (False, 24), (False, None)]  # (rope_interleave, q_lora_rank)


@pytest.mark.parametrize("rope_interleave,q_lora_rank", V3_CASES)
def test_matches_hf_deepseek_v3_attention(rope_interleave, q_lora_rank):
    hf, hf_config, attention = hf_v3_layer(rope_interleave, q_lora_rank, seed=10)
    cfg, w = MLAConfig.from_hf(hf_config), MLAWeights.from_hf(attention)
    S = 8
    x = hidden(cfg, batch=2, seq=S, seed=11)  # [B, S, D]
    positions = torch.arange(S)  # [S]
    cos, sin = hf.DeepseekV3RotaryEmbedding(hf_config)(x, positions[None].expand(2, S))  # [B, S, R] fp32 → fp64
    with torch.no_grad():
        out_hf, _ = attention(x, position_embeddings=(cos, sin), attention_mask=causal_mask(S))  # [B, S, D]
    for mode in ("naive", "absorbed"):
        assert rel_diff(mla_forward(x, w, cfg, positions, mode=mode), out_hf) <= HF_FP32_BAR


@pytest.mark.parametrize("rope_interleave,q_lora_rank", V3_CASES)
def test_matches_hf_v3_exactly_without_fp32_roundings(rope_interleave, q_lora_rank, monkeypatch):
    """Patch out HF's three fp32 casts, feed fp64 rope tables, and record HF's roped q_pe/k_pe: fp64 agreement."""
    hf, hf_config, attention = hf_v3_layer(rope_interleave, q_lora_rank, seed=12)
    cfg, w = MLAConfig.from_hf(hf_config), MLAWeights.from_hf(attention)

    recorded = {}
    rope_fn = "apply_rotary_pos_emb_interleave" if rope_interleave else "apply_rotary_pos_emb"
    original_rope = getattr(hf, rope_fn)

    def recording_rope(q, k, cos, sin, *args, **kwargs):
        recorded["q_pe"], recorded["k_pe"] = original_rope(q, k, cos, sin, *args, **kwargs)
        return recorded["q_pe"], recorded["k_pe"]

    monkeypatch.setattr(hf.DeepseekV3RMSNorm, "forward", rms_norm_fp64)
    monkeypatch.setattr(hf, "eager_attention_forward", eager_fp64)
    monkeypatch.setattr(hf, rope_fn, recording_rope)

    S = 8
    x = hidden(cfg, batch=2, seq=S, seed=13)  # [B, S, D]
    positions = torch.arange(3000, 3000 + S)  # [S]
    cos, sin = rope_angles(positions[None].expand(2, S), cfg)  # [B, S, R/2] fp64, amplitude included
    with torch.no_grad():
        out_hf, _ = attention(x, position_embeddings=(torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)),
                              attention_mask=causal_mask(S))  # [B, S, D]
    for mode in ("naive", "absorbed"):
        assert rel_diff(mla_forward(x, w, cfg, positions, mode=mode), out_hf) <= FP64_REASSOC

    # HF's roped q_pe [B, H, S, R] and k_pe [B, 1, S, R] come out in the HF layout for both rope_interleave values
    q_nope, q_pe = project_q(x, w, cfg, positions)  # [B, S, H, d], [B, S, H, R] interleaved
    k_pe = latent_cache_row(x, w, cfg, positions)[..., cfg.kv_lora_rank:]  # [B, S, R] interleaved
    q_pe_hf, k_pe_hf = recorded["q_pe"].transpose(1, 2), recorded["k_pe"][:, 0]  # [B, S, H, R], [B, S, R]
    assert rel_diff(hf_to_interleaved(q_pe_hf), q_pe) <= FP64_REASSOC
    assert rel_diff(interleaved_to_hf(q_pe), q_pe_hf) <= FP64_REASSOC
    assert rel_diff(hf_to_interleaved(k_pe_hf), k_pe) <= FP64_REASSOC
    assert rel_diff(interleaved_to_hf(k_pe), k_pe_hf) <= FP64_REASSOC


def test_matches_hf_deepseek_v2_attention():
    """V2's complex RoPE (interleaved, no permutation) and the plain `q_proj` path (V2-Lite style)."""
    hf, hf_config, attention = hf_v2_layer(seed=14)
    cfg, w = MLAConfig.from_hf(hf_config), MLAWeights.from_hf(attention)
    S = 8
    x = hidden(cfg, batch=2, seq=S, seed=15)  # [B, S, D]
    positions = torch.arange(S)  # [S]
    freqs_cis = hf.DeepseekV2RotaryEmbedding(hf_config)(x, positions[None].expand(2, S))  # [B, S, R/2] complex64
    with torch.no_grad():
        out_hf, _ = attention(x, attention_mask=causal_mask(S), position_embeddings=freqs_cis)  # [B, S, D]
    # V2 also rotates q_pe/k_pe in complex64 (`xq.float()`); measured floor 1.3e-7 at positions 0..7
    assert rel_diff(mla_forward(x, w, cfg, positions, mode="absorbed"), out_hf) <= HF_FP32_BAR


def test_matches_hf_v2_exactly_without_fp32_roundings(monkeypatch):
    """V2 with HF's fp32 steps patched out (its RMSNorm cast, the eager softmax and the complex64 rotation), fed fp64
    rope tables: fp64 agreement, so a relative error below HF_FP32_BAR in the V2 path is seen too (a review's
    mutant, out x (1 + 5e-6), passed the fp32-floored parity test)."""
    hf, hf_config, attention = hf_v2_layer(seed=16)
    cfg, w = MLAConfig.from_hf(hf_config), MLAWeights.from_hf(attention)

    def rotary_fp64(xq, xk, freqs_cis):  # HF's apply_rotary_emb in complex128 instead of complex64
        xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2).contiguous())  # [B, H, S, R/2]
        xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2).contiguous())  # [B, 1, S, R/2]
        freqs_cis = freqs_cis.unsqueeze(1)  # [B, 1, S, R/2]
        return torch.view_as_real(xq_ * freqs_cis).flatten(3), torch.view_as_real(xk_ * freqs_cis).flatten(3)

    monkeypatch.setattr(hf.DeepseekV2RMSNorm, "forward", rms_norm_fp64)
    monkeypatch.setattr(hf, "eager_attention_forward", eager_fp64)
    monkeypatch.setattr(hf, "apply_rotary_emb", rotary_fp64)
    S = 8
    x = hidden(cfg, batch=2, seq=S, seed=17)  # [B, S, D]
    positions = torch.arange(3000, 3000 + S)  # [S]
    cos, sin = rope_angles(positions[None].expand(2, S), cfg)  # [B, S, R/2] fp64, amplitude included
    with torch.no_grad():
        out_hf, _ = attention(x, attention_mask=causal_mask(S), position_embeddings=torch.complex(cos, sin))
    for mode in ("naive", "absorbed"):
        assert rel_diff(mla_forward(x, w, cfg, positions, mode=mode), out_hf) <= FP64_REASSOC
