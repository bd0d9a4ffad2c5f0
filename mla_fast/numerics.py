"""How mla_fast's Triton decode kernel rounds: declared data, read by verify.bounds (numerics.md §5(f)).

Each field states what the code in mla_fast/triton_decode.py does; change them together.

Rounding points of `_mla_decode_kernel` (per query row, per KV tile of BLOCK_N tokens):

1. Operands. q, c_kv, k_pe enter the MMAs in `qk_operand` (= `pv_operand`): bf16 for bf16 inputs; for fp8 caches
   the fp8 values are cast to fp16 (mma="fp16", e4m3fn/e4m3fnuz values are exact in fp16) or bf16 (mma="bf16",
   exact too). Scales are never applied to operands: q_scale * kv_scale * sm_scale * log2(e) multiplies the fp32
   scores, kv_scale multiplies the normalised fp32 output. So the MMAs see the stored values (fp8 codes for fp8).
   With fp8 KV and bf16 q ("fp8kv", mma="fp16") q is cast bf16 -> fp16: exact for 2^-17 <= |q| <= 65504 (bf16 has 8
   significant bits, fp16 11, and fp16 subnormals reach 2^-24); smaller |q| round with absolute error <= 2^-25,
   larger overflow to inf. When some value is not exact in fp16, verify.bounds charges u(fp16) |q| + 2^-25 (half
   the fp16 min subnormal: the absolute error of a flushed or subnormal value) to every q element.
   V loaded a second time for P.V (config v_reload) holds the same values, and so does the fp16 copy of an e4m3fn
   tile (and of an e4m3fn q) staged in shared memory (config fp8_stage, exact conversion): no numerical effect.
2. QK: fp32 accumulators over the L (512) latent and R (64) rope channels: one chain (L, then R onto it) with
   split_l = 1 and no unchain; with split_l = n (by default 4 for bf16 and 8 for fp8 caches up to 32 rows, 2 at 64
   rows; unchain with n = 1 too) n independent chains of L/n channels and one of R, summed pairwise by n fp32 adds.
   Either way every score is a sum of L + R products with at most L + R additions. Tensor-core fp32 accumulation
   is not guaranteed round-to-nearest (truncation is documented for NVIDIA tensor cores, Fasi et al., SIAM J. Sci.
   Comput. 2021), so each addition is charged 2^-23 (one fp32 ulp, chopped), plus one fp32 rounding of the scale
   multiply: gamma_qk = (L + R + 1) * 2^-23, whatever the summation order. Config interleave (each slice's dot
   written after its load) keeps the same dots and sums: no numerical effect.
3. Softmax: base 2, s * log2(e) folded into the scale; exp2 is the hardware approximation (~2 ulp), covered by the
   2^-22 term of §5(f). Row sums l in fp32 from unrounded P (with lazy_l one running sum per tile column, each
   rescaled by alpha per tile like the row sum, added up once at the end: another order of the same fp32 sum).
4. P: rounded to `p_fmt` (bf16 or fp16, no scale: p <= 1) before the P.V MMA.
5. PV: per tile one MMA over BLOCK_N tokens whose accumulator operand C is the running output, rescaled by alpha
   first. A Hopper tensor core aligns each product to the largest exponent among the products and C and truncates
   it below 2^-25 of that (measured on one H200, forty-first session: 16 products of 1.5 x 2^-25 added onto 1.0 gave
   4 x 2^-23, not 6 x 2^-23; products of 1.5 x 2^-26 vanished), then rounds the sum into fp32 once per k16
   instruction: per token at most 2^-25 + 2^-23 / 16 < 2^-24 of the running output, which is <= Σ p|v| in the final
   units, so the error grows with the request's length: numerics.md §5(f)'s γ = n 2^-24. A chain of 4096 tiles of
   same-sign products measured 1.62e-3 relative (0.52 x 2^-24 per token). Per tile also: the fp32 rescale of the
   accumulator (2^-23, chopped) and alpha's ex2 approximation (2^-22), which weights earlier tiles against later
   ones (charged twice). So gamma_pv_per_token = 2^-24 + (2^-23 + 2^-21) / BLOCK_N, times the request's seq_len,
   plus gamma_pv = 4 * 2^-23 (the final 1/l, kv_scale, and the split merge's weight and division). (Until the
   forty-first session the tile's MMA was charged as a sum from zero, BLOCK_N * 2^-23, for requests up to 2^18
   tokens: a crafted request of 2^18 tokens measured 2.07x that.)
6. Split merge (reduce kernel): fp32, exact LSE merge in base 2 (numerics.md §3, §5(g): <= 1.1e-5 Σp|v| measured).
7. Output: bf16, one rounding (the 2^-8 |o| term of §5(f)); lse fp32 natural log.

The Gluon seesaw kernel (mla_fast/gluon_decode.py) on bf16 has the same rounding points, so
`KERNEL_NUMERICS["bf16"]` declares it too: bf16 operands, one fp32 chain of L + R products per score (9 chunks of 64
channels), P rounded to bf16 once (the half that multiplies the other warpgroup's tile rounds p * 2^(m0 - m1) <= 1
instead of p), fp32 row sums from unrounded P, one 64-token P.V MMA per tile and half, two fp32 rescales of each
accumulator half per tile on average (four per pair of tiles).

On e4m3fn caches the seesaw kernel (KV_FP8) has the rounding points of `KERNEL_NUMERICS["fp8kv"]` / `["fp8"]`
(mma="fp16"): each fp8 tile converted to fp16 (exact; in registers by its loader partition on pages of 16, 32 and
64k, `gluon_decode.fp8_loader`, else expanded in shared memory: the same values), q cast to fp16, the same chains,
P rounded to fp16 once (p0' as above), scales folded as in point 1.

The Gluon fp8 kernel (mla_fast/gluon_fp8.py, e4m3fn caches at 16 packed rows per program) with bf16 q, or with
e4m3fn q and qk_fp8=False, has the rounding points of `KERNEL_NUMERICS["fp8kv"]` / `["fp8"]` (mma="fp16"): fp8
codes and q cast to fp16, one fp32 chain of L + R products per score (9 chunks of 64 channels, each k16 step over
the same 16 channels in another column order), P rounded to fp16 once, fp32 row sums from unrounded P (per token
slot, summed once per item, as lazy_l), one 64-token P.V MMA per tile and 128-channel quarter into the accumulator
rescaled once per tile, scales folded as in point 1.

With e4m3fn q (the "fp8" combination) the Gluon fp8 kernel multiplies the scores on the fp8 codes themselves
(`KernelConfig.qk_fp8`, its default there): fp8 wgmmas read q and the cache tile from shared memory, no conversion.
Hopper's fp8 MMAs do not accumulate in fp32 (numerics.md §4.2; DeepSeek-V3 §3.3.2: about 14 bits), so each score
is 9 accumulators of 64 channels (two k32 instructions each, started at 0) added in fp32. Declared as
`gluon_fp8_qk_numerics`: the model is that an fp8 MMA instruction aligns its 32 products and the accumulator it adds
them to at the largest exponent among them and truncates each to 2^(e - FP8_ACC_FRACTION_BITS): each term then loses
less than 2^-13 of the largest term, which is <= Σ|q||k| of its accumulator. Over an accumulator of 64 products
(two instructions, the second also truncating the first's partial sum) at most 65 terms lose that much, so
gamma_qk = 65 x 2^-13 (7.9e-3) plus the fp32 adds and the scale multiply. Measured on one H200 (twenty-third
session, lse of length-1 requests against fp64, max |err| / σ Σ|q||k|, 2048 requests x 16 heads each):
Gaussian 4.3e-5, all positive 3.0e-4, all positive with an outlier channel 3.2e-3, and an adversarial
construction (one product of 448², the others just under the truncation unit of the group's largest term) 3.4e-3,
against 8.0e-3 with 128-channel accumulators (beyond this gamma; tests/test_fp8_qk_numerics.py shows why on the
model) and at most 1.7e-6 for the fp16 path; tests/test_triton_gpu.py re-measures it on a worst-case construction
(3.6e-3). The P.V side is the fp16 path's (`KERNEL_NUMERICS["fp8"]`).

`KERNEL_NUMERICS` is keyed by the dtype combination of `triton_decode.dtype_combo`: "bf16" (bf16 q and cache),
"fp8kv" (bf16 q, fp8 cache), "fp8" (fp8 q and cache); `DEFAULT_MMA` gives the MMA dtype the launcher uses for each.
"""

