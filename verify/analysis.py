"""fp8 error analysis of MLA decode: the experiments behind notebooks/fp8_error_analysis.ipynb.

Every experiment builds `verify.cases.Case` batches (bf16 "exact" inputs and their fp8 quantization), runs the fp64
oracle `mla_decode_ref` on both, and reports errors in the units of numerics.md §5.1:

    err_rel = max over (row, head, channel c) of |ô_c - o_c| / Σ_j p_j |v_jc|

(ô on the quantized inputs, o and p on the exact ones): the error as a fraction of the magnitude the output is
averaged from. ``cos_diff`` is the FlashMLA cosine difference (numerics.md §6), ``dlse`` the max |Δlse| (nats).

Quantization error (tier 2, numerics.md §8) compares the oracle on fp8 inputs with the oracle on the exact inputs;
kernel error (tier 1) compares an emulated kernel with the oracle on the *same* dequantized inputs. Results are lists
of plain dicts (one per case), so the notebook needs no dataframe library. Sizes: ``SIZES["ci"]`` runs in about a
minute on 2 CPU cores; ``SIZES["full"]`` is meant for a GPU (``device="cuda"``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from mla_ref.decode import DecodeBatch, mla_decode_ref
from mla_ref.fp8 import dequantize, quantize, round_p
from verify.cases import Case
from verify.metrics import cos_diff

F64 = torch.float64


@dataclass(frozen=True)
class Size:
    """How much the notebook computes.

    Attributes:
        heads: query heads per case (DeepSeek-V3: 128).
        seq_lens: sequence lengths of the error-vs-length sweep and the log-length regression.
        seeds: independent draws per point.
        dist_seq_len: sequence length of the per-distribution, per-format and per-granularity comparisons.
        split_seq_len: sequence length of the split-count sweep.
        workers: persistent worker counts of the split sweep (one request: about that many splits).
        rms_seq_len: sequence length of the first-order RMS comparison (its cost grows as H·L·D·N).
    """

    heads: int
    seq_lens: tuple[int, ...]
    seeds: int
    dist_seq_len: int
    split_seq_len: int
    workers: tuple[int, ...]
    rms_seq_len: int


SIZES = {
    "ci": Size(heads=16, seq_lens=(64, 128, 256, 512, 1024, 2048), seeds=4, dist_seq_len=512, split_seq_len=2048,
               workers=(1, 2, 4, 8, 16, 32), rms_seq_len=64),
    "full": Size(heads=128, seq_lens=(64, 256, 1024, 4096, 16384, 32768), seeds=8, dist_seq_len=4096,
                 split_seq_len=32768, workers=(1, 2, 4, 8, 16, 32, 64, 128, 256), rms_seq_len=512),
}
RANDOM_DISTS = ("gauss1", "gauss4", "outlier", "sink")  # independent rounding errors
ALL_DISTS = (*RANDOM_DISTS, "coherent")  # + rounding errors that add up


def size_from_env(default: str = "ci") -> tuple[str, Size]:
    """(name, Size) from the MLA_NB_SIZE environment variable ("ci" or "full"); ValueError otherwise."""
    name = os.environ.get("MLA_NB_SIZE", default)
    if name not in SIZES:
        raise ValueError(f"MLA_NB_SIZE: expected one of {sorted(SIZES)}, got {name!r}")
    return name, SIZES[name]


def fp8_case(dist: str, seq_len: int, seed: int, heads: int, **changes) -> Case:
    """A one-request fp8 case (fp8 q and KV, e4m3fn, dynamic per-tensor scales) with the given changes."""
    case = Case(seq_lens=(seq_len,), q_lens=(1,), heads=heads, q_dtype="fp8", kv_dtype="fp8", dist=dist, seed=seed)
    if dist == "coherent" and "scale_mode" not in changes:
        changes["scale_mode"] = "unit"  # the coherent data are fp8 ties only at scale 1 (numerics.md §5.1)
    return dataclasses.replace(case, **changes)


# ---- error measures --------------------------------------------------------------------------------------------
def softmax_pv(batch: DecodeBatch) -> torch.Tensor:
    """[T, H, L] Σ_j p_j |v_jc| of the oracle on ``batch`` (fp64): the unit of err_rel."""
    q = batch.dequantized_q(F64)  # [T, H, D]
    pv = torch.zeros(batch.num_tokens, batch.num_heads, batch.kv_lora_rank, dtype=F64, device=batch.device)
    visible, qo = batch.visible_tokens(), batch.qo_indptr.tolist()
    for b in range(batch.batch_size):
        rows = slice(qo[b], qo[b + 1])
        K = batch.request_kv(b, F64)  # [s, D]
        s = batch.sm_scale * torch.einsum("nhd,sd->nhs", q[rows], K)  # [n, H, s]
        mask = torch.arange(K.shape[0], device=batch.device)[None, :] < visible[rows, None]  # [n, s]
        p = torch.softmax(s.masked_fill(~mask[:, None, :], -math.inf), dim=-1).nan_to_num()  # [n, H, s]
        pv[rows] = torch.einsum("nhs,sc->nhc", p, K[:, : batch.kv_lora_rank].abs())  # [n, H, L]
    return pv


def error_stats(out, lse, out_ref, lse_ref, pv: torch.Tensor) -> dict:
    """err_rel (max |Δo| / Σp|v|), cos_diff and dlse (max |Δlse|, nats) of (out, lse) against the reference."""
    err = (out.to(F64) - out_ref.to(F64)).abs()  # [T, H, L]
    return {
        "err_rel": float((err / pv).max()),
        "cos_diff": cos_diff(out, out_ref),
        "dlse": float((lse.to(F64) - lse_ref.to(F64)).abs().max()),
    }


def quantization_error(case: Case, device="cpu") -> dict:
    """Oracle on the case's fp8 inputs vs oracle on its exact (bf16) inputs: case fields + error_stats."""
    kernel, exact = case.materialize(device)
    out_q, lse_q = mla_decode_ref(kernel)  # [T, H, L], [T, H]
    out_e, lse_e = mla_decode_ref(exact)
    return {**_fields(case), **error_stats(out_q, lse_q, out_e, lse_e, softmax_pv(exact))}


