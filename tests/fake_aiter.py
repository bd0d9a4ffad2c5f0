"""A CPU stand-in for ROCm/aiter's persistent MLA API, to test `mla_fast.aiter_backend`'s argument marshalling.

`make_fake_aiter(version)` returns modules `aiter` and `aiter.mla` whose functions carry the parameter lists of
aiter v0.1.7 (tag v0.1.7) or HEAD (e4048607) exactly (aiter-contract.md §2-§4, §6; checked against the ROCm/aiter
source). Their bodies are this project's own:

- `get_mla_metadata_v1` binds its arguments the way the real op does. At v0.1.7 the Python stub names params 7-8
  `work_indptr, work_info` but the compiled binding reads them as `work_info_set, work_indptr`: the fake binds by the
  stub's names (what keywords would do) and then reads the values in binding order. It fills a deterministic
  split-KV partition (chunks of `2 * kv_granularity` pages, round-robin over `NUM_CU` workers).
- `mla_decode_fwd` checks shapes/dtypes/scalars, then replays `work_info_set` the way aiter's reference
  `torch_mla_extend_split_kv` does (global KV from `kv_start * page_size` up to `kv_offset` before the request's end,
  causal diagonal, fp8 read in its own format times the scales), in fp64, and merges partials like `mla_reduce_v1`
  (all-empty row: out 0, lse +inf). Output is rounded to o.dtype once.
- every call is recorded in `aiter.calls` as (name, {param: value}) under the *effective* (binding) names.
"""

from __future__ import annotations

import inspect
import math
import types

import torch

NUM_CU = 4  # persistent workgroups of the fake "GPU"

# ---- exact parameter lists ------------------------------------------------------------------------------------
DECODE_V0_1_7 = """q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale=None,
    logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None,
    work_info_set=None, reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
    kv_scale=None"""
DECODE_HEAD = """q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1,
    nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
    work_indptr=None, work_info_set=None, reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None,
    q_scale=None, kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False, g_kv_indptr=None,
    cp_world_size=1, cp_rank=0, causal=True"""
INFO_V0_1_7 = "batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True"
INFO_HEAD = """batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, fast_mode=True, num_kv_splits=32,
    intra_batch_mode=False, max_split_per_batch=-1"""
# v0.1.7: the Python stub (what inspect.signature and keywords see) and the pybind binding (what runs)
METADATA_V0_1_7_STUB = """seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k, num_heads_k, is_causal,
    work_metadata_ptrs, work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map,
    kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True, topk=-1"""
METADATA_V0_1_7_BINDING = """seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k, num_heads_k, is_causal,
    work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
    kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True, topk=-1"""
METADATA_HEAD = """seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
    is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
    page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True, topk=-1,
    max_split_per_batch=-1, intra_batch_mode=False, is_cp_round_robin=False, mla_version=1, dtype_q_nope=None,
    dtype_q_rope=None, dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None"""
REDUCE_V0_1_7 = """partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map, final_output,
    final_lse=None"""
REDUCE_HEAD = """partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map, max_seqlen_q,
    num_kv_splits, final_output, final_lse=None"""


def _signature(params: str) -> inspect.Signature:
    namespace: dict = {}
    exec(f"def f({params}): pass", namespace)  # noqa: S102  builds a signature from a fixed string above
    return inspect.signature(namespace["f"])


def _with_signature(sig: inspect.Signature, body):
    """A function whose inspect.signature is `sig`; calls body(bound_arguments_dict)."""

    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # TypeError on an unknown keyword or a missing argument, as Python would
        bound.apply_defaults()
        return body(dict(bound.arguments))

    fn.__signature__ = sig
    return fn


# ---- metadata -------------------------------------------------------------------------------------------------
def _info(args: dict) -> list:
    tiles = args["batch_size"] * max(1, args["max_seqlen_qo"])  # generous: one tile per query row
    max_work = 64 * tiles + NUM_CU
    return [
        ((2,), torch.uint64),
        ((NUM_CU + 1,), torch.int32),
        ((max_work, 8), torch.int32),
        ((tiles + 1,), torch.int32),
        ((tiles, 2), torch.int32),
        ((max_work,), torch.int32),
    ]