from dataclasses import dataclass, replace

import torch

from mla_ref.fp8 import WIDE_DTYPES, p_format_max

BLOCK_N = 64  # KV tokens per tile in the launcher's configs (mla_fast.triton_decode.default_config)
HOPPER_PV_PER_TOKEN = 2**-24  # MMA accumulation into the running output, per token (point 5 above)
FP32_CHOPPED = 2**-23  # one chopped fp32 addition per accumulated term (point 2), in units of the sum
PV_PER_TILE = FP32_CHOPPED + 2**-21  # per KV tile: the accumulator's fp32 rescale and alpha's ex2, twice (point 5)
DEEPSEEK_CHANNELS = 512 + 64  # L + R of DeepSeek-V3, the channels a score sums by default
FP32_EPILOGUE = 4 * FP32_CHOPPED  # the epilogue's fp32 steps: 1/l, kv_scale, the split merge's weight and division


def fp32_score_gamma(channels: int = DEEPSEEK_CHANNELS) -> float:
    """gamma_qk of a score summed in chopped fp32 over `channels` = L + R products, then scaled: L + R + 1 steps of
    FP32_CHOPPED each (point 2), relative to the sum of |products|."""
    return (channels + 1) * FP32_CHOPPED


@dataclass(frozen=True)
class KernelNumerics:
    """Where a decode kernel rounds (numerics.md §5(f)).

    Attributes:
        p_fmt: format P is rounded to before the P.V MMA (None = fp32 P; else a `mla_ref.fp8.round_p` format).
        p_scale: factor P is multiplied by before that rounding (and divided by after).
        qk_operand: dtype the Q.K MMA sees (inputs are exact in it: see module docstring).
        pv_operand: dtype the P.V MMA sees for V (P is `p_fmt`).
        gamma_qk: accumulation error of the scores per unit of σ Σ|q||k| (relative to the exact dot product).
        gamma_pv: accumulation error of the output per unit of Σ p|v|, the part that does not grow with the
            request's length.
        gamma_pv_per_token: the part that does, per KV token of the request (verify.bounds charges
            gamma_pv + gamma_pv_per_token x seq_len per request).
        out_dtype: dtype of `out` (lse is always fp32, natural log).
        scale_then_round: the kernel multiplies fp8 codes by their per-tensor scale (in fp32) and rounds the product
            to the operand dtype (qk_operand / pv_operand) before the MMAs, instead of folding the scales into the
            fp32 scores and output. FlashInfer's fp8 KV path does this (dequantized tiles rounded to bf16): with a
            scale that is not a power of two every K and V element then carries one more rounding (2^-9 relative
            for bf16), which verify.bounds charges on both the scores and the values. False (this module's kernel):
            the MMAs see the fp8 codes, exact in fp16 and bf16.
        partial_dtype: dtype a split's output is stored in between the split pass and the merge (its lse is fp32):
            fp32 for this module's kernels, FlashMLA and aiter; FlashInfer's MLA stores ``partial_o`` in the output
            dtype. verify.bounds.merge_bound charges its unit roundoff once per split output.
        plan_invariant_scores: every token's score comes out the same whatever plan cuts its row (its dot product
            summed over the channels in one order, whatever tile or split holds the token: this module's kernels,
            and MMA-based kernels generally). verify.bounds.split_bound then takes the score errors as common to
            the two runs the split check compares. False (a kernel that scores a split row with another kernel,
            tile shape or summation order): each run is charged its own score errors, a looser split bound.
        l_from_rounded_p: the row sum l (the softmax's denominator) is summed from P as rounded to ``p_fmt`` for the
            P.V MMA, not from the unrounded P (this module's kernels, FlashMLA and vLLM's sum the unrounded one).
            verify.bounds then charges l's rounding on out and lse too: with bf16 P the lse moves by up to about 2^-8.
    """

    p_fmt: str | None
    p_scale: float
    qk_operand: torch.dtype
    pv_operand: torch.dtype
    gamma_qk: float
    gamma_pv: float
    out_dtype: torch.dtype = torch.bfloat16
    scale_then_round: bool = False
    gamma_pv_per_token: float = 0.0
    partial_dtype: torch.dtype = torch.float32
    plan_invariant_scores: bool = True
    l_from_rounded_p: bool = False

    def __post_init__(self):
        for name in ("p_scale", "gamma_qk", "gamma_pv", "gamma_pv_per_token"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 or x == float("inf"):
                raise ValueError(f"KernelNumerics.{name} must be a finite float >= 0, got {x!r}")
        if self.p_scale <= 0:
            raise ValueError(f"KernelNumerics.p_scale must be > 0, got {self.p_scale!r}")
        try:
            top = p_format_max(self.p_fmt)
        except ValueError as e:
            raise ValueError(f"KernelNumerics.p_fmt: {e}") from None
        if self.p_scale > top:  # P = 1 would saturate
            raise ValueError(f"KernelNumerics.p_scale: expected at most {self.p_fmt or 'fp32'}'s max {top:g} (P = 1 "
                             f"times it must not saturate), got {self.p_scale!r}")
        for name in ("scale_then_round", "plan_invariant_scores", "l_from_rounded_p"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelNumerics.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("qk_operand", "pv_operand", "out_dtype"):  # a string such as "bf16" is p_fmt's form, not theirs
            x = getattr(self, name)
            if not isinstance(x, torch.dtype) or not x.is_floating_point:
                raise ValueError(f"KernelNumerics.{name} must be a floating-point torch.dtype (e.g. torch.bfloat16), "
                                 f"got {x!r}")
        if self.partial_dtype not in WIDE_DTYPES.values():
            raise ValueError(f"KernelNumerics.partial_dtype: expected one of {list(WIDE_DTYPES.values())}, got "
                             f"{self.partial_dtype!r}")

    def describe(self) -> str:
        """One line with every field, for reports: what the verifier's kernel bound assumed."""
        def name(dtype):
            return str(dtype).removeprefix("torch.")

        p = f"P {self.p_fmt or 'fp32'}" + (f" x{self.p_scale:g}" if self.p_scale != 1 else "")
        stage = ", fp8 scaled then rounded" if self.scale_then_round else ""
        partials = f", split partials {name(self.partial_dtype)}" if self.partial_dtype != torch.float32 else ""
        scores = ("" if self.plan_invariant_scores else ", scores vary with the plan") + (
            ", row sum from rounded P" if self.l_from_rounded_p else "")
        return (f"{p}, QK {name(self.qk_operand)} gamma {self.gamma_qk:.3g}, PV {name(self.pv_operand)} gamma "
                f"{self.gamma_pv:.3g} + {self.gamma_pv_per_token:.3g}/token, out {name(self.out_dtype)}{stage}"
                f"{partials}{scores}")


def triton_numerics(mma: str, block_n: int = BLOCK_N, channels: int = DEEPSEEK_CHANNELS) -> KernelNumerics:
    """KernelNumerics of `_mla_decode_kernel` with MMA operands in `mma` ("bf16" or "fp16"), tiles of block_n and
    scores over `channels` = L + R (a score's error grows with its terms: the batch's, not DeepSeek's, bound it)."""
    operand = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mma not in operand:
        raise ValueError(f"mma must be 'bf16' or 'fp16', got {mma!r}")
    return KernelNumerics(
        p_fmt=mma,
        p_scale=1.0,
        qk_operand=operand[mma],
        pv_operand=operand[mma],
        gamma_qk=fp32_score_gamma(channels),
        gamma_pv=FP32_EPILOGUE,
        gamma_pv_per_token=HOPPER_PV_PER_TOKEN + PV_PER_TILE / block_n,  # MMA into C, then per tile
        out_dtype=torch.bfloat16,
    )


DEFAULT_MMA = {"bf16": "bf16", "fp8kv": "fp16", "fp8": "fp16"}  # fp8kv: fp16 MMAs 1.4x faster than bf16 (H200)
KERNEL_NUMERICS = {combo: triton_numerics(mma) for combo, mma in DEFAULT_MMA.items()}  # at DeepSeek's L + R

FP8_ACC_FRACTION_BITS = 13  # Hopper fp8 MMA: terms truncated to 2^(e_max - 13) (module docstring; numerics.md §4.2)
FP8_QK_GROUP = 64  # channels per fp8 score accumulator in the Gluon fp8 kernel (two k32 instructions, from 0)


def gluon_fp8_qk_numerics(block_n: int = BLOCK_N) -> KernelNumerics:
    """KernelNumerics of the Gluon fp8 kernel with fp8 score MMAs (`KernelConfig.qk_fp8`, e4m3fn q and cache): the
    scores from e4m3fn codes in FP8_QK_GROUP-channel fp8 accumulators added in fp32 (module docstring), the rest as
    `triton_numerics("fp16", block_n)`."""
    groups = (512 + 64) // FP8_QK_GROUP  # accumulators per score (L + R = 576 channels)
    per_group = (FP8_QK_GROUP + 1) * 2.0**-FP8_ACC_FRACTION_BITS  # its products and the first instruction's sum
    return replace(triton_numerics("fp16", block_n), qk_operand=torch.float8_e4m3fn,
                   gamma_qk=per_group + (groups + 1) * FP32_CHOPPED)  # + the fp32 adds of the groups and the scale
