"""Exact fp8 formats and saturating quantize / dequantize, as the oracle sees them.

Formats (numerics.md §4; u = unit roundoff of round-to-nearest-even, eta = half the min subnormal):

| name      | E | M | bias | max   | min normal | min subnormal | u    | eta   | inf | -0  | NaN bytes       |
|-----------|---|---|------|-------|------------|---------------|------|-------|-----|-----|-----------------|
| e4m3fn    | 4 | 3 | 7    | 448   | 2^-6       | 2^-9          | 2^-4 | 2^-10 | no  | yes | 0x7F, 0xFF      |
| e4m3fnuz  | 4 | 3 | 8    | 240   | 2^-7       | 2^-10         | 2^-4 | 2^-11 | no  | no  | 0x80            |
| e5m2      | 5 | 2 | 15   | 57344 | 2^-14      | 2^-16         | 2^-3 | 2^-17 | yes | yes | 0x7D-7F, 0xFD-FF|
| e5m2fnuz  | 5 | 2 | 16   | 57344 | 2^-15      | 2^-17         | 2^-3 | 2^-18 | no  | no  | 0x80            |

Conventions:
- real = fp8 * scale; scales are fp32. Element error model (numerics.md §4), for a group with scale s:
  |x - dequantize(quantize(x))| <= u * |x| + eta * s whenever |x| <= max * s (no saturation).
- Quantization always saturates: (x / s).clamp(-max, max), then one round-to-nearest-even to the fp8 grid.
  Finite input never gives NaN; +-inf gives +-max; NaN stays NaN. (A plain torch `.to(fp8)` depends on the
  version and format: torch 2.11 gives NaN above 464 for e4m3fn; torch 2.13's CPU cast saturates e4m3fn, +-inf too,
  but gives NaN for e4m3fnuz beyond its max and +-inf for e5m2.)
- x / s is computed in fp64 and rounded to the fp8 grid by this module, not by torch's cast: torch (and ml_dtypes)
  convert fp64 -> fp8 through fp32, which double-rounds (1.0625 + 2^-40 -> 1.0 instead of 1.125). For inputs with a
  significand of at most 24 bits (fp32, bf16, fp16) and an fp32 scale, the fp64 quotient is never within 2^-53 of
  an fp8 tie unless it is the tie, so the result is the correctly rounded real quotient. fp64 inputs get one extra
  fp64 rounding of x / s first.
"""

import functools
import math
from dataclasses import dataclass

import torch

TILE = 128  # channels per scale for granularity="tile128" (DeepSeek fp8_ds_mla)
GRANULARITIES = ("tensor", "token", "tile128")


