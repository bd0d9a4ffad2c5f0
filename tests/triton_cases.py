"""Shared by tests/test_triton_decode.py (interpreter) and tests/test_triton_gpu.py: cases and the bound check.

Imports no triton, so the interpreter worker can set TRITON_INTERPRET=1 before triton is first imported.
"""

import math
from dataclasses import dataclass

import torch

from mla_ref.decode import make_decode_batch, mla_decode_ref
from mla_ref.fp8 import quantize

# The interpreter tests' kernel geometry (tests/test_triton_decode.py and the modules beside it), KernelConfig fields:
# 16-token kernel tiles and planner blocks and an item overhead of one block, so that short requests split
INTERPRETER_TILES = dict(block_n=16, plan_block_n=16, fixed_overhead=1)


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
            whole = torch.cat(kvs)  # [Σs, D]: one per-tensor scale and one quantize (one per request: 100 s at 1000)
            whole8, kv_scale = quantize(whole if len(whole) else torch.ones(1, D), "e4m3fn")  # [Σs or 1, D] e4m3fn
            kvs = list(torch.split(whole8[:len(whole)], list(self.seq_lens)))  # B x [s_b, D] e4m3fn
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


def smoke_prefix_our_kernels_take(dtype: str) -> list:
    """The smoke prefix (`verify.strategies.smoke_cases`) less the cases whose MTP rows our kernels refuse by name
    (`mla_fast.triton_decode.q_len_unsupported`: the 72-row case, a shape no drawn case has). mla-verify counts that
    case as unsupported and `mla_property_test` would fail it, so the GPU property tests take the rest as examples."""
    from mla_fast.triton_decode import q_len_unsupported  # imports triton: not at this module's import
    from verify.strategies import smoke_cases

    return [c for c in smoke_cases(dtype) if q_len_unsupported(max(c.q_lens)) is None]


def same_bits(a: tuple, b: tuple) -> bool:
    """Two (out bf16, lse fp32) pairs bit for bit, through integer views: NaN payloads and -0.0 count, unlike ==."""
    return bool(torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
                and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32)))