def _fields(case: Case) -> dict:
    return {"dist": case.dist, "seq_len": case.seq_lens[0], "seed": case.seed, "fmt": case.fp8_format,
            "q_dtype": case.q_dtype, "scale_mode": case.scale_mode}


# ---- experiments ---------------------------------------------------------------------------------------------
def sweep_seq_len(size: Size, dists=("gauss1", "gauss4", "sink"), device="cpu") -> list[dict]:
    """Quantization error (fp8 q and KV) for every dist x seq_len x seed."""
    return [quantization_error(fp8_case(d, n, s, size.heads), device)
            for d in dists for n in size.seq_lens for s in range(size.seeds)]


def sweep_formats(size: Size, device="cpu") -> list[dict]:
    """Quantization error of e4m3fn and e4m3fnuz, fp8 q and KV, for every distribution (dist_seq_len)."""
    return [quantization_error(fp8_case(d, size.dist_seq_len, s, size.heads, fp8_format=f), device)
            for f in ("e4m3fn", "e4m3fnuz") for d in ALL_DISTS for s in range(size.seeds)]


def sweep_fp8_q(size: Size, device="cpu") -> list[dict]:
    """Quantization error with bf16 q (fp8 KV only) and with fp8 q, for every distribution."""
    return [quantization_error(fp8_case(d, size.dist_seq_len, s, size.heads, q_dtype=qd), device)
            for qd in ("bf16", "fp8") for d in ALL_DISTS for s in range(size.seeds)]


def granularity_error(case: Case, granularity: str, device="cpu") -> dict:
    """KV quantized with per-tensor, per-token or 128-channel-tile scales (q kept exact): oracle error.

    The dynamic scale of each group is ``quantize``'s; unused cache slots hold NaN, which never enters an amax.
    """
    _, exact = case.materialize(device)
    kv8, scale = quantize(exact.kv_cache, case.fp8_format, granularity)  # [P, ps, D] fp8
    quant = exact.replace(kv_cache=dequantize(kv8, scale, granularity, F64), q=exact.q.to(F64))  # fp64 batch
    out_q, lse_q = mla_decode_ref(quant)
    out_e, lse_e = mla_decode_ref(exact)
    return {**_fields(case), "granularity": granularity, **error_stats(out_q, lse_q, out_e, lse_e, softmax_pv(exact))}


