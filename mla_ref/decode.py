"""The paged MLA decode contract and its fp64 oracle.

A decode kernel sees the *absorbed* MLA problem (numerics.md §1.2, §2): per query row t and head h

    s_j      = sm_scale · <q[t, h, :], K[j, :]>          K[j] = [c_kv_j (L) | k_pe_j (R)], one row of the cache
    out[t,h] = Σ_j softmax(s)_j · K[j, :L]               V is the latent itself: the first L channels of K
    lse[t,h] = ln Σ_j exp(s_j)                           natural log, sm_scale included

Conventions fixed here and used by every backend:

- ``sm_scale`` includes YaRN's mscale² (0.1352338 for DeepSeek-V3); nothing is rescaled behind the caller's back.
- Paging: token ``j`` of request ``b`` lives in ``kv_cache[block_table[b, j // page_size], j % page_size]``.
  Only the first ``ceil(seq_len / page_size)`` entries of a block-table row are read; the rest may hold garbage.
- MTP: the ``q_lens[b]`` query rows of request ``b`` are contiguous in ``q``; row ``r`` (0-based) sees the first
  ``max(0, seq_len - q_len + r + 1)`` tokens (the causal diagonal ``s_k - s_q``).
- A row that sees no token (an empty sequence, e.g. CUDA-graph padding) gives ``out = 0`` and ``lse = -inf``.
  (FlashMLA returns ``+inf``; its adapter converts.)
- fp8 inputs carry per-tensor dequantization scales: ``real = fp8_value · scale``.
- Layout: q, kv_cache and block_table may be strided views (vLLM's block table is the first rows of a wider
  persistent buffer). A kernel honours the strides or raises ValueError naming what it takes (the Triton kernels:
  a dense last dim); it never addresses a tensor by its shape alone (verify's ``layout`` check).
- Unused cache slots hold NaN in every batch this package builds. The oracle gathers only valid slots, so a
  NaN in its output means a NaN or an infinity in a valid input (an infinite score gives inf - inf in the
  softmax; `DecodeBatch.validate` does not read the values).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass

import torch

from mla_ref.config import is_int
from mla_ref.fp8 import widen

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, *FP8_DTYPES)
ORACLE_DTYPES = (torch.float64, torch.float32)  # what mla_decode_ref computes in: fp64 the oracle, fp32 a quick look
INVALID_PAGE = 2_147_480_000  # what unused block-table entries hold in built batches (as FlashMLA's tests do)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _fp32_positive(x) -> bool:
    """x is a python number (not a bool) that stays finite and > 0 when rounded to fp32."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    x32 = torch.tensor(float(x), dtype=torch.float64).float().item()  # 1e39 -> inf, 1e-46 -> 0
    return math.isfinite(x32) and x32 > 0


def _field_error(field: str, expectation: str, got: object) -> ValueError:
    return ValueError(f"DecodeBatch.{field}: expected {expectation}, got {got}")


