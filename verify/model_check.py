"""`mla-verify model`: does fp8 MLA decode change what a DeepSeek-V3-architecture model predicts?

Method (llama.cpp ``llama-perplexity --kl-divergence``, numerics.md §7). Two runs of one model decode the same
seeded random token ids, one token per step, in lockstep; each keeps its own paged latent caches. They differ only
in how each layer's MLA decode attention is computed:

- reference: mla_ref's absorbed decode (``mla_decode_ref``, fp64) on bf16 q and bf16 cache rows, out rounded to
  bf16 — what a correct bf16 kernel computes, up to its own accumulation error;
- candidate: ``--dtype fp8``: q and cache rows quantized to fp8 (e4m3fn by default) with static per-tensor scales,
  run through a decode backend (``--backend``: the CPU emulation of the persistent kernel, our Triton kernel, a
  peer), out bf16; ``--dtype bf16``: the same bf16 inputs through that backend.

At every step both runs give next-token logits; the report gives the KL divergence KL(P_ref || P_cand) per token
(natural log: nats) as mean, 99th percentile and max, the top-1 agreement, and max |logit_cand - logit_ref|.
The rest of the model (projections, norms, MLP, lm_head) runs in the model's dtype (fp32) in both runs, so every
difference comes from the attention path.

Design: transformers builds the model (``DeepseekV3ForCausalLM``; its weights, norms, MLP and lm_head are used as
they are), and this module drives it token by token and layer by layer: per layer, ``MLAWeights.from_hf`` of its
attention module, ``project_q`` / ``absorbed_query`` / ``latent_cache_row`` for the new token, one paged
``DecodeBatch`` step, ``absorb_output`` and ``wo``. HF's own attention forward is never called during decode (a
test checks that this loop with exact attention reproduces HF's forward logits).

Model: random init (a **proxy**: no training, no download), 16 heads with DeepSeek-V3's head dims (kv_lora 512,
rope 64, nope 128, v 128) and YaRN (factor 40, mscale_all_dim 1: σ = 0.1352338), dense MLP, small hidden size and
vocabulary. Init gains put the attention scores at std ``SCORE_STD`` and the logits at std ``LOGIT_STD`` so that
attention is far from uniform and next-token entropy is well below log(vocab); the report gives both (mean
attention entropy against mean log(context), mean next-token entropy against log(vocab)). Real weights already on
disk: ``--weights DIR`` (``from_pretrained(DIR, local_files_only=True)``; never downloads).

fp8 scales: static per-tensor, per layer, calibrated once on the evaluated tokens as vLLM's
``--calculate-kv-scales`` does: ``scale = amax / (fmt.max / SCALE_HEADROOM)`` over that layer's q (resp. cache rows)
in an exact prefill; values beyond the range saturate.

Exit codes: 0 ran (and within ``--max-kl`` if given), 1 mean KL above ``--max-kl``, 2 bad usage or input,
5 the backend cannot run here (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from mla_fast.report_path import unwritable
from mla_ref.config import MLAConfig
from mla_ref.decode import DecodeBatch
from mla_ref.fp8 import FORMATS, quantize
from mla_ref.mla import MLAWeights, absorb_output, absorbed_query, latent_cache_row, project_q

SCHEMA_VERSION = 1
SCORE_STD = 3.0  # target std of attention scores σ<q, k> at init: softmax far from uniform
LOGIT_STD = 3.5  # target std of next-token logits at init: entropy well below log(vocab)
SCALE_HEADROOM = 2.0  # calibration amax maps to fmt.max / 2 (vLLM: amax / 200 for e4m3fn, 448 / 200 = 2.24)
PAGE_SIZE = 64  # tokens per cache page (FlashMLA's page size)
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")  # formats the decode backends take for q and cache


@dataclass(frozen=True)
class ModelSize:
    """A random-init DeepSeek-V3-architecture model and how long to decode it.

    Attributes:
        num_layers, hidden_size, q_lora_rank, intermediate_size, vocab_size: model shape (heads and head dims are
            DeepSeek-V3's: 16 heads here, kv_lora 512, rope 64, nope 128, v 128).
        batch: sequences decoded in parallel (one DecodeBatch request each).
        steps: decode steps (tokens per sequence); the context grows from 1 to ``steps``.
    """

    num_layers: int
    hidden_size: int
    q_lora_rank: int
    intermediate_size: int
    vocab_size: int
    batch: int
    steps: int


SIZES = {
    "ci": ModelSize(num_layers=2, hidden_size=256, q_lora_rank=256, intermediate_size=512, vocab_size=2048,
                    batch=4, steps=64),
    "full": ModelSize(num_layers=4, hidden_size=1024, q_lora_rank=512, intermediate_size=2048, vocab_size=32768,
                      batch=8, steps=512),
}
NUM_HEADS = 16


# ---- model --------------------------------------------------------------------------------------------------------
def hf_config(size: ModelSize):
    """transformers DeepseekV3Config: V3 head dims and YaRN, dense MLP in every layer (no MoE), eager attention."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        q_lora_rank=size.q_lora_rank,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        first_k_dense_replace=size.num_layers,  # every layer dense: no MoE
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_interleave=True,
        tie_word_embeddings=False,
        num_mtp_layers=0,
    )
    config._attn_implementation = "eager"
    return config


