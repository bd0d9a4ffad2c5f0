"""MLAConfig presets, softmax scale, YaRN frequencies (closed form and HF), RoPE rotation and layout converters."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_ref.config import MLAConfig, YaRN
from mla_ref.rope import (
    apply_rope_interleaved,
    hf_to_interleaved,
    interleaved_to_hf,
    rope_amplitude,
    rope_angles,
    rope_inv_freq,
)

FP64_UNIT = 2**-52  # float64 unit roundoff (2**-53) doubled: one ulp at 1.0
FP32_UNIT = 2**-24  # float32 unit roundoff

V3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


# -- config ---------------------------------------------------------------------------------------------------------


def test_v3_softmax_scale_matches_numerics_md():
    cfg = MLAConfig.deepseek_v3()
    assert cfg.qk_head_dim == 192
    # numerics.md §1.3 prints σ = 0.1352338, m = 1.368888, σ·log2(e) = 0.1951011: half a unit of the last digit
    assert abs(cfg.softmax_scale - 0.1352338) <= 0.5e-7
    assert abs(cfg.mscale - 1.368888) <= 0.5e-6
    assert abs(cfg.softmax_scale * math.log2(math.e) - 0.1951011) <= 0.5e-7
    assert rope_amplitude(cfg) == 1.0  # mscale == mscale_all_dim


def test_v2_lite_preset():
    cfg = MLAConfig.deepseek_v2_lite()
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (2048, 16, None, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert abs(cfg.softmax_scale - 192**-0.5 * m * m) <= 4 * FP64_UNIT * cfg.softmax_scale  # a few fp64 roundings


def test_plain_rope_has_no_mscale():
    cfg = dataclasses.replace(MLAConfig.deepseek_v3(), rope_scaling=None)
    assert cfg.mscale == 1.0 and rope_amplitude(cfg) == 1.0
    assert cfg.softmax_scale == 192**-0.5
    theta = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)  # [32]
    torch.testing.assert_close(rope_inv_freq(cfg), theta, rtol=4 * FP64_UNIT, atol=0)  # pow + reciprocal


def test_from_hf_v3_equals_preset_and_hf_scaling():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(rope_parameters=dict(V3_YARN), max_position_embeddings=163840)
    assert MLAConfig.from_hf(hf) == MLAConfig.deepseek_v3()
    assert MLAConfig.from_hf(transformers.DeepseekV3Config()).rope_scaling is None  # HF default: plain rope


def test_from_hf_v2_old_rope_scaling_equals_v2_lite():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=0.707, mscale_all_dim=0.707),
    )
    assert MLAConfig.from_hf(hf) == MLAConfig.deepseek_v2_lite()


@pytest.mark.parametrize("mscales", [
    dict(mscale=1.0, mscale_all_dim=0.8),  # mscale != mscale_all_dim, so the cos/sin amplitude is not 1
    dict(mscale=None, mscale_all_dim=None),  # neither: HF's default amplitude m(f, 1) (a review's mutant survived)
    dict(mscale=0.707, mscale_all_dim=None),  # mscale alone: also m(f, 1)
])
def test_from_hf_softmax_scale_and_amplitude_match_hf_module(mscales):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope = {k: v for k, v in {**V3_YARN, **mscales}.items() if v is not None}
    hf = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                       max_position_embeddings=163840, rope_parameters=rope)
    cfg = MLAConfig.from_hf(hf)
    assert abs(DeepseekV3Attention(hf, layer_idx=0).scaling - cfg.softmax_scale) <= 4 * FP64_UNIT * cfg.softmax_scale
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert abs(attention_factor - rope_amplitude(cfg)) <= 4 * FP64_UNIT
    assert abs(rope_amplitude(cfg) - 1.0) > 0.01


def test_config_rejects_bad_fields():
    v3 = MLAConfig.deepseek_v3()
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        dataclasses.replace(v3, qk_rope_head_dim=63)
    with pytest.raises(ValueError, match="q_lora_rank"):
        dataclasses.replace(v3, q_lora_rank=0)
    for field, value in [("num_heads", 2.5), ("kv_lora_rank", True), ("q_lora_rank", 1536.0),  # found by reviews
                         ("rope_theta", math.inf), ("rope_theta", 1.0),  # ln(1) = 0 divides YaRN's correction_dim
                         ("rms_norm_eps", 0.0), ("rms_norm_eps", math.inf)]:
        with pytest.raises(ValueError, match=f"MLAConfig.{field}"):
            dataclasses.replace(v3, **{field: value})
    for beta_fast, beta_slow in [(1.0, 32.0), (2.0, 2.0)]:  # the ramp needs beta_fast > beta_slow, strictly
        with pytest.raises(ValueError, match="beta"):
            YaRN(factor=40.0, original_max_position_embeddings=4096, beta_fast=beta_fast, beta_slow=beta_slow)
    for field, value in [("factor", math.inf), ("factor", 0.5),  # below 1 HF ramps (with a warning), DeepSeek never
                         ("original_max_position_embeddings", 4096.0),
                         ("mscale", math.nan), ("mscale_all_dim", math.nan),
                         ("mscale_all_dim", -1 / (0.1 * math.log(40.0)))]:  # m(40, x) = 0: a zero softmax scale
        with pytest.raises(ValueError, match=f"YaRN.{field}"):
            dataclasses.replace(v3.rope_scaling, **{field: value})


def test_from_hf_without_factor_takes_max_positions_over_original():
    """HF's rule (`factor = max_position_embeddings / original_max_position_embeddings` when it is missing):
    transformers 5 refuses a yarn config without one, so a plain object with the fields from_hf reads stands in for
    an older config; it must give the config with 163840 / 4096 = 40 written out."""
    transformers = pytest.importorskip("transformers")
    import types

    with_factor = transformers.DeepseekV3Config(rope_parameters=dict(V3_YARN), max_position_embeddings=163840)
    fields = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
    rope = {k: v for k, v in V3_YARN.items() if k != "factor"}
    without = types.SimpleNamespace(**{k: getattr(with_factor, k) for k in fields}, rope_parameters=rope)
    assert MLAConfig.from_hf(without) == MLAConfig.from_hf(with_factor) == MLAConfig.deepseek_v3()


def test_from_hf_latent_norm_eps_is_the_one_hf_attention_uses():
    """HF builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps (the decoder
    layers' norms): with rms_norm_eps 0.25 in the config, the oracle's latent-norm eps is still the modules'."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                       max_position_embeddings=163840, rope_parameters=dict(V3_YARN),
                                       rms_norm_eps=0.25)
    attention = DeepseekV3Attention(hf, layer_idx=0)
    assert attention.kv_a_layernorm.variance_epsilon == attention.q_a_layernorm.variance_epsilon
    assert MLAConfig.from_hf(hf).rms_norm_eps == attention.kv_a_layernorm.variance_epsilon != 0.25


