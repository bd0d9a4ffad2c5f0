"""Persistent work planner for split-KV MLA decode.

A persistent decode kernel launches one program per worker (an SM or CU); each program walks its own list of
work items. A work item is one contiguous KV range of one *tile*, a tile being one (request, head group): all q rows
of the request (MTP rows share every KV block), the heads ``[g * head_group, (g + 1) * head_group)``, and the KV
tokens ``[kv_start, kv_end)`` of the request. A tile cut into several items is *split*: each piece writes a
per-split normalised output and its LSE to an fp32 workspace, and a reduce step merges the pieces in KV order.

Cost model (units: KV blocks of ``block_n`` tokens)
---------------------------------------------------
- A tile holds ``blocks = ceil(seq_len / block_n)`` blocks (0 for an empty sequence).
- A work item costs its blocks plus ``fixed_overhead`` (OVH) blocks: loading q, writing the output or a partial,
  and its share of the reduce. The cost does not depend on q_len (<= 4 rows ride along with every KV block).
- Lay the tiles end to end on a line, request-major then head group, each taking ``blocks + OVH`` units with its
  overhead first. The line has ``C = sum_t (blocks_t + OVH)`` units; cut it every ``Q = ceil(C / num_workers)``
  units (cut ``w`` at ``w * Q``). A cut inside a tile's blocks splits the tile there, on a block boundary, so
  every split point is a multiple of ``block_n`` tokens. A cut on a tile's start or inside its overhead moves back
  to the tile's start, so no piece is ever empty unless its sequence is. Worker ``w`` runs, in order, the items
  between cuts ``w`` and ``w + 1``.
- This is the greedy contiguous fill of FlashMLA and aiter (payload ``ceil(C / W) + OVH``, fill workers in order,
  split the request that does not fit), written with prefix sums and ``searchsorted`` instead of a sequential loop.

Balance guarantee. A worker's cost is the length of its line interval, plus OVH if it starts inside a tile (that
continuation piece pays an overhead the line did not count). If its first cut was moved back, it moved by at most
OVH units and the worker starts on a tile boundary. Either way::

    max_w cost_w <= Q + OVH = ceil(C / W) + OVH < mean_w cost_w + 1 + OVH      (mean_w cost_w >= C / W)

i.e. the busiest worker exceeds the mean by less than one block plus one fixed overhead.

Split cap ``max_splits = m`` (pieces per tile). The cuts inside a tile of ``b`` blocks sit strictly between its
block ends, so there are at most ``ceil((b - 1) / Q)`` of them. For ``m >= 2`` the planner raises the stride to
``Q = max(ceil(C / W), ceil((b_max - 1) / (m - 1)))``, which keeps every tile within ``m`` pieces, and the bound
``max cost <= Q + OVH`` holds with that Q (the optimum is at least ``max(C / W, b_max / m)``). For ``m = 1`` no
cut splits a tile: each moves back to its tile's start, and ``max cost <= ceil(C / W) + max_t (blocks_t + OVH) - 1``.

Three candidate plans. Cutting tiles is what balances few long requests over many workers, but the line's cuts
fall wherever the stride puts them, so when there are about as many tiles as workers they can split almost every
tile near its end (tiles slightly longer than the stride Q) for no gain: each piece pays an overhead and a partial
write, and the tile needs a reduce. The planner makes three plans and returns the one whose busiest worker costs
least, ties going to fewer partial rows (less reduce work); the balance guarantee above holds for it.

- the *line* plan above;
- the *unsplit* plan: whole tiles, contiguous, with the least busiest worker over all such partitions (one tile
  per worker when there are at most W; else the least cost the greedy fill fits in W workers, searched up from
  ``max(longest tile, ceil(C / W))``), tried only when that lower bound could beat the line plan's key. Cuts at
  a fixed stride moved back to tile starts, the line's with ``max_splits = 1``, can cost a long tile more: tiles
  of 1, 4, 6, 4, 8, 8 blocks on 3 workers cost 16 that way and 12 partitioned;
- the *even* plan, when there are no more tiles than workers: one item per worker, tile t cut into
  ``k_t = ceil(blocks_t / P)`` near-equal pieces (at most ``max_splits``) for the least piece length ``P`` with
  ``sum_t k_t <= W``; its busiest worker costs ``max_t ceil(blocks_t / k_t) + OVH`` (``<= P + OVH`` without a
  cap). Tiles of no cost (empty, with ``OVH = 0``) may share a worker.

On 132 workers (h = 16, one head group), measured on one H200 with the Triton kernel (bf16, µs, same run):

- b = 128 requests of 4096 tokens: line plan max 72 blocks with every request split, unsplit 69 blocks and no
  reduce: 161.5 vs 171.0 µs.
- b = 64 of 4096: line max 39 blocks (186 items, 2-3 pieces per request), even 37 (2 pieces each, 128 items):
  93.0 vs 98.4 µs. b = 32 of 4096: 59.1 vs 60.7 µs; b = 1 of 8192: 18.6 vs 20.1 µs (128 vs 65 pieces); 32 of
  4096 at 128 heads (66 workers): 145.8 vs 156.4 µs.

Fixed splits (``split_tokens``), for batch-invariant decoding. Every plan above cuts a request where the whole
batch puts the cuts, so a request's pieces, and with them the bits of its merged output, change with the other
requests. With ``split_tokens = S`` every tile is cut at each multiple of S tokens instead (``ceil(s / S)``
pieces, a request of at most S tokens whole), whatever else the batch holds; the items, in line order, go to the
workers contiguously with the least busiest worker over all such partitions (the unsplit plan's search, over items
instead of tiles). Cost: a request longer than S always pays a reduce, and one shorter than S runs on one worker
(vLLM's batch-invariant mode sets FlashInfer's fixed split size, 2048 tokens, for the same reason).

Worked example of the line plan: ``seq_lens = [1000, 100, 0]``, ``q_lens = 1``, ``block_n = 64``, ``OVH = 5``, 4
workers, one head group. Blocks are 16, 2, 0; tile lengths 21, 7, 5 start at 0, 21, 28; ``C = 33`` and ``Q = 9``:
cuts at 9, 18, 27. Cut 9 lies 4 blocks into tile 0 (after its overhead 0..5), cut 18 lies 13 blocks in; cut 27 lies
1 block into tile 1. The items (request: tokens) and worker costs are::

    worker 0: 0:[0, 256)                    cost 4 + 5           =  9
    worker 1: 0:[256, 832)                  cost 9 + 5           = 14
    worker 2: 0:[832, 1000), 1:[0, 64)      cost (3 + 5) + (1 + 5) = 14
    worker 3: 1:[64, 100),   2:[0, 0)       cost (1 + 5) + (0 + 5) = 11   (max 14 = Q + OVH, mean 12)

Request 0 is split in three (partial rows 0, 1, 2), request 1 in two (rows 3, 4); request 2 is written straight
to ``out`` (``out = 0``, ``lse = -inf``). ``plan_decode`` returns the even plan here (3 tiles, 4 workers, P = 8):
request 0 in two pieces ``[0, 512)``, ``[512, 1000)`` (partial rows 0, 1), requests 1 and 2 whole, one per worker;
costs 13, 13, 7, 5 (max 13).

Partial workspace. Piece ``i`` of a split tile of request ``b`` uses the rows ``base_b + i * q_len_b + r``
(``r < q_len_b``) of ``o [num_partial_rows, H, L] fp32`` and ``lse [num_partial_rows, H] fp32``, heads of its group
only; the head groups of one request share rows (they write disjoint heads), so every (row, head) is written once.

The plan is computed on the CPU in numpy (a few dozen array ops per candidate, no Python loop over requests:
numpy's per-call cost is a fraction of torch's on arrays this small) and the result moved to the device of
``seq_lens`` as torch int32 tensors; the same lengths give bit-identical plans on any device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from mla_ref.config import is_int

# columns of WorkPlan.work_items and WorkPlan.reduce_final (docs/architecture.md)
BATCH, PARTIAL_ROW, QO_START, QO_END, KV_START, KV_END, HEAD_START, HEAD_END = range(8)
TILE_QO_START, TILE_QO_END, TILE_HEAD_START, TILE_HEAD_END, SPLIT_BEGIN, SPLIT_END, PARTIAL_BASE = range(7)
FINAL = -1  # PARTIAL_ROW of an unsplit item: write straight to out / lse
DEFAULT_OVERHEAD_TOKENS = 320  # FlashMLA: 5 blocks of 64 tokens per piece (aiter: 16 blocks of 16)


def _ceil_div(a, b):
    """ceil(a / b) for non-negative ints or integer tensors / arrays."""
    return -(-a // b)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """[n] -> [n]: out[i] = x[0] + ... + x[i - 1]."""
    return np.cumsum(x) - x


def _indptr(counts: np.ndarray) -> np.ndarray:
    """[n] -> [n + 1]: 0 followed by the running sum of counts."""
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])


def _as_lengths(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor, got shape {tuple(t.shape)}")
    if t.numel() == 0 and t.dtype == torch.float32:  # torch.as_tensor([]): no values, so no dtype to refuse
        t = t.long()
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    return t


def _check_int(value, name: str, low: int) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True, eq=False)  # tensors: compare fields with torch.equal, not ==
class WorkPlan:
    """A persistent split-KV schedule (layout fixed in docs/architecture.md).

    Attributes:
        work_items: int32 [N, 8], columns BATCH, PARTIAL_ROW, QO_START, QO_END, KV_START, KV_END, HEAD_START,
            HEAD_END. QO_* are global q rows, KV_* token positions inside the request, HEAD_* heads (end exclusive).
            PARTIAL_ROW is the first workspace row of the item's partial output, or -1 (FINAL): write to out/lse.
        worker_indptr: int32 [num_workers + 1]; worker w runs work_items[worker_indptr[w]:worker_indptr[w + 1]].
        reduce_indptr: int32 [num_tiles + 1]; tile t (request-major, head group minor) merges the partial rows
            reduce_partial_map[reduce_indptr[t]:reduce_indptr[t + 1]] (empty range: unsplit, no reduce).
        reduce_final: int32 [num_tiles, 8], columns TILE_QO_START, TILE_QO_END, TILE_HEAD_START, TILE_HEAD_END (the
            tile's q rows and heads), SPLIT_BEGIN, SPLIT_END (= reduce_indptr[t], reduce_indptr[t + 1]), PARTIAL_BASE
            (reduce_partial_map[reduce_indptr[t]]: piece i uses rows PARTIAL_BASE + i x q_len; -1 when unsplit), and
            0: everything a reduce program needs in one 32-byte row.
        reduce_partial_map: int32 [M], first partial row of each piece, in KV order.
        num_workers, num_partial_rows, block_n, fixed_overhead (blocks), num_heads, head_group: ints.
        split_final: int32 [split_tiles, 8], the reduce_final rows of the split tiles (more than one piece), in
            tile order: the Triton reduce kernel's grid, which then has no program for an unsplit tile.
        max_pieces: int, the most pieces of any split tile (0 when no tile is split).
        seq_lens, q_lens: int32 [B], the planner's inputs.
        one_item_per_worker: worker w runs exactly work item w for w < N and idle workers come last
            (worker_indptr = min(w, N)): the even plan, and the unsplit plan of at most num_workers tiles. A kernel
            can then find its item without reading worker_indptr (one dependent load fewer before its first KV tile).
        paired_splits: every tile is split into exactly two pieces, and tile t's pieces are items 2t and 2t + 1 (KV
            order). With one_item_per_worker they run on workers 2t and 2t + 1, which a 2-CTA cluster can merge
            without the reduce kernel (mla_fast.dsmem).
    """

    work_items: torch.Tensor
    worker_indptr: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final: torch.Tensor
    reduce_partial_map: torch.Tensor
    split_final: torch.Tensor
    num_workers: int
    num_partial_rows: int
    block_n: int
    fixed_overhead: int
    num_heads: int
    head_group: int
    max_pieces: int
    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    one_item_per_worker: bool = False
    paired_splits: bool = False

    @property
    def num_items(self) -> int:
        return self.work_items.shape[0]

    @property
    def split_tiles(self) -> int:
        """Tiles with more than one piece (host int: split_final's rows)."""
        return self.split_final.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.reduce_final.shape[0]

    @property
    def device(self) -> torch.device:
        return self.work_items.device

    def item_costs(self) -> torch.Tensor:
        """int64 [N]: KV blocks of each item plus the fixed overhead (the planner's cost model)."""
        items = self.work_items.cpu().long()  # [N, 8]
        blocks = _ceil_div(items[:, KV_END] - items[:, KV_START], self.block_n)  # [N], KV_START is block aligned
        return blocks + self.fixed_overhead

    def worker_costs(self) -> torch.Tensor:
        """int64 [num_workers]: summed item costs of each worker."""
        counts = torch.diff(self.worker_indptr.cpu().long())  # [W] items per worker
        worker = torch.arange(self.num_workers).repeat_interleave(counts)  # [N] worker of each item
        return torch.zeros(self.num_workers, dtype=torch.long).index_add_(0, worker, self.item_costs())

    def stats(self) -> dict:
        """Plain-number statistics: items per worker, pieces per tile, cost balance (costs in blocks)."""
        counts = torch.diff(self.worker_indptr.cpu().long()).double()  # [W]
        pieces = torch.diff(self.reduce_indptr.cpu().long())  # [tiles], 0 = unsplit
        pieces = torch.where(pieces == 0, 1, pieces) if pieces.numel() else torch.zeros(1, dtype=torch.long)
        cost = self.worker_costs().double()  # [W]
        mean = cost.mean().item()
        return {
            "num_requests": self.seq_lens.numel(),
            "num_tiles": self.num_tiles,
            "num_items": self.num_items,
            "num_workers": self.num_workers,
            "num_partial_rows": self.num_partial_rows,
            "items_per_worker": {"min": counts.min().item(), "mean": counts.mean().item(), "max": counts.max().item()},
            "split_tiles": self.split_tiles,
            "pieces_per_tile": {"mean": pieces.double().mean().item(), "max": int(pieces.max())},
            "worker_cost": {"min": cost.min().item(), "mean": mean, "max": cost.max().item()},
            "imbalance": cost.max().item() / mean if mean > 0 else 1.0,
        }

    def summary(self) -> str:
        """A few lines for humans: see stats()."""
        s = self.stats()
        ipw, ppt, cost = s["items_per_worker"], s["pieces_per_tile"], s["worker_cost"]
        return "\n".join([
            f"WorkPlan: {s['num_requests']} requests, {s['num_tiles']} tiles (head_group {self.head_group} of "
            f"{self.num_heads}), {s['num_items']} items on {s['num_workers']} workers, block_n {self.block_n}, "
            f"overhead {self.fixed_overhead} blocks",
            f"  items/worker  min {ipw['min']:.0f}  mean {ipw['mean']:.2f}  max {ipw['max']:.0f}",
            f"  splits        {s['split_tiles']} split tiles, pieces/tile mean {ppt['mean']:.2f} max {ppt['max']}, "
            f"{s['num_partial_rows']} partial rows",
            f"  cost (blocks) min {cost['min']:.0f}  mean {cost['mean']:.2f}  max {cost['max']:.0f}  "
            f"imbalance max/mean {s['imbalance']:.3f}",
        ])

    def to_aiter(self, page_size: int = 1) -> dict[str, torch.Tensor]:
        """The six persistent-mode buffers of aiter's mla_decode_fwd / mla_reduce_v1 (aiter-contract.md §4).

        Keys are aiter's keyword names:
            work_meta_data: int64 [2] zeros. aiter holds two uint64 device addresses (of work_indptr and
                work_info_set) here; the adapter fills them on the device.
            work_indptr: int32 [num_workers + 1].
            work_info_set: int32 [N, 8] = (batch_idx, partial_qo_loc, qo_start, qo_end, kv_start, kv_end,
                kv_offset, pad 0); kv_start/kv_end are positions in kv_indices (page units):
                kv_indptr[b] + token / page_size with kv_indptr = cumsum(ceil(seq_lens / page_size)), the end
                rounded up; kv_offset = tokens of the request after kv_end.
            reduce_indptr: int32 [num_tiles + 1]; reduce_final_map: int32 [num_tiles, 2] (qo_start, qo_end);
            reduce_partial_map: int32 [M].
        aiter has no head groups, so head_group must equal num_heads; split points must fall on page boundaries,
        so block_n must be a multiple of page_size.
        """
        _check_int(page_size, "page_size", 1)
        if self.head_group != self.num_heads:
            raise ValueError(f"to_aiter needs head_group == num_heads ({self.num_heads}), got {self.head_group}")
        if self.block_n % page_size:
            raise ValueError(f"to_aiter needs block_n ({self.block_n}) to be a multiple of page_size, got {page_size}")
        items = self.work_items.long()  # [N, 8]
        seq_lens = self.seq_lens.to(items.device).long()  # [B]
        pages = _ceil_div(seq_lens, page_size)  # [B]
        kv_indptr = torch.cumsum(pages, 0) - pages  # [B] first kv_indices position of each request
        b = items[:, BATCH]  # [N]
        total_pages = int(pages.sum())  # kv_indices' length: the largest position written below
        if total_pages >= 2**31:  # never wrap silently (as _build refuses)
            raise ValueError(f"to_aiter: the batch's {total_pages} pages of {page_size} tokens do not fit aiter's "
                             "int32 kv_indices positions (< 2^31)")
        info = torch.zeros(self.num_items, 8, dtype=torch.int32, device=items.device)  # [N, 8]
        info[:, 0:4] = items[:, [BATCH, PARTIAL_ROW, QO_START, QO_END]].int()
        info[:, 4] = (kv_indptr[b] + items[:, KV_START] // page_size).int()
        info[:, 5] = (kv_indptr[b] + _ceil_div(items[:, KV_END], page_size)).int()
        info[:, 6] = (seq_lens[b] - items[:, KV_END]).int()
        return {
            "work_meta_data": torch.zeros(2, dtype=torch.int64, device=items.device),
            "work_indptr": self.worker_indptr.clone(),
            "work_info_set": info,
            "reduce_indptr": self.reduce_indptr.clone(),
            "reduce_final_map": self.reduce_final[:, 0:2].contiguous(),
            "reduce_partial_map": self.reduce_partial_map.clone(),
        }


def check_plan(plan: WorkPlan, seq_lens: torch.Tensor, q_lens: torch.Tensor, num_heads: int) -> None:
    """Raise ValueError when `plan` was not made for these lengths and heads: a plan for other lengths (e.g. the
    previous step's) would drop or invent KV tokens without an error. seq_lens, q_lens: int tensors [B] (read on the
    host: one sync for the batch's device tensors, one for the plan's)."""
    if not isinstance(plan, WorkPlan):
        raise ValueError(f"plan must be a WorkPlan (planner.plan_decode), got {type(plan).__name__}")
    if plan.num_heads != num_heads:
        raise ValueError(f"plan.num_heads must equal the batch's num_heads ({num_heads}), got {plan.num_heads}")
    got = torch.stack([plan.seq_lens, plan.q_lens]).long().cpu()  # [2, B_plan]
    want = torch.stack([_as_lengths(seq_lens, "seq_lens"), _as_lengths(q_lens, "q_lens")]).long().cpu()  # [2, B]
    for i, name in enumerate(("seq_lens", "q_lens")):
        if not torch.equal(got[i], want[i]):
            raise ValueError(f"plan.{name} must equal the batch's {name} {want[i].tolist()}, got {got[i].tolist()}")


def plan_decode(
    seq_lens,
    q_lens,
    num_heads: int,
    num_workers: int,
    *,
    block_n: int = 64,
    fixed_overhead: int | None = None,
    max_splits: int | None = None,
    head_group: int | None = None,
    min_tail: int = 1,
    split_tokens: int | None = None,
) -> WorkPlan:
    """Plan a persistent split-KV decode (cost model and guarantees in the module docstring).

    Args:
        seq_lens: int [B], KV tokens per request (>= 0). Tensor on any device, or a sequence. B = 0 (no requests)
            gives a plan of no items, every worker idle.
        q_lens: int [B], q rows per request (>= 1, MTP); rows of request b are contiguous.
        num_heads: query heads H.
        num_workers: persistent programs W (>= 1).
        block_n: KV tokens per cost block; every split point is a multiple of it.
        fixed_overhead: cost of one work item in blocks; default ceil(320 / block_n) (FlashMLA's 5 x 64 tokens).
        max_splits: at most this many pieces per (request, head group); None = no cap.
        head_group: heads per tile (divides num_heads); default num_heads (one group).
        min_tail: fewest KV tokens of a split tile's last piece (1 to block_n): a split that would leave a tile's
            last block alone with fewer tokens moves one block earlier. aiter's own metadata keeps a tail of at
            least max q_len tokens, and its fp8 kernels gave NaN on tails under 4 (aiter-contract.md §5, §11);
            mla_fast.aiter_backend plans with max(4, max q_len). Pieces before the last hold whole blocks.
        split_tokens: cut every tile at each multiple of this many tokens (a multiple of block_n), and nowhere else:
            the fixed-split plan (module docstring), whose pieces of a request do not depend on the other requests.
            None: the least busiest worker of the three candidate plans. Excludes max_splits and min_tail > 1.

    Returns:
        WorkPlan with int32 tensors on the device of seq_lens (computed on the CPU): of the line plan, the unsplit
        plan and the even plan (module docstring), the one whose busiest worker costs least; ties go to fewer
        partial rows (less reduce work), then to that order.
    """
    line = _line(seq_lens, q_lens, num_heads, num_workers, block_n, fixed_overhead, max_splits, head_group, min_tail)
    if split_tokens is not None:
        _check_split_tokens(split_tokens, block_n, max_splits, min_tail)
    if line.tile_req.size == 0:  # no requests: no items, every worker idle
        return _on_device(_build(line, _idle(line)), line.device)
    if split_tokens is not None:
        return _on_device(_build(line, _fixed_cut(line, split_tokens // block_n)), line.device)
    best = _cut(line, _line_cuts(line, max_splits), split=max_splits != 1)
    unsplit = _unsplit_cuts(line, best.key)
    if unsplit is not None:
        unsplit_cut = _cut(line, unsplit, split=False)
        if unsplit_cut.key < best.key:  # first of equal keys: the line plan
            best = unsplit_cut
    even = _even_cuts(line, max_splits)
    if even is not None and (even[1:] < best.key or line.min_tail > 1):  # cut only when it may win: min_tail may
        even_cut = _cut(line, even[0], split=True)  # move a cut, making it cost more or split less than its closed
        if even_cut.key < best.key:  # forms say, so then its own key decides
            best = even_cut
    return _on_device(_build(line, best), line.device)


def _on_device(plan: WorkPlan, device: torch.device) -> WorkPlan:
    """The plan with its tensors on `device`: candidates are built and compared on the CPU, only the returned one
    moves."""
    if device.type == "cpu":
        return plan
    tensors = {f.name: getattr(plan, f.name) for f in fields(plan)}
    return replace(plan, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


@dataclass(frozen=True)
class _Line:
    """Validated planner inputs and the tiles laid end to end (module docstring); int64 numpy arrays."""

    seq: np.ndarray  # [B] KV tokens per request
    qlen: np.ndarray  # [B] q rows per request
    tile_req: np.ndarray  # [T] request of each tile, request-major
    tile_grp: np.ndarray  # [T] head group of each tile
    blocks: np.ndarray  # [T] KV blocks per tile
    start: np.ndarray  # [T] line position of each tile (its overhead first, then its blocks)
    total: int  # C, the line's length in units
    ovh: int  # fixed overhead per item, in blocks
    num_heads: int
    head_group: int
    num_workers: int
    block_n: int
    min_tail: int  # fewest tokens of a split tile's last piece (plan_decode)
    device: torch.device  # where the returned plan's tensors go (candidates stay on the CPU)


def _line(seq_lens, q_lens, num_heads, num_workers, block_n, fixed_overhead, max_splits, head_group,
          min_tail: int = 1) -> _Line:
    """Check the planner's arguments (as in plan_decode) and lay the (request, head group) tiles on the line."""
    seq_lens = _as_lengths(seq_lens, "seq_lens")
    q_lens = _as_lengths(q_lens, "q_lens")
    if q_lens.shape != seq_lens.shape:
        raise ValueError(f"q_lens must have the shape of seq_lens {tuple(seq_lens.shape)}, got {tuple(q_lens.shape)}")
    if q_lens.device != seq_lens.device:
        raise ValueError(f"q_lens must be on the device of seq_lens ({seq_lens.device}), got {q_lens.device}")
    seq = seq_lens.cpu().long().numpy()  # [B]
    qlen = q_lens.cpu().long().numpy()  # [B]
    if bool((seq < 0).any()):
        raise ValueError("seq_lens must be >= 0")
    if bool((qlen < 1).any()):
        raise ValueError("q_lens must be >= 1")
    if seq.size and (int(seq.max()) >= 2**31 or int(qlen.sum()) >= 2**31):
        raise ValueError("seq_lens values and the sum of q_lens must be < 2**31 (the plan is int32), got max "
                         f"seq_len {int(seq.max())}, sum of q_lens {int(qlen.sum())}")
    _check_int(num_heads, "num_heads", 1)
    _check_int(num_workers, "num_workers", 1)
    _check_int(block_n, "block_n", 1)
    ovh = _ceil_div(DEFAULT_OVERHEAD_TOKENS, block_n) if fixed_overhead is None else fixed_overhead
    _check_int(ovh, "fixed_overhead", 0)
    if max_splits is not None:
        _check_int(max_splits, "max_splits", 1)
    head_group = num_heads if head_group is None else head_group
    _check_int(head_group, "head_group", 1)
    if num_heads % head_group:
        raise ValueError(f"head_group must divide num_heads ({num_heads}), got {head_group}")
    _check_int(min_tail, "min_tail", 1)
    if min_tail > block_n:
        raise ValueError(f"min_tail must be <= block_n ({block_n}): a split moved one block earlier leaves a last "
                         f"piece of more than block_n tokens, got {min_tail}")

    B, G = seq.size, num_heads // head_group
    tile_req = np.repeat(np.arange(B), G)  # [T]
    blocks = _ceil_div(seq, block_n)[tile_req]  # [T]
    length = blocks + ovh  # [T] line units: overhead first, then blocks
    return _Line(seq=seq, qlen=qlen, tile_req=tile_req, tile_grp=np.tile(np.arange(G), B), blocks=blocks,
                 start=_exclusive_cumsum(length), total=int(length.sum()), ovh=ovh, num_heads=num_heads,
                 head_group=head_group, num_workers=num_workers, block_n=block_n, min_tail=min_tail,
                 device=seq_lens.device)


def _line_cuts(line: _Line, max_splits: int | None) -> np.ndarray:
    """[W - 1] cuts of the line plan: cut w at w x Q, Q = ceil(C / W) raised so that no tile exceeds max_splits
    pieces (max_splits 1: the caller keeps every tile whole)."""
    stride = max(1, _ceil_div(line.total, line.num_workers))
    if max_splits is not None and max_splits >= 2:
        stride = max(stride, _ceil_div(int(line.blocks.max()) - 1, max_splits - 1))
    return np.minimum(np.arange(1, line.num_workers) * stride, line.total)  # [W-1]


def _fits(ends: np.ndarray, cost: int, workers: int) -> bool:
    """Whether whole tiles (line boundaries ``ends`` [T + 1], 0 first, C last) fill at most ``workers`` workers of
    at most ``cost`` each, contiguously. The greedy fill (each worker takes tiles while they fit) uses the fewest
    workers; the tile boundary reached after w of its workers comes from ``reach`` composed w times, by doubling
    (log2 W array ops instead of a loop over workers)."""
    reach = np.searchsorted(ends, ends + cost, side="right") - 1  # [T + 1] boundary one worker reaches from each
    at, w = 0, workers
    while w:
        if w & 1:
            at = int(reach[at])
        w >>= 1
        if w:
            reach = reach[reach]
    return at == ends.size - 1


def _least_fill(ends: np.ndarray, workers: int, lo: int, cap: int) -> int | None:
    """The least cost in [lo, cap] at which the pieces between boundaries ``ends`` ([N + 1], 0 first, C last) fill
    at most ``workers`` workers contiguously (`_fits`), or None: found by doubling a step up from ``lo`` (the
    optimum is usually within a few units of a good lower bound), then bisecting."""
    if lo > cap:
        return None
    step, hi = 1, lo
    while not _fits(ends, hi, workers):
        if hi == cap:
            return None
        lo, hi, step = hi + 1, min(hi + step, cap), 2 * step
    while lo < hi:  # hi fits, and nothing below lo does
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(ends, mid, workers) else (mid + 1, hi)
    return hi


def _greedy_fill(ends: np.ndarray, cost: int, workers: int) -> list[int]:
    """[workers - 1] indices into ``ends`` where workers 1.. start when each worker in turn takes pieces while they
    fit in ``cost`` (a cost that `_fits`): the workers past the last piece stay idle."""
    bounds, starts, at = ends.tolist(), [], 0
    for _ in range(workers - 1):
        at = bisect.bisect_right(bounds, bounds[at] + cost) - 1
        starts.append(at)
    return starts


def _unsplit_cuts(line: _Line, beat: tuple[int, int]) -> np.ndarray | None:
    """[W - 1] cuts of the best unsplit plan, or None when it cannot beat the key ``beat`` (busiest worker's cost,
    partial rows: an unsplit plan has none, so it must cost less, or as much when ``beat`` has partial rows).

    Whole tiles, contiguous, the least busiest worker over all such partitions. With at most W tiles that is one
    tile per worker. Otherwise its cost lies in [max(longest tile, ceil(C / W)), ...]: the least that `_fits`
    (`_least_fill`); the cuts are the greedy fill's at that cost."""
    T, W = line.blocks.size, line.num_workers
    cap = beat[0] if beat[1] > 0 else beat[0] - 1  # the most the plan may cost and still win
    lo = max(int((line.blocks + line.ovh).max()), _ceil_div(line.total, W))  # the longest tile with T <= W
    if lo > cap:
        return None
    if T <= W:
        return np.concatenate([line.start[1:], np.full(W - T, line.total)])  # [W - 1]
    ends = np.append(line.start, line.total)  # [T + 1] tile boundaries on the line
    cost = _least_fill(ends, W, lo, cap)
    return None if cost is None else ends[_greedy_fill(ends, cost, W)]  # [W - 1]


def _fixed_cut(line: _Line, split_blocks: int) -> _Cut:
    """The fixed-split plan (module docstring): tile t in max(1, ceil(blocks_t / split_blocks)) pieces cut at the
    multiples of split_blocks, the items in line order dealt contiguously to the workers with the least busiest
    worker (`_least_fill`, between the costliest item or ceil(total / W) and the whole line)."""
    B, G, W, ovh = line.seq.size, line.num_heads // line.head_group, line.num_workers, line.ovh
    pieces = np.maximum(_ceil_div(line.blocks, split_blocks), 1)  # [T]
    first = _exclusive_cumsum(pieces)  # [T] index of each tile's first item
    item_tile = np.repeat(np.arange(pieces.size), pieces)  # [N]
    blk_start = (np.arange(item_tile.size) - first[item_tile]) * split_blocks  # [N]
    blk_end = np.minimum(blk_start + split_blocks, line.blocks[item_tile])  # [N]
    ends = _indptr(blk_end - blk_start + ovh)  # [N + 1] item boundaries on a line of the items' costs
    total = int(ends[-1])
    cost = _least_fill(ends, W, max(int(np.diff(ends).max()), _ceil_div(total, W)), total)
    worker_indptr = np.array([0, *_greedy_fill(ends, cost, W), item_tile.size], dtype=np.int64)  # [W + 1]
    busiest = int((ends[worker_indptr[1:]] - ends[worker_indptr[:-1]]).max())
    req_pieces = np.where(pieces > 1, pieces, 0).reshape(B, G).max(1)  # [B]
    partial_rows = int((req_pieces * line.qlen).sum())
    return _Cut(pieces=pieces, first=first, item_tile=item_tile, blk_start=blk_start, blk_end=blk_end,
                worker_indptr=worker_indptr, req_pieces=req_pieces, partial_rows=partial_rows,
                key=(busiest, partial_rows))


def _check_split_tokens(split_tokens, block_n: int, max_splits: int | None, min_tail: int) -> None:
    _check_int(split_tokens, "split_tokens", 1)
    if split_tokens % block_n:
        raise ValueError(f"split_tokens must be a multiple of block_n ({block_n}): splits fall on block boundaries, "
                         f"got {split_tokens}")
    if max_splits is not None:
        raise ValueError(f"max_splits must be None with split_tokens (the pieces are fixed by it), got {max_splits}")
    if min_tail != 1:
        raise ValueError(f"min_tail must be 1 with split_tokens (the cuts are fixed by it), got {min_tail}")


def _even_cuts(line: _Line, max_splits: int | None) -> tuple[np.ndarray, int, int] | None:
    """(cuts [W - 1], busiest worker's cost, partial rows) of the even plan, or None when there are more tiles than
    workers.

    One item per worker: tile t is cut into k_t = clamp(ceil(blocks_t / P), 1, max_splits) near-equal pieces (block
    boundaries floor(j x blocks_t / k_t)), for the smallest piece length P (blocks) with sum_t k_t <= W; the busiest
    worker costs max_t ceil(blocks_t / k_t) + OVH. Cut w sits where item w starts; the cuts past the last item sit
    at C (idle workers).
    """
    T, W = line.blocks.size, line.num_workers
    if T > W:
        return None
    cap = max_splits or int(line.blocks.max()) or 1

    def pieces(P: int) -> np.ndarray:
        return np.minimum(np.maximum(_ceil_div(line.blocks, P), 1), cap)  # [T] (np.clip costs more per call)

    lo, hi = 1, max(1, int(line.blocks.max()))  # sum(pieces(hi)) = T <= W; find the least feasible P
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if int(pieces(mid).sum()) <= W else (mid + 1, hi)
    k = pieces(lo)  # [T]
    item_tile = np.repeat(np.arange(T), k)  # [N]
    j = np.arange(item_tile.size) - _exclusive_cumsum(k)[item_tile]  # [N] piece index inside its tile
    first_block = j * line.blocks[item_tile] // k[item_tile]  # [N]
    item_pos = line.start[item_tile] + np.where(j == 0, 0, line.ovh + first_block)  # [N] line position
    cuts = np.concatenate([item_pos[1:], np.full(W - item_pos.size, line.total)])  # [W-1]
    cost = int(_ceil_div(line.blocks, k).max()) + line.ovh
    G = line.num_heads // line.head_group  # the head groups of a request share its partial rows
    rows = int((np.where(k > 1, k, 0) * line.qlen[line.tile_req]).sum()) // G
    return cuts, cost, rows


@dataclass(frozen=True)
class _Cut:
    """The items of the line cut at given positions (int64 numpy arrays, in line order), and the candidate's key."""

    pieces: np.ndarray  # [T] items of each tile
    first: np.ndarray  # [T] index of each tile's first item
    item_tile: np.ndarray  # [N]
    blk_start: np.ndarray  # [N] first KV block of each item
    blk_end: np.ndarray  # [N] one past its last block
    worker_indptr: np.ndarray  # [W + 1]
    req_pieces: np.ndarray  # [B] pieces of the request's split tiles (0: none split)
    partial_rows: int
    key: tuple[int, int]  # (busiest worker's cost, partial rows): plan_decode keeps the least


def _idle(line: _Line) -> _Cut:
    """The cut of a line of no tiles (no requests): no items, every worker's range empty."""
    none = np.zeros(0, dtype=np.int64)
    return _Cut(pieces=none, first=none, item_tile=none, blk_start=none, blk_end=none,
                worker_indptr=np.zeros(line.num_workers + 1, dtype=np.int64), req_pieces=none, partial_rows=0,
                key=(0, 0))


def _cut(line: _Line, cut: np.ndarray, split: bool) -> _Cut:
    """The items of the line cut at `cut` ([W - 1] non-decreasing positions; cut w opens worker w): a cut inside a
    tile's blocks splits it there (unless not `split`), any other moves back to its tile's start."""
    blocks, start, ovh, total = line.blocks, line.start, line.ovh, line.total
    B, G = line.seq.size, line.num_heads // line.head_group
    cut_tile = np.searchsorted(start, cut, side="right") - 1  # [W-1] last tile starting at or before the cut
    cut_block = cut - start[cut_tile] - ovh  # [W-1] blocks of that tile before the cut
    splits = (cut_block > 0) & (cut_block < blocks[cut_tile]) & split  # [W-1]
    kept = np.zeros_like(splits)  # [W-1] cuts that split nothing but stay where they are
    if line.min_tail > 1:  # a split at a tile's last block, short of min_tail tokens, moves one block earlier
        tail = line.seq[line.tile_req] - (blocks - 1) * line.block_n  # [T] tokens of each tile's last block
        short = splits & (cut_block == blocks[cut_tile] - 1) & (tail[cut_tile] < line.min_tail)  # [W-1]
        cut, cut_block = cut - short, cut_block - short  # [W-1] still non-decreasing: only a cut equal to the
        # one before it (the same block, split by both) can meet it, and then it splits nothing there
        kept[1:] = short[1:] & splits[:-1] & (cut[1:] == cut[:-1])
        splits = splits & (cut_block > 0) & ~kept
    cut = np.where(splits | kept, cut, np.where(cut < total, start[cut_tile], cut))  # [W-1] non-decreasing

    # items: every tile's first piece plus one piece per splitting cut, in line order
    pieces = 1 + np.bincount(cut_tile[splits], minlength=B * G)  # [T]
    first = _exclusive_cumsum(pieces)  # [T] index of each tile's first item
    item_tile = np.repeat(np.arange(B * G), pieces)  # [N]
    is_first = np.zeros(item_tile.size, dtype=bool)  # [N]
    is_first[first] = True
    blk_start = np.zeros(item_tile.size, dtype=np.int64)  # [N] first block of each item
    blk_start[~is_first] = cut_block[splits]
    blk_end = np.concatenate([blk_start[1:], blk_start[:1]])  # [N] next item's start within the same tile ...
    blk_end[first + pieces - 1] = blocks  # ... or the tile's end
    item_pos = start[item_tile] + np.where(is_first, 0, ovh + blk_start)  # [N] line position of the item
    worker = np.searchsorted(cut, item_pos, side="right")  # [N] non-decreasing
    worker_indptr = _indptr(np.bincount(worker, minlength=line.num_workers))  # [W + 1]
    # the cost model (WorkPlan.worker_costs): an item costs its blocks + OVH; items are in worker order, so a
    # worker's cost is a difference of the running sum at its range's ends
    running = _indptr(blk_end - blk_start + ovh)  # [N + 1]
    busiest = int((running[worker_indptr[1:]] - running[worker_indptr[:-1]]).max())
    req_pieces = np.where(pieces > 1, pieces, 0).reshape(B, G).max(1)  # [B]
    partial_rows = int((req_pieces * line.qlen).sum())
    return _Cut(pieces=pieces, first=first, item_tile=item_tile, blk_start=blk_start, blk_end=blk_end,
                worker_indptr=worker_indptr, req_pieces=req_pieces, partial_rows=partial_rows,
                key=(busiest, partial_rows))


def _build(line: _Line, c: _Cut) -> WorkPlan:
    """The WorkPlan (CPU int32 tensors) of a cut line."""
    seq, qlen, tile_req, block_n, num_workers = line.seq, line.qlen, line.tile_req, line.block_n, line.num_workers
    B = seq.size
    pieces, first, item_tile, blk_start, blk_end, worker_indptr, req_pieces = (
        c.pieces, c.first, c.item_tile, c.blk_start, c.blk_end, c.worker_indptr, c.req_pieces)

    # partial rows: piece i of a split tile of request b -> base_b + i * q_len_b; head groups share rows
    item_req = tile_req[item_tile]  # [N]
    is_split = pieces > 1  # [T]
    req_base = _exclusive_cumsum(req_pieces * qlen)  # [B]
    piece_idx = np.arange(item_tile.size) - first[item_tile]  # [N]
    partial_row = np.where(is_split[item_tile], req_base[item_req] + piece_idx * qlen[item_req], FINAL)  # [N]

    qo_indptr = _indptr(qlen)  # [B + 1]
    head_start = line.tile_grp * line.head_group  # [T]
    work_items = np.stack([
        item_req,
        partial_row,
        qo_indptr[item_req],
        qo_indptr[item_req + 1],
        blk_start * block_n,
        np.minimum(blk_end * block_n, seq[item_req]),
        head_start[item_tile],
        head_start[item_tile] + line.head_group,
    ], axis=1)  # [N, 8]
    reduce_indptr = _indptr(np.where(is_split, pieces, 0))  # [T + 1]
    reduce_partial_map = partial_row[is_split[item_tile]]  # [M], items are in KV order within a tile
    partial_base = np.where(is_split, req_base[tile_req], FINAL)  # [T] piece i: rows base + i * q_len
    reduce_final = np.stack(
        [qo_indptr[tile_req], qo_indptr[tile_req + 1], head_start, head_start + line.head_group,
         reduce_indptr[:-1], reduce_indptr[1:], partial_base, np.zeros_like(partial_base)], axis=1
    )  # [T, 8]

    def out(x: np.ndarray) -> torch.Tensor:
        if x.size and not -(2**31) <= int(x.min()) <= int(x.max()) < 2**31:  # never wrap silently
            raise ValueError(f"plan values must fit int32, got the range [{int(x.min())}, {int(x.max())}]")
        return torch.from_numpy(x.astype(np.int32))  # on the CPU; plan_decode moves the plan it returns

    return WorkPlan(
        work_items=out(work_items),
        worker_indptr=out(worker_indptr),
        reduce_indptr=out(reduce_indptr),
        reduce_final=out(reduce_final),
        reduce_partial_map=out(reduce_partial_map),
        split_final=out(reduce_final[is_split]),
        num_workers=num_workers,
        num_partial_rows=c.partial_rows,
        block_n=block_n,
        fixed_overhead=line.ovh,
        num_heads=line.num_heads,
        head_group=line.head_group,
        max_pieces=int(req_pieces.max()) if B else 0,  # the most pieces of any split tile
        seq_lens=out(seq),
        q_lens=out(qlen),
        one_item_per_worker=bool(np.array_equal(worker_indptr, np.minimum(np.arange(num_workers + 1), item_tile.size))),
        paired_splits=bool(pieces.size > 0 and (pieces == 2).all()
                           and np.array_equal(item_tile, np.arange(item_tile.size) // 2)),
    )
