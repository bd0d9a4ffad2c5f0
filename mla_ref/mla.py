"""One MLA attention layer (DeepSeek-V2/V3), naive and weight-absorbed, as an fp64 reference.

Equations: numerics.md §1.2. Symbols: B batch, S query tokens, T key tokens, D hidden, H heads,
d = qk_nope_head_dim, R = qk_rope_head_dim, v = v_head_dim, L = kv_lora_rank, Q = q_lora_rank.
Weights use the nn.Linear layout [out, in]; q_pe/k_pe and their weight rows use DeepSeek's interleaved RoPE layout.
All arithmetic runs in the dtype of the inputs (pass float64 for the oracle); nothing is upcast or rounded inside.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mla_ref.config import MLAConfig
from mla_ref.rope import apply_rope_interleaved, hf_to_interleaved, rope_angles


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dim, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # [..., n]


@dataclass(frozen=True, kw_only=True)
class MLAWeights:
    """Weights of one MLA layer, nn.Linear layout [out, in].

    wq_a [Q, D], q_norm [Q], wq_b [H·(d+R), Q]  — or wq [H·(d+R), D] when q_lora_rank is None;
    wkv_a [L+R, D], kv_norm [L], wkv_b [H·(d+v), L], wo [D, H·v].
    Per head, wq/wq_b rows are [nope (d) | rope (R)] and wkv_b rows are [W_UK (d) | W_UV (v)]; the last R rows of
    wkv_a and the rope rows of wq/wq_b are in the interleaved RoPE layout (as DeepSeek checkpoints store them).
    """

    num_heads: int
    wkv_a: torch.Tensor
    kv_norm: torch.Tensor
    wkv_b: torch.Tensor
    wo: torch.Tensor
    wq: torch.Tensor | None = None
    wq_a: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    wq_b: torch.Tensor | None = None

    @property
    def W_UK(self) -> torch.Tensor:
        """[H, d, L] view of wkv_b: k_nope = W_UK c_kv per head."""
        H, v = self.num_heads, self.wo.shape[1] // self.num_heads
        return self.wkv_b.view(H, -1, self.wkv_b.shape[1])[:, :-v]  # [H, d, L]

    @property
    def W_UV(self) -> torch.Tensor:
        """[H, v, L] view of wkv_b: value = W_UV c_kv per head."""
        H, v = self.num_heads, self.wo.shape[1] // self.num_heads
        return self.wkv_b.view(H, -1, self.wkv_b.shape[1])[:, -v:]  # [H, v, L]

    def validate(self, cfg: MLAConfig) -> None:
        """Raise ValueError naming the first weight whose shape does not match cfg."""
        D, H, L = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        d, R, v, Q = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        if self.num_heads != H:
            raise ValueError(f"MLAWeights.num_heads: expected {H}, got {self.num_heads}")
        q_shapes = {"wq": (H * (d + R), D)} if Q is None else {"wq_a": (Q, D), "q_norm": (Q,), "wq_b": (H * (d + R), Q)}
        expected = {"wkv_a": (L + R, D), "kv_norm": (L,), "wkv_b": (H * (d + v), L), "wo": (D, H * v), **q_shapes}
        present = {f.name for f in fields(self) if f.name != "num_heads" and getattr(self, f.name) is not None}
        if present != set(expected):
            raise ValueError(f"MLAWeights: expected tensors {sorted(expected)}, got {sorted(present)}")
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"MLAWeights.{name}: expected shape {shape}, got {tuple(getattr(self, name).shape)}")

    @classmethod
    def random(cls, config: MLAConfig, seed: int, dtype: torch.dtype = torch.float64, std: float | None = None):
        """Gaussian weights from a local torch.Generator(seed).

        Matrices get N(0, std²), std defaulting to fan_in^{-1/2} so activations stay O(1); norm weights 1 + N(0, 0.1²).
        """
        gen = torch.Generator().manual_seed(seed)
        cfg = config
        H, L, R = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        d_q = cfg.qk_head_dim

        def matrix(rows: int, cols: int) -> torch.Tensor:
            scale = cols**-0.5 if std is None else std
            return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale).to(dtype)  # [rows, cols]

        def norm(n: int) -> torch.Tensor:
            return (1 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)  # [n]

        if cfg.q_lora_rank is None:
            q = {"wq": matrix(H * d_q, cfg.hidden_size)}
        else:
            Q = cfg.q_lora_rank
            q = {"wq_a": matrix(Q, cfg.hidden_size), "q_norm": norm(Q), "wq_b": matrix(H * d_q, Q)}
        return cls(
            num_heads=H,
            wkv_a=matrix(L + R, cfg.hidden_size),
            kv_norm=norm(L),
            wkv_b=matrix(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), L),
            wo=matrix(cfg.hidden_size, H * cfg.v_head_dim),
            **q,
        )

    @classmethod
    def from_hf(cls, attention) -> MLAWeights:
        """From a transformers `DeepseekV3Attention` / `DeepseekV2Attention` (tensors copied, dtype kept).

        HF's `rope_interleave=True` (V3 default) and V2's complex RoPE read the rope weight rows interleaved, as here.
        With `rope_interleave=False` HF applies `rotate_half`, i.e. it expects those rows already permuted to the HF
        layout [x0, x2, …, x1, x3, …]; they are converted back with `hf_to_interleaved` so that q_pe/k_pe here are
        the interleaved versions of HF's (scores and outputs unchanged).
        """
        H, d, R = attention.num_heads, attention.qk_nope_head_dim, attention.qk_rope_head_dim
        rows_hf_layout = not getattr(attention.config, "rope_interleave", True)

        def weight(linear) -> torch.Tensor:
            if getattr(linear, "bias", None) is not None:
                raise ValueError("attention_bias: biased projections are not supported (DeepSeek has none)")
            return linear.weight.detach().clone()  # [out, in]

        def q_rows(w: torch.Tensor) -> torch.Tensor:  # [H·(d+R), in]
            if not rows_hf_layout:
                return w
            w = w.view(H, d + R, -1)  # [H, d+R, in]
            pe = hf_to_interleaved(w[:, d:].transpose(1, 2)).transpose(1, 2)  # [H, R, in]
            return torch.cat((w[:, :d], pe), dim=1).flatten(0, 1)  # [H·(d+R), in]

        wkv_a = weight(attention.kv_a_proj_with_mqa)  # [L+R, D]
        if rows_hf_layout:
            L = wkv_a.shape[0] - R
            wkv_a = torch.cat((wkv_a[:L], hf_to_interleaved(wkv_a[L:].T).T))  # [L+R, D]
        if attention.q_lora_rank is None:
            q = {"wq": q_rows(weight(attention.q_proj))}
        else:
            q = {
                "wq_a": weight(attention.q_a_proj),
                "q_norm": attention.q_a_layernorm.weight.detach().clone(),
                "wq_b": q_rows(weight(attention.q_b_proj)),
            }
        return cls(
            num_heads=H,
            wkv_a=wkv_a,
            kv_norm=attention.kv_a_layernorm.weight.detach().clone(),
            wkv_b=weight(attention.kv_b_proj),
            wo=weight(attention.o_proj),
            **q,
        )


def _broadcast_positions(positions: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
    try:
        return positions.expand(token_shape)  # [...] one position per token
    except RuntimeError:
        shape = tuple(positions.shape)
        raise ValueError(f"positions: shape {shape} does not broadcast to tokens {tuple(token_shape)}") from None


def project_q(
    x: torch.Tensor, w: MLAWeights, cfg: MLAConfig, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (q_nope [..., H, d], q_pe [..., H, R] roped, interleaved); positions broadcast to x[..., 0]."""
    positions = _broadcast_positions(positions, x.shape[:-1])
    if cfg.q_lora_rank is None:
        q = x @ w.wq.T  # [..., H·(d+R)]
    else:
        c_q = rms_norm(x @ w.wq_a.T, w.q_norm, cfg.rms_norm_eps)  # [..., Q]
        q = c_q @ w.wq_b.T  # [..., H·(d+R)]
    q = q.unflatten(-1, (cfg.num_heads, cfg.qk_head_dim))  # [..., H, d+R]
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # [..., H, d], [..., H, R]
    cos, sin = rope_angles(positions, cfg, x.dtype)  # [..., R/2] each
    q_pe = apply_rope_interleaved(q_pe, cos[..., None, :], sin[..., None, :])  # [..., H, R]
    return q_nope, q_pe


