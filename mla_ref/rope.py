"""YaRN rotary position embedding in DeepSeek's interleaved layout, and converters to Hugging Face's layout.

Conventions (numerics.md §1.4–1.5):
- Frequencies θ'_k (k = 0 … R/2 − 1, R = qk_rope_head_dim) follow DeepSeek `precompute_freqs_cis` (equal to HF
  `_compute_yarn_parameters` with truncate=True); the angle of position t is φ_{t,k} = t · θ'_k (radians).
- Interleaved layout (DeepSeek, vLLM GPT-J style, what MLA caches store): pair k is (x_{2k}, x_{2k+1}), rotated
  as the complex number x_{2k} + i x_{2k+1} times A · e^{iφ_k}, A = the YaRN cos/sin amplitude factor.
- HF layout (`rope_interleave=True` output, or `rope_interleave=False` weights): [x0, x2, …, x_{R−2}, x1, x3, …,
  x_{R−1}], pair k is (x_k, x_{k+R/2}) and HF rotates it with `rotate_half`. Scores q_pe·k_pe are identical.
Everything is computed in float64 and cast to the requested dtype at the end.
"""

from __future__ import annotations

import math

import torch

from mla_ref.config import MLAConfig, yarn_get_mscale


def rope_inv_freq(config: MLAConfig) -> torch.Tensor:
    """θ'_k in radians per position, float64 [R/2]; plain θ_k = rope_theta^{-2k/R} when rope_scaling is None."""
    R = config.qk_rope_head_dim
    base = config.rope_theta
    theta = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # [R/2] θ_k
    yarn = config.rope_scaling
    if yarn is None or yarn.factor == 1.0:  # the ramp would blend θ with θ / 1: plain θ, without its roundings
        return theta

    def correction_dim(num_rotations: float) -> float:
        # dim(r) = R · ln(L_orig / (2π r)) / (2 ln base): the pair index that turns r times over L_orig positions
        wavelengths = yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return R * math.log(wavelengths) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(yarn.beta_fast)), 0)  # 10 for DeepSeek-V3
    hi = min(math.ceil(correction_dim(yarn.beta_slow)), R - 1)  # 23 for DeepSeek-V3
    if lo == hi:
        hi += 0.001  # as DeepSeek and HF: avoid a zero-width ramp
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)  # [R/2] 0 → keep, 1 → /f
    return theta * ramp / yarn.factor + theta * (1 - ramp)  # [R/2] θ'_k


def rope_amplitude(config: MLAConfig) -> float:
    """YaRN cos/sin amplitude A = m(f, mscale) / m(f, mscale_all_dim) (1 for DeepSeek-V3 and without YaRN)."""
    yarn = config.rope_scaling
    if yarn is None:
        return 1.0
    return yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)


def rope_angles(
    positions: torch.Tensor, config: MLAConfig, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A·cos φ, A·sin φ), each [*positions.shape, R/2], for integer token positions; computed in float64."""
    if positions.dtype.is_floating_point or positions.dtype.is_complex:
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    phi = positions.to(torch.float64)[..., None] * rope_inv_freq(config).to(positions.device)  # [..., R/2]
    amplitude = rope_amplitude(config)
    return (amplitude * phi.cos()).to(dtype), (amplitude * phi.sin()).to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., R] (interleaved layout); cos, sin broadcast against [..., R/2]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even, got {x.shape[-1]}")
    x_even, x_odd = x[..., 0::2], x[..., 1::2]  # [..., R/2] each: real and imaginary parts of pair k
    y_even = x_even * cos - x_odd * sin  # [..., R/2]
    y_odd = x_even * sin + x_odd * cos  # [..., R/2]
    return torch.stack((y_even, y_odd), dim=-1).flatten(-2)  # [..., R] interleaved again


def interleaved_to_hf(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, …, x_{R−1}] → [x0, x2, …, x_{R−2}, x1, x3, …, x_{R−1}] along the last dim (R even)."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even, got {x.shape[-1]}")
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # [..., R]


def hf_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleaved_to_hf`: [a0 … a_{R/2−1}, b0 … b_{R/2−1}] → [a0, b0, a1, b1, …]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)  # [..., R]