def build_model(size: ModelSize, seed: int, device="cpu", dtype: torch.dtype = torch.float32):
    """Random-init DeepseekV3ForCausalLM, every parameter drawn from a local torch.Generator(seed).

    Matrices [out, in] get N(0, (gain / sqrt(in))²), so an input of RMS 1 gives outputs of RMS ``gain``:
    - q_b_proj, the W_UK rows of kv_b_proj and the k_pe rows of kv_a_proj_with_mqa: gain g with
      σ · g² · sqrt(d_qk) = SCORE_STD (q and k entries of RMS g, d_qk = 192 terms per score);
    - lm_head: gain LOGIT_STD (the final norm gives RMS 1);
    - everything else: gain 1. Embeddings N(0, 1); RMSNorm weights 1 + N(0, 0.1²).
    """
    from transformers import DeepseekV3ForCausalLM

    config = hf_config(size)
    model = DeepseekV3ForCausalLM(config)
    cfg = MLAConfig.from_hf(config)
    g = math.sqrt(SCORE_STD / (cfg.softmax_scale * math.sqrt(cfg.qk_head_dim)))
    L, d = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weight
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))  # [n]
                continue
            w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])  # [out, in], unit gain
            if name.endswith("embed_tokens.weight"):
                w = torch.randn(p.shape, generator=gen)  # [V, D] N(0, 1)
            elif name.endswith("q_b_proj.weight"):
                w = w * g
            elif name.endswith("kv_a_proj_with_mqa.weight"):
                w[L:] *= g  # k_pe rows
            elif name.endswith("kv_b_proj.weight"):
                w.view(NUM_HEADS, -1, L)[:, :d] *= g  # W_UK rows of each head
            elif name == "lm_head.weight":
                w = w * LOGIT_STD
            p.copy_(w)
    return model.to(device=device, dtype=dtype).eval()


def load_model(weights_dir: str, device="cpu", dtype: torch.dtype = torch.float32):
    """A DeepSeek-V2/V3 checkpoint already on disk (never downloads); ValueError naming what is missing."""
    if not os.path.isdir(weights_dir):
        raise ValueError(f"--weights: expected a directory holding config.json and weights, got {weights_dir!r}")
    if not os.path.isfile(os.path.join(weights_dir, "config.json")):
        raise ValueError(f"--weights: no config.json in {weights_dir!r}")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(weights_dir, local_files_only=True, dtype=dtype,
                                                     attn_implementation="eager")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--weights: cannot load a model from {weights_dir!r}: {e}") from e
    if not hasattr(model.model.layers[0].self_attn, "kv_a_proj_with_mqa"):
        raise ValueError(f"--weights: {weights_dir!r} is not an MLA (DeepSeek-V2/V3) model")
    return model.to(device).eval()


@dataclass
class _Layer:
    module: torch.nn.Module  # the HF decoder layer (norms and MLP are used as they are)
    weights: MLAWeights
    cfg: MLAConfig


def _layers(model) -> list[_Layer]:
    cfg = MLAConfig.from_hf(model.config)
    return [_Layer(layer, MLAWeights.from_hf(layer.self_attn), cfg) for layer in model.model.layers]