@dataclass(frozen=True)
class FP8Format:
    """One fp8 format: bit layout, range and the constants of its element error model.

    Attributes:
        name: "e4m3fn", "e4m3fnuz", "e5m2" or "e5m2fnuz".
        torch_dtype: the matching torch dtype.
        exponent_bits, mantissa_bits: field widths (sign bit not counted).
        bias: exponent bias.
        max: largest finite value.
        min_normal, min_subnormal: smallest positive normal / subnormal value.
        u: unit roundoff of round-to-nearest-even, 2^-(mantissa_bits + 1).
        eta: absolute error term in units of the scale, min_subnormal / 2.
        has_inf: whether the format encodes +-inf.
        has_negative_zero: whether -0 is encoded (fnuz formats map -0 to 0x00).
        nan_bits: every byte that decodes to NaN.
    """

    name: str
    torch_dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    u: float
    eta: float
    has_inf: bool
    has_negative_zero: bool
    nan_bits: tuple[int, ...]

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal: min_normal = 2^emin."""
        return 1 - self.bias


# fmt: off
_F = FP8Format
#     name        torch dtype            E  M  bias max      min_normal min_sub u      eta     inf    -0     NaN bytes
_TABLE = [
    _F("e4m3fn",   torch.float8_e4m3fn,   4, 3, 7,  448.0,   2**-6,  2**-9,  2**-4, 2**-10, False, True,  (0x7F, 0xFF)),
    _F("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8,  240.0,   2**-7,  2**-10, 2**-4, 2**-11, False, False, (0x80,)),
    _F("e5m2",     torch.float8_e5m2,     5, 2, 15, 57344.0, 2**-14, 2**-16, 2**-3, 2**-17, True,  True,
       (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)),
    _F("e5m2fnuz", torch.float8_e5m2fnuz, 5, 2, 16, 57344.0, 2**-15, 2**-17, 2**-3, 2**-18, False, False, (0x80,)),
]
# fmt: on
FORMATS: dict[str, FP8Format] = {f.name: f for f in _TABLE}
_FP8_DTYPES = frozenset(f.torch_dtype for f in _TABLE)

WIDE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # round_p's non-fp8 formats
# wider formats round_p can model: (mantissa_bits, emin, max); saturating like the fp8 formats
_WIDE_FORMATS = {
    "fp32": (23, -126, torch.finfo(torch.float32).max),
    "bf16": (7, -126, torch.finfo(torch.bfloat16).max),
    "fp16": (10, -14, torch.finfo(torch.float16).max),
}
_FP32_MIN_NORMAL = torch.finfo(torch.float32).tiny  # floor of a dynamic scale, 2^-126


def fp8_format(fmt: "str | torch.dtype | FP8Format") -> FP8Format:
    """Look up a format by name, torch dtype or FP8Format; ValueError lists the valid names otherwise."""
    if isinstance(fmt, FP8Format):
        return fmt
    for f in FORMATS.values():
        if fmt == f.name or fmt == f.torch_dtype:
            return f
    raise ValueError(f"fmt must be one of {sorted(FORMATS)} (or their torch dtypes), got {fmt!r}")


@functools.cache
def _code_values(fp8: torch.dtype, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] the value of each code of the fp8 dtype (indexed by its byte) in ``dtype``: torch's own conversion."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(fp8).to(dtype)


def widen(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``x.to(dtype)``: the same values, NaNs included; contiguous for fp8 x, which is read as its bytes through the
    format's table of 256 values (`_code_values`). On a CPU that is about 5x faster than torch 2.13's conversion of
    e4m3fn (2.2 vs 11.7 ms for 2.4 M values on one thread), the oracle's and the emulation's largest single cost in
    an fp8 campaign."""
    if x.dtype not in _FP8_DTYPES:
        return x.to(dtype)
    codes = x.reshape(-1).view(torch.uint8).int()  # [N] each value's byte
    return _code_values(x.dtype, dtype, x.device).index_select(0, codes).view(x.shape)


def _round_rne(y: torch.Tensor, mantissa_bits: int, emin: int, max_value: float) -> torch.Tensor:
    """Saturate fp64 y to [-max, max] and round once to nearest-even on the grid of a binary format."""
    y = y.clamp(-max_value, max_value)  # saturate; +-inf -> +-max, NaN stays NaN
    _, e = torch.frexp(y)  # |y| in [2^(e-1), 2^e)
    q = (e - 1).clamp(min=emin) - mantissa_bits  # exponent of the grid spacing at y (subnormals: 2^(emin-M))
    return torch.ldexp(torch.round(torch.ldexp(y, -q)), q)  # torch.round is half-to-even; both ldexp are exact


def _group_shape(x: torch.Tensor, granularity: str) -> tuple[int, ...]:
    """Shape of the scale tensor for x under granularity."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return ()
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim for granularity={granularity!r}, got {tuple(x.shape)}")
    n_groups = 1 if granularity == "token" else math.ceil(x.shape[-1] / TILE)
    return tuple(x.shape[:-1]) + (n_groups,)


def _expand(scale: torch.Tensor, granularity: str, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a scale of the group shape against x [..., D]."""
    if granularity == "tile128":
        return scale.repeat_interleave(TILE, dim=-1)[..., : x.shape[-1]]  # [..., ceil(D/128)] -> [..., D]
    return scale  # [] or [..., 1]