def _fill_metadata(a: dict) -> None:
    """A deterministic partition: pages of each request cut into chunks of 2 * kv_granularity, round-robin."""
    assert a["work_info_set"].dim() == 2 and a["work_info_set"].shape[1] == 8, "work_info_set must be [n, 8]"
    assert a["work_indptr"].dim() == 1 and a["work_indptr"].shape[0] == NUM_CU + 1, "work_indptr must be [cu + 1]"
    assert a["work_metadata_ptrs"].dtype == torch.uint64 and a["work_metadata_ptrs"].numel() == 2
    for name in ("seqlens_qo_indptr", "seqlens_kv_indptr"):
        assert a[name].dtype == torch.int32 and a[name].is_contiguous(), f"{name} must be contiguous int32"
    assert a["num_heads_k"] == 1 and a["num_heads_per_head_k"] % 16 == 0, "aiter: num_head_qo % 16 == 0"
    qo, kv = a["seqlens_qo_indptr"].tolist(), a["seqlens_kv_indptr"].tolist()
    page_size = a.get("page_size", 1)  # v0.1.7 knows block size 1 only
    last = a["kv_last_page_lens"].tolist() if "kv_last_page_lens" in a else [1] * (len(kv) - 1)
    chunk = 2 * a["kv_granularity"]
    per_worker: list[list[list[int]]] = [[] for _ in range(NUM_CU)]
    reduce_indptr, final_map, partial_map = [0], [], []
    next_partial, worker = 0, 0
    for b in range(len(qo) - 1):
        n_q = qo[b + 1] - qo[b]
        starts = list(range(kv[b], kv[b + 1], chunk)) or [kv[b]]
        split = len(starts) > 1
        for s in starts:
            e = min(s + chunk, kv[b + 1])
            partial = next_partial if split else -1
            if split:
                partial_map.append(next_partial)
                next_partial += n_q
            seq = (kv[b + 1] - kv[b] - 1) * page_size + last[b] if kv[b + 1] > kv[b] else 0
            offset = max(0, seq - (e - kv[b]) * page_size)  # tokens of the request after this piece
            per_worker[worker].append([b, partial, qo[b], qo[b + 1], s, e, offset, 0])
            worker = (worker + 1) % NUM_CU
        if split:
            reduce_indptr.append(len(partial_map))
            final_map.append([qo[b], qo[b + 1]])
    works = [w for ws in per_worker for w in ws]
    a["work_info_set"][: len(works)] = torch.tensor(works, dtype=torch.int32).reshape(-1, 8)
    counts = torch.tensor([0] + [len(ws) for ws in per_worker])
    a["work_indptr"][:] = torch.cumsum(counts, 0).to(torch.int32)
    a["reduce_indptr"][:] = reduce_indptr[-1]  # unused tail padded with the last value
    a["reduce_indptr"][: len(reduce_indptr)] = torch.tensor(reduce_indptr, dtype=torch.int32)
    if final_map:
        a["reduce_final_map"][: len(final_map)] = torch.tensor(final_map, dtype=torch.int32)
        a["reduce_partial_map"][: len(partial_map)] = torch.tensor(partial_map, dtype=torch.int32)
    a["work_metadata_ptrs"][:] = torch.tensor(
        [a["work_indptr"].data_ptr(), a["work_info_set"].data_ptr()], dtype=torch.int64
    ).view(torch.uint64)


