"""Comparison metrics: ULP distance in narrow formats, cosine difference, and one structured ``compare()``.

Conventions:
- ``expected`` is the fp64 oracle; ``actual`` is what a kernel returned (any float dtype; fp8 is upcast first,
  never compared with tolerances in its own dtype, style.md §A8).
- Errors are absolute, ``|actual - expected|`` in fp64; a bound is an elementwise fp64 tensor of the same units.
- Non-finite values: NaN, +inf and -inf positions must agree exactly (FlashMLA ``kernelkit``, style.md §A5);
  agreeing non-finite positions (e.g. ``lse = -inf`` of an empty row on both sides) count as error 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_ref.fp8 import fp8_format, round_p

NAN_ULP = torch.iinfo(torch.int64).max  # ulp_distance where exactly one side is NaN

# bit width -> signed integer dtype to view the bits as (sign bit set <=> negative integer)
_INT_VIEW = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def _bit_width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """int64 ordered integer of each value of x: order-preserving, +0 and -0 both 0.

    Bits are sign-magnitude; the magnitude bits of a non-negative float increase with its value, so
    ordered = +magnitude for sign 0 and -magnitude for sign 1.
    """
    w = _bit_width(x.dtype)
    bits = x.view(_INT_VIEW[w]).to(torch.int64)  # sign bit -> negative int (two's complement view)
    magnitude = bits & ((1 << (w - 1)) - 1)  # drop the sign bit
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise distance in units in the last place of ``dtype``: how many ``dtype`` values lie between.

    a and b (any float dtypes, fp8 included, broadcastable) are first rounded once to nearest-even on ``dtype``'s
    grid (`_to_grid`), so a correctly rounded result is 0 ulp from its fp64 reference. For fp8 targets, finite
    values are saturated to ±max first (the saturating cast kernels use, numerics.md §4); ±inf then becomes NaN in
    formats without inf.
    Bits are mapped to ordered integers (sign-magnitude -> two's-complement order) and subtracted, so the distance
    crosses zero naturally (+0 and -0 are the same point, the smallest subnormals are 1 ulp from 0) and ±inf is
    1 ulp beyond ±max.

    NaN: both NaN -> 0; exactly one NaN -> ``NAN_ULP`` (int64 max).

    Args:
        dtype: bf16, fp16, fp32, fp64 or an fp8 dtype (numpy's ``nulp_diff`` has no bf16 / fp8). fp64 distances
            of int64 max or more (opposite signs, near ±2 and beyond) saturate at NAN_ULP - 1, so that NAN_ULP
            only ever means one NaN.
    Returns:
        int64 tensor of the broadcast shape.
    """
    if not (dtype.is_floating_point and _bit_width(dtype) in _INT_VIEW):
        raise ValueError(f"dtype must be a float dtype of 8, 16, 32 or 64 bits, got {dtype}")
    a, b = torch.broadcast_tensors(a.double(), b.double())  # fp64 holds every input exactly (fp8: no isfinite)
    if _bit_width(dtype) == 8:
        top = torch.finfo(dtype).max
        a = torch.where(torch.isfinite(a), a.clamp(-top, top), a)  # saturate finite values
        b = torch.where(torch.isfinite(b), b.clamp(-top, top), b)
        if not fp8_format(dtype).has_inf:  # ±inf is NaN there (torch 2.13's CPU e4m3fn cast gives ±448)
            a = torch.where(torch.isinf(a), math.nan, a)
            b = torch.where(torch.isinf(b), math.nan, b)
    a_t, b_t = _to_grid(a, dtype), _to_grid(b, dtype)  # round once to the target grid
    oa, ob = _ordered(a_t), _ordered(b_t)  # [...] int64
    # |oa - ob| overflows int64 only for fp64 of opposite signs beyond ±2: saturate at NAN_ULP - 1
    overflow = (oa.sign() * ob.sign() < 0) & (oa.abs() >= NAN_ULP - ob.abs())  # NAN_ULP itself: the NaN mark
    dist = torch.where(overflow, NAN_ULP - 1, (oa - ob).abs())  # [...]
    nan_a, nan_b = torch.isnan(a_t), torch.isnan(b_t)
    dist = torch.where(nan_a & nan_b, 0, dist)
    return torch.where(nan_a ^ nan_b, NAN_ULP, dist)


