"""Adapter for ROCm/aiter's persistent ("PS") MLA decode: `mla_decode_fwd` + `get_mla_metadata_*_v1` (ROCm only).

What aiter expects is written up in docs/notes/aiter-contract.md; the rules this adapter follows:

- aiter's argument order changed between releases, so the installed API is read once with `inspect.signature`
  (`detect_api`), falling back to the package version where a compiled op hides its signature:
    * `mla_decode_fwd`: `page_size, nhead_kv` were inserted before `sm_scale` (>= v0.1.11); everything after
      `max_seqlen_q` therefore always goes by keyword.
    * `get_mla_metadata_v1`: `kv_last_page_lens` became the 3rd positional (ROCm/aiter #1950). The v0.1.7 Python stub
      names params 7-8 `work_indptr, work_info` while the compiled binding (what runs) takes `work_info_set,
      work_indptr`: the required arguments go positionally in *binding* order, the options by keyword.
    * `dtype_q`/`dtype_kv` (or `dtype_{q,kv}_{nope,rope}`) are always passed where they exist: omitted, the C++
      side assumes bf16 and builds wrong metadata for fp8 (vllm-project/vllm #46997).
    * `mla_reduce_v1` gained `max_seqlen_q` (v0.1.8) and `num_kv_splits` (later) before `final_output`.
- Layout: q [T, H, 576], kv_buffer [pages, page_size, 1, 576], o [T, H, 512] bf16 (zeroed), natural-log LSE [T, H].
  By default the cache is viewed with block size 1 (`kv_indices` = token slots), as vLLM's ROCM_AITER_MLA backend
  does (aiter #3095/#2996: bf16 PS at page_size > 1 was silently wrong); `native_pages=True` passes the batch's
  pages where the installed aiter takes a `page_size`.
- Heads: aiter needs a multiple of 16 query heads (it folds 32..128 into 16-head sub-batches itself, or runs them
  natively, and metadata and kernel decide alike only when given the dtypes). Fewer heads that divide 16 are
  repeated up to 16 (as vLLM #51647 pads) and the copies dropped from the output.
- fp8 follows the arch: e4m3fnuz on gfx942, e4m3fn on gfx950. An e4m3fn batch goes to gfx942 as the same bytes
  read as fnuz (value halves, so the scale doubles; the fn byte 0x80 = -0 becomes 0x00, fn NaN becomes 0x80).
  Scales are per-tensor fp32 one-element tensors. fp8 q needs fp8 KV (aiter has no fp8-q/bf16-KV kernel).
- Rows that see no token: aiter's reduce writes out = 0, lse = +inf; converted to this package's lse = -inf.
- `metadata="ours"` feeds aiter the six buffers of our `WorkPlan.to_aiter()` instead of its own metadata;
  `aiter_metadata`/`plan_metadata` + `diff_metadata` compare the two partitions.

`import aiter` raises RuntimeError without ROCm, so every import here is lazy and guarded with `except Exception`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, field

import torch

from mla_ref.decode import DecodeBatch, is_fp8

HEADS_PER_GROUP = 16  # aiter's MLA kernels work on 16-head groups (aiter-contract.md §2)
AITER_MIN_TAIL = 4  # fewest KV tokens of a split's last piece in our plans for aiter: its fp8 persistent kernels
# gave NaN on tails under 4 (ROCm/aiter #2106, #2128; aiter-contract.md §11), and its own metadata keeps a tail of at
# least max q_len tokens (tail_done_threshold, §5), so that no causal row sees nothing in a split

AITER_Q_LENS = (1, 2, 4)  # query lengths of aiter's persistent kernels (a8w8 at 1/2/4, a16w8 <= 4); a max_seqlen_q
# that is not a power of two gave identical rows for every query position (#2720), 8 wrong rows on gfx942 (#5679)
AITER_MAX_HEADS = 128  # aiter folds 32..128 heads into 16-head groups (#1450 capped the fold range)

BUFFER_NAMES = (  # aiter's keyword names in mla_decode_fwd; get_mla_metadata_info_v1 returns them in this order
    "work_meta_data",
    "work_indptr",
    "work_info_set",
    "reduce_indptr",
    "reduce_final_map",
    "reduce_partial_map",
)


# ---- importing aiter ---------------------------------------------------------------------------------------------
def import_aiter():
    """(aiter, aiter.mla) or raise ValueError with the reason (no ROCm, amd-aiter missing, the wrong `aiter`)."""
    try:
        aiter = importlib.import_module("aiter")
        mla = importlib.import_module("aiter.mla")
    except Exception as exc:  # `import aiter` raises RuntimeError without ROCm (aiter-contract.md §10)
        raise ValueError(f"aiter: cannot import amd-aiter ({type(exc).__name__}: {exc})") from exc
    if not hasattr(mla, "mla_decode_fwd") or not hasattr(aiter, "get_mla_metadata_v1"):
        raise ValueError(
            "aiter: the installed `aiter` has no mla_decode_fwd/get_mla_metadata_v1 (the unrelated PyPI package "
            "'aiter' also installs a module `aiter`; install 'amd-aiter' >= 0.1.7)"
        )
    return aiter, mla


def aiter_version() -> tuple[int, ...] | None:
    """Release of the installed amd-aiter as a tuple of ints (0, 1, 7), or None when unknown."""
    try:
        from importlib.metadata import version

        text = version("amd-aiter")
    except Exception:
        return None
    parts = []
    for token in text.split("+")[0].split("."):  # the release parts, before a local tag
        digits = re.match(r"\d+", token)  # "9rc1", a pre-release: the release it leads to
        if digits is None:  # "dev5", "post1": no release part
            break
        parts.append(int(digits.group()))
    return tuple(parts) or None


# ---- which API is installed --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AiterApi:
    """The parts of aiter's persistent-MLA API that changed between releases (aiter-contract.md §2-§4, §6).

    Attributes:
        decode_params: parameter names of `mla_decode_fwd` after `max_seqlen_q` (all passed by keyword).
        metadata_last_page_lens: `get_mla_metadata_v1` takes `kv_last_page_lens` as its 3rd positional (>= v0.1.11).
        metadata_options: keyword options `get_mla_metadata_v1` accepts (page_size, kv_granularity, dtype_q, ...).
        info_options: keyword options of `get_mla_metadata_info_v1` after `is_sparse`.
        reduce_max_seqlen_q: `mla_reduce_v1` takes `max_seqlen_q` before `final_output` (>= v0.1.8).
        reduce_num_kv_splits: `mla_reduce_v1` takes `num_kv_splits` after `max_seqlen_q` (HEAD, after v0.1.13).
        source: how each answer was found ("signature", "version x.y.z" or "default").
    """

    decode_params: tuple[str, ...]
    metadata_last_page_lens: bool
    metadata_options: tuple[str, ...]
    info_options: tuple[str, ...]
    reduce_max_seqlen_q: bool
    reduce_num_kv_splits: bool
    source: dict = field(default_factory=dict, compare=False)

    def decode_takes(self, name: str) -> bool:
        return name in self.decode_params


# Known releases, for compiled ops whose Python signature is hidden behind aiter's op wrappers.
_METADATA_V1_OPTIONS_0_1_7 = ("kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "topk")
_METADATA_V1_OPTIONS_0_1_8 = (
    *_METADATA_V1_OPTIONS_0_1_7, "max_split_per_batch", "intra_batch_mode", "dtype_q", "dtype_kv"
)  # fmt: skip
_METADATA_V1_OPTIONS_0_1_11 = ("page_size",) + _METADATA_V1_OPTIONS_0_1_8


def _param_names(fn) -> tuple[str, ...] | None:
    """Named parameters of fn, or None when inspect cannot see them (compiled op, *args/**kwargs wrapper)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return names or None


def detect_api(aiter=None, mla=None, version: tuple[int, ...] | None = None) -> AiterApi:
    """Read the installed aiter's signatures (imports aiter unless modules are given)."""
    if aiter is None or mla is None:
        aiter, mla = import_aiter()
    version = version if version is not None else aiter_version()
    vtag = "version " + ".".join(map(str, version)) if version else "default (version unknown: assuming HEAD)"
    newer = (lambda v: version is None or version >= v)  # noqa: E731  unknown version: assume the newest API
    source = {}

    names = _param_names(mla.mla_decode_fwd)
    if names is not None and "max_seqlen_q" in names:
        decode_params = names[names.index("max_seqlen_q") + 1 :]
        source["mla_decode_fwd"] = "signature"
    else:
        decode_params = ("page_size", "nhead_kv") if newer((0, 1, 11)) else ()
        decode_params += (
            "sm_scale", "logit_cap", "num_kv_splits", "num_kv_splits_indptr", "work_meta_data", "work_indptr",
            "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale",
        )  # fmt: skip
        decode_params += ("intra_batch_mode", "return_logits", "return_lse") if newer((0, 1, 10)) else ()
        source["mla_decode_fwd"] = vtag

    names = _param_names(aiter.get_mla_metadata_v1)
    if names is not None and "reduce_partial_map" in names:
        last_page_lens = "kv_last_page_lens" in names
        options = names[names.index("reduce_partial_map") + 1 :]
        source["get_mla_metadata_v1"] = "signature"
    else:
        last_page_lens = newer((0, 1, 11))
        options = (
            _METADATA_V1_OPTIONS_0_1_11
            if newer((0, 1, 11))
            else _METADATA_V1_OPTIONS_0_1_8
            if newer((0, 1, 8))
            else _METADATA_V1_OPTIONS_0_1_7
        )
        source["get_mla_metadata_v1"] = vtag

    names = _param_names(aiter.get_mla_metadata_info_v1)
    if names is not None and "is_sparse" in names:
        info_options = names[names.index("is_sparse") + 1 :]
        source["get_mla_metadata_info_v1"] = "signature"
    else:
        info_options = ("fast_mode", "num_kv_splits", "intra_batch_mode") if newer((0, 1, 11)) else ("fast_mode",)
        source["get_mla_metadata_info_v1"] = vtag

    names = _param_names(aiter.mla_reduce_v1) if hasattr(aiter, "mla_reduce_v1") else None
    if names is not None and "final_output" in names:
        reduce_max_seqlen_q, reduce_num_kv_splits = "max_seqlen_q" in names, "num_kv_splits" in names
        source["mla_reduce_v1"] = "signature"
    else:
        # num_kv_splits: after v0.1.13, aiter's last tag (v0.1.7-v0.1.13 have none: read in their source, ROCm/aiter)
        reduce_max_seqlen_q, reduce_num_kv_splits = newer((0, 1, 8)), newer((0, 1, 14))
        source["mla_reduce_v1"] = vtag

    return AiterApi(
        decode_params=tuple(decode_params),
        metadata_last_page_lens=last_page_lens,
        metadata_options=tuple(options),
        info_options=tuple(info_options),
        reduce_max_seqlen_q=reduce_max_seqlen_q,
        reduce_num_kv_splits=reduce_num_kv_splits,
        source=source,
    )


# ---- fp8 formats -------------------------------------------------------------------------------------------------
def fp8_dtype_for_arch(gfx: str) -> torch.dtype:
    """aiter's fp8 dtype on an AMD arch: e4m3fnuz on gfx942 (MI300/MI308/MI325), e4m3fn on gfx950 (MI350/MI355)."""
    arch = gfx.split(":")[0]
    if arch == "gfx942":
        return torch.float8_e4m3fnuz
    if arch == "gfx950":
        return torch.float8_e4m3fn
    raise ValueError(f"aiter: gfx must be gfx942 or gfx950 (the archs with MLA persistent kernels), got {gfx!r}")


def e4m3fn_to_fnuz(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """Re-express e4m3fn data as e4m3fnuz without rounding: (bytes read as fnuz, 2 * scale).

    Every fn byte read as fnuz is worth exactly half (bias 8 instead of 7, normals and subnormals alike), so doubling
    the scale keeps `fp8 * scale` bit-exact. Two bytes need remapping: 0x80 (fn -0, fnuz NaN) -> 0x00, and the fn NaNs
    0x7F/0xFF (fnuz +-240) -> 0x80 (fnuz NaN), so NaN padding stays NaN.
    """
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3fn_to_fnuz.x: expected float8_e4m3fn, got {x.dtype}")
    b = x.view(torch.uint8)  # same shape, raw bytes
    b = torch.where(b == 0x80, torch.zeros_like(b), b)  # -0 -> +0
    b = torch.where((b & 0x7F) == 0x7F, torch.full_like(b, 0x80), b)  # NaN -> fnuz NaN
    return b.view(torch.float8_e4m3fnuz), 2.0 * scale


def e4m3fnuz_to_fn(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """Re-express e4m3fnuz data as e4m3fn without rounding: (bytes read as fn, scale / 2).

    The inverse of `e4m3fn_to_fnuz`: every fnuz byte read as fn is worth twice as much. fnuz NaN 0x80 becomes fn NaN
    0x7F. fnuz +-240 (0x7F/0xFF) has no fn byte of twice its value (480 > 448): `Unsupported` (a ValueError), so that
    a backend converting fnuz inputs for an e4m3fn kernel declines such data (a dynamic scale puts amax at 240)
    instead of failing its contract.
    """
    from mla_fast.backends import Unsupported

    if x.dtype != torch.float8_e4m3fnuz:
        raise ValueError(f"e4m3fnuz_to_fn.x: expected float8_e4m3fnuz, got {x.dtype}")
    b = x.view(torch.uint8)
    if bool(((b & 0x7F) == 0x7F).any()):
        raise Unsupported("e4m3fnuz_to_fn.x: holds +-240 (byte 0x7F/0xFF), which e4m3fn cannot hold at half the "
                          "scale (this backend's kernel takes e4m3fn)")
    b = torch.where(b == 0x80, torch.full_like(b, 0x7F), b)  # NaN -> fn NaN
    return b.view(torch.float8_e4m3fn), scale / 2.0


def to_aiter_fp8(x: torch.Tensor, scale: float, target: torch.dtype) -> tuple[torch.Tensor, float]:
    """fp8 data + scale in aiter's format for this arch (bit-exact, see the two converters)."""
    if x.dtype == target:
        return x, scale
    if x.dtype == torch.float8_e4m3fn and target == torch.float8_e4m3fnuz:
        return e4m3fn_to_fnuz(x, scale)
    if x.dtype == torch.float8_e4m3fnuz and target == torch.float8_e4m3fn:
        return e4m3fnuz_to_fn(x, scale)
    raise ValueError(f"aiter: fp8 inputs must be e4m3fn or e4m3fnuz (aiter reads {target}), got {x.dtype}")


# ---- inputs in aiter's layout ------------------------------------------------------------------------------------
@dataclass
class AiterInputs:
    """Everything `mla_decode_fwd` reads, already in aiter's layout (aiter-contract.md §2).

    q: [T, Hk, 576]; kv_buffer: [pages, page_size, 1, 576]; qo_indptr/kv_indptr: int32 [B+1] (kv in pages);
    kv_indices: int32 [kv_indptr[-1]] page ids; kv_last_page_lens: int32 [B]; head_repeat: Hk / H (>= 1), the
    factor heads were repeated by to reach 16.
    """

    q: torch.Tensor
    kv_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    max_seqlen_q: int
    page_size: int
    sm_scale: float
    q_scale: torch.Tensor | None
    kv_scale: torch.Tensor | None
    head_repeat: int

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]


def token_slots(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [B+1], slots [Σ seq_lens]) int32: the cache at block size 1, `slot = page * page_size + offset`."""
    kv_indptr = torch.nn.functional.pad(torch.cumsum(batch.seq_lens.long(), 0), (1, 0))  # [B+1]
    pages, slots, _ = batch.token_addresses()  # [N], [N]
    return kv_indptr.to(torch.int32), (pages * batch.page_size + slots).to(torch.int32)


def aiter_refusal(batch: DecodeBatch) -> str | None:
    """Why aiter takes no such batch, in words that name no case value (mla-verify groups unsupported cases by
    them), or None: `aiter_inputs`' refusal of a valid batch, without its ", got ..." (a host sync)."""
    try:
        _check_scope(batch)
    except ValueError as e:
        return str(e).split(", got")[0]
    return None


def _check_scope(batch: DecodeBatch) -> None:
    """ValueError, naming the field and the case's value, for a valid batch aiter cannot run (`aiter_inputs`)."""
    if batch.batch_size and int(batch.q_lens.min()) != int(batch.q_lens.max()):
        raise ValueError(f"aiter.q_lens: expected one query length for all requests, got {batch.q_lens.tolist()}")
    if batch.batch_size and int(batch.q_lens[0]) not in AITER_Q_LENS:
        raise ValueError(f"aiter.q_lens: expected a query length in {AITER_Q_LENS} (other lengths: wrong rows, "
                         f"ROCm/aiter #2720, #5679), got {int(batch.q_lens[0])}")
    if batch.kv_lora_rank != 512 or batch.head_dim != 576:
        raise ValueError(f"aiter.kv_cache: expected L+R = 512+64, got {batch.kv_lora_rank}+{batch.rope_dim}")
    for name, t in (("q", batch.q), ("kv_cache", batch.kv_cache)):
        if t.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise ValueError(f"aiter.{name}: expected bf16 or fp8 e4m3 (aiter's MLA kernels take no other), got "
                             f"{t.dtype}")
    if is_fp8(batch.q.dtype) and not is_fp8(batch.kv_cache.dtype):
        raise ValueError("aiter.q: fp8 q needs an fp8 KV cache (aiter has no fp8-q/bf16-KV kernel)")
    if not batch.kv_cache.is_contiguous():  # reshape would copy the whole cache on every call, silently
        raise ValueError(f"aiter.kv_cache: expected a contiguous cache (the adapter hands aiter the cache itself as "
                         f"[pages, page_size, 1, 576], or as one token per page; whether aiter's kernels honour "
                         f"other strides is not verified here, without ROCm), got strides "
                         f"{tuple(batch.kv_cache.stride())}")
    H = batch.num_heads
    if H % HEADS_PER_GROUP and HEADS_PER_GROUP % H or H > AITER_MAX_HEADS:
        raise ValueError(f"aiter.q: expected a head count that is a multiple or a divisor of 16, at most "
                         f"{AITER_MAX_HEADS} (aiter folds 32..128 heads into 16-head groups, ROCm/aiter #1450), "
                         f"got {H}")


def aiter_inputs(batch: DecodeBatch, fp8_dtype: torch.dtype | None = None, native_pages: bool = False) -> AiterInputs:
    """Lay a DecodeBatch out for aiter: heads padded to 16, fp8 in the arch's format, block size 1 unless native_pages.

    Raises ValueError for what aiter cannot run: non-uniform query lengths or one outside AITER_Q_LENS, head counts
    that are neither a multiple of 16 nor a divisor of 16 or above AITER_MAX_HEADS, fp8 q with non-fp8 KV, q/KV
    dtypes other than bf16 and e4m3 (e4m3fn or e4m3fnuz, converted to the arch's), a cache that is not contiguous.
    """
    batch.validate()
    _check_scope(batch)
    H = batch.num_heads
    repeat = HEADS_PER_GROUP // H if H < HEADS_PER_GROUP else 1

    q, kv, q_scale, kv_scale = batch.q, batch.kv_cache, batch.q_scale, batch.kv_scale
    if is_fp8(q.dtype):
        q, q_scale = to_aiter_fp8(q, q_scale, fp8_dtype or q.dtype)
    if is_fp8(kv.dtype):
        kv, kv_scale = to_aiter_fp8(kv, kv_scale, fp8_dtype or kv.dtype)
    q = q.repeat_interleave(repeat, dim=1) if repeat > 1 else q  # [T, 16, D] copies of each head side by side

    if native_pages:
        layout = batch.to_aiter()
        kv_buffer = kv.unsqueeze(2)  # [P, ps, 1, D]
        kv_indptr, kv_indices, last = layout["kv_indptr"], layout["kv_indices"], layout["kv_last_page_lens"]
        page_size = batch.page_size
    else:  # vLLM's layout: one token per page
        kv_buffer = kv.reshape(-1, 1, 1, batch.head_dim)  # [P * ps, 1, 1, D] a view
        kv_indptr, kv_indices = token_slots(batch)
        last = torch.ones(batch.batch_size, dtype=torch.int32, device=batch.device)  # [B] vLLM: last_page_len = 1
        page_size = 1

    def scale_tensor(s):
        return None if s is None else torch.tensor([s], dtype=torch.float32, device=batch.device)  # [1] fp32

    return AiterInputs(
        q=q.contiguous(),
        kv_buffer=kv_buffer,
        qo_indptr=batch.qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_lens=last,
        max_seqlen_q=int(batch.q_lens.max()) if batch.batch_size else 1,
        page_size=page_size,
        sm_scale=float(batch.sm_scale),
        q_scale=scale_tensor(q_scale),
        kv_scale=scale_tensor(kv_scale),
        head_repeat=repeat,
    )


# ---- metadata ----------------------------------------------------------------------------------------------------
def aiter_metadata(inputs: AiterInputs, api: AiterApi, aiter, is_causal: bool = True) -> dict[str, torch.Tensor]:
    """aiter's own work partition: allocate with get_mla_metadata_info_v1, fill with get_mla_metadata_v1."""
    B = inputs.qo_indptr.shape[0] - 1
    device = inputs.q.device
    info_kw = {"fast_mode": True} if "fast_mode" in api.info_options else {}
    specs = aiter.get_mla_metadata_info_v1(
        B, inputs.max_seqlen_q, inputs.num_heads, inputs.q.dtype, inputs.kv_buffer.dtype, False, **info_kw
    )
    buffers = {n: torch.empty(shape, dtype=dtype, device=device) for n, (shape, dtype) in zip(BUFFER_NAMES, specs)}

    required = [inputs.qo_indptr, inputs.kv_indptr]
    if api.metadata_last_page_lens:
        required.append(inputs.kv_last_page_lens)
    required += [inputs.num_heads, 1, is_causal]  # num_heads_per_head_k, num_heads_k, is_causal
    required += [buffers["work_meta_data"], buffers["work_info_set"], buffers["work_indptr"]]  # binding order
    required += [buffers["reduce_indptr"], buffers["reduce_final_map"], buffers["reduce_partial_map"]]

    options = {
        "page_size": inputs.page_size,
        "kv_granularity": max(inputs.page_size, 16),  # what aiter's tests and vLLM pass
        "max_seqlen_qo": inputs.max_seqlen_q,
        "uni_seqlen_qo": inputs.max_seqlen_q,
        "fast_mode": True,
    }
    if "dtype_q_nope" in api.metadata_options:  # HEAD: NoPE/RoPE dtypes (one dtype for the whole 576 row here)
        options |= {f"dtype_{t}_{part}": d for t, d in (("q", inputs.q.dtype), ("kv", inputs.kv_buffer.dtype))
                    for part in ("nope", "rope")}  # fmt: skip
    elif "dtype_q" in api.metadata_options:
        options |= {"dtype_q": inputs.q.dtype, "dtype_kv": inputs.kv_buffer.dtype}
    if inputs.page_size != 1 and "page_size" not in api.metadata_options:
        raise ValueError(f"aiter.page_size: this aiter's metadata knows block size 1 only, got {inputs.page_size}")
    aiter.get_mla_metadata_v1(*required, **{k: v for k, v in options.items() if k in api.metadata_options})
    return buffers


def work_meta_data(work_indptr: torch.Tensor, work_info_set: torch.Tensor) -> torch.Tensor:
    """[2] uint64 device addresses of work_indptr and work_info_set: what the PS kernel reads its work through."""
    ptrs = torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()], dtype=torch.int64)  # addresses < 2^63
    return ptrs.view(torch.uint64).to(work_indptr.device)


def num_cus(device: torch.device) -> int:
    """Compute units of the device: aiter's persistent grid (304 on MI300X, 256 on MI355X)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_metadata(batch: DecodeBatch, inputs: AiterInputs, plan=None, num_workers: int | None = None) -> dict:
    """Our partition as aiter's six buffers: `plan_decode` then `WorkPlan.to_aiter(page_size)`.

    The default plan: 16 heads in one group, one worker per CU, block_n = 64 tokens (a multiple of aiter's page),
    no split piece shorter than max(AITER_MIN_TAIL, max q_len) tokens (as aiter's own metadata keeps its tails).
    aiter runs 16-head groups and folds more heads into sub-batches with its own metadata layout, so a plan for any
    other head count is refused rather than silently mis-read.
    """
    if inputs.num_heads != HEADS_PER_GROUP:
        raise ValueError(
            f"aiter.metadata='ours': expected 16 heads (aiter folds {inputs.num_heads} heads into 16-head "
            f"sub-batches with its own metadata layout), got {inputs.num_heads}"
        )
    if plan is None:
        from mla_fast.planner import plan_decode

        plan = plan_decode(
            batch.seq_lens, batch.q_lens, inputs.num_heads, num_workers or num_cus(batch.device), block_n=64,
            min_tail=min(max(AITER_MIN_TAIL, inputs.max_seqlen_q), 64),
        )
    buffers = plan.to_aiter(inputs.page_size)
    device = inputs.q.device
    buffers = {n: buffers[n].to(device=device, dtype=torch.int32).contiguous() for n in BUFFER_NAMES[1:]}
    buffers["work_meta_data"] = work_meta_data(buffers["work_indptr"], buffers["work_info_set"])
    return {n: buffers[n] for n in BUFFER_NAMES}


# ---- the decode call ---------------------------------------------------------------------------------------------
def decode_kwargs(inputs: AiterInputs, buffers: dict[str, torch.Tensor], api: AiterApi) -> dict:
    """Keyword arguments after `max_seqlen_q`, filtered by what the installed `mla_decode_fwd` takes."""
    kw = {
        "page_size": inputs.page_size,
        "nhead_kv": 1,
        "sm_scale": inputs.sm_scale,
        "work_meta_data": buffers["work_meta_data"],  # passing it selects persistent mode
        "work_indptr": buffers["work_indptr"],
        "work_info_set": buffers["work_info_set"],
        "reduce_indptr": buffers["reduce_indptr"],
        "reduce_final_map": buffers["reduce_final_map"],
        "reduce_partial_map": buffers["reduce_partial_map"],
        "return_lse": True,
        "causal": True,  # MTP rows: diagonal s_k - s_q; no effect at one query row
    }
    if inputs.q_scale is not None or inputs.kv_scale is not None:
        if not api.decode_takes("kv_scale"):
            raise ValueError("aiter: this mla_decode_fwd has no q_scale/kv_scale (vllm-project/vllm #30005)")
        kw |= {"q_scale": inputs.q_scale, "kv_scale": inputs.kv_scale}
    if inputs.page_size != 1 and not api.decode_takes("page_size"):
        raise ValueError(f"aiter.page_size: this mla_decode_fwd knows block size 1 only, got {inputs.page_size}")
    return {k: v for k, v in kw.items() if api.decode_takes(k)}


def aiter_decode(
    batch: DecodeBatch,
    *,
    metadata: str = "aiter",
    plan=None,
    native_pages: bool = False,
    num_workers: int | None = None,
    api: AiterApi | None = None,
    gfx: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run aiter's persistent MLA decode on a DecodeBatch.

    Args:
        metadata: "aiter" (its own get_mla_metadata_v1) or "ours" (our WorkPlan.to_aiter()).
        plan: a WorkPlan for metadata="ours" (planned here when None, with num_workers or one worker per CU).
        native_pages: pass the batch's page size instead of block size 1 (needs aiter >= v0.1.11).
        api, gfx: override detection (tests).
    Returns:
        out [T, H, 512] bf16, lse [T, H] fp32 natural log (NaN where aiter gave none); empty rows 0 / -inf.
    """
    if metadata not in ("aiter", "ours"):
        raise ValueError(f"aiter_decode.metadata: expected 'aiter' or 'ours', got {metadata!r}")
    aiter, mla = import_aiter()
    api = api or detect_api(aiter, mla)
    gfx = gfx or torch.cuda.get_device_properties(batch.device).gcnArchName
    inputs = aiter_inputs(batch, fp8_dtype_for_arch(gfx) if batch.is_fp8 else None, native_pages)
    if metadata == "aiter":
        buffers = aiter_metadata(inputs, api, aiter)
    else:
        buffers = plan_metadata(batch, inputs, plan, num_workers)

    T, Hk = inputs.q.shape[:2]
    o = torch.zeros(T, Hk, batch.kv_lora_rank, dtype=torch.bfloat16, device=batch.device)  # [T, Hk, 512] zeroed
    result = mla.mla_decode_fwd(
        inputs.q,
        inputs.kv_buffer,
        o,
        inputs.qo_indptr,
        inputs.kv_indptr,
        inputs.kv_indices,
        inputs.kv_last_page_lens,
        inputs.max_seqlen_q,
        **decode_kwargs(inputs, buffers, api),
    )
    lse = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    if not isinstance(lse, torch.Tensor) or lse.shape != (T, Hk):  # some kernels fill no LSE (contract §2)
        lse = torch.full((T, Hk), math.nan, dtype=torch.float32, device=batch.device)
    out, lse = o[:, :: inputs.head_repeat], lse[:, :: inputs.head_repeat].float()  # [T, H, 512], [T, H]
    empty = (batch.visible_tokens() == 0)[:, None] & torch.isposinf(lse)  # aiter's reduce: +inf for no token
    return out, torch.where(empty, -math.inf, lse)


# ---- aiter's reduce on given partials ----------------------------------------------------------------------------
def aiter_reduce(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    buffers: dict[str, torch.Tensor],
    out: torch.Tensor,
    max_seqlen_q: int = 1,
    api: AiterApi | None = None,
) -> torch.Tensor:
    """Merge split partials with aiter's `mla_reduce_v1` (fills and returns final lse [T, H] fp32).

    partial_out: [rows, 1, H, 512] fp32 per-split normalised; partial_lse: [rows, 1, H, 1] fp32; out: [T, H, 512].
    """
    aiter, mla = import_aiter()
    api = api or detect_api(aiter, mla)
    final_lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)  # [T, H]
    maps = [buffers["reduce_indptr"], buffers["reduce_final_map"], buffers["reduce_partial_map"]]
    args = [partial_out, partial_lse, *maps]
    if api.reduce_max_seqlen_q:
        args.append(max_seqlen_q)
    if api.reduce_num_kv_splits:
        args.append(0)  # 0 = let aiter choose
    aiter.mla_reduce_v1(*args, out, final_lse)
    return final_lse


# ---- comparing two partitions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AiterWork:
    """One row of work_info_set plus the persistent workgroup (CU) that runs it."""

    worker: int
    batch_idx: int
    partial_qo_loc: int
    qo_start: int
    qo_end: int
    kv_start: int
    kv_end: int


def parse_metadata(buffers: dict[str, torch.Tensor]) -> list[AiterWork]:
    """The works aiter's kernel would run, in worker order (reads only work_indptr's valid range)."""
    indptr = buffers["work_indptr"].cpu().tolist()
    info = buffers["work_info_set"].cpu()
    works = []
    for cid in range(len(indptr) - 1):
        for w in range(indptr[cid], indptr[cid + 1]):
            b, part, qs, qe, ks, ke = (int(x) for x in info[w, :6])
            works.append(AiterWork(cid, b, part, qs, qe, ks, ke))
    return works


def coverage_errors(works: list[AiterWork], qo_indptr: torch.Tensor, kv_indptr: torch.Tensor) -> list[str]:
    """Problems with a partition: every (request, query rows) must see its KV range [kv_indptr[b], kv_indptr[b+1])
    cut into disjoint, contiguous pieces, and a split (several pieces) must write partials, not `o`."""
    qo, kv = qo_indptr.cpu().tolist(), kv_indptr.cpu().tolist()
    pieces: dict[tuple[int, int, int], list[AiterWork]] = {}
    errors = []
    for w in works:
        if not 0 <= w.batch_idx < len(qo) - 1:
            errors.append(f"work {w}: batch_idx out of range")
            continue
        pieces.setdefault((w.batch_idx, w.qo_start, w.qo_end), []).append(w)
    for b in range(len(qo) - 1):
        tiles = sorted(key for key in pieces if key[0] == b)
        rows = [r for _, s, e in tiles for r in range(s, e)]
        if sorted(rows) != list(range(qo[b], qo[b + 1])):
            errors.append(f"request {b}: query rows covered {sorted(rows)}, expected [{qo[b]}, {qo[b + 1]})")
        for key in tiles:
            ws = sorted(pieces[key], key=lambda w: w.kv_start)
            cuts = [(w.kv_start, w.kv_end) for w in ws]
            ends = [kv[b]] + [e for _, e in cuts]
            if [s for s, _ in cuts] != ends[:-1] or ends[-1] != kv[b + 1] or any(e < s for s, e in cuts):
                errors.append(f"request {b} rows {key[1:]}: KV pieces {cuts} do not tile [{kv[b]}, {kv[b + 1]})")
            if len(ws) > 1 and any(w.partial_qo_loc < 0 for w in ws):
                errors.append(f"request {b} rows {key[1:]}: split into {len(ws)} pieces but one writes to o directly")
    return errors


@dataclass(frozen=True)
class MetadataDiff:
    """How two aiter partitions of one batch differ (see `diff_metadata`)."""

    identical: bool  # same works on the same workers in the same order
    same_pieces: bool  # same set of (request, rows, KV range) pieces, whatever the worker assignment
    ours_errors: tuple[str, ...]
    theirs_errors: tuple[str, ...]
    stats: dict  # name -> (ours, theirs)

    def summary(self) -> str:
        lines = [f"identical={self.identical} same_pieces={self.same_pieces}"]
        lines += [f"  {name}: ours={a} theirs={b}" for name, (a, b) in self.stats.items()]
        lines += [f"  ours: {e}" for e in self.ours_errors] + [f"  theirs: {e}" for e in self.theirs_errors]
        return "\n".join(lines)


def _stats(works: list[AiterWork]) -> dict:
    load: dict[int, int] = {}
    pieces: dict[tuple[int, int], int] = {}
    for w in works:
        load[w.worker] = load.get(w.worker, 0) + w.kv_end - w.kv_start
        pieces[(w.batch_idx, w.qo_start)] = pieces.get((w.batch_idx, w.qo_start), 0) + 1
    return {
        "works": len(works),
        "workers_used": len(load),
        "max_worker_kv": max(load.values(), default=0),
        "split_tiles": sum(n > 1 for n in pieces.values()),
        "max_splits": max(pieces.values(), default=0),
    }


def diff_metadata(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], qo_indptr: torch.Tensor, kv_indptr: torch.Tensor
) -> MetadataDiff:
    """Compare two sets of aiter buffers for the same batch: validity of each, piece sets, load statistics."""
    a, b = parse_metadata(ours), parse_metadata(theirs)

    def piece(w: AiterWork):
        return (w.batch_idx, w.qo_start, w.qo_end, w.kv_start, w.kv_end)

    sa, sb = _stats(a), _stats(b)
    return MetadataDiff(
        identical=[(w.worker, piece(w)) for w in a] == [(w.worker, piece(w)) for w in b],
        same_pieces=sorted(map(piece, a)) == sorted(map(piece, b)),
        ours_errors=tuple(coverage_errors(a, qo_indptr, kv_indptr)),
        theirs_errors=tuple(coverage_errors(b, qo_indptr, kv_indptr)),
        stats={k: (sa[k], sb[k]) for k in sa},
    )
