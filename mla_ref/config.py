"""MLA layer configuration: dimensions, RoPE/YaRN parameters and the softmax scale.

Names follow DeepSeek-V3 `inference/model.py` and the Hugging Face `DeepseekV3Config`.
Numbers and formulas: docs/notes/numerics.md §1.1 (dimensions), §1.3 (softmax scale), §1.4 (YaRN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def is_int(x) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def yarn_get_mscale(factor: float, mscale: float) -> float:
    """YaRN attention factor m(f, mscale) = 0.1 * mscale * ln(f) + 1 for f > 1, else 1 (natural log)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN context-extension parameters (DeepSeek `ModelArgs`, HF `rope_parameters` with rope_type "yarn").

    factor: position interpolation factor f >= 1 (40 for DeepSeek-V3; 1 gives plain rope and m = 1).
    original_max_position_embeddings: pre-extension context length (4096).
    beta_fast, beta_slow: rotation counts bounding the interpolation ramp (32, 1).
    mscale: numerator of the cos/sin amplitude factor m(f, mscale) / m(f, mscale_all_dim).
    mscale_all_dim: drives the softmax factor m = m(f, mscale_all_dim), applied squared to the scale.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.factor) and self.factor >= 1):  # below 1 HF ramps with a warning, DeepSeek never
            raise ValueError(f"YaRN.factor must be finite and >= 1 (YaRN stretches the context), got {self.factor}")
        n = self.original_max_position_embeddings
        if not is_int(n) or n <= 0:
            raise ValueError(f"YaRN.original_max_position_embeddings must be an int > 0, got {n!r}")
        if not (math.isfinite(self.beta_fast) and self.beta_fast > self.beta_slow > 0):
            raise ValueError(f"YaRN needs finite beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")
        for name in ("mscale", "mscale_all_dim"):  # m(f, x) scales the rope amplitude and (squared) the softmax
            x = getattr(self, name)
            if not (math.isfinite(x) and yarn_get_mscale(self.factor, x) > 0):
                raise ValueError(f"YaRN.{name} must be finite with 0.1 * {name} * ln(factor) + 1 > 0 (factor "
                                 f"{self.factor}), got {x}")


@dataclass(frozen=True)
class MLAConfig:
    """One MLA attention layer (DeepSeek-V2/V3).

    q_lora_rank None means the query is a plain projection `wq` (DeepSeek-V2-Lite); otherwise
    `wq_b(RMSNorm(wq_a x))`. rope_scaling None means plain RoPE with base rope_theta.
    rms_norm_eps is the eps of the q/kv latent RMSNorms.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: YaRN | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"MLAConfig.{name} must be an int > 0, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and (not is_int(self.q_lora_rank) or self.q_lora_rank <= 0):
            raise ValueError(f"MLAConfig.q_lora_rank must be None or an int > 0, got {self.q_lora_rank!r}")
        if not is_int(self.qk_rope_head_dim) or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even and > 0, got {self.qk_rope_head_dim}")
        if not 1 < self.rope_theta < math.inf:
            raise ValueError(f"MLAConfig.rope_theta must be finite and > 1, got {self.rope_theta}")
        if not 0 < self.rms_norm_eps < math.inf:  # 0: an all-zero latent gives 0/0 = NaN; inf: every output 0
            raise ValueError(f"MLAConfig.rms_norm_eps must be finite and > 0, got {self.rms_norm_eps}")

    @property
    def qk_head_dim(self) -> int:
        """d_qk = qk_nope_head_dim + qk_rope_head_dim (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """Softmax YaRN factor m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 without YaRN or for factor 1)."""
        if self.rope_scaling is None:
            return 1.0
        return yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """σ = d_qk^{-1/2} · m² multiplying q·k (0.1352338 for DeepSeek-V3), as HF and vLLM apply it."""
        return self.qk_head_dim**-0.5 * self.mscale**2

    @classmethod
    def deepseek_v3(cls) -> MLAConfig:
        """DeepSeek-V3 / R1 (671B) attention, numerics.md §1.1."""
        return cls(
            hidden_size=7168,
            num_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_theta=10000.0,
            rope_scaling=YaRN(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                              mscale=1.0, mscale_all_dim=1.0),
            rms_norm_eps=1e-6,
        )

    @classmethod
    def deepseek_v2_lite(cls) -> MLAConfig:
        """DeepSeek-V2-Lite attention: no query LoRA (plain `wq`), 16 heads, mscale = mscale_all_dim = 0.707."""
        return cls(
            hidden_size=2048,
            num_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_theta=10000.0,
            rope_scaling=YaRN(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                              mscale=0.707, mscale_all_dim=0.707),
            rms_norm_eps=1e-6,
        )

    @classmethod
    def from_hf(cls, hf_config) -> MLAConfig:
        """From a transformers `DeepseekV3Config` / `DeepseekV2Config` (new `rope_parameters` or old `rope_scaling`).

        Reproduces what HF's attention computes:
        - HF builds q_a_layernorm / kv_a_layernorm with the default eps 1e-6 (as DeepSeek's model.py does), not
          `config.rms_norm_eps` (that one is for the decoder-layer norms), so rms_norm_eps is 1e-6 here.
        - HF applies m² to σ only when mscale_all_dim is non-zero (missing → 0 → m = 1 here), and scales cos/sin
          by m(f, mscale)/m(f, mscale_all_dim) only when both are non-zero, else by m(f, 1). A config with
          mscale_all_dim set but mscale missing/0 has no equivalent here and raises ValueError.
        - `factor` missing means max_position_embeddings / original_max_position_embeddings (HF's rule).
        """
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = float(rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "yarn":
            if rope.get("attention_factor") is not None:
                raise ValueError("rope_parameters.attention_factor: an explicit YaRN attention factor is not supported")
            if not rope.get("truncate", True):
                raise ValueError("rope_parameters.truncate: only truncate=True (DeepSeek's YaRN ramp) is supported")
            original = int(rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
            factor = rope.get("factor") or hf_config.max_position_embeddings / original
            mscale, mscale_all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
            if mscale_all_dim and not mscale:
                raise ValueError("rope_parameters.mscale: expected non-zero mscale when mscale_all_dim is set")
            if not (mscale and mscale_all_dim):
                mscale = 1.0  # HF then scales cos/sin by m(f, 1)
            rope_scaling = YaRN(
                factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=float(mscale),
                mscale_all_dim=float(mscale_all_dim),
            )
        else:
            raise ValueError(f"rope_parameters.rope_type: expected 'default' or 'yarn', got {rope_type!r}")
        return cls(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=1e-6,
        )