def sweep_granularity(size: Size, dists=("gauss1", "outlier", "sink"), device="cpu") -> list[dict]:
    """granularity_error for tensor / token / tile128 scales, KV only, for each dist x seed."""
    return [granularity_error(fp8_case(d, size.dist_seq_len, s, size.heads), g, device)
            for g in ("tensor", "token", "tile128") for d in dists for s in range(size.seeds)]


def decode_p_rounded(batch: DecodeBatch, p_fmt, p_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 oracle with the softmax weights rounded as a kernel does before P·V (``round_p(p, p_fmt, p_scale)``).

    As in FlashMLA's fp8 kernel, P = exp(s - max s) is rounded, the row sum l comes from the unrounded P, and
    out = Σ_j P̃_j v_j / l; lse is unchanged. p_fmt None = no rounding (the plain oracle).
    """
    q = batch.dequantized_q(F64)  # [T, H, D]
    out = torch.zeros(batch.num_tokens, batch.num_heads, batch.kv_lora_rank, dtype=F64, device=batch.device)
    lse = torch.full((batch.num_tokens, batch.num_heads), -math.inf, dtype=F64, device=batch.device)
    qo = batch.qo_indptr.tolist()
    for b in range(batch.batch_size):  # one query row per request in the analysis cases (no MTP masks)
        rows = slice(qo[b], qo[b + 1])
        K = batch.request_kv(b, F64)  # [s, D]
        s = batch.sm_scale * torch.einsum("nhd,sd->nhs", q[rows], K)  # [n, H, s]
        m = s.amax(dim=-1, keepdim=True)  # [n, H, 1]
        p = torch.exp(s - m)  # [n, H, s] unnormalised, max 1
        l = p.sum(dim=-1)  # [n, H] from the unrounded P
        out[rows] = torch.einsum("nhs,sc->nhc", round_p(p, p_fmt, p_scale), K[:, : batch.kv_lora_rank]) / l[..., None]
        lse[rows] = m[..., 0] + torch.log(l)  # [n, H]
    return out, lse


P_ROUNDINGS = {  # label -> (p_fmt, p_scale), numerics.md §5(f)
    "fp32 P": ("fp32", 1.0),
    "bf16 P": ("bf16", 1.0),
    "e4m3 P": ("e4m3fn", 1.0),
    "e4m3 P x256": ("e4m3fn", 256.0),
}


def sweep_p_rounding(size: Size, dists=("gauss1", "gauss4", "sink"), device="cpu") -> list[dict]:
    """Error of rounding P (P_ROUNDINGS) on the exact bf16 inputs, against the unrounded oracle."""
    rows = []
    for d in dists:
        for s in range(size.seeds):
            case = fp8_case(d, size.dist_seq_len, s, size.heads)
            _, exact = case.materialize(device)
            out_e, lse_e = mla_decode_ref(exact)
            pv = softmax_pv(exact)
            for label, (fmt, scale) in P_ROUNDINGS.items():
                out, lse = decode_p_rounded(exact, fmt, scale)
                rows.append({**_fields(case), "p": label, **error_stats(out, lse, out_e, lse_e, pv)})
    return rows


def sweep_splits(size: Size, dist: str = "sink", seed: int = 0, device="cpu") -> list[dict]:
    """Kernel error of the emulated persistent kernel (fp32, planner splits) vs the oracle on the same fp8 inputs.

    One request of split_seq_len tokens is planned on each worker count of ``size.workers``; ``splits`` is the
    number of pieces its KV range is cut into. ``bound_ratio`` is the max of err / (kernel bound §5(f) + merge
    bound §5(g)) with the emulation's declared numerics and fp32 output (above 1 = a violated bound);
    ``merge_rel`` is the merge bound alone in err_rel units. The quantization error of the same case is reported
    alongside (it does not depend on the plan).
    """
    from mla_fast.backends import BACKENDS
    from mla_fast.emulate import run_plan_reference
    from mla_fast.planner import plan_decode
    from verify.bounds import kernel_bound, merge_bound

    case = fp8_case(dist, size.split_seq_len, seed, size.heads)
    kernel, exact = case.materialize(device)
    out_k, lse_k = mla_decode_ref(kernel)  # oracle on the dequantized fp8 inputs
    pv = softmax_pv(kernel)
    quant = error_stats(out_k, lse_k, *mla_decode_ref(exact), softmax_pv(exact))["err_rel"]
    numerics = dataclasses.replace(BACKENDS["emulated"].numerics(kernel), out_dtype=torch.float32)
    k_bound = kernel_bound(kernel, numerics, ref=(out_k, lse_k)).out  # [T, H, L]
    rows = []
    for w in size.workers:
        plan = plan_decode(kernel.seq_lens, kernel.q_lens, kernel.num_heads, w)
        out, lse = run_plan_reference(kernel, plan, torch.float32)  # [T, H, L], [T, H]
        splits = max(int(torch.diff(plan.reduce_indptr.cpu()).max()), 1) if plan.num_tiles else 1
        merge = merge_bound(kernel, splits).out  # [T, H, L]
        ratio = float(((out.to(F64) - out_k).abs() / (k_bound + merge)).max())
        rows.append({**_fields(case), "workers": w, "splits": splits, "quant_err_rel": quant,
                     "bound_ratio": ratio, "merge_rel": float((merge / pv).max()),
                     **error_stats(out, lse, out_k, lse_k, pv)})
    return rows


def bound_ratios(case: Case, device="cpu") -> dict:
    """Tightness of the quantization bounds on one case (verify.bounds, numerics.md §5(a)–(e)).

    Returns the case fields and, per (row, head), the max over channels of err / bound for B_det, B_post and the
    probabilistic B_prob (numpy arrays; a ratio > 1 for B_det or B_post would be a violated bound), plus omega_det
    and omega_act (max over rows and heads).
    """
    from verify.bounds import prob_bound, quantization_bounds

    kernel, exact = case.materialize(device)
    out_q, _ = mla_decode_ref(kernel)
    ref = mla_decode_ref(exact)
    err = (out_q - ref[0]).abs()  # [T, H, L]
    qb = quantization_bounds(kernel, exact, ref_exact=ref)
    prob = prob_bound(kernel, exact).out  # [T, H, L]

    def ratio(bound: torch.Tensor) -> np.ndarray:
        r = torch.where(bound > 0, err / bound, torch.where(err > 0, math.inf, 0.0))  # [T, H, L]
        return r.amax(dim=-1).flatten().cpu().numpy()  # [T·H]

    return {**_fields(case), "det": ratio(qb.det_out), "post": ratio(qb.post_out), "prob": ratio(prob),
            "omega_det": float(qb.omega_det.max()), "omega_act": float(qb.omega_act.max())}


def sweep_bounds(size: Size, device="cpu") -> list[dict]:
    """bound_ratios for every distribution x seed at dist_seq_len."""
    return [bound_ratios(fp8_case(d, size.dist_seq_len, s, size.heads), device)
            for d in ALL_DISTS for s in range(size.seeds)]


def rms_ratio(case: Case, device="cpu") -> float:
    """Actual RMS quantization error over all outputs / first-order RMS prediction (verify.bounds.rms_estimate).

    Above 1: the independent-rounding model under-predicts (numerics.md §5.1: coherent data, 3–65x).
    """
    from verify.bounds import rms_estimate

    kernel, exact = case.materialize(device)
    err = mla_decode_ref(kernel)[0] - mla_decode_ref(exact)[0]  # [T, H, L]
    predicted = rms_estimate(kernel, exact)  # [T, H, L]
    return float(err.pow(2).mean().sqrt() / predicted.pow(2).mean().sqrt())


# ---- statistics ------------------------------------------------------------------------------------------------
def relative_norm_change(out: torch.Tensor, out_ref: torch.Tensor) -> np.ndarray:
    """Per (row, head): <ô - o, o> / |o|², the relative change of the output along itself (< 0: it shrinks)."""
    o, d = out_ref.to(F64), out.to(F64) - out_ref.to(F64)  # [T, H, L]
    return ((d * o).sum(-1) / (o * o).sum(-1)).flatten().cpu().numpy()  # [T·H]


def bias_test(samples: np.ndarray) -> dict:
    """Is the mean of ``samples`` zero? One-sample t-test and Wilcoxon signed-rank test (two-sided p-values)."""
    t = stats.ttest_1samp(samples, 0.0)
    w = stats.wilcoxon(samples)
    return {"n": int(samples.size), "mean": float(samples.mean()), "std": float(samples.std(ddof=1)),
            "t_pvalue": float(t.pvalue), "wilcoxon_pvalue": float(w.pvalue)}


def rounding_bias(size: Size, dist: str = "gauss1", device="cpu", max_samples: int = 100_000) -> dict:
    """bias_test of three signed errors over ``size.seeds`` cases of split_seq_len tokens:

    - "fp8 KV elements": x̂ - x of the cache entries (subsampled to ``max_samples``, local generator): RNE of data
      symmetric about 0 has mean error 0;
    - "fp8 q+KV output": relative norm change of the output: zero-mean score noise flattens a softmax on average
      (Jensen), so ‖ô‖ can shrink even though every rounding is unbiased;
    - "e4m3 P (unscaled)": relative norm change from rounding P alone: p < 2^-10 flushes to zero while l keeps
      it, so the output shrinks (numerics.md §5.2).
    """
    elems, quant, p_fp8 = [], [], []
    for s in range(size.seeds):
        kernel, exact = fp8_case(dist, size.split_seq_len, s, size.heads).materialize(device)
        elems.append((kernel.request_kv(0) - exact.request_kv(0)).flatten().cpu())  # [s·D] x̂ - x
        out_e = mla_decode_ref(exact)[0]
        quant.append(relative_norm_change(mla_decode_ref(kernel)[0], out_e))
        p_fp8.append(relative_norm_change(decode_p_rounded(exact, "e4m3fn")[0], out_e))
    elems = torch.cat(elems)  # [n]
    pick = torch.randperm(elems.numel(), generator=torch.Generator().manual_seed(0))[:max_samples]
    return {
        "fp8 KV elements": bias_test(elems[pick].numpy()),
        "fp8 q+KV output": bias_test(np.concatenate(quant)),
        "e4m3 P (unscaled)": bias_test(np.concatenate(p_fp8)),
    }


def log_fit(seq_lens, values, confidence: float = 0.95) -> dict:
    """Least-squares fit values ≈ a + b·ln(seq_len) with a t confidence interval on the slope b.

    b ± t_{(1+confidence)/2, n-2} · stderr(b) (scipy.stats.linregress); ``contains_zero`` says whether the data
    are consistent with no growth.
    """
    x, y = np.log(np.asarray(seq_lens, dtype=float)), np.asarray(values, dtype=float)
    fit = stats.linregress(x, y)
    # constant values fit exactly (zero residuals: stderr 0), but scipy's r is 0/0 there and its stderr NaN
    stderr = 0.0 if np.ptp(y) == 0 else fit.stderr
    half = stats.t.ppf((1 + confidence) / 2, x.size - 2) * stderr
    lo, hi = fit.slope - half, fit.slope + half
    return {"slope": fit.slope, "intercept": fit.intercept, "ci": (lo, hi), "confidence": confidence,
            "r2": fit.rvalue**2, "n": int(x.size), "contains_zero": bool(lo <= 0.0 <= hi)}


def column(rows: list[dict], key: str, **where) -> np.ndarray:
    """Values of ``key`` over the rows whose fields equal ``where``."""
    return np.array([r[key] for r in rows if all(r[k] == v for k, v in where.items())])


# ---- plots (each draws on a matplotlib Axes, so cells and the summary figure share them) ------------------------
def _whiskers(values: np.ndarray) -> tuple[float, float, float]:
    """(mean, mean - min, max - mean) for an error bar spanning the seeds."""
    m = float(values.mean())
    return m, m - float(values.min()), float(values.max()) - m


def plot_seq_len(ax, rows: list[dict], metric: str = "err_rel") -> None:
    """metric vs sequence length (log x) per distribution, mean over seeds with min-max bars."""
    for dist in dict.fromkeys(r["dist"] for r in rows):
        n = np.unique(column(rows, "seq_len", dist=dist))
        m = np.array([_whiskers(column(rows, metric, dist=dist, seq_len=k)) for k in n])  # [len(n), 3]
        ax.errorbar(n, m[:, 0], yerr=m[:, 1:].T, marker="o", capsize=3, label=dist)
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="max |Δo| / Σp|v|",
           title="fp8 q+KV error vs sequence length")
    ax.legend(fontsize=8)


def plot_splits(ax, rows: list[dict]) -> None:
    """Kernel error (emulated fp32 kernel vs oracle, same fp8 inputs) vs number of splits; quantization error line."""
    splits = column(rows, "splits")
    ax.plot(splits, column(rows, "err_rel"), "o-", label="kernel (fp32 emulation) vs oracle")
    ax.axhline(rows[0]["quant_err_rel"], color="C3", ls="--", label="fp8 quantization (same case)")
    ax.set(xscale="log", yscale="log", xlabel="KV splits (planner)", ylabel="max |Δo| / Σp|v|",
           title=f"error vs split count, N = {rows[0]['seq_len']}")
    ax.legend(fontsize=8)


def plot_grouped(ax, rows: list[dict], group: str, metric: str = "err_rel", title: str = "") -> None:
    """Bars of ``metric`` per distribution (x) and value of ``group`` (one bar each); mean, min-max whiskers."""
    dists = list(dict.fromkeys(r["dist"] for r in rows))
    groups = list(dict.fromkeys(r[group] for r in rows))
    width = 0.8 / len(groups)
    for k, g in enumerate(groups):
        m = np.array([_whiskers(column(rows, metric, dist=d, **{group: g})) for d in dists])  # [dists, 3]
        x = np.arange(len(dists)) + (k - (len(groups) - 1) / 2) * width
        ax.bar(x, m[:, 0], width, yerr=m[:, 1:].T, capsize=2, label=str(g))
    ax.set_xticks(np.arange(len(dists)), dists, fontsize=8)
    ax.set(yscale="log", ylabel="max |Δo| / Σp|v|" if metric == "err_rel" else metric, title=title)
    ax.legend(fontsize=7)


def plot_bound_hist(ax, bound_rows: list[dict]) -> None:
    """Histograms (log x) of err / B_det and err / B_post over all (case, row, head)."""
    bins = np.logspace(-4, 0, 41)
    for key, label in (("det", "err / B_det (a priori)"), ("post", "err / B_post (a posteriori)")):
        values = np.concatenate([r[key] for r in bound_rows])
        ax.hist(np.clip(values, bins[0], None), bins=bins, alpha=0.6, label=label)
    ax.axvline(1.0, color="k", lw=1)
    ax.set(xscale="log", xlabel="error / bound (1 = bound reached)", ylabel="(case, row, head) count",
           title="tightness of the quantization bounds")
    ax.legend(fontsize=8)


def plot_prob(ax, bound_rows: list[dict], rms: dict[str, float]) -> None:
    """Per distribution: max err / B_prob (bars) and actual / predicted RMS error (markers); 1 = prediction met."""
    dists = list(rms)
    prob = [max(float(r["prob"].max()) for r in bound_rows if r["dist"] == d) for d in dists]
    x = np.arange(len(dists))
    ax.bar(x - 0.2, prob, 0.4, label="max err / B_prob")
    ax.bar(x + 0.2, [rms[d] for d in dists], 0.4, label="RMS err / first-order RMS estimate")
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(x, dists, fontsize=8)
    ax.set(yscale="log", title="probabilistic estimates: under-prediction above 1")
    ax.legend(fontsize=7)