def strided_outputs(T: int, H: int, L: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """out [T, H, L] bf16 and lse [T, H] fp32 as views into NaN-filled buffers with a row, a head and channels
    around them (every stride but the last changed), and the buffers: (out, lse, out_buffer, lse_buffer)."""
    nan = float("nan")
    out_buffer = torch.full((T + 2, H + 1, L + 16), nan, dtype=torch.bfloat16, device=device)  # [T + 2, H + 1, L + 16]
    lse_buffer = torch.full((T + 2, H + 3), nan, device=device)  # [T + 2, H + 3]
    return out_buffer[1 : T + 1, :H, :L], lse_buffer[1 : T + 1, 1 : H + 1], out_buffer, lse_buffer


def outside_is_nan(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Every element of ``buffer`` outside ``view`` (a view into it) is still NaN."""
    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)
    inside.as_strided(view.shape, view.stride(), view.storage_offset() - buffer.storage_offset()).fill_(True)
    return bool(torch.isnan(buffer.float())[~inside].all())


def with_nan_token(batch, request: int, token: int, channel: int = 5):
    """`batch` with a NaN in one channel of a valid cache token of `request` (e4m3fn caches: the NaN code 0x7F),
    located through the batch's own paging (`DecodeBatch.token_slots`)."""
    pages, slots = batch.token_slots(request)  # [s_b], [s_b]
    kv = batch.kv_cache.clone()
    kv[pages[token], slots[token], channel] = float("nan")
    return batch.replace(kv_cache=kv)


def nan_masks_match(out, lse, ref_out, ref_lse) -> bool:
    """out and lse are NaN exactly where the oracle's are (compared on the oracle's device)."""
    return bool(torch.equal(torch.isnan(out).to(ref_out.device), torch.isnan(ref_out))
                and torch.equal(torch.isnan(lse).to(ref_lse.device), torch.isnan(ref_lse)))


def check(out, lse, batch, numerics, num_splits: int = 1) -> dict:
    """Kernel output against the fp64 oracle on the same inputs, bound = verify.bounds.kernel_bound (numerics.md
    §5(f), from the kernel's declared KernelNumerics) + merge_bound (§5(g), `num_splits` = most pieces of a tile).

    Returns max err / bound ratios (must be <= 1), finiteness, and the empty-row convention (out 0, lse -inf).
    """
    from verify.bounds import kernel_bound, merge_bound

    out_ref, lse_ref = mla_decode_ref(batch)  # [T, H, L], [T, H] fp64
    bound = kernel_bound(batch, numerics, ref=(out_ref, lse_ref)) + merge_bound(batch, num_splits)
    out_ref, lse_ref, out_bound, lse_bound = (t.cpu() for t in (out_ref, lse_ref, bound.out, bound.lse))
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


def split_pair(out_a, out_b, batch, numerics, num_splits: int) -> dict:
    """Two fp32 runs of one kernel under different plans: max |a - b| / verify.bounds.split_bound, and / the two
    merge bounds alone (what a split check without the re-tiling rounding would allow)."""
    from verify.bounds import merge_bound, split_bound

    diff = (out_a.double() - out_b.double()).abs().cpu()  # [T, H, L]
    bound, merge = split_bound(batch, numerics, num_splits).out.cpu(), merge_bound(batch, num_splits).out.cpu()
    return {
        "split_ratio": float((diff / bound.clamp(min=1e-300)).amax()),
        "merge_only_ratio": float((diff / (2 * merge).clamp(min=1e-300)).amax()),
        "max_abs_diff": float(diff.amax()),
    }


def _bf16_rne(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().bfloat16().double().item() if math.isfinite(x) else x


def _rounded(x: float, fmt: str) -> float:
    """x (fp64) rounded once, to nearest even, to bf16 or fp16."""
    from mla_ref.fp8 import round_p

    return round_p(torch.tensor([x], dtype=torch.float64), fmt).item()


def _margin(x: float, fmt: str) -> float:
    """Relative distance of x to the nearest rounding midpoint of fmt (bf16 or fp16): how far x may move before
    its rounding changes."""
    bits = {"bf16": 8, "fp16": 11}[fmt]
    ulp = 2.0 ** (math.floor(math.log2(abs(x))) - bits + 1)
    frac = (abs(x) / ulp) % 1.0
    return abs(frac - 0.5) * ulp / abs(x)


def p_rounding_batch(combo: str, L: int = 64, R: int = 32, heads: int = 16, device="cpu"):
    """(batch, {p_fmt: predicted out[:, :, 0]}) of a decode whose bf16 output tells how P was rounded before P.V.

    Two tokens: token 0 all zeros (score 0, value 0), token 1 with c_kv channel 0 = 1 and k_pe channel 0 = 1, q with
    k_pe channel 0 = -x: p_1 = exp(-x σ) < 1 = p_0, and out[..., 0] = bf16(rnd(p_1) / (1 + p_1)) with the row sum
    from unrounded P. x (exact in e4m3fn, so fp8 q holds it) is the first value for which rounding p_1 to bf16
    and to fp16 give different bf16 outputs, each far (relative 2^-16 and more) from a rounding midpoint, so the
    kernel's exp2 approximation and fp32 division cannot move them. Other channels are 0.
    """
    sigma = 1.0
    codes = torch.arange(0x30, 0x48, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # [24] 0.125 .. 4.5
    for x in codes.tolist():
        p1 = math.exp(-x * sigma)
        pred = {fmt: _rounded(p1, fmt) / (1 + p1) for fmt in ("bf16", "fp16")}
        out = {fmt: _bf16_rne(v) for fmt, v in pred.items()}
        if (out["bf16"] != out["fp16"] and min(_margin(p1, f) for f in pred) > 2**-16
                and min(_margin(v, "bf16") for v in pred.values()) > 2**-16):
            break
    else:
        raise AssertionError("no discriminating x among the e4m3fn codes")
    H, D = heads, L + R
    q = torch.zeros(1, H, D)
    q[:, :, L] = -x  # [1, H, D]
    kv = torch.zeros(2, D)
    kv[1, 0], kv[1, L] = 1.0, 1.0  # [2, D] token 1: value 1 in channel 0, key 1 on k_pe channel 0
    kw = {}
    if combo == "bf16":
        q, kv = q.bfloat16(), kv.bfloat16()
    else:
        kv, kw["kv_scale"] = kv.to(torch.float8_e4m3fn), 1.0
        if combo == "fp8":
            q, kw["q_scale"] = q.to(torch.float8_e4m3fn), 1.0
        else:
            q = q.bfloat16()
    batch = make_decode_batch(q, [kv], sm_scale=sigma, kv_lora_rank=L, page_size=16,
                              generator=torch.Generator().manual_seed(0), **kw)
    return batch.to(device), out


def observed_p_fmt(out: torch.Tensor, predicted: dict) -> str | None:
    """The p_fmt whose predicted output every head's out[0, h, 0] equals, or None (none, or heads disagree)."""
    got = set(out[0, :, 0].double().cpu().tolist())
    if len(got) != 1 or not torch.all(out[0, :, 1:] == 0):
        return None
    value = got.pop()
    matches = [fmt for fmt, v in predicted.items() if v == value]
    return matches[0] if len(matches) == 1 else None


class LaunchRecorder:
    """Stands in for `triton_decode._mla_decode_kernel` (interpreter or GPU): launches the kernel and keeps
    each launch's constexprs (the upper-case keywords), i.e. what reached the kernel rather than what the config
    asked for (a review's mutant that launched PAGE_CHUNK=0, LAZY_L=False, UNCHAIN=False, INTERLEAVE=False and
    PAGE_SELECT=1 whatever the config passed every CPU test)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({k: v for k, v in kwargs.items() if k.isupper()})
            return self.kernel[grid](*args, **kwargs)

        return launch