def _to_grid(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 x rounded once to nearest-even in ``dtype``. torch's fp64 -> bf16 / fp16 / fp8 casts go through fp32 and
    round twice (1 + 2^-8 + 2^-40 -> 1 + 2^-8 in fp32, a bf16 tie -> 1.0 instead of 1 + 2^-7), so values in range are
    first snapped to the grid in fp64 (`mla_ref.fp8.round_p`, one rounding), which makes the cast exact. In range
    means below the overflow threshold max + ulp(max) / 2, where round-to-nearest-even gives ±max (from there on it
    gives ±inf); values at or beyond it and NaN take the cast (to ±inf, or NaN in fp8 formats without inf)."""
    if dtype in (torch.float64, torch.float32):  # fp64 -> fp32 is one rounding
        return x.to(dtype)
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, dtype)  # else an fp8 dtype
    info = torch.finfo(dtype)
    overflow = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2  # max + half its ulp, exact in fp64
    in_range = x.abs() < overflow  # [...] False for NaN and inf
    return torch.where(in_range, round_p(x, fmt), x).to(dtype)


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - 2 Σ a·b / Σ (a² + b²), in fp64 (numerics.md §6; FlashMLA / DeepGEMM ``calc_diff``).

    0 for identical tensors (and for two all-zero tensors), 1 for orthogonal ones of equal norm, 2 for b = -a.
    Non-finite inputs give NaN; ``compare()`` evaluates it over the positions where both sides are finite.
    """
    x, y = a.double().flatten(), b.double().flatten()  # [N]
    return _cos_diff_of_sums(float((x * x + y * y).sum()), float((x * y).sum()))


def _cos_diff_of_sums(denom: float, dot: float) -> float:
    """``cos_diff`` from its two sums: Σ (a² + b²) and Σ a·b (0 when both tensors are all zero)."""
    return 0.0 if denom == 0.0 else 1.0 - 2.0 * dot / denom


def _json_float(x: float) -> float | str:
    """A float JSON can hold (allow_nan=False): non-finite values become "nan", "inf" or "-inf"."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclass
class Report:
    """One comparison of ``actual`` against the fp64 ``expected`` under an elementwise bound.

    Attributes:
        name: what was compared ("out", "lse", ...).
        shape: shape of both tensors.
        max_abs, max_abs_index, max_abs_actual, max_abs_expected: the largest |actual - expected| (finite
            positions), where, and both values there.
        max_rel, max_rel_index: the largest |actual - expected| / |expected| (inf where expected = 0 ≠ actual).
        max_ulp: the largest ULP distance in ``out_dtype`` over finite positions (``ulp_distance``).
        cos_diff: cosine difference over the positions where both are finite.
        nonfinite_mask_ok: the NaN, +inf and -inf positions agree; nonfinite_detail says how they differ.
        err_over_bound_max, err_over_bound_median: max and median of err / bound over finite positions
            (err / 0 is inf for err > 0 and 0 for err = 0); NaN when no bound was given.
        worst_index: where err / bound is largest (() without a bound).
        violations: finite positions with err > bound.
        ok: the non-finite masks agree and err <= bound at every finite position.
        out_dtype: the format ULPs are counted in.
        nonfinite_count: positions where either side is NaN or ±inf.
        nonfinite_first_index: the first position whose NaN / +inf / -inf class differs (() when they agree).
    """

    name: str
    shape: tuple
    max_abs: float
    max_abs_index: tuple
    max_abs_actual: float
    max_abs_expected: float
    max_rel: float
    max_rel_index: tuple
    max_ulp: int
    cos_diff: float
    nonfinite_mask_ok: bool
    nonfinite_detail: str
    err_over_bound_max: float
    err_over_bound_median: float
    worst_index: tuple
    violations: int
    ok: bool
    out_dtype: str = "bfloat16"
    nonfinite_count: int = 0
    nonfinite_first_index: tuple = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        """Multi-line message in the style of torch ``assert_close`` / FlashMLA ``check_is_allclose``."""
        status = "OK" if self.ok else "NOT OK"
        lines = [f"{self.name}: {status} (shape {self.shape})"]
        if not math.isnan(self.err_over_bound_max):
            pct = 100.0 * self.violations / max(self.numel, 1)
            lines.append(f"  elements over the bound: {self.violations} / {self.numel} ({pct:.3g}%)")
            lines.append(
                f"  err / bound: max {self.err_over_bound_max:.4g} at index {self.worst_index},"
                f" median {self.err_over_bound_median:.4g}"
            )
        lines.append(
            f"  greatest absolute difference: {self.max_abs:.6g} at index {self.max_abs_index}"
            f" (actual {self.max_abs_actual:.8g}, expected {self.max_abs_expected:.8g})"
        )
        lines.append(f"  greatest relative difference: {self.max_rel:.6g} at index {self.max_rel_index}")
        lines.append(f"  max ulp ({self.out_dtype}): {self.max_ulp}, cos-diff: {self.cos_diff:.3e}")
        lines.append(f"  non-finite: {self.nonfinite_detail}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A dict that ``json.dumps(..., allow_nan=False)`` accepts: tuples as lists, non-finite floats as strings."""
        out = {}
        for key, value in self.__dict__.items():
            if isinstance(value, tuple):
                value = [int(v) for v in value]
            elif isinstance(value, float):
                value = _json_float(value)
            out[key] = value
        return out


def _index(flat: int, shape: tuple) -> tuple:
    """Multi-dimensional index of a flat (row-major) position, computed on the host."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


_NONFINITE = (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))


def _nonfinite_stats(a: torch.Tensor, e: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Device-side statistics of the NaN / +inf / -inf masks of a and e (flat fp64, non-empty).

    Returns (ints, floats): per class [differing positions, count in a, count in e, first differing flat position]
    and the non-finite count (ints); per class a and e at that first position (floats). No host sync.
    """
    ints, floats = [], []
    for _, test in _NONFINITE:
        ma, me = test(a), test(e)  # [N] bool
        diff = ma ^ me  # [N]
        first = diff.to(torch.uint8).argmax()  # [] first differing position (0 if none)
        ints += [diff.sum(), ma.sum(), me.sum(), first]
        floats += [a[first], e[first]]
    ints.append((~torch.isfinite(a) | ~torch.isfinite(e)).sum())
    return ints, floats


def _nonfinite_detail(counts: list[int], values: list[float], shape: tuple) -> tuple[bool, str, int, tuple]:
    """Host side of ``_nonfinite_stats``: (masks agree, detail, positions non-finite on either side, the first
    differing position over the classes: () when they agree)."""
    problems, firsts = [], []
    for k, (label, _) in enumerate(_NONFINITE):
        n_diff, n_a, n_e, first = counts[4 * k : 4 * k + 4]
        if n_diff:
            va, ve = values[2 * k : 2 * k + 2]
            firsts.append(first)
            problems.append(
                f"{label} at {n_diff} positions differ (actual {n_a}, expected {n_e};"
                f" first at {_index(first, shape)}: actual {va}, expected {ve})"
            )
    count = counts[4 * len(_NONFINITE)]
    if problems:
        return False, "; ".join(problems), count, _index(min(firsts), shape)
    return True, f"NaN/inf positions agree ({count} non-finite)", count, ()


def _lower_median(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """torch.median (the lower median) of x[keep] for x [N] >= 0 (inf allowed, no NaN), 0 when nothing is kept.

    The dropped positions become +inf, which order after every kept value, so the kept values' k-th smallest is the
    k-th smallest overall for k < n_keep. On a CPU, where reading n_keep syncs nothing, torch.kthvalue selects it
    (4-5x faster than a sort on 8.6 M values, one thread); elsewhere `_lower_median_by_sort`, without a host sync.
    """
    if x.device.type != "cpu":
        return _lower_median_by_sort(x, keep)
    n = int(keep.sum())
    return torch.where(keep, x, math.inf).kthvalue((n - 1) // 2 + 1).values if n else x.new_zeros(())


def _lower_median_by_sort(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`_lower_median` by a sort and a gather: no boolean indexing, no host sync."""
    n_keep = keep.sum()  # []
    ordered = torch.where(keep, x, math.inf).sort().values  # [N]
    mid = ((n_keep - 1).clamp(min=0) // 2).reshape(1)  # [1] the lower median's rank
    return torch.where(n_keep > 0, ordered.gather(0, mid)[0], 0.0)


def _to_host(ints: list[torch.Tensor], floats: list[torch.Tensor]) -> tuple[list[int], list[float]]:
    """One device-to-host transfer for every scalar: int64 and fp64 (bit-cast to int64) packed in one tensor."""
    packed = torch.cat([torch.stack(ints).to(torch.int64), torch.stack(floats).to(torch.float64).view(torch.int64)])
    packed = packed.cpu()  # the one sync
    return packed[: len(ints)].tolist(), packed[len(ints) :].view(torch.float64).tolist()


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    bound: torch.Tensor | float | None = None,
    *,
    name: str = "out",
    out_dtype: torch.dtype = torch.bfloat16,
) -> Report:
    """Compare ``actual`` with the fp64 ``expected`` elementwise, optionally under ``bound``.

    Every reduction runs on the tensors' device; the scalars come to the host in one transfer.

    Args:
        actual, expected: same shape, any float dtype (both go to fp64).
        bound: None (statistics only; ok then only means the non-finite masks agree), or a non-negative
            elementwise bound on |actual - expected| broadcastable to expected's shape.
        name: label used in the report.
        out_dtype: the format in which ``max_ulp`` is counted (the kernel's output dtype).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"actual: expected shape {tuple(expected.shape)} (as expected), got {tuple(actual.shape)}")
    shape = tuple(expected.shape)
    a, e = actual.double().flatten(), expected.to(actual.device).double().flatten()  # [N] fp64
    b = None
    if bound is not None:
        b = torch.as_tensor(bound, dtype=torch.float64, device=a.device)
        try:
            b = b.expand(shape).flatten()  # [N]
        except RuntimeError:
            raise ValueError(f"bound: expected a float or a tensor broadcastable to {shape}, got shape "
                             f"{tuple(b.shape)}") from None
    if a.numel() == 0:
        return _empty_report(name, shape, b, out_dtype)

    ints, floats = _nonfinite_stats(a, e)
    finite = torch.isfinite(a) & torch.isfinite(e)  # [N] positions with a numeric error
    err = torch.where(finite, (a - e).abs(), 0.0)  # [N] agreeing non-finite positions count 0
    rel = torch.where(e != 0, err / e.abs(), torch.where(err > 0, math.inf, 0.0))  # [N]
    rel = torch.where(finite, rel, 0.0)
    i_abs, i_rel = err.argmax(), rel.argmax()  # [], []
    ulp = torch.where(finite, ulp_distance(a, e, out_dtype), 0)  # [N] finite positions only (ulp >= 0)
    x, y = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)  # [N] cos_diff over finite positions
    ints += [i_abs, i_rel, ulp.max()]
    floats += [err[i_abs], a[i_abs], e[i_abs], rel[i_rel], (x * x + y * y).sum(), (x * y).sum()]
    if b is not None:
        ratio = torch.where(b > 0, err / b, torch.where(err > 0, math.inf, 0.0))  # [N] err / 0 -> inf or 0
        ratio = torch.where(finite, ratio, 0.0)  # [N]
        ints += [(torch.isnan(b) | (b < 0)).any(), (finite & (err > b)).sum(), ratio.argmax()]
        floats += [ratio.max(), _lower_median(ratio, finite)]
    counts, values = _to_host(ints, floats)

    mask_ok, detail, n_nonfinite, first_nonfinite = _nonfinite_detail(counts, values, shape)
    k, f = 4 * len(_NONFINITE) + 1, 2 * len(_NONFINITE)
    (i_abs, i_rel, max_ulp), (max_abs, at_a, at_e, max_rel, denom, dot) = counts[k : k + 3], values[f : f + 6]
    obm = obmed = math.nan
    worst: tuple = ()
    violations = 0
    if b is not None:
        bad_bound, violations, i_worst = counts[k + 3 : k + 6]
        if bad_bound:
            raise ValueError("bound: expected a non-negative, non-NaN elementwise bound, got NaN or negative values")
        obm, obmed = values[f + 6 : f + 8]
        worst = _index(i_worst, shape)
    return Report(
        name=name,
        shape=shape,
        max_abs=max_abs,
        max_abs_index=_index(i_abs, shape),
        max_abs_actual=at_a,
        max_abs_expected=at_e,
        max_rel=max_rel,
        max_rel_index=_index(i_rel, shape),
        max_ulp=max_ulp,
        cos_diff=_cos_diff_of_sums(denom, dot),  # cos_diff(a[finite], e[finite])
        nonfinite_mask_ok=mask_ok,
        nonfinite_detail=detail,
        err_over_bound_max=obm,
        err_over_bound_median=obmed,
        worst_index=worst,
        violations=violations,
        ok=mask_ok and violations == 0,
        out_dtype=str(out_dtype).removeprefix("torch."),
        nonfinite_count=n_nonfinite,
        nonfinite_first_index=first_nonfinite,
    )


def _empty_report(name: str, shape: tuple, b: torch.Tensor | None, out_dtype: torch.dtype) -> Report:
    """The report of two empty tensors: nothing differs; err / bound is NaN (no element) even with a bound."""
    zero = (0,) * len(shape) if shape else ()
    return Report(
        name=name,
        shape=shape,
        max_abs=0.0,
        max_abs_index=zero,
        max_abs_actual=0.0,
        max_abs_expected=0.0,
        max_rel=0.0,
        max_rel_index=zero,
        max_ulp=0,
        cos_diff=0.0,
        nonfinite_mask_ok=True,
        nonfinite_detail="NaN/inf positions agree (0 non-finite)",
        err_over_bound_max=math.nan,
        err_over_bound_median=math.nan,
        worst_index=(),
        violations=0,
        ok=True,
        out_dtype=str(out_dtype).removeprefix("torch."),
        nonfinite_count=0,
    )