def test_from_hf_rejects_unsupported_rope_type():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="rope_type"):
        MLAConfig.from_hf(hf)


# -- YaRN frequencies -----------------------------------------------------------------------------------------------


def test_yarn_frequencies_closed_form_v3():
    """numerics.md §1.4, written out with the math module: lo = 10, hi = 23, ramp over 13 pairs, factor 40."""
    expected = []
    for k in range(32):
        theta = 10000.0 ** (-2 * k / 64)
        ramp = min(max((k - 10) / 13, 0.0), 1.0)
        expected.append(theta * ramp / 40 + theta * (1 - ramp))
    got = rope_inv_freq(MLAConfig.deepseek_v3())  # [32]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=8 * FP64_UNIT, atol=0)
    # the ramp ends: pairs 0..10 keep θ_k, pairs 23..31 are interpolated by the full factor
    assert got[10].item() == pytest.approx(10000.0 ** (-20 / 64), rel=8 * FP64_UNIT)
    assert got[23].item() == pytest.approx(10000.0 ** (-46 / 64) / 40, rel=8 * FP64_UNIT)


def test_yarn_frequencies_match_hf_fp32():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(rope_parameters=dict(V3_YARN), max_position_embeddings=163840)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf)  # [32] float32
    ours = rope_inv_freq(MLAConfig.from_hf(hf))  # [32] float64
    # HF's fp32 chain (pow, reciprocal, factor product, ramp blend) rounds ≤ 4 times; measured max 2.13 units
    torch.testing.assert_close(inv_freq.double(), ours, rtol=4 * FP32_UNIT, atol=0)