@dataclass(frozen=True)
class DecodeBatch:
    """One paged MLA decode step, in the layout of vLLM's MLA backends. Frozen: a field is never rebound (``replace``
    gives another batch; the tensors themselves are shared and may be written in place, as a serving loop does).

    Attributes:
        q: [T, H, L+R] absorbed queries ``[q_nope · W_UK | q_pe]``; bf16, fp16, fp32, fp64 or fp8.
        kv_cache: [P, page_size, L+R] latent cache rows ``[c_kv | k_pe]``; same dtype family as ``q`` or fp8.
        block_table: [B, max_pages] int32 physical page ids.
        seq_lens: [B] int32 KV tokens per request (0 allowed).
        q_lens: [B] int32 query rows per request (default all 1); they must add up to T.
        sm_scale: softmax scale applied to ``<q, k>`` (YaRN mscale² included).
        kv_lora_rank: L, the latent width; V is ``kv_cache[..., :L]``.
        q_scale, kv_scale: per-tensor dequantization scales, required for fp8 inputs and only then.
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    _: KW_ONLY
    sm_scale: float
    kv_lora_rank: int
    q_lens: torch.Tensor | None = None
    q_scale: float | None = None
    kv_scale: float | None = None

    def __post_init__(self) -> None:
        if self.q_lens is None and isinstance(self.seq_lens, torch.Tensor):  # frozen: set once, here
            object.__setattr__(self, "q_lens", torch.ones_like(self.seq_lens))

    # ---- shape helpers -------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def rope_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def num_pages(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.q.dtype) or is_fp8(self.kv_cache.dtype)

    @property
    def qo_indptr(self) -> torch.Tensor:
        """[B+1] int32 offsets of each request's query rows in ``q``, computed on every access (cumsum, pad, cast:
        three kernels on a GPU, 8-9 us per captured call on an H200), so hoist it out of timed or graph-captured
        code (`mla_fast.triton_decode.TritonMLADecode` keeps its own copy)."""
        return torch.nn.functional.pad(torch.cumsum(self.q_lens, 0), (1, 0)).to(torch.int32)

    @property
    def pages_per_request(self) -> torch.Tensor:
        """[B] int32 pages each request uses: ceil(seq_len / page_size)."""
        return ((self.seq_lens.long() + self.page_size - 1) // self.page_size).to(torch.int32)  # int64: no wrap

    @property
    def used_entries(self) -> torch.Tensor:
        """[B, max_pages] bool: the block-table entries that hold the page of a valid token (entry i of request b
        while i < pages_per_request[b]); the others may hold garbage."""
        pages = torch.arange(self.block_table.shape[1], device=self.block_table.device)  # [max_pages]
        return pages[None, :] < self.pages_per_request[:, None]

    def to(self, device: torch.device | str) -> DecodeBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return DecodeBatch(**moved)

    def replace(self, **changes) -> DecodeBatch:
        return dataclasses.replace(self, **changes)

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> DecodeBatch:
        """Check every field; raise ``ValueError`` naming the first field that is wrong. Returns self."""
        q, kv = self.q, self.kv_cache
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise _field_error("q", "a 3-D tensor [T, H, L+R]", _describe(q))
        if q.dtype not in Q_DTYPES:
            raise _field_error("q", f"dtype in {[str(d) for d in Q_DTYPES]}", q.dtype)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 3:
            raise _field_error("kv_cache", "a 3-D tensor [P, page_size, L+R]", _describe(kv))
        if kv.dtype not in Q_DTYPES:
            raise _field_error("kv_cache", f"dtype in {[str(d) for d in Q_DTYPES]}", kv.dtype)
        if kv.shape[2] != q.shape[2]:
            raise _field_error("kv_cache", f"last dim equal to q's ({q.shape[2]})", tuple(kv.shape))
        if kv.shape[1] < 1:
            raise _field_error("kv_cache", "page_size >= 1", tuple(kv.shape))
        if q.shape[1] < 1:
            raise _field_error("q", "at least one head (shape [T, H >= 1, L+R])", tuple(q.shape))
        if not is_int(self.kv_lora_rank) or not 0 < self.kv_lora_rank <= q.shape[2]:
            raise _field_error("kv_lora_rank", f"an int in [1, {q.shape[2]}]", self.kv_lora_rank)
        for name in ("block_table", "seq_lens", "q_lens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
                raise _field_error(name, "an int32 tensor", _describe(t))
            if t.device != q.device:
                raise _field_error(name, f"a tensor on {q.device} (as q)", t.device)
        if kv.device != q.device:
            raise _field_error("kv_cache", f"a tensor on {q.device} (as q)", kv.device)
        if self.seq_lens.dim() != 1:
            raise _field_error("seq_lens", "a 1-D tensor [B]", tuple(self.seq_lens.shape))
        B = self.seq_lens.shape[0]
        if self.q_lens.shape != (B,):
            raise _field_error("q_lens", f"shape ({B},) like seq_lens", tuple(self.q_lens.shape))
        if self.block_table.dim() != 2 or self.block_table.shape[0] != B:
            raise _field_error("block_table", f"a 2-D tensor [{B}, max_pages]", tuple(self.block_table.shape))
        used = self.used_entries  # [B, max_pages]
        table = self.block_table.long()  # [B, max_pages] only the pages that valid tokens live on are checked
        seq, n = self.seq_lens.long(), self.q_lens.long()  # [B], [B]
        none = torch.zeros((), dtype=torch.int64, device=q.device)  # the reductions of an empty batch pass
        stats = torch.stack([  # one host sync for every value-dependent check
            seq.min() if B else none,
            n.min() if B else none + 1,
            n.sum(),
            seq.max() if B else none,
            torch.where(used, table, 0).min() if used.numel() else none,  # 0 when no page is used
            torch.where(used, table, -1).max() if used.numel() else none - 1,  # -1 when no page is used
        ]).tolist()
        seq_min, q_min, q_sum, seq_max, page_min, page_max = stats
        if seq_min < 0:
            raise _field_error("seq_lens", "values >= 0", self.seq_lens.tolist())
        if q_min < 1:
            raise _field_error("q_lens", "values >= 1", self.q_lens.tolist())
        if q_sum != q.shape[0]:
            raise _field_error("q_lens", f"a sum equal to q.shape[0] = {q.shape[0]}", q_sum)
        capacity = self.block_table.shape[1] * self.page_size
        if seq_max > capacity:
            raise _field_error(
                "seq_lens", f"values <= block_table capacity {capacity} (max_pages x page_size)", self.seq_lens.tolist()
            )
        if page_min < 0 or page_max >= kv.shape[0]:
            pages = self.block_table[used]  # the used entries, for the message
            raise _field_error("block_table", f"used entries in [0, {kv.shape[0]}) (kv_cache pages)", pages.tolist())
        return self.validate_scales()

    def validate_scales(self) -> DecodeBatch:
        """The scalar fields alone (sm_scale, q_scale, kv_scale), as `validate` checks them, reading no device
        tensor: for a step planned from host copies of the lengths. Returns self; ValueError naming the field."""
        q, kv = self.q, self.kv_cache
        if not _fp32_positive(self.sm_scale):
            raise _field_error("sm_scale", "a float, finite and > 0 in fp32 (kernels scale in fp32)",
                               _describe(self.sm_scale))
        for name, tensor in (("q_scale", q), ("kv_scale", kv)):
            scale = getattr(self, name)
            if is_fp8(tensor.dtype):
                if scale is None:
                    raise _field_error(name, f"a float scale because the input is {tensor.dtype}", None)
                if not _fp32_positive(scale):
                    raise _field_error(name, "a float, finite and > 0 in fp32 (kernels scale in fp32)",
                                       _describe(scale))
            elif scale is not None:
                raise _field_error(name, f"None because the input is {tensor.dtype}, not fp8", _describe(scale))
        score_scale = self.sm_scale * (self.q_scale or 1.0) * (self.kv_scale or 1.0) * math.log2(math.e)
        if not _fp32_positive(score_scale):  # the kernels fold it into one fp32 factor of the scores
            raise _field_error("sm_scale", "sm_scale x q_scale x kv_scale x log2(e) finite and > 0 in fp32",
                               f"{self.sm_scale} x {self.q_scale} x {self.kv_scale}")
        return self

    # ---- what the oracle sees ------------------------------------------------------------------------------
    def dequantized(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, L+R], kv_cache [P, page_size, L+R]) in ``dtype``, fp8 inputs multiplied by their scales."""
        kv = widen(self.kv_cache, dtype) * (self.kv_scale if is_fp8(self.kv_cache.dtype) else 1.0)  # [P, ps, L+R]
        return self.dequantized_q(dtype), kv

    def dequantized_q(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[T, H, L+R] queries in ``dtype``, fp8 multiplied by ``q_scale``."""
        return widen(self.q, dtype) * (self.q_scale if is_fp8(self.q.dtype) else 1.0)

    def token_slots(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages [s_b], slots [s_b]) int64 addresses of request b's tokens in kv_cache, valid tokens only."""
        j = torch.arange(int(self.seq_lens[b]), device=self.device)  # [s_b] token positions
        pages = self.block_table[b].long()[j // self.page_size]  # [s_b]
        return pages, j % self.page_size

    def token_addresses(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pages, slots, positions) [Σ seq_len] int64 of every valid token, request by request in order: the
        physical page that holds it, its slot in that page and its position in its request (``token_slots`` of
        every request at once). One host sync (the total)."""
        seq = self.seq_lens.long()  # [B]
        total = int(seq.sum())
        requests = torch.arange(self.batch_size, device=self.device)  # [B]
        request = torch.repeat_interleave(requests, seq, output_size=total)  # [N] owner of each token
        j = torch.arange(total, device=self.device) - (torch.cumsum(seq, 0) - seq)[request]  # [N] position
        return self.block_table.long()[request, j // self.page_size], j % self.page_size, j

    def request_kv(self, b: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[s_b, L+R] the valid cache rows of request b, dequantized to ``dtype``. Never touches unused slots."""
        pages, slots = self.token_slots(b)
        rows = self.kv_cache[pages, slots]  # [s_b, L+R] gather before any arithmetic
        return rows.to(dtype) * (self.kv_scale if is_fp8(self.kv_cache.dtype) else 1.0)

    def _grid(self, N: int, S: int) -> RequestGrid:
        """The batch's query rows on a padded [B, N] grid; N = max q_len and S = max seq_len, known on the host."""
        B = self.batch_size
        request = self.row_request()  # [T]
        r = torch.arange(self.num_tokens, device=self.device) - self.qo_indptr.long()[request]  # [T] row in request
        slot = request * N + r  # [T] flat grid position b·N + r
        visible = self.visible_tokens()  # [T]
        visible = visible.new_zeros(B * N).index_copy(0, slot, visible)  # [B·N] padding rows see nothing
        return RequestGrid(N, S, slot, visible.view(B, N))

    def buckets(self, waste: float = 1.25) -> list[Bucket]:
        """The requests in length buckets, each evaluated on a padded grid of its own; one host sync.

        A single padded grid does B x max seq_len x max q_len work, up to B times the true work when lengths
        differ (4096, 17, 0). Requests sorted by seq_len (stable) are grouped into consecutive runs: from the first
        request not yet in a bucket, the longest run whose padded work (members x max seq_len x max q_len) stays
        <= ``waste`` x its true work (Σ seq_len x q_len, an empty request counting 1). A batch that passes as a
        whole is one bucket, the batch itself (``Bucket.whole``). Per row, every result is the one of a single
        grid up to fp64 summation order. A loop over the buckets, not over the requests.
        """
        B, T = self.batch_size, self.num_tokens
        everything = torch.arange(B, device=self.device), torch.arange(T, device=self.device)  # [B], [T]
        if not B:
            return [Bucket(self, self._grid(0, 0), *everything, whole=True)]
        s, n = torch.stack([self.seq_lens, self.q_lens]).cpu().long()  # [B], [B] on the host: the one sync
        order = torch.argsort(s, stable=True)  # [B] requests by seq_len
        s, n = s[order], n[order]  # [B], [B] sorted
        work = (s * n).clamp(min=1).double()  # [B] true work, an empty request counts 1
        buckets, i = [], 0
        while i < B:
            members = torch.arange(1, B - i + 1, dtype=torch.float64)  # [B - i] size of the run i..j
            padded = members * s[i:] * n[i:].cummax(0).values  # [B - i] s ascending: s_j is the run's max
            fits = padded <= waste * work[i:].cumsum(0)  # [B - i] always True at j = i
            end = i + int(fits.nonzero()[-1]) + 1  # the longest run that fits
            N, S = int(n[i:end].max()), int(s[end - 1])
            if end - i == B:
                return [Bucket(self, self._grid(N, S), *everything, whole=True)]
            requests = order[i:end].sort().values.to(self.device)  # [b] in their original order
            sub, rows = self.subset(requests, int(n[i:end].sum()))
            buckets.append(Bucket(sub, sub._grid(N, S), requests, rows, whole=False))
            i = end
        return buckets

    def subset(self, requests: torch.Tensor, t: int) -> tuple[DecodeBatch, torch.Tensor]:
        """(the requests [b] as a batch of their own, rows [t] int64 of their query rows in q); t = their Σ q_len.
        Shares kv_cache; fields are not validated again."""
        n = self.q_lens.long()[requests]  # [b]
        first = self.qo_indptr.long()[requests] - (torch.cumsum(n, 0) - n)  # [b] q row minus sub-batch row
        rows = torch.repeat_interleave(first, n, output_size=t) + torch.arange(t, device=self.device)  # [t]
        sub = self.replace(q=self.q[rows], block_table=self.block_table[requests], seq_lens=self.seq_lens[requests],
                           q_lens=self.q_lens[requests])
        return sub, rows

    def padded_kv(self, S: int, dtype: torch.dtype = torch.float64, *, scaled: bool = True) -> torch.Tensor:
        """[B, S, L+R] every request's valid cache rows (``request_kv`` of each b), zero beyond its seq_len.

        ``scaled=False`` keeps fp8 codes unscaled (the values as stored, in ``dtype``). Only valid slots are read:
        padding positions gather page 0 slot 0 and are replaced by 0 before any arithmetic.
        """
        j = torch.arange(S, device=self.device)  # [S] token positions
        valid = j[None, :] < self.seq_lens[:, None]  # [B, S]
        pages = self.block_table.long().gather(1, (j // self.page_size)[None, :].expand(self.batch_size, -1))
        pages = torch.where(valid, pages, 0)  # [B, S] unused block-table entries may hold garbage
        rows = self.kv_cache[pages, torch.where(valid, j % self.page_size, 0)]  # [B, S, L+R] gather first
        rows = widen(rows, dtype).masked_fill_(~valid[..., None], 0.0)  # [B, S, L+R] NaN of unused slots dropped
        return rows.mul_(self.kv_scale) if scaled and is_fp8(self.kv_cache.dtype) else rows

    def visible_tokens(self) -> torch.Tensor:
        """[T] int64: how many KV tokens each query row sees, max(0, s - n + r + 1)."""
        request = self.row_request()  # [T]
        start = self.qo_indptr.long()[request]  # [T] first row of the row's request
        r = torch.arange(self.num_tokens, device=self.device) - start  # [T] row index inside its request
        s, n = self.seq_lens.long()[request], self.q_lens.long()[request]  # [T], [T]
        return (s - n + r + 1).clamp(min=0)

    def row_request(self) -> torch.Tensor:
        """[T] int64: the request each query row belongs to."""
        requests = torch.arange(self.batch_size, device=self.device)  # [B]
        return torch.repeat_interleave(requests, self.q_lens.long(), output_size=self.num_tokens)  # no host sync

    # ---- layout converters ---------------------------------------------------------------------------------
    def _kv_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr [B+1], kv_indices [Σ pages]) int32, CSR form of the used block-table entries."""
        npages = self.pages_per_request  # [B]
        kv_indptr = torch.nn.functional.pad(torch.cumsum(npages, 0), (1, 0)).to(torch.int32)  # [B+1]
        return kv_indptr, self.block_table[self.used_entries].to(torch.int32)  # row-major: request by request, in order

    def to_aiter(self) -> dict:
        """aiter ``mla_decode_fwd`` layout (aiter-contract.md §2): page ids in CSR form, kv_buffer [P, ps, 1, D]."""
        kv_indptr, kv_indices = self._kv_indices()
        npages = self.pages_per_request
        # aiter's kernels read a request's length as (pages - 1) x page_size + last: an empty request needs
        # last = page_size for 0 (vLLM pads it so), not 0 (-page_size)
        last = torch.where(npages > 0, self.seq_lens - (npages - 1) * self.page_size, self.page_size)  # [B]
        last = last.to(torch.int32)
        return {
            "q": self.q,  # [T, H, D]
            "kv_buffer": self.kv_cache.unsqueeze(2),  # [P, ps, 1, D], nhead_kv = 1
            "qo_indptr": self.qo_indptr,  # [B+1]
            "kv_indptr": kv_indptr,  # [B+1] in pages
            "kv_indices": kv_indices,  # [Σ pages]
            "kv_last_page_lens": last,  # [B] valid tokens in the last page (page_size for an empty sequence)
            "max_seqlen_q": int(self.q_lens.max()) if self.batch_size else 0,
            "page_size": self.page_size,
            "sm_scale": self.sm_scale,
            "q_scale": self.q_scale,
            "kv_scale": self.kv_scale,
        }

    def to_flashmla(self) -> dict:
        """FlashMLA layout (peers.md §4): q [B, s_q, H, D] (uniform q_len), k_cache [P, ps, 1, D], natural LSE."""
        if self.batch_size and int(self.q_lens.min()) != int(self.q_lens.max()):
            raise _field_error("q_lens", "uniform query lengths for FlashMLA's [B, s_q, H, D] layout", self.q_lens)
        s_q = int(self.q_lens[0]) if self.batch_size else 1
        return {
            "q": self.q.view(self.batch_size, s_q, self.num_heads, self.head_dim),  # [B, s_q, H, D]
            "k_cache": self.kv_cache.unsqueeze(2),  # [P, ps, 1, D]
            "block_table": self.block_table,  # [B, max_pages]
            "cache_seqlens": self.seq_lens,  # [B]
            "head_dim_v": self.kv_lora_rank,
            "softmax_scale": self.sm_scale,
            "causal": s_q > 1,
        }

    def to_flashinfer(self) -> dict:
        """FlashInfer ``BatchMLAPagedAttentionWrapper`` layout (peers.md §5): split nope/rope, CSR pages."""
        kv_indptr, kv_indices = self._kv_indices()
        L = self.kv_lora_rank
        return {
            "qo_indptr": self.qo_indptr,  # [B+1]
            "kv_indptr": kv_indptr,  # [B+1] in pages
            "kv_indices": kv_indices,  # [Σ pages]
            "kv_len_arr": self.seq_lens,  # [B]
            "q_nope": self.q[..., :L],  # [T, H, L]
            "q_pe": self.q[..., L:],  # [T, H, R]
            "ckv_cache": self.kv_cache[..., :L],  # [P, ps, L]
            "kpe_cache": self.kv_cache[..., L:],  # [P, ps, R]
            "page_size": self.page_size,
            "sm_scale": self.sm_scale,
        }


@dataclass(frozen=True)
class RequestGrid:
    """A batch's query rows on a padded [B, N] grid: row r of request b at flat position ``b·N + r``.

    Batched computations run over [B, N, H, S] (S = max seq_len) with padding rows and tokens masked out: a padding
    row sees no token, exactly like an empty row. ``pad`` / ``unpad`` move [T, ...] tensors on and off the grid.
    """

    N: int  # max q_len
    S: int  # max seq_len
    slot: torch.Tensor  # [T] int64 flat grid position of each query row
    visible: torch.Tensor  # [B, N] int64 tokens each grid row sees (0 for padding rows)

    @property
    def mask(self) -> torch.Tensor:
        """[B, N, S] bool: grid row (b, r) sees token j (the causal diagonal; all False on padding rows)."""
        return torch.arange(self.S, device=self.slot.device) < self.visible[..., None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, N, ...], zeros on padding rows."""
        B = self.visible.shape[0]
        return x.new_zeros(B * self.N, *x.shape[1:]).index_copy(0, self.slot, x).view(B, self.N, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] -> [T, ...]."""
        return x.flatten(0, 1)[self.slot]


@dataclass(frozen=True)
class Bucket:
    """Requests of similar length evaluated together (``DecodeBatch.buckets``): a batch of their own on its own grid.

    ``whole``: the bucket is the whole batch (``batch`` is it, requests and rows are aranges, nothing to gather).
    """

    batch: DecodeBatch  # the bucket's requests in their original order; kv_cache shared
    grid: RequestGrid  # batch's padded grid, N and S of this bucket
    requests: torch.Tensor  # [b] int64 the requests' ids in the whole batch
    rows: torch.Tensor  # [t] int64 where batch.q's rows sit in the whole batch's q
    _: KW_ONLY
    whole: bool

    def take(self, other: DecodeBatch) -> DecodeBatch:
        """The bucket's requests of ``other``, a batch with the same seq_lens and q_lens (e.g. the exact twin)."""
        return other if self.whole else other.subset(self.requests, self.rows.shape[0])[0]

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] tensor of the whole batch -> [t, ...] the bucket's rows."""
        return x if self.whole else x[self.rows]


def by_bucket(buckets: list[Bucket], fn) -> tuple[torch.Tensor, ...]:
    """Evaluate ``fn(bucket)`` -> a tuple of per-row tensors [t, ...] on each bucket and reassemble each as [T, ...]
    in q's row order. One whole bucket: fn's result as it is."""
    parts = [fn(bucket) for bucket in buckets]
    if len(buckets) == 1 and buckets[0].whole:
        return tuple(parts[0])
    rows = torch.cat([bucket.rows for bucket in buckets])  # [T] a permutation of the query rows
    joined = [torch.cat(xs) for xs in zip(*parts)]  # [T, ...] each, bucket by bucket
    return tuple(x.new_empty(x.shape).index_copy_(0, rows, x) for x in joined)  # [T, ...] in q's order


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return repr(x)


def make_decode_batch(
    q: torch.Tensor,
    kv_per_request: list[torch.Tensor],
    *,
    sm_scale: float,
    kv_lora_rank: int,
    page_size: int,
    generator: torch.Generator,
    q_lens: list[int] | torch.Tensor | None = None,
    extra_pages: int = 1,
    q_scale: float | None = None,
    kv_scale: float | None = None,
) -> DecodeBatch:
    """Page dense per-request KV rows into a cache with a random page order and NaN in every unused slot.

    Args:
        q: [T, H, L+R] queries (rows of request b contiguous).
        kv_per_request: B tensors [s_b, L+R] (s_b may be 0), all of one dtype (fp8 allowed).
        page_size: tokens per page.
        generator: local RNG for the page permutation.
        extra_pages: whole pages of NaN that no request uses (poison for out-of-range reads).
    Returns:
        A validated ``DecodeBatch``; unused block-table entries hold ``INVALID_PAGE``.
    """
    for name, value, least in (("page_size", page_size, 1), ("extra_pages", extra_pages, 0)):
        if not is_int(value) or value < least:
            raise ValueError(f"make_decode_batch.{name}: expected an int >= {least}, got {value!r}")
    if not isinstance(generator, torch.Generator):  # the global RNG would make the page order irreproducible
        raise ValueError(f"make_decode_batch.generator: expected a torch.Generator (a local RNG for the page order), "
                         f"got {type(generator).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"make_decode_batch.q: expected a tensor [T, H, L+R], got {_describe(q)}")
    device, D = q.device, q.shape[-1]
    kv_dtype = getattr(kv_per_request[0], "dtype", None) if kv_per_request else q.dtype
    for b, kv in enumerate(kv_per_request):
        if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[-1] != D or kv.dtype != kv_dtype:
            expected = f"[s, {D}] {kv_dtype}"
            raise ValueError(f"make_decode_batch.kv_per_request[{b}]: expected {expected}, got {_describe(kv)}")
    B = len(kv_per_request)
    seq_lens = [int(kv.shape[0]) for kv in kv_per_request]
    npages = [-(-s // page_size) for s in seq_lens]  # ceil
    total = sum(npages) + extra_pages
    perm = torch.randperm(total, generator=generator).to(device)  # physical page of each logical page
    nan = torch.full((total, page_size, D), float("nan"), dtype=torch.float32, device=device)
    kv_cache = nan.to(kv_dtype)  # [P, ps, D] NaN everywhere (fp8 NaN bit pattern for fp8 dtypes)
    block_table = torch.full((B, max(npages, default=0) or 1), INVALID_PAGE, dtype=torch.int32, device=device)
    if q_lens is not None:  # checked before the int32 cast, which would truncate floats and wrap large ints
        values = q_lens.tolist() if isinstance(q_lens, torch.Tensor) else list(q_lens)
        if any(not is_int(n) or not 1 <= n < 2**31 for n in values):
            raise _field_error("q_lens", "ints in [1, 2^31) (one per request)", values)
    q_lens_t = torch.as_tensor(q_lens if q_lens is not None else [1] * B, dtype=torch.int32, device=device)
    batch = DecodeBatch(q, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                        sm_scale=sm_scale, kv_lora_rank=kv_lora_rank, q_lens=q_lens_t, q_scale=q_scale,
                        kv_scale=kv_scale)  # filled in place below, then validated
    # logical pages run request by request, page by page: the row-major order of the used block-table entries
    block_table[batch.used_entries] = perm[: sum(npages)].to(torch.int32)  # [B, max_pages]
    if sum(seq_lens):
        pages, slots, _ = batch.token_addresses()  # [Σ s_b] each
        kv_cache[pages, slots] = torch.cat([kv.to(device) for kv in kv_per_request])  # [Σ s_b, D]
    return batch.validate()


def mla_decode_ref(batch: DecodeBatch, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: absorbed MLA decode over the paged cache, computed in ``dtype`` (fp64 by default; fp32 also
    taken, ``ORACLE_DTYPES``, anything else a ValueError).

    Requests in length buckets (``DecodeBatch.buckets``), each bucket's at once on its padded grid ([b, N] query rows,
    S tokens, masked): per row the same sums as a row-by-row loop, up to the summation order of the batched dot
    products (fp64 round-off).

    Returns:
        out: [T, H, L] in ``dtype``; lse: [T, H] natural log in ``dtype``. Rows that see no token: out 0, lse -inf.
    """
    if dtype not in ORACLE_DTYPES:
        raise ValueError(f"mla_decode_ref.dtype: expected one of {[str(d) for d in ORACLE_DTYPES]}, got {dtype!r}")
    batch.validate()
    return by_bucket(batch.buckets(), lambda bucket: _decode_grid(bucket.batch, bucket.grid, dtype))


def _decode_grid(batch: DecodeBatch, grid: RequestGrid, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode_ref`` of every request of ``batch`` on its padded ``grid``: (out [T, H, L], lse [T, H])."""
    L = batch.kv_lora_rank
    q = grid.pad(batch.dequantized_q(dtype))  # [B, N, H, D]
    K = batch.padded_kv(grid.S, dtype)  # [B, S, D] valid tokens, zero padding
    V = K[..., :L]  # [B, S, L] the latent is the value
    mask = grid.mask  # [B, N, S] causal diagonal s_k - s_q
    s = batch.sm_scale * torch.einsum("bnhd,bsd->bnhs", q, K)  # [B, N, H, S]
    s = s.masked_fill(~mask[:, :, None, :], -math.inf)  # [B, N, H, S]
    seen = mask.any(dim=-1)[..., None]  # [B, N, 1] rows that see at least one token
    m = torch.where(seen, s.amax(dim=-1) if grid.S else 0.0, 0.0)  # [B, N, H] row max (0 if empty)
    p = torch.exp(s - m[..., None])  # [B, N, H, S] unnormalised, exp(-inf) = 0
    l = p.sum(dim=-1)  # [B, N, H]
    out = _p_times_v(p, V, mask) / torch.where(seen, l, 1.0)[..., None]  # [B, N, H, L]
    lse = torch.where(seen, m + torch.log(l), -math.inf)  # [B, N, H]
    return grid.unpad(out), grid.unpad(lse)


def _p_times_v(p: torch.Tensor, V: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """P·V where a row reads only the tokens it sees: [B, N, H, S] x [B, S, L] -> [B, N, H, L].

    A matmul would give every row of a request 0·NaN = NaN from a non-finite latent value of a token that the row's
    causal mask hides (or, with none seen, out NaN instead of 0). So the finite values go through the einsum and each
    non-finite one (NaN or inf, rare: a probe or an overflow) is added to the rows that see its token only, weighted
    by their p (which may be 0 there: a token seen but underflowed still gives 0·NaN = NaN).
    """
    finite = torch.isfinite(V)  # [B, S, L]
    out = torch.einsum("bnhs,bsc->bnhc", p, V.where(finite, 0.0))  # [B, N, H, L]
    if bool(finite.all()):
        return out
    b, t, c = (~finite).nonzero(as_tuple=True)  # [k] each: the non-finite values' request, token, channel
    seen = mask[b, :, t][..., None]  # [k, N, 1] the rows that see each value's token
    add = torch.where(seen, p[b, :, :, t] * V[b, t, c][:, None, None], 0.0)  # [k, N, H]
    out.permute(0, 3, 1, 2).index_put_((b, c), add, accumulate=True)  # out[b, :, :, c] += add, in place
    return out


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of split-KV partials (numerics.md §3).

    Args:
        outs: [S, ..., L] per-split outputs, each normalised by its own softmax sum.
        lses: [S, ...] per-split natural-log LSEs; an empty split has lse = -inf (its out is ignored).
    Returns:
        (out [..., L], lse [...]): M = max_S L_S, L = M + ln Σ_S exp(L_S − M), O = Σ_S exp(L_S − L) O_S;
        all splits empty gives out 0, lse -inf. Only an empty split's out is ignored: a NaN in the out of a split
        that saw tokens gives NaN, however small its weight; a NaN lse gives NaN out and lse.
    Raises:
        ValueError naming outs or lses: not floating tensors, no split, shapes that are not [S, ..., L] and
        [S, ...] with the same leading dims, or an lse of +inf.
    """
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"merge_partials: {name} must be a floating tensor, got {_describe(t)}")
    if outs.dim() < 2 or outs.shape[0] < 1 or tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"merge_partials: outs must be [S >= 1, ..., L] and lses [S, ...] (outs' shape without L), "
                         f"got outs {tuple(outs.shape)} and lses {tuple(lses.shape)}")
    if bool(torch.isposinf(lses).any()):  # exp(+inf - +inf) = NaN would come back silently
        raise ValueError("merge_partials: lses must be finite or -inf (an empty split), got +inf (FlashMLA writes +inf "
                         "for rows without tokens: convert those to -inf first)")
    M = lses.amax(dim=0)  # [...]
    empty = torch.isneginf(M)  # [...] no split saw a token
    M_safe = torch.where(empty, 0.0, M)  # [...]
    w = torch.exp(lses - M_safe)  # [S, ...] exp(-inf) = 0 for empty splits
    total = w.sum(dim=0)  # [...]
    lse = torch.where(empty, -math.inf, M_safe + torch.log(total))  # [...]
    weights = torch.where(empty, 0.0, w / torch.where(empty, 1.0, total))  # [S, ...]
    safe_outs = torch.where(torch.isneginf(lses)[..., None], 0.0, outs)  # [S, ..., L] an empty split's out is never
    # read; one that saw tokens is, even where its weight underflows to 0 (0 x NaN = NaN)
    return (weights[..., None] * safe_outs).sum(dim=0), lse
