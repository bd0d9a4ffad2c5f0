"""vLLM's Triton MLA decode (`decode_attention_fwd`) as a timed peer for mla-bench: a benchmark peer only, not a
verifier backend (it gives NaN for a request of length 0 and takes q_len 1 only).

Where the code comes from (it is Apache-2.0 third-party code that this project does not ship, peers.md licensing):
1. an installed vLLM, `vllm.v1.attention.ops.triton_decode_attention`;
2. else the file named by $MLA_BENCH_VLLM_SRC: a copy of that module, e.g. unzipped from a vLLM wheel
   (`unzip vllm-*.whl vllm/v1/attention/ops/triton_decode_attention.py`). Such a file imports two vLLM names,
   `vllm.platforms.current_platform` (for `is_rocm()`) and `vllm.triton_utils` (`tl`, `triton`); the loader gives the
   module those two while it imports, and nothing else of vLLM.

How it is called: as vLLM's `TritonMLAImpl.forward_mqa` calls it for a decode batch of q_len 1: q [B, H, 576] in
bf16, the cache viewed as [pages, page_size, 1, 576] with V its first 512 columns, the block table as
`req_to_token`, fp32 split logits [B, H, splits, 513]; o [B, H, 512] in q's dtype and lse [B, H] (also in q's dtype,
natural log) preallocated (vLLM zero-fills both per call, which is not timed here). Which vLLM is read off the
function's parameters:
- with `is_mla` (vLLM 0.20 and later, e.g. 0.33: V read as the transposed K tile): `is_mla=True`, k_scale =
  v_scale = the cache's per-tensor scale (1.0 for bf16), and the split rule
  `min(next_pow2(max(1, max_seq_len // 512)), 2 * SMs)` (`_compute_num_kv_splits`, from vllm-project/vllm#33529);
- without (vLLM 0.19 and before, e.g. 0.15: K and V loaded separately): 4 splits, the fixed count before #33529; an
  fp8 cache only where the function takes `k_scale` (0.15's Triton MLA has no fp8 cache: "n/a").
$MLA_BENCH_VLLM_SPLITS overrides the split count: "rule" (the rule above, e.g. with 0.15's kernel, which reproduces
issue #5's vLLM numbers) or a positive integer. fp8 q is not a vLLM Triton input ("n/a").
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types

import torch

from mla_fast.triton_decode import num_sms
from mla_ref.decode import DecodeBatch, is_fp8

ENV_SRC = "MLA_BENCH_VLLM_SRC"
ENV_SPLITS = "MLA_BENCH_VLLM_SPLITS"
MODULE = "vllm.v1.attention.ops.triton_decode_attention"
MIN_WORK_PER_SPLIT = 512  # vLLM 0.33 triton_mla.py _MIN_WORK_PER_SPLIT
SPLIT_OCCUPANCY = 2  # vLLM 0.33 triton_mla.py _SPLIT_OCCUPANCY_MULTIPLIER
LEGACY_SPLITS = 4  # vLLM 0.15 triton_mla.py: num_kv_splits = 4 (before vllm-project/vllm#33529)


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM 0.33's split count for its Triton MLA decode (uniform over the batch)."""
    import triton

    return min(triton.next_power_of_2(max(1, max_seq_len // MIN_WORK_PER_SPLIT)), sm_count * SPLIT_OCCUPANCY)


def _load_file(path: str) -> types.ModuleType:
    """Import a copy of vLLM's triton_decode_attention.py, giving it the two vLLM names it imports."""
    import triton
    import triton.language as tl

    platform = types.SimpleNamespace(is_rocm=lambda: torch.version.hip is not None)
    stubs = {"vllm": types.ModuleType("vllm"), "vllm.platforms": types.ModuleType("vllm.platforms"),
             "vllm.triton_utils": types.ModuleType("vllm.triton_utils")}
    stubs["vllm.platforms"].current_platform = platform
    stubs["vllm.triton_utils"].tl, stubs["vllm.triton_utils"].triton = tl, triton
    saved = {name: sys.modules.get(name) for name in stubs}
    spec = importlib.util.spec_from_file_location("mla_bench_vllm_triton_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.update(stubs)
    try:
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def load_decode_attention_fwd():
    """vLLM's `decode_attention_fwd`: from vLLM if it imports, else from $MLA_BENCH_VLLM_SRC's file; a string saying
    why not when neither is there. ValueError when the variable names no file; a file that fails to import raises
    its own error."""
    try:
        return importlib.import_module(MODULE).decode_attention_fwd
    except Exception as e:  # vLLM absent, or present without what it needs on this machine
        installed = type(e).__name__
    path = os.environ.get(ENV_SRC)
    if not path:
        return f"not installed (no vllm: {installed}; or set ${ENV_SRC})"
    if not os.path.isfile(path):
        raise ValueError(f"${ENV_SRC} must name vLLM's triton_decode_attention.py, got {path!r} (no such file)")
    return _load_file(path).decode_attention_fwd


def _split_count(max_seq_len: int, sm_count: int, mla: bool) -> int:
    """The split count this vLLM would use (the rule with is_mla, else 4), or $MLA_BENCH_VLLM_SPLITS's."""
    override = os.environ.get(ENV_SPLITS, "")
    if override == "rule" or (not override and mla):
        return num_kv_splits(max_seq_len, sm_count)
    if not override:
        return LEGACY_SPLITS
    if not (override.isascii() and override.isdigit()) or int(override) < 1:  # str.isdigit takes '²' and '٣'
        raise ValueError(f"${ENV_SPLITS} must be 'rule' or a positive integer, got {override!r}")
    return int(override)


def vllm_inputs(batch: DecodeBatch, params=("is_mla", "k_scale", "v_scale")) -> dict:
    """decode_attention_fwd's arguments for a q_len-1 batch, outputs preallocated; `params`: the names the function
    takes among is_mla / k_scale / v_scale, which say how this vLLM calls it (see module docstring)."""
    if int(batch.q_lens.max()) != 1 or batch.q.shape[0] != batch.batch_size:
        raise ValueError("vllm_inputs needs q_len 1 for every request (mla-bench's batches)")
    B, H, L, dev = batch.batch_size, batch.num_heads, batch.kv_lora_rank, batch.device
    cache = batch.kv_cache.unsqueeze(2)  # [P, ps, 1, 576]
    mla = "is_mla" in params
    splits = _split_count(int(batch.seq_lens.max()), num_sms(dev), mla)
    args = {"q": batch.q, "k_buffer": cache, "v_buffer": cache[..., :L],  # V: [P, ps, 1, 512]
            "o": torch.empty(B, H, L, dtype=batch.q.dtype, device=dev),  # [B, H, 512]
            "lse": torch.empty(B, H, dtype=batch.q.dtype, device=dev),  # [B, H]
            "req_to_token": batch.block_table, "b_seq_len": batch.seq_lens,
            "attn_logits": torch.empty(B, H, splits, L + 1, dtype=torch.float32, device=dev),  # [B, H, S, 513]
            "num_kv_splits": splits, "sm_scale": batch.sm_scale, "page_size": batch.page_size}
    scale = torch.tensor(1.0 if batch.kv_scale is None else float(batch.kv_scale), dtype=torch.float32, device=dev)
    args.update({name: scale for name in ("k_scale", "v_scale") if name in params})
    if mla:
        args["is_mla"] = True
    return args


def vllm_fn(batch: DecodeBatch):
    """() -> vLLM's decode on preallocated buffers (fn.outputs = (o, lse), fn.num_kv_splits), or a reason string."""
    if batch.q.dtype not in (torch.bfloat16, torch.float16):
        return "n/a (bf16 q only)"
    decode_attention_fwd = load_decode_attention_fwd()
    if isinstance(decode_attention_fwd, str):
        return decode_attention_fwd
    params = tuple(inspect.signature(decode_attention_fwd).parameters)
    if is_fp8(batch.kv_cache.dtype) and "k_scale" not in params:
        return "n/a (this vLLM's Triton MLA has no fp8 cache)"
    args = vllm_inputs(batch, params)

    def fn():
        decode_attention_fwd(**args)

    fn()
    fn.outputs, fn.num_kv_splits = (args["o"], args["lse"]), args["num_kv_splits"]
    return fn