@pytest.mark.parametrize("R, rope", [
    (4, dict(V3_YARN)),  # the ramp's end ceil(dim(beta_slow)) = 2 > R/2 - 1: clamped at R - 1, as HF's dim - 1
    (16, dict(V3_YARN, beta_fast=16, beta_slow=4)),  # betas other than DeepSeek's: the ramp over pairs 3-5
    (64, dict(V3_YARN, factor=8.0, original_max_position_embeddings=6)),  # both ends clamp to 0: the 0.001 guard
])
def test_yarn_frequencies_match_hf_beyond_the_v3_preset(R, rope):
    """The V3 preset never reaches the ramp's clamps, its zero-width guard or beta_slow != 1: HF's YaRN there."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8,
                                       max_position_embeddings=163840, rope_parameters=rope)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf)  # [R/2] float32
    ours = rope_inv_freq(MLAConfig.from_hf(hf))  # [R/2] float64
    torch.testing.assert_close(inv_freq.double(), ours, rtol=4 * FP32_UNIT, atol=0)  # HF's fp32 chain, as above


def test_rope_angles_equal_closed_form_cos_sin_at_long_positions():
    """cos(t θ'_k), sin(t θ'_k) with θ'_k and the angle written out with the math module (numerics.md §1.4): the
    angles stay fp64 (θ' or φ rounded to fp32 is 2**-24 relative: 1e-2 rad at t = 163839)."""
    positions = [0, 1, 4095, 4096, 70000, 163839]
    cos, sin = rope_angles(torch.tensor(positions), MLAConfig.deepseek_v3())  # [6, 32], amplitude 1
    for i, t in enumerate(positions):
        for k in range(32):
            theta = 10000.0 ** (-2 * k / 64)
            ramp = min(max((k - 10) / 13, 0.0), 1.0)
            phi = t * (theta * ramp / 40 + theta * (1 - ramp))
            # θ' within 8 units (test_yarn_frequencies_closed_form_v3), t θ' one more on each side: |Δφ| <= 10 units
            # of φ; cos and sin move by at most |Δφ|, plus one rounding each in math and in torch
            tol = 10 * FP64_UNIT * phi + 2 * FP64_UNIT
            assert abs(cos[i, k].item() - math.cos(phi)) <= tol, (t, k)
            assert abs(sin[i, k].item() - math.sin(phi)) <= tol, (t, k)


def test_rope_angles_amplitude_and_shape():
    cfg = dataclasses.replace(
        MLAConfig.deepseek_v3(), rope_scaling=dataclasses.replace(MLAConfig.deepseek_v3().rope_scaling, mscale=0.5)
    )
    positions = torch.tensor([[0, 1, 4095], [4096, 70000, 163839]])  # [2, 3]
    cos, sin = rope_angles(positions, cfg)  # [2, 3, 32]
    assert cos.shape == sin.shape == (2, 3, 32) and cos.dtype == torch.float64
    A = rope_amplitude(cfg)
    assert abs(A - (0.1 * 0.5 * math.log(40) + 1) / (0.1 * math.log(40) + 1)) <= 4 * FP64_UNIT
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, A * A), rtol=4 * FP64_UNIT, atol=0)
    torch.testing.assert_close(cos[0, 0], torch.full((32,), A, dtype=torch.float64), rtol=0, atol=0)  # t = 0
    with pytest.raises(ValueError, match="positions"):
        rope_angles(positions.double(), cfg)


# -- rotation and layouts -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RotationCase:
    """8 positions from ``start``, x drawn from ``seed``."""

    start: int
    seed: int