def latent_cache_row(x: torch.Tensor, w: MLAWeights, cfg: MLAConfig, positions: torch.Tensor) -> torch.Tensor:
    """x [..., D] → cache row [..., L+R] = [c_kv (RMS-normed) | k_pe (roped, interleaved)]."""
    positions = _broadcast_positions(positions, x.shape[:-1])
    kv = x @ w.wkv_a.T  # [..., L+R]
    c_kv, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)  # [..., L], [..., R]
    c_kv = rms_norm(c_kv, w.kv_norm, cfg.rms_norm_eps)  # [..., L]
    cos, sin = rope_angles(positions, cfg, x.dtype)  # [..., R/2] each
    k_pe = apply_rope_interleaved(k_pe, cos, sin)  # [..., R]
    return torch.cat((c_kv, k_pe), dim=-1)  # [..., L+R]


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """(q_nope [..., H, d], q_pe [..., H, R]) → q [..., H, L+R] = [q_nope · W_UK | q_pe], what decode kernels read."""
    q_latent = torch.einsum("...hd,hdc->...hc", q_nope, w.W_UK)  # [..., H, L]
    return torch.cat((q_latent, q_pe), dim=-1)  # [..., H, L+R]


def absorb_output(o_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """Latent attention output o_latent [..., H, L] → per-head value output [..., H, v] (applies W_UV)."""
    return torch.einsum("...hc,hdc->...hd", o_latent, w.W_UV)  # [..., H, v]


def mla_forward(
    x: torch.Tensor, w: MLAWeights, cfg: MLAConfig, positions: torch.Tensor, mode: str = "naive"
) -> torch.Tensor:
    """Causal prefill of one MLA layer: x [B, S, D] → [B, S, D].

    positions [S] or [B, S] (integer RoPE positions); token s attends to tokens t ≤ s of the same row.
    mode "naive" expands c_kv to per-head keys and values; "absorbed" folds W_UK into the query and W_UV into the
    output and attends over the latent cache rows (σ = cfg.softmax_scale, softmax in x's dtype, in both modes).
    """
    if mode not in ("naive", "absorbed"):
        raise ValueError(f"mode: expected 'naive' or 'absorbed', got {mode!r}")
    if x.dim() != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x: expected [B, S, {cfg.hidden_size}], got {tuple(x.shape)}")
    w.validate(cfg)
    S, L = x.shape[1], cfg.kv_lora_rank
    q_nope, q_pe = project_q(x, w, cfg, positions)  # [B, S, H, d], [B, S, H, R]
    kv = latent_cache_row(x, w, cfg, positions)  # [B, T=S, L+R]
    c_kv, k_pe = kv.split([L, cfg.qk_rope_head_dim], dim=-1)  # [B, T, L], [B, T, R]
    future = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)  # [S, T] True where t > s

    if mode == "naive":
        k_nope = torch.einsum("btc,hdc->bthd", c_kv, w.W_UK)  # [B, T, H, d]
        value = torch.einsum("btc,hdc->bthd", c_kv, w.W_UV)  # [B, T, H, v]
        scores = (
            torch.einsum("bshd,bthd->bsht", q_nope, k_nope)  # [B, S, H, T]
            + torch.einsum("bshr,btr->bsht", q_pe, k_pe)  # [B, S, H, T]
        ) * cfg.softmax_scale
        scores = scores.masked_fill(future[:, None, :], float("-inf"))  # [B, S, H, T]
        p = scores.softmax(dim=-1)  # [B, S, H, T]
        o = torch.einsum("bsht,bthd->bshd", p, value)  # [B, S, H, v]
    else:
        q = absorbed_query(q_nope, q_pe, w)  # [B, S, H, L+R]
        scores = torch.einsum("bshc,btc->bsht", q, kv) * cfg.softmax_scale  # [B, S, H, T]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))  # [B, S, H, T]
        p = scores.softmax(dim=-1)  # [B, S, H, T]
        o_latent = torch.einsum("bsht,btc->bshc", p, c_kv)  # [B, S, H, L]
        o = absorb_output(o_latent, w)  # [B, S, H, v]
    return o.flatten(-2) @ w.wo.T  # [B, S, D]