def _group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max |x| over each group, ignoring +-inf and NaN (they would poison the scale), in x.dtype."""
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))  # [..., D]
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())  # []
    if granularity == "token":
        return a.amax(dim=-1, keepdim=True)  # [..., 1]
    pad = -x.shape[-1] % TILE
    a = torch.nn.functional.pad(a, (0, pad))  # [..., n_tiles * 128]
    return a.unflatten(-1, (-1, TILE)).amax(dim=-1)  # [..., n_tiles]


def _static_scale(scale, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Validate a given scale (python number, or tensor of the group shape) and return it as fp32."""
    if isinstance(scale, torch.Tensor):
        if tuple(scale.shape) != shape or not scale.is_floating_point():
            raise ValueError(f"scale must be a float tensor of shape {shape}, got {scale.dtype} {tuple(scale.shape)}")
        s = scale.to(device=device, dtype=torch.float32)
    else:
        if not isinstance(scale, (int, float)):
            raise ValueError(f"scale must be None, a number or a tensor of shape {shape}, got {type(scale).__name__}")
        s = torch.full(shape, float(scale), dtype=torch.float64, device=device).float()  # 1e39 -> inf, rejected below
    if not bool(((s > 0) & torch.isfinite(s)).all()):
        raise ValueError(f"scale must be finite and > 0 after rounding to fp32, got {scale!r}")
    return s


def quantize(x: torch.Tensor, fmt="e4m3fn", granularity: str = "tensor", scale=None):
    """Quantize x to fp8 with saturation. Returns (x_fp8 [x.shape], scale fp32), real = x_fp8 * scale.

    Args:
        x: floating tensor [..., D] (any float dtype except fp8).
        fmt: fp8 format name, torch dtype or FP8Format.
        granularity: "tensor" (scale shape []), "token" (x.shape[:-1] + (1,)) or "tile128"
            (x.shape[:-1] + (ceil(D/128),), tile t = channels [128t, 128t + 128) of the last dim).
        scale: None for a dynamic scale, else a static scale: a python number, or a tensor of the group shape;
            it is rounded to fp32 and must then be finite and > 0.

    Dynamic recipe, per group:
        amax = max |x| over the finite elements       # +-inf and NaN excluded
        s = fp32(amax / fmt.max)                      # all-zero group: s = 1.0; floored at 2^-126 (normal fp32)
        y = fp64(x) / s                               # fp64 quotient
        y = y.clamp(-fmt.max, fmt.max)                # saturate: +-inf -> +-max, NaN stays NaN
        x_fp8 = rne(y).to(fmt)                        # one round-to-nearest-even, then an exact cast
    """
    f = fp8_format(fmt)
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise ValueError(f"x must be a non-fp8 floating tensor, got {x.dtype}")
    shape = _group_shape(x, granularity)
    if scale is None:
        amax = _group_amax(x, granularity).double()  # [groups]
        s = (amax / f.max).to(torch.float32)  # [groups]
        s = torch.where(amax == 0, torch.ones_like(s), s.clamp(min=_FP32_MIN_NORMAL))  # [groups]
        if not bool(torch.isfinite(s).all()):
            raise ValueError(f"x has amax {amax.max().item():.3e}: amax / {f.max} overflows an fp32 scale")
    else:
        s = _static_scale(scale, shape, x.device)  # [groups]
    y = x.double() / _expand(s, granularity, x).double()  # [..., D] fp64
    y = _round_rne(y, f.mantissa_bits, f.emin, f.max)  # [..., D] fp64, on the fp8 grid
    return y.to(f.torch_dtype), s