@given(st.builds(RotationCase, start=st.integers(0, 200_000), seed=st.integers(0, 2**31 - 1)))
def test_rotation_preserves_pair_norms(case):
    start = case.start
    g = torch.Generator().manual_seed(case.seed)
    cfg = MLAConfig.deepseek_v3()  # amplitude 1
    x = torch.randn(8, 3, 64, generator=g, dtype=torch.float64)  # [T, H, R]
    cos, sin = rope_angles(torch.arange(start, start + 8), cfg)  # [T, 32]
    y = apply_rope_interleaved(x, cos[:, None], sin[:, None])  # [T, H, R]
    pair_norm = lambda t: t.unflatten(-1, (32, 2)).norm(dim=-1)  # noqa: E731  [T, H, 32]
    # |cos|,|sin| ≤ 1: each output element rounds ≤ 3 times, the norms ≤ 3 more
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=8 * FP64_UNIT, atol=0)


def test_rotation_is_complex_multiplication():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64)  # [T, R]
    cos, sin = rope_angles(torch.tensor([0, 3, 17, 4096, 99999]), MLAConfig.deepseek_v3())  # [T, 32]
    expected = torch.view_as_real(torch.view_as_complex(x.view(5, 32, 2)) * torch.complex(cos, sin)).flatten(-2)
    torch.testing.assert_close(apply_rope_interleaved(x, cos, sin), expected, rtol=4 * FP64_UNIT, atol=4 * FP64_UNIT)


def test_layout_converters():
    x = torch.arange(8)
    assert interleaved_to_hf(x).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert hf_to_interleaved(torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])).tolist() == list(range(8))
    y = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(hf_to_interleaved(interleaved_to_hf(y)), y)
    assert torch.equal(interleaved_to_hf(hf_to_interleaved(y)), y)
    with pytest.raises(ValueError, match="even"):
        interleaved_to_hf(torch.zeros(3))


@pytest.mark.parametrize("hf_fn", ["apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb"])
def test_interleaved_rope_matches_hf_in_hf_layout(hf_fn):
    """HF `rope_interleave=True` reads interleaved x and returns the HF layout; `False` reads and returns HF layout."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    g = torch.Generator().manual_seed(2)
    cfg = MLAConfig.deepseek_v3()
    q = torch.randn(1, 4, 6, 64, generator=g, dtype=torch.float64)  # [B, H, S, R] interleaved
    k = torch.randn(1, 1, 6, 64, generator=g, dtype=torch.float64)  # [B, 1, S, R] interleaved
    cos, sin = rope_angles(torch.arange(100, 106)[None], cfg)  # [1, S, 32]
    cos_hf, sin_hf = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # [1, S, 64]: HF's cat(φ, φ)
    if hf_fn == "apply_rotary_pos_emb_interleave":
        q_hf, k_hf = hf.apply_rotary_pos_emb_interleave(q, k, cos_hf, sin_hf)
    else:
        q_hf, k_hf = hf.apply_rotary_pos_emb(interleaved_to_hf(q), interleaved_to_hf(k), cos_hf, sin_hf)
    q_ours = apply_rope_interleaved(q, cos[:, None], sin[:, None])  # [B, H, S, R]
    k_ours = apply_rope_interleaved(k, cos[:, None], sin[:, None])  # [B, 1, S, R]
    # same two products and one sum per element as ours, in fp64
    torch.testing.assert_close(q_hf, interleaved_to_hf(q_ours), rtol=4 * FP64_UNIT, atol=4 * FP64_UNIT)
    torch.testing.assert_close(hf_to_interleaved(k_hf), k_ours, rtol=4 * FP64_UNIT, atol=4 * FP64_UNIT)
    # scores are layout-independent
    s_hf = torch.einsum("bhsr,bztr->bhst", q_hf, k_hf)  # [B, H, S, S]
    s_ours = torch.einsum("bhsr,bztr->bhst", q_ours, k_ours)  # [B, H, S, S]
    torch.testing.assert_close(s_hf, s_ours, rtol=0, atol=64 * 8 * FP64_UNIT)  # 64-term dots of O(1) products
