"""Shared by tests/test_triton_decode.py (interpreter) and tests/test_triton_gpu.py: cases and the kernel bound.

Imports no triton, so the interpreter worker can set TRITON_INTERPRET=1 before triton is first imported.
"""

import math
from dataclasses import dataclass

import torch

from mla_ref.decode import make_decode_batch, mla_decode_ref
from mla_ref.fp8 import quantize


@dataclass(frozen=True)
class TritonCase:
    """One decode batch for the Triton kernel. combo: "bf16" | "fp8kv" | "fp8" (mla_fast.triton_decode)."""

    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    heads: int = 16
    page_size: int = 16
    combo: str = "bf16"
    num_workers: int = 3
    L: int = 64
    R: int = 32
    seed: int = 0
    sm_scale: float = 0.1352338  # DeepSeek-V3 (numerics.md §1.3)

    def batch(self, device="cpu"):
        """DecodeBatch with random page order, NaN in every unused slot and a NaN page nobody owns."""
        g = torch.Generator().manual_seed(self.seed)
        D = self.L + self.R
        q = torch.randn(sum(self.q_lens), self.heads, D, generator=g)  # [T, H, D]
        kvs = [torch.randn(s, D, generator=g) for s in self.seq_lens]  # B x [s_b, D]
        kw = {}
        if self.combo in ("fp8kv", "fp8"):
            whole = torch.cat(kvs) if sum(self.seq_lens) else torch.ones(1, D)  # [Σs, D] one per-tensor scale
            _, kv_scale = quantize(whole, "e4m3fn")
            kvs = [quantize(kv, "e4m3fn", scale=kv_scale)[0] for kv in kvs]  # B x [s_b, D] e4m3fn
            kw["kv_scale"] = float(kv_scale)
        else:
            kvs = [kv.to(torch.bfloat16) for kv in kvs]
        if self.combo == "fp8":
            q, q_scale = quantize(q, "e4m3fn")  # [T, H, D] e4m3fn
            kw["q_scale"] = float(q_scale)
        else:
            q = q.to(torch.bfloat16)
        batch = make_decode_batch(q, kvs, sm_scale=self.sm_scale, kv_lora_rank=self.L, page_size=self.page_size,
                                  generator=g, q_lens=list(self.q_lens), **kw)
        return batch.to(device)


def kernel_bound(batch, numerics):
    """numerics.md §5(f) per element, against the fp64 oracle on the same dequantized inputs.

    |o_ker - o| <= (1 + 2^-8) [2^-8 |o| + (u_P + 2^-22 + gamma_PV) Σ_j p_j |v_j| + eta_P Σ_j |v_j| / l
                               + tanh(omega_acc / 4) R_c],   omega_acc = 2 gamma_QK σ max_j Σ_i |q_i||k_ji|
    LSE (derived the same way): |lse_ker - lse| <= omega_acc / 2 + (n + 16) 2^-22 + 2^-21 |lse|  (scores moved by
    at most omega_acc / 2; n fp32 additions, exp2/log2 approximations (2^-22) and the merge on l; fp32 lse).
    Returns (out_bound [T, H, L], lse_bound [T, H]) fp64; rows that see no token get bound 0 (exact 0 / -inf).
    """
    u_p, eta_p = {None: (0.0, 0.0), "fp32": (0.0, 0.0), "bf16": (2**-8, 0.0), "fp16": (2**-11, 2**-25)}[numerics.p_fmt]
    L = batch.kv_lora_rank
    q = batch.dequantized_q()  # [T, H, D] fp64
    visible = batch.visible_tokens().tolist()  # [T]
    request = batch.row_request().tolist()  # [T]
    out_ref, lse_ref = mla_decode_ref(batch)  # [T, H, L], [T, H]
    out_bound = torch.zeros_like(out_ref)
    lse_bound = torch.zeros_like(lse_ref)
    kv_by_request = {}
    for t in range(batch.num_tokens):
        n = visible[t]
        if n == 0:
            continue
        b = request[t]
        if b not in kv_by_request:
            kv_by_request[b] = batch.request_kv(b)  # [s_b, D] fp64, valid rows only
        K = kv_by_request[b][:n]  # [n, D]
        V = K[:, :L]  # [n, L]
        s = batch.sm_scale * q[t] @ K.T  # [H, n]
        p = torch.softmax(s, dim=-1)  # [H, n]
        l_hat = torch.exp(s - s.amax(-1, keepdim=True)).sum(-1)  # [H]
        omega = 2 * numerics.gamma_qk * batch.sm_scale * (q[t].abs() @ K.abs().T).amax(-1)  # [H]
        spread = V.amax(0) - V.amin(0)  # [L] R_c
        out_bound[t] = (1 + 2**-8) * (
            2**-8 * out_ref[t].abs()
            + (u_p + 2**-22 + numerics.gamma_pv) * (p @ V.abs())  # [H, L]
            + eta_p * V.abs().sum(0)[None, :] / l_hat[:, None]
            + torch.tanh(omega / 4)[:, None] * spread[None, :]
        )
        lse_bound[t] = omega / 2 + (n + 16) * 2**-22 + 2**-21 * lse_ref[t].abs()
    return out_ref, lse_ref, out_bound, lse_bound


def check(out, lse, batch, numerics) -> dict:
    """Kernel output against the oracle: max err / bound ratios (must be <= 1) and the empty-row convention."""
    out_ref, lse_ref, out_bound, lse_bound = kernel_bound(batch, numerics)
    out, lse = out.double().cpu(), lse.double().cpu()
    seen = torch.isfinite(lse_ref)  # [T, H] rows that see >= 1 token
    out_err = (out - out_ref).abs()
    lse_err = torch.where(seen, (lse - lse_ref).abs(), 0.0)
    return {
        "finite": bool(torch.isfinite(out).all() and torch.isfinite(lse[seen]).all()),
        "out_ratio": float((out_err / out_bound.clamp(min=1e-300)).amax()) if out.numel() else 0.0,
        "lse_ratio": float((lse_err / lse_bound.clamp(min=1e-300)).amax()) if lse.numel() else 0.0,
        "max_abs_err": float(out_err.amax()) if out.numel() else 0.0,
        "empty_ok": bool((out[~seen] == 0).all() and (lse[~seen] == -math.inf).all()),
        "empty_rows": int((~seen).sum()),
    }