# ---- decode ---------------------------------------------------------------------------------------------------
def _replay(a: dict, page_size: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (out [T, H, 512], lse [T, H]) from work_info_set, as aiter's torch_mla_extend_split_kv + reduce."""
    q, kv_buffer = a["q"], a["kv_buffer"]
    T, H, _ = q.shape
    L = a["o"].shape[2]
    qs = a["q_scale"].item() if a["q_scale"] is not None else 1.0
    ks = a["kv_scale"].item() if a["kv_scale"] is not None else 1.0
    qf = q.to(torch.float64) * qs  # [T, H, D] fp8 read in its own format
    kvc = kv_buffer.index_select(0, a["kv_indices"].long()).flatten(0, 1)[:, 0].to(torch.float64) * ks  # [pages*ps, D]
    qo, kv = a["qo_indptr"].tolist(), a["kv_indptr"].tolist()
    last = a["kv_last_page_lens"].tolist()
    out = torch.zeros(T, H, L, dtype=torch.float64)
    lse = torch.full((T, H), math.inf, dtype=torch.float64)  # rows no work writes stay +inf, as in aiter's reduce
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # partial row -> (out [H, L], lse [H])
    indptr, info = a["work_indptr"].tolist(), a["work_info_set"]
    for w in range(indptr[-1]):
        b, part, q0, q1, k0, _k1, k_off = info[w, :7].tolist()
        npages = kv[b + 1] - kv[b]
        seq = (npages - 1) * page_size + last[b]  # as aiter's kernels read it: an empty request needs last = ps
        assert seq >= 0, f"aiter would read request {b}'s length as {seq}: kv_last_page_lens must be page_size there"
        end = kv[b] * page_size + seq - k_off  # token end of this piece (kv_offset counts tokens)
        K = kvc[k0 * page_size : end]  # [n, D]
        s = a["sm_scale"] * torch.einsum("thd,nd->thn", qf[q0:q1], K)  # [t, H, n]
        if causal:
            row = torch.arange(q0, q1) - qo[b]  # [t] row inside the request
            pos = torch.arange(K.shape[0]) + (k0 - kv[b]) * page_size  # [n] token position inside the request
            see = pos[None, :] < (seq - (qo[b + 1] - qo[b]) + row + 1)[:, None]  # [t, n]
            s = s.masked_fill(~see[:, None, :], -math.inf)
        m = s.amax(-1, keepdim=True) if K.shape[0] else torch.full(s.shape[:2] + (1,), -math.inf, dtype=s.dtype)
        m = torch.where(torch.isfinite(m), m, 0.0)
        p = torch.exp(s - m)  # [t, H, n]
        l = p.sum(-1)  # [t, H]
        o = torch.einsum("thn,nc->thc", p, K[:, :L]) / l.clamp_min(1e-300)[..., None]  # [t, H, L]
        piece_lse = torch.where(l > 0, m[..., 0] + torch.log(l), -math.inf)  # [t, H]
        if part < 0:
            out[q0:q1] = torch.where((l > 0)[..., None], o, 0.0)
            lse[q0:q1] = torch.where(l > 0, piece_lse, math.inf)
        else:
            for i in range(q1 - q0):
                partial[part + i] = (o[i], piece_lse[i])
    rp = a["reduce_indptr"].tolist()
    for t in range(len(rp) - 1):
        if rp[t] == rp[t + 1]:
            continue
        q0, q1 = a["reduce_final_map"][t].tolist()
        locs = a["reduce_partial_map"][rp[t] : rp[t + 1]].tolist()
        rows = range(q1 - q0)
        outs = torch.stack([torch.stack([partial[loc + i][0] for i in rows]) for loc in locs])  # [S, t, H, L]
        lses = torch.stack([torch.stack([partial[loc + i][1] for i in rows]) for loc in locs])  # [S, t, H]
        M = lses.amax(0)
        total = torch.exp(lses - torch.where(torch.isfinite(M), M, 0.0)).sum(0)  # [t, H]
        merged = torch.where(total > 0, torch.where(torch.isfinite(M), M, 0.0) + torch.log(total), math.inf)
        w = torch.where(torch.isfinite(lses), torch.exp(lses - merged), 0.0)  # [S, t, H]
        out[q0:q1] = (w[..., None] * torch.nan_to_num(outs)).sum(0)
        lse[q0:q1] = merged
    return out, lse


def _decode(a: dict, version: str) -> tuple:
    q, kv_buffer, o = a["q"], a["kv_buffer"], a["o"]
    assert q.is_contiguous(), "aiter checks q.is_contiguous()"
    assert q.dtype in (torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn), f"q dtype {q.dtype}"
    assert kv_buffer.dim() == 4 and kv_buffer.shape[2] == 1, "kv_buffer must be [pages, page_size, 1, 576]"
    assert o.shape == (q.shape[0], q.shape[1], 512) and o.dtype == torch.bfloat16, "o must be [T, H, 512] bf16"
    assert isinstance(a["max_seqlen_q"], int) and a["max_seqlen_q"] >= 1, "max_seqlen_q must be an int >= 1"
    assert a["logit_cap"] <= 0, "logit_cap unsupported"
    assert isinstance(a["sm_scale"], float), f"sm_scale must be a float, got {a['sm_scale']!r}"
    assert a["work_meta_data"] is not None, "the adapter must run the persistent kernel"
    ptrs = a["work_meta_data"].view(torch.int64).tolist()
    assert ptrs == [a["work_indptr"].data_ptr(), a["work_info_set"].data_ptr()], "work_meta_data must point at both"
    if q.dtype != torch.bfloat16:
        assert a["q_scale"] is not None and a["kv_scale"] is not None, "fp8 q needs q_scale and kv_scale"
    for name in ("q_scale", "kv_scale"):
        if a[name] is not None:
            assert a[name].dtype == torch.float32 and a[name].numel() == 1, f"{name} must be one fp32 element"
    page_size = kv_buffer.shape[1]
    causal = True
    if version == "head":
        assert a["page_size"] == page_size and a["nhead_kv"] == 1, "page_size/nhead_kv must match kv_buffer"
        causal = a["causal"]
    out, lse = _replay(a, page_size, causal)
    o.copy_(out.to(o.dtype))
    logits = torch.empty(0, 1, q.shape[1], 512)  # fp32 scratch, not the result
    final_lse = lse.float()
    if version == "head" and not a["return_lse"]:
        final_lse = None
    return logits, final_lse


def make_fake_aiter(version: str, opaque_metadata: bool = False) -> types.ModuleType:
    """Modules `aiter` (with `.mla`) faking ROCm/aiter at version "0.1.7" or "head".

    opaque_metadata: give get_mla_metadata_v1 a (*args, **kwargs) signature, as aiter's compiled-op wrappers do.
    """
    if version not in ("0.1.7", "head"):
        raise ValueError(f"version must be '0.1.7' or 'head', got {version!r}")
    aiter = types.ModuleType("aiter")
    mla = types.ModuleType("aiter.mla")
    aiter.mla = mla
    aiter.calls = []

    def recorded(name, body):
        def run(a):
            aiter.calls.append((name, a))
            return body(a)

        return run

    head = version == "head"
    mla.mla_decode_fwd = _with_signature(
        _signature(DECODE_HEAD if head else DECODE_V0_1_7), recorded("mla_decode_fwd", lambda a: _decode(a, version))
    )
    aiter.get_mla_metadata_info_v1 = _with_signature(
        _signature(INFO_HEAD if head else INFO_V0_1_7), recorded("get_mla_metadata_info_v1", _info)
    )
    if head:
        aiter.get_mla_metadata_v1 = _with_signature(
            _signature(METADATA_HEAD), recorded("get_mla_metadata_v1", _fill_metadata)
        )
    else:
        stub, binding = _signature(METADATA_V0_1_7_STUB), _signature(METADATA_V0_1_7_BINDING)

        def as_binding(a: dict) -> dict:  # the op receives the stub's values by position
            return dict(zip(binding.parameters, (a[name] for name in stub.parameters)))

        fill = recorded("get_mla_metadata_v1", _fill_metadata)
        aiter.get_mla_metadata_v1 = _with_signature(stub, lambda a: fill(as_binding(a)))
    if opaque_metadata:
        inner = aiter.get_mla_metadata_v1

        def opaque(*args, **kwargs):
            return inner(*args, **kwargs)

        aiter.get_mla_metadata_v1 = opaque
    aiter.mla_reduce_v1 = _with_signature(
        _signature(REDUCE_HEAD if head else REDUCE_V0_1_7), recorded("mla_reduce_v1", lambda a: None)
    )
    return aiter