def dequantize(x_fp8: torch.Tensor, scale, granularity: str = "tensor", dtype: torch.dtype = torch.float64):
    """real = x_fp8 * scale, the product computed exactly in fp64 and rounded once to dtype.

    x_fp8: a tensor of an fp8 format (`FORMATS`). scale: python number (any granularity) or a tensor of the group
    shape of `quantize`, finite and > 0 after rounding to fp32 (as `quantize` requires of a static scale).
    """
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype not in _FP8_DTYPES:
        got = x_fp8.dtype if isinstance(x_fp8, torch.Tensor) else type(x_fp8).__name__
        raise ValueError(f"x_fp8 must be a tensor of an fp8 format {sorted(FORMATS)}, got {got}")
    shape = _group_shape(x_fp8, granularity)
    if isinstance(scale, torch.Tensor) and tuple(scale.shape) != shape:
        raise ValueError(f"scale must have shape {shape} for granularity={granularity!r}, got {tuple(scale.shape)}")
    s = _static_scale(scale, shape, x_fp8.device)  # [groups] fp32, finite and > 0
    return (widen(x_fp8) * _expand(s.double(), granularity, x_fp8)).to(dtype)  # [..., D]; fp8 x fp32 exact in fp64


def p_format_max(fmt=None) -> float:
    """The largest finite value of a `round_p` format (None = fp32); ValueError naming the formats otherwise."""
    fmt = "fp32" if fmt is None else fmt
    if fmt in _WIDE_FORMATS:
        return float(_WIDE_FORMATS[fmt][2])
    try:
        return float(fp8_format(fmt).max)
    except ValueError:
        raise ValueError(
            f"fmt must be None, one of {sorted(_WIDE_FORMATS)} or {sorted(FORMATS)}, got {fmt!r}"
        ) from None


def round_p(p: torch.Tensor, fmt=None, p_scale: float = 1.0) -> torch.Tensor:
    """Round softmax weights P as a kernel does before P.V; returns p's dtype.

    fmt: None or "fp32", "bf16", "fp16", or an fp8 format. The value is rne(p * p_scale) / p_scale, computed in
    fp64 with one saturating round-to-nearest-even to fmt (a single rounding even for fp64 p, unlike torch's
    fp64 -> bf16/fp8 casts through fp32). Unscaled e4m3fn flushes p <= 2^-10 to 0; p_scale = 256 moves that to
    2^-18 (numerics.md §5(f), eta_P). Exact in p's dtype when it is wider than fmt and p_scale is a power of two.
    """
    fmt = "fp32" if fmt is None else fmt
    max_value = p_format_max(fmt)  # ValueError for an unknown format
    if fmt in _WIDE_FORMATS:
        mantissa_bits, emin, _ = _WIDE_FORMATS[fmt]
    else:
        f = fp8_format(fmt)
        mantissa_bits, emin = f.mantissa_bits, f.emin
    if isinstance(p_scale, bool) or not isinstance(p_scale, (int, float)) or not (math.isfinite(p_scale)
                                                                                  and p_scale > 0):
        raise ValueError(f"p_scale must be a float, finite and > 0, got {p_scale!r}")
    y = _round_rne(p.double() * p_scale, mantissa_bits, emin, max_value)  # [...] fp64 on fmt's grid
    return (y / p_scale).to(p.dtype)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (fp64) rounded once, round-to-nearest-even and saturating, to the values of ``dtype`` (bf16, fp16, fp32 or
    an fp8 dtype; fp64 returns x): fp64 values that ``.to(dtype)`` then stores exactly (torch's own fp64 -> bf16 /
    fp8 casts round twice, through fp32, and do not always saturate). Symmetric: round_to(-x) = -round_to(x)."""
    if dtype == torch.float64:
        return x
    fmt = next((name for name, d in WIDE_DTYPES.items() if d == dtype), None)
    return round_p(x, fmt if fmt is not None else fp8_format(dtype).name)
