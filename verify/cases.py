"""One verifier case: a small frozen description of a decode batch, and how to build its tensors.

A `Case` holds only shapes, dtypes, a data distribution and a seed; `materialize(device)` builds the tensors from a
local `torch.Generator(seed)` on the CPU (identical bits on every machine), then moves them to `device`.

It returns two batches that share q rows, block table and page order:

- ``batch_exact``: the unquantized inputs, bf16 (what a bf16 model's KV cache holds; fp16 for ``kv_dtype="fp16"``);
- ``batch_kernel``: what the kernel under test receives: the same 16-bit batch for ``kv_dtype="bf16"`` or
  ``"fp16"``, or its fp8 quantization (``real = fp8 · scale``, saturating, mla_ref.fp8.quantize) for
  ``kv_dtype="fp8"`` (e4m3fn, e4m3fnuz or e5m2).

Data distributions (numerics.md §5.1, §8.2), each with q scaled so that scores ``s = σ <q, k>`` have the given std:

| dist     | cache rows [c_kv | k_pe]                              | score std | stresses                        |
|----------|-------------------------------------------------------|-----------|---------------------------------|
| gauss1   | N(0, 1)                                               | 1         | the typical case                |
| gauss4   | N(0, 1)                                               | 4         | peaky softmax (large ω)         |
| outlier  | N(0, 1), two latent channels × 3000 (q there ÷ 3000)  | 1         | the rest in fp8 subnormals      |
| wide     | N(0, 1)                                               | 32        | logits past 88.7, where fp32    |
|          |                                                       |           | exp overflows without the max   |
| sink     | N(0, 1); token 0 of each request gets a +12 logit     | ~1.4      | one dominant token              |
| recent   | N(0, 1); the newest token of each request gets +12    | ~1.4      | one dominant token that only    |
|          |                                                       |           | the request's last row sees     |
| shifted  | N(0, 1); every token -120, the newest +120            | ~1.4 + 5  | a running max started at 0, or  |
|          |                                                       | per row   | a merge or tile kept at the     |
|          |                                                       |           | first max (exp(240) overflows)  |
| heads    | N(0, 1), the last rope channel 1; q there c_h / σ,    | 1, head h | a max, lse or merge shift taken |
|          | c_h cycling over HEAD_OFFSETS (0, +120, -120, ...)    | shifted   | from, or reduced over, another  |
|          |                                                       | by c_h    | head (softmax ignores one shift |
|          |                                                       |           | shared by every head)           |
| coherent | 4 repeated rows of ±1.0625, q = ±0.296875 (fp8 ties)  | ~1        | rounding errors that add up     |
| near_max | N(0, 1), a few entries at s·(448, 464] (static s)     | 1         | saturation (torch's NaN trap)   |

fp8 scale modes (per tensor, q and KV alike):

- ``dynamic``: s = amax / fmt.max of the actual data (vLLM's runtime quantization);
- ``static``: s = 2^ceil(log2(8·std / fmt.max)), a power of two from the *distribution*, not the data (a checkpoint
  scale); near_max places its entries beyond fmt.max·s, so they saturate;
- ``unit``: s = 1 (vLLM's default ``k_scale``); with the coherent data every value is an fp8 tie.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from dataclasses import dataclass

import torch

from mla_ref.config import is_int
from mla_ref.decode import DecodeBatch, _fp32_positive, make_decode_batch
from mla_ref.fp8 import FORMATS, quantize

SM_SCALE_RANGE = (2.0**-16, 2.0**16)  # σ a Case takes (drawn: 0.072-0.22); DecodeBatch takes any finite σ > 0
SM_SCALE = 0.1352338  # DeepSeek-V3 σ = 192^-1/2 · mscale² (numerics.md §1.3)
NO_YARN_SM_SCALE = 192**-0.5  # the same model without YaRN's mscale² (a short-context config)
MINICPM3_SM_SCALE = 96**-0.5  # MiniCPM3: q·k head dim 64 + 32 (longrope: no mscale); its latent is 256, its rope 32
V2_LITE_SM_SCALE = 192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2  # DeepSeek-V2-Lite: mscale_all_dim 0.707
DISTRIBUTIONS = ("gauss1", "gauss4", "wide", "outlier", "sink", "recent", "coherent", "near_max", "shifted", "heads")
SCORE_STD = {"gauss4": 4.0, "wide": 32.0}  # the others: 1
SCALE_MODES = ("dynamic", "static", "unit", "kv_unit")
DTYPES = ("bf16", "fp8")  # what a campaign draws (--dtype)
CASE_DTYPES = (*DTYPES, "fp16")  # what a Case takes: fp16 q and cache too (the smoke prefix's dtype case)
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")  # a campaign's (--fp8-format)
CASE_FP8_FORMATS = (*FP8_FORMATS, "e5m2")  # a Case's: e5m2 caches too (vLLM's fp8_e5m2; the smoke prefix's)

OUTLIER_GAIN = 3000.0  # numerics.md §5.1: 2 outlier channels × 3000 leave ~36% of the rest subnormal
SINK_LOGIT = 12.0  # extra logit of the sink token (numerics.md §5.1)
SHIFT_LOGIT = 120.0  # shifted: every token at -120 (exp underflows in fp32 past -103), the newest at +120
HEAD_OFFSETS = (0.0, 120.0, -120.0, 60.0, -60.0)  # heads: head h's scores shifted by HEAD_OFFSETS[h % 5] (nats)
COHERENT_KV = 1.0625  # 1 + 2^-4: an e4m3 tie (between 1 and 1.125), exact in bf16
COHERENT_Q = 0.296875  # 19/64: an e4m3 tie (between 0.28125 and 0.3125), exact in bf16
NEAR_MAX_FRACTION = 1 / 256  # share of entries placed beyond fmt.max·s in the near_max distribution
NEAR_MAX = {"e4m3fn": (450.0, 452.0, 456.0, 460.0, 464.0), "e4m3fnuz": (242.0, 244.0, 246.0)}  # torch -> ±max
STD_RANGE = 8.0  # a static scale covers 8 standard deviations


@dataclass(frozen=True)
class Case:
    """A decode batch described by plain values; see the module docstring for distributions and scales.

    Attributes:
        seq_lens: KV tokens per request (0 = empty sequence).
        q_lens: query rows per request (> 1: MTP), same length as seq_lens.
        heads: query heads H.
        page_size: tokens per cache page.
        kv_lora_rank, rope_dim: L and R (DeepSeek-V3: 512, 64).
        q_dtype: "bf16", "fp16" or "fp8" (fp8 q needs fp8 KV; fp16 q and KV go together).
        kv_dtype: "bf16", "fp16" or "fp8".
        fp8_format: "e4m3fn", "e4m3fnuz" or "e5m2" (ignored for 16-bit KV).
        scale_mode: "dynamic", "static" or "unit" (ignored for bf16); "kv_unit": a cache scale of 1 with q's dynamic
            (vLLM's default k_scale 1.0 beside a dynamically quantized fp8 q).
        dist: data distribution, one of DISTRIBUTIONS.
        num_workers: persistent workers the kernel's plan uses (caps the KV splits of a request).
        seed: seed of the local torch.Generator every tensor comes from.
        sm_scale: the softmax scale σ (YaRN's mscale² included), DeepSeek-V3's SM_SCALE unless given; q is drawn so
            that the scores' std is the distribution's whatever σ is (but for ``coherent``, whose q is a fixed fp8
            tie: its score std scales with σ), so a kernel that ignores the batch's σ fails.
    """

    seq_lens: tuple[int, ...] = (64,)
    q_lens: tuple[int, ...] = (1,)
    heads: int = 16
    page_size: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    fp8_format: str = "e4m3fn"
    scale_mode: str = "dynamic"
    dist: str = "gauss1"
    num_workers: int = 4
    seed: int = 0
    sm_scale: float = SM_SCALE

    def __post_init__(self) -> None:
        if not self.seq_lens or any(not is_int(s) or s < 0 for s in self.seq_lens):
            raise ValueError(f"Case.seq_lens: expected a non-empty tuple of ints >= 0, got {self.seq_lens!r}")
        if len(self.q_lens) != len(self.seq_lens) or any(not is_int(n) or n < 1 for n in self.q_lens):
            n = len(self.seq_lens)
            raise ValueError(f"Case.q_lens: expected {n} ints >= 1 (one per request), got {self.q_lens!r}")
        for name in ("heads", "page_size", "kv_lora_rank", "rope_dim", "num_workers"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"Case.{name}: expected an int >= 1, got {value!r}")
        for name, allowed in (("q_dtype", CASE_DTYPES), ("kv_dtype", CASE_DTYPES), ("fp8_format", CASE_FP8_FORMATS),
                              ("scale_mode", SCALE_MODES), ("dist", DISTRIBUTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Case.{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.q_dtype == "fp8" and self.kv_dtype != "fp8":
            raise ValueError(f"Case.q_dtype: fp8 queries need kv_dtype='fp8', got kv_dtype={self.kv_dtype!r}")
        if (self.q_dtype == "fp16") != (self.kv_dtype == "fp16"):
            field = "q_dtype" if self.q_dtype == "fp16" else "kv_dtype"
            raise ValueError(f"Case.{field}: fp16 goes for q and the cache both (an fp16 model's), got q_dtype="
                             f"{self.q_dtype!r}, kv_dtype={self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.fp8_format == "e5m2" and self.dist == "near_max":
            raise ValueError("Case.dist: near_max places values past e4m3's max (NEAR_MAX), not e5m2's: give another "
                             "dist with fp8_format='e5m2'")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"Case.seed: expected an int in [0, 2^63), got {self.seed!r}")
        if not _fp32_positive(self.sm_scale) or not SM_SCALE_RANGE[0] <= self.sm_scale <= SM_SCALE_RANGE[1]:
            raise ValueError(f"Case.sm_scale: expected a float in [2^-16, 2^16] (q is drawn in proportion to 1/σ: "
                             f"a σ of 1e-40 gave an infinite q), got {self.sm_scale!r}")
        object.__setattr__(self, "sm_scale", float(self.sm_scale))  # 1 and 1.0: one case, one repro

    # ---- derived sizes ----------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def work(self) -> int:
        """Σ_b q_len_b · seq_len_b · H: (query row, head, KV token) triples, the cost of one oracle pass."""
        return self.heads * sum(n * s for n, s in zip(self.q_lens, self.seq_lens))

    def describe(self) -> str:
        """A short human label, e.g. ``fp8(e4m3fn,dynamic)/bf16q gauss4 H16 ps64 seq[1,2048] q[1,2] w4``."""
        dt = f"fp8({self.fp8_format},{self.scale_mode})/{self.q_dtype}q" if self.is_fp8 else self.kv_dtype
        seqs = ",".join(map(str, self.seq_lens))
        qs = ",".join(map(str, self.q_lens))
        sigma = "" if self.sm_scale == SM_SCALE else f" σ{self.sm_scale:.4g}"
        dims = "" if (self.kv_lora_rank, self.rope_dim) == (512, 64) else f" L{self.kv_lora_rank}R{self.rope_dim}"
        return (f"{dt} {self.dist} H{self.heads}{dims} ps{self.page_size} seq[{seqs}] q[{qs}] w{self.num_workers}"
                f"{sigma}")

    # ---- serialisation and replay -----------------------------------------------------------------------------
    def to_json(self) -> str:
        """Compact one-line JSON of every field (what ``--case`` takes)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        """Parse ``to_json`` output; fields left out take their defaults. ValueError on bad JSON or fields."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"Case JSON: expected a JSON object, got {text[:80]!r} ({e.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"Case JSON: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Case JSON: unknown fields {unknown}; expected a subset of {sorted(known)}")
        for name in ("seq_lens", "q_lens"):
            if name in data:
                if not isinstance(data[name], list):
                    raise ValueError(f"Case.{name}: expected a JSON list of ints, got {data[name]!r}")
                data[name] = tuple(data[name])
        return cls(**data)

    def repro(self, flags: str = "") -> str:
        """One shell line that replays this case alone: ``mla-verify --case '<json>' <flags>``."""
        return f"mla-verify --case {shlex.quote(self.to_json())}" + (f" {flags}" if flags else "")

    # ---- tensors ------------------------------------------------------------------------------------------------
    def materialize(self, device: torch.device | str = "cpu") -> tuple[DecodeBatch, DecodeBatch]:
        """Build (batch_kernel, batch_exact) on ``device``; both share block_table and page order."""
        g = torch.Generator().manual_seed(self.seed)
        q, kv = _draw(self, g)  # [T, H, D] fp32, B x [s_b, D] fp32
        wide = torch.float16 if self.kv_dtype == "fp16" else torch.bfloat16  # what the model computes in
        q, kv = q.to(wide), [k.to(wide) for k in kv]  # [T, H, D], B x [s_b, D]
        pages = torch.Generator().set_state(g.get_state())  # the same page order for the fp8 twin
        shape = dict(sm_scale=self.sm_scale, kv_lora_rank=self.kv_lora_rank, page_size=self.page_size,
                     q_lens=list(self.q_lens))
        exact = make_decode_batch(q, kv, generator=g, **shape)
        if not self.is_fp8:
            return exact.to(device), exact.to(device)
        # one per-tensor scale over every request's tokens (dynamic: their amax); only valid rows are quantized
        kv8, kv_scale = quantize(torch.cat(kv), self.fp8_format, scale=self._scale("kv"))  # [Σ s_b, D]
        q_scale = None
        if self.q_dtype == "fp8":
            q, q_scale = quantize(q, self.fp8_format, scale=self._scale("q"))  # [T, H, D]
            q_scale = float(q_scale)
        kernel = make_decode_batch(q, list(kv8.split(list(self.seq_lens))), generator=pages, q_scale=q_scale,
                                   kv_scale=float(kv_scale), **shape)
        return kernel.to(device), exact.to(device)

    def _scale(self, which: str) -> float | None:
        """The per-tensor scale of the scale mode (None = dynamic, quantize computes amax / fmt.max)."""
        if self.scale_mode == "dynamic" or (self.scale_mode == "kv_unit" and which == "q"):
            return None
        if self.scale_mode in ("unit", "kv_unit"):
            return 1.0
        return static_scale(self, which)


# ---- data -------------------------------------------------------------------------------------------------------


def q_std(case: Case) -> float:
    """Std of the generated q entries: score std = σ · sqrt(D) · q_std for unit-variance cache rows."""
    return SCORE_STD.get(case.dist, 1.0) / (case.sm_scale * math.sqrt(case.head_dim))


def static_scale(case: Case, which: str) -> float:
    """Power-of-two static scale covering STD_RANGE stds of the distribution of q or the cache (not of the data)."""
    if case.dist == "coherent":
        amax = COHERENT_Q if which == "q" else COHERENT_KV
    elif which == "q" and case.dist == "heads":  # the offsets' channel, c_h / σ, outgrows 8 stds of the rest
        amax = max(STD_RANGE * q_std(case), max(map(abs, HEAD_OFFSETS)) / case.sm_scale)
    elif which == "q":
        amax = STD_RANGE * q_std(case)
    else:
        amax = STD_RANGE * (OUTLIER_GAIN if case.dist == "outlier" else 1.0)
    return 2.0 ** math.ceil(math.log2(amax / FORMATS[case.fp8_format].max))


def _draw(case: Case, g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(q [T, H, D], per-request cache rows B x [s_b, D]) in fp32 for the case's distribution."""
    T, H, D, L = case.num_tokens, case.heads, case.head_dim, case.kv_lora_rank
    if case.dist == "coherent":
        rows = COHERENT_KV * _signs((4, D), g)  # [4, D] a few rows, repeated
        kv = [rows[torch.randint(0, 4, (s,), generator=g)] for s in case.seq_lens]  # B x [s_b, D]
        return COHERENT_Q * _signs((T, H, D), g), kv

    q = q_std(case) * torch.randn(T, H, D, generator=g)  # [T, H, D]
    kv = [torch.randn(s, D, generator=g) for s in case.seq_lens]  # B x [s_b, D]
    if case.dist == "outlier":
        ch = torch.randperm(L, generator=g)[:2]  # two latent channels
        for k in kv:
            k[:, ch] *= OUTLIER_GAIN
        q[..., ch] /= OUTLIER_GAIN  # keep their score contribution typical
    elif case.dist in ("sink", "recent", "shifted"):
        u = torch.randn(D, generator=g)
        u = u / u.norm()  # [D] unit direction
        q = q + u / case.sm_scale  # [T, H, D] σ <q, u> = 1 more score noise for every token ...
        j = 0 if case.dist == "sink" else -1  # the attention sink, or the newest token (only the last row sees it)
        lift = 2 * SHIFT_LOGIT if case.dist == "shifted" else SINK_LOGIT
        for k in kv:
            if case.dist == "shifted":  # softmax ignores a shift; a max started at 0, or kept from a first tile, not
                k -= SHIFT_LOGIT * u  # ... every token -120 (plus one constant per row and head, σ (-120) <q_row, u>)
            if k.shape[0]:
                k[j] += lift * u  # ... and +12 for token j (shifted: the newest at +120)
    elif case.dist == "heads":  # head h's scores all shifted by c_h: exp of another head's max overflows or flushes
        c = torch.tensor(HEAD_OFFSETS)[torch.arange(H) % len(HEAD_OFFSETS)]  # [H] nats
        q[..., -1] = c / case.sm_scale  # [T, H] the last rope channel: σ q k = c_h there ...
        for k in kv:
            k[:, -1] = 1.0  # ... for every token alike
    elif case.dist == "near_max" and case.is_fp8:
        fmt = case.fp8_format
        q = _place_near_max(q, static_scale(case, "q"), fmt, g) if case.q_dtype == "fp8" else q
        kv = [_place_near_max(k, static_scale(case, "kv"), fmt, g) for k in kv]
    return q, kv


def _signs(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random ±1.0 of the given shape."""
    return torch.randint(0, 2, shape, generator=g).float() * 2 - 1


def _place_near_max(x: torch.Tensor, scale: float, fmt: str, g: torch.Generator) -> torch.Tensor:
    """Set a few entries of x to ±scale·v with v beyond the fp8 max where torch's cast still gives ±max.

    v is drawn from NEAR_MAX[fmt]: (448, 464] for e4m3fn (above 464 torch 2.11 gives NaN), (240, 248) for e4m3fnuz.
    v is an even integer (exact in bf16 at this magnitude) and scale a power of two: the bf16 value is scale·v.
    """
    values = torch.tensor(NEAR_MAX[fmt])  # [k]
    n = max(1, round(x.numel() * NEAR_MAX_FRACTION)) if x.numel() else 0
    where = torch.randperm(x.numel(), generator=g)[:n]  # [n] flat positions
    v = values[torch.randint(0, len(values), (n,), generator=g)]  # [n]
    flat = x.flatten().clone()
    flat[where] = scale * v * _signs((n,), g)
    return flat.view_as(x)