# ---- attention paths ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionPath:
    """How one run computes each layer's MLA decode attention.

    Attributes:
        kv_format: "exact" (q and cache rows in the model's dtype, out not rounded: the harness check),
            "bf16" (q and cache rows rounded to bf16), or an fp8 format in FP8_FORMATS (q and cache rows quantized
            with static per-tensor scales). Outputs of "bf16" and fp8 paths are rounded to bf16.
        backend: a ``mla_fast.backends`` name ("ref", "emulated", "triton", ...).
        sm_scale: softmax scale handed to the backend; None = the model's (YaRN mscale² included).
    """

    kv_format: str
    backend: str = "ref"
    sm_scale: float | None = None

    def __post_init__(self):
        if self.kv_format not in ("exact", "bf16", *FP8_FORMATS):
            raise ValueError(f"kv_format: expected 'exact', 'bf16' or one of {FP8_FORMATS}, got {self.kv_format!r}")

    @property
    def label(self) -> str:
        scale = "" if self.sm_scale is None else f", sm_scale={self.sm_scale:.6g}"
        return f"{self.kv_format} q+KV via {self.backend}{scale}"


REFERENCE = AttentionPath("bf16", "ref")  # mla_ref on bf16 inputs, out rounded to bf16


def _storage_dtype(kv_format: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_format == "exact":
        return model_dtype
    if kv_format == "bf16":
        return torch.bfloat16
    return FORMATS[kv_format].torch_dtype


class _PagedCache:
    """One layer's latent cache: [P, PAGE_SIZE, L+R] pages in a seeded random order, NaN in every unused slot."""

    def __init__(self, batch: int, max_len: int, width: int, dtype: torch.dtype, device, gen: torch.Generator):
        pages = -(-max_len // PAGE_SIZE)  # ceil
        total = batch * pages + 1  # + one page no request uses
        nan = torch.full((total, PAGE_SIZE, width), float("nan"), device=device)  # [P, ps, L+R] fp32
        self.pages = nan.to(dtype)  # [P, ps, L+R] (fp8 NaN bit pattern for fp8 dtypes)
        perm = torch.randperm(total, generator=gen)[: batch * pages]  # [B·pages] physical page of each logical one
        self.block_table = perm.view(batch, pages).to(device=device, dtype=torch.int32)  # [B, pages]

    def write(self, rows: torch.Tensor, t: int) -> None:
        """rows [B, L+R] become token t of every request."""
        self.pages[self.block_table[:, t // PAGE_SIZE].long(), t % PAGE_SIZE] = rows  # [B, L+R]


def attention_entropy(batch: DecodeBatch) -> torch.Tensor:
    """[T, H] entropy (nats) of the softmax over the tokens each query row sees (one q row per request here)."""
    q = batch.dequantized_q(torch.float64)  # [T, H, D]
    ent = torch.empty(batch.num_tokens, batch.num_heads, dtype=torch.float64, device=batch.device)  # [T, H]
    for b in range(batch.batch_size):
        K = batch.request_kv(b, torch.float64)  # [s, D]
        s = batch.sm_scale * torch.einsum("hd,sd->hs", q[b], K)  # [H, s]
        logp = torch.log_softmax(s, dim=-1)  # [H, s]
        ent[b] = -(logp.exp() * logp).sum(-1)  # [H]
    return ent


class _Run:
    """One decode run of the model along one attention path: its own caches, one token per step for B sequences."""

    def __init__(self, model, layers: list[_Layer], path: AttentionPath, batch: int, max_len: int, scales,
                 seed: int, record_entropy: bool = False):
        from mla_fast.backends import get_backend

        self.model, self.layers, self.path = model, layers, path
        self.backend = get_backend(path.backend)
        self.scales = scales  # per layer (q_scale, kv_scale) for fp8 paths, else None
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        width = layers[0].cfg.kv_lora_rank + layers[0].cfg.qk_rope_head_dim
        gen = torch.Generator().manual_seed(seed)
        store = _storage_dtype(path.kv_format, dtype)
        self.caches = [_PagedCache(batch, max_len, width, store, device, gen) for _ in layers]
        self.record_entropy = record_entropy
        self.entropy: list[torch.Tensor] = []  # per step: [layers, B, H] attention entropy (nats)

    def _attend(self, i: int, q: torch.Tensor, row: torch.Tensor, t: int) -> torch.Tensor:
        """q [B, H, L+R], new cache row [B, L+R] at position t -> latent output [B, H, L] in q's dtype."""
        path, layer, cache = self.path, self.layers[i], self.caches[i]
        q_scale = kv_scale = None
        if path.kv_format == "bf16":
            q, row = q.to(torch.bfloat16), row.to(torch.bfloat16)  # [B, H, D], [B, D]
        elif path.kv_format in FP8_FORMATS:
            q, s_q = quantize(q, path.kv_format, "tensor", scale=self.scales[i][0])  # [B, H, D] fp8
            row, s_kv = quantize(row, path.kv_format, "tensor", scale=self.scales[i][1])  # [B, D] fp8
            q_scale, kv_scale = float(s_q), float(s_kv)
        cache.write(row, t)
        B = q.shape[0]
        batch = DecodeBatch(
            q.contiguous(), cache.pages, cache.block_table,
            torch.full((B,), t + 1, dtype=torch.int32, device=q.device),
            sm_scale=layer.cfg.softmax_scale if path.sm_scale is None else path.sm_scale,
            kv_lora_rank=layer.cfg.kv_lora_rank, q_scale=q_scale, kv_scale=kv_scale,
        )
        out, _ = self.backend(batch)  # [B, H, L]
        if self.record_entropy:
            self._step_entropy.append(attention_entropy(batch))  # [B, H]
        if path.kv_format != "exact":
            out = out.to(torch.bfloat16)  # kernels return bf16; the ref oracle returns fp64
        return out.to(self.model.lm_head.weight.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """tokens [B] at position t -> next-token logits [B, V] (model dtype)."""
        self._step_entropy = []
        x = self.model.model.embed_tokens(tokens)  # [B, D]
        positions = torch.full_like(tokens, t)  # [B]
        for i, layer in enumerate(self.layers):
            w, cfg, block = layer.weights, layer.cfg, layer.module
            h = block.input_layernorm(x)  # [B, D]
            q_nope, q_pe = project_q(h, w, cfg, positions)  # [B, H, d], [B, H, R]
            q = absorbed_query(q_nope, q_pe, w)  # [B, H, L+R]
            row = latent_cache_row(h, w, cfg, positions)  # [B, L+R]
            o_latent = self._attend(i, q, row, t)  # [B, H, L]
            o = absorb_output(o_latent, w)  # [B, H, v]
            x = x + o.flatten(-2) @ w.wo.T  # [B, D]
            x = x + block.mlp(block.post_attention_layernorm(x))  # [B, D]
        if self.record_entropy:
            self.entropy.append(torch.stack(self._step_entropy))  # [layers, B, H]
        return self.model.lm_head(self.model.model.norm(x))  # [B, V]


# ---- scales -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def calibrate_scales(model, layers: list[_Layer], tokens: torch.Tensor, fmt: str) -> list[tuple[float, float]]:
    """Static per-tensor (q_scale, kv_scale) per layer: amax / (fmt.max / SCALE_HEADROOM), fp32.

    amax is taken over the absorbed queries (resp. cache rows) of that layer in one exact prefill of ``tokens``
    [B, N] by the HF model (a pre-hook on each attention module reads its input).
    """
    inputs: list[torch.Tensor] = []
    hooks = [layer.module.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: inputs.append(kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True) for layer in layers]
    try:
        model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    positions = torch.arange(tokens.shape[1], device=tokens.device)  # [N]
    target = FORMATS[fmt].max / SCALE_HEADROOM
    scales = []
    for layer, h in zip(layers, inputs, strict=True):
        q = absorbed_query(*project_q(h, layer.weights, layer.cfg, positions), layer.weights)  # [B, N, H, L+R]
        rows = latent_cache_row(h, layer.weights, layer.cfg, positions)  # [B, N, L+R]
        scales.append((float(q.abs().max()) / target, float(rows.abs().max()) / target))
    return scales


# ---- comparison ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_logits(model, tokens: torch.Tensor, path: AttentionPath, scales=None, seed: int = 0) -> torch.Tensor:
    """Next-token logits [B, N, V] (model dtype) of decoding ``tokens`` [B, N] one step at a time along ``path``."""
    B, N = tokens.shape
    run = _Run(model, _layers(model), path, B, N, scales, seed)
    return torch.stack([run.step(tokens[:, t], t) for t in range(N)], dim=1)  # [B, N, V]


def _token_stats(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sequence at one step: KL(P_ref || P_cand) (nats), top-1 agreement, max |Δlogit|; ref logits [B, V]."""
    logp_ref = torch.log_softmax(ref.double(), dim=-1)  # [B, V]
    logp_cand = torch.log_softmax(cand.double(), dim=-1)  # [B, V]
    p_ref = logp_ref.exp()  # [B, V]
    diff = torch.where(p_ref > 0, logp_ref - logp_cand, 0.0)  # [B, V] (0 · anything = 0)
    return {
        "kl": (p_ref * diff).sum(-1),  # [B]
        "top1": (ref.argmax(-1) == cand.argmax(-1)).double(),  # [B]
        "dlogit": (cand.double() - ref.double()).abs().amax(-1),  # [B]
    }


def _summary(per_token: dict[str, torch.Tensor]) -> dict[str, float]:
    kl = per_token["kl"].flatten().cpu()  # [N·B]
    return {
        "kl_mean": float(kl.mean()),
        "kl_median": float(kl.median()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(per_token["top1"].mean()),
        "max_logit_diff": float(per_token["dlogit"].max()),
    }


@torch.no_grad()
def compare_paths(model, tokens: torch.Tensor, reference: AttentionPath, candidates: list[AttentionPath],
                  scales=None, seed: int = 0) -> dict:
    """Decode ``tokens`` [B, N] along the reference and each candidate path in lockstep.

    Returns a dict: "candidates" (one summary per candidate: kl_mean/median/p99/max in nats, top1_agreement,
    max_logit_diff), "per_token" (per candidate: kl, top1, dlogit tensors [N, B] on the CPU), "next_token_entropy"
    (mean entropy of the reference's next-token distributions, nats), "attention_entropy" (mean over layers,
    heads, sequences and steps with context >= 2, nats) and "mean_log_context" (mean ln(context) over those steps).
    scales: per layer (q_scale, kv_scale), needed by fp8 paths (see ``calibrate_scales``).
    """
    B, N = tokens.shape
    layers = _layers(model)
    runs = [_Run(model, layers, path, B, N, scales, seed, record_entropy=(k == 0))
            for k, path in enumerate([reference, *candidates])]
    per_token = [{"kl": [], "top1": [], "dlogit": []} for _ in candidates]
    next_entropy = []
    for t in range(N):
        logits = [run.step(tokens[:, t], t) for run in runs]  # each [B, V]
        logp = torch.log_softmax(logits[0].double(), dim=-1)  # [B, V]
        next_entropy.append(-(logp.exp() * logp).sum(-1))  # [B]
        for acc, cand in zip(per_token, logits[1:], strict=True):
            for key, value in _token_stats(logits[0], cand).items():
                acc[key].append(value)
    per_token = [{k: torch.stack(v).cpu() for k, v in acc.items()} for acc in per_token]  # each [N, B]
    ent = torch.stack(runs[0].entropy).cpu()[1:]  # [N-1, layers, B, H] steps with context 2..N
    return {
        "candidates": [_summary(acc) for acc in per_token],
        "per_token": per_token,
        "next_token_entropy": float(torch.stack(next_entropy).mean()),
        "attention_entropy": float(ent.mean()) if ent.numel() else 0.0,
        "mean_log_context": float(torch.log(torch.arange(2, N + 1, dtype=torch.float64)).mean()) if N > 1 else 0.0,
    }


# ---- CLI ----------------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mla-verify model",
        description="Model-level fp8 check: KL divergence of next-token distributions, fp8 (or bf16) MLA decode "
        "vs mla_ref bf16, on a random-init DeepSeek-V3-architecture model (a proxy) or --weights DIR.",
    )
    p.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8", help="candidate attention inputs")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, default="e4m3fn")
    p.add_argument("--size", choices=sorted(SIZES), default="ci")
    p.add_argument("--steps", type=int, default=None, help="decode steps (default: the size's)")
    p.add_argument("--batch", type=int, default=None, help="sequences (default: the size's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--backend", default="auto",
                   help="mla_fast.backends name for the candidate; auto = triton on CUDA, emulated on CPU")
    p.add_argument("--weights", default=None, help="local HF checkpoint dir of a DeepSeek-V2/V3 model (no download)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here ('-' = stdout)")
    p.add_argument("--max-kl", type=float, default=None, help="exit 1 when the mean KL (nats) exceeds this")
    return p


def run_model_check(args: argparse.Namespace) -> dict:
    """Build or load the model, calibrate fp8 scales, decode both paths; the JSON report as a dict."""
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:  # not a device string
        raise ValueError(f"--device: expected a torch device such as cpu or cuda:0, got {args.device!r} "
                         f"({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: cannot run here: no CUDA device")
    size = SIZES[args.size]
    steps, batch = args.steps or size.steps, args.batch or size.batch
    backend = args.backend if args.backend != "auto" else ("triton" if device.type == "cuda" else "emulated")
    from mla_fast.backends import get_backend

    get_backend(backend)  # ValueError "... cannot run here: <why>" before any model is built
    start = time.perf_counter()
    model = load_model(args.weights, device) if args.weights else build_model(size, args.seed, device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(model.config.vocab_size, (batch, steps), generator=gen).to(device)  # [B, N]
    candidate = AttentionPath(args.fp8_format if args.dtype == "fp8" else "bf16", backend)
    scales = calibrate_scales(model, _layers(model), tokens, args.fp8_format) if args.dtype == "fp8" else None
    result = compare_paths(model, tokens, REFERENCE, [candidate], scales, seed=args.seed)
    summary = result["candidates"][0]
    cfg = MLAConfig.from_hf(model.config)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "source": args.weights or "random init (a proxy: untrained weights, not a real model)",
            "size": None if args.weights else args.size,
            **({} if args.weights else asdict(size)),
            "num_layers": model.config.num_hidden_layers,
            "num_heads": cfg.num_heads,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "softmax_scale": cfg.softmax_scale,
            "vocab_size": model.config.vocab_size,
        },
        "data": {"tokens": "random ids, torch.Generator(seed + 1)", "seed": args.seed, "sequences": batch,
                 "steps": steps, "tokens_compared": batch * steps},
        "reference": REFERENCE.label,
        "candidate": candidate.label,
        "scales": None if scales is None else [{"q_scale": q, "kv_scale": kv} for q, kv in scales],
        **summary,
        "next_token_entropy": result["next_token_entropy"],
        "log_vocab": math.log(model.config.vocab_size),
        "attention_entropy": result["attention_entropy"],
        "mean_log_context": result["mean_log_context"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "triton": _version("triton")},
        "elapsed_s": time.perf_counter() - start,
        "repro": "mla-verify model " + " ".join(_repro_args(args)),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _repro_args(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if value is not None and key != "json":
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mla-verify model: {report['candidate']}  vs  {report['reference']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("model", report["model"]["source"]),
        ("tokens compared", f"{report['data']['sequences']} seqs x {report['data']['steps']} steps"),
        ("mean KL (nats)", f"{report['kl_mean']:.3e}"),
        ("99th pct KL", f"{report['kl_p99']:.3e}"),
        ("max KL", f"{report['kl_max']:.3e}"),
        ("top-1 agreement", f"{100 * report['top1_agreement']:.2f} %"),
        ("max |Δ logit|", f"{report['max_logit_diff']:.3e}"),
        ("next-token entropy / ln(vocab)", f"{report['next_token_entropy']:.2f} / {report['log_vocab']:.2f}"),
        ("attention entropy / mean ln(context)",
         f"{report['attention_entropy']:.2f} / {report['mean_log_context']:.2f}"),
        ("elapsed", f"{report['elapsed_s']:.1f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(stderr=True).print(table)


def _json_safe(x):
    """Non-finite floats as the strings "nan", "inf", "-inf" (JSON has no such numbers; allow_nan=False)."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _write_json(report: dict, path: str) -> None:
    text = json.dumps(_json_safe(report), indent=2, allow_nan=False)
    if path == "-":
        print(text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".model_check.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)  # atomic: readers never see a partial report


def main(argv: list[str] | None = None) -> int:
    """`mla-verify model ...`; returns the exit code (module docstring)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        for name in ("steps", "batch"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                parser.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
        if args.max_kl is not None and not args.max_kl >= 0:  # a KL is >= 0: a negative bar always fails
            parser.error(f"--max-kl: expected a number >= 0, got {args.max_kl}")
        if args.json and args.json != "-" and (why := unwritable(args.json)):  # before the run, not after it
            parser.error(f"--json: cannot write {args.json}: {why}")
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed): returned, as mla-verify does
        return int(e.code or 0)
    try:
        report = run_model_check(args)
    except ValueError as e:
        cannot_run = "cannot run here" in str(e)
        print(f"mla-verify model: {e}", file=sys.stderr)
        return 5 if cannot_run else 2
    _print_table(report)
    if args.json:
        _write_json(report, args.json)
    if not math.isfinite(report["kl_mean"]):
        print("mla-verify model: non-finite KL: the candidate produced NaN or inf logits", file=sys.stderr)
        return 1
    if args.max_kl is not None and not report["kl_mean"] <= args.max_kl:
        print(f"mla-verify model: mean KL {report['kl_mean']:.3e} > --max-kl {args.max_kl:.3e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
