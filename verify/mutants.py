"""Planted-bug decode kernels: each one must make the default `mla-verify` campaign fail (exit 1); the two scale
mutants (``kv_scale_ignored``, ``q_scale_ignored``) need fp8 cases, ``--dtype fp8``, ``int32_offsets`` and
``page_ids_16bit`` the far check (on by default on CUDA devices; ``--far on`` on a CPU), ``uint16_positions``,
``out_index_16bit`` and ``block_column_12bit`` the long cases (the same; ``--long on``) and ``realloc_workspace`` a
CUDA device (its bug needs a CUDA graph).

Use them as plug-ins, ``mla-verify --impl verify.mutants:NAME``; ``correct`` is the same kernel without a bug and
must pass. All share one small split-KV, online-softmax decode (`_decode`) in fp32 with bf16 output; each mutant
turns one knob, the way such bugs happen in real kernels:

| name                  | bug                                                          | caught by (smoke case)        |
|-----------------------|--------------------------------------------------------------|-------------------------------|
| wrong_scale           | σ = 576^-1/2 (FlashMLA's default) instead of the YaRN σ     | tier1 (any)                   |
| drop_rope             | scores from c_kv only, the 64 k_pe channels dropped          | tier1 (any)                   |
| page_off_by_one       | physical page id + 1                                         | tier1 / finite (any)          |
| last_page_unmasked    | reads the whole last page (NaN in unused slots)              | finite (partial last page)    |
| lse_base2             | returns log2 Σ exp(s) (FlashInfer's convention)              | tier1.lse (any)               |
| kv_scale_ignored      | fp8 KV used without its scale                                | tier1 (fp8, scale != 1)       |
| q_scale_ignored       | fp8 q used without its scale                                 | tier1 (fp8 q, scale != 1)     |
| average_splits        | split partials averaged instead of LSE-merged                | tier1 (>= 2 splits)           |
| mtp_causal_off_by_one | MTP rows see one future token (<= instead of <)              | tier1 (q_len > 1)             |
| nan_empty             | an empty row divides 0 by 0: out NaN                         | empty (seq_len 0)             |
| out_gain              | out · (1 + 2^-7): a 2-ulp bias no cosine check sees          | tier1.out (any)               |
| bf16_accumulation     | running softmax sum and output kept in bf16 across KV blocks | tier1.out (long request)      |
| seq_lens_cleared      | zeroes batch.seq_lens in place, then decodes: all rows empty | tier1 / inputs (any)          |
| cache_padding_written | correct output, then writes 0 into the unused cache slots    | inputs (any)                  |
| nan_dropped           | a NaN split partial merged as an empty one (aiter's reduce)  | nan (a split request)         |
| no_max_subtraction    | softmax without the max subtracted: exp(s) overflows         | finite / tier1 (wide logits)  |
| int32_offsets         | cache rows addressed by int32 element offsets, which wrap    | far (CUDA, or `run_case(...,  |
|                       | past 2^31 elements (3.7 M bf16 tokens)                       | far=True)`; any case)         |
| page_ids_16bit        | page ids kept in 16 bits: page 2^16 + p read as page p       | far (as int32_offsets)        |
| p_rounded_bf16        | P rounded to bf16 before P.V, fp32 P declared (the plug-in   | rounding (a request of >= 2   |
|                       | default): one bf16 ulp per weight, below the output's        | tokens)                       |
| bf16_partials         | split outputs stored in bf16 for the merge (lse fp32), fp32  | partials (a request of > 64   |
|                       | partials declared (the plug-in default), as FlashInfer's     | tokens, split)                |
|                       | MLA stores them                                              |                               |
| ignores_strides       | q, cache and block table addressed from their shapes, as if  | layout (any)                  |
|                       | contiguous                                                   |                               |
| uint16_positions      | token positions kept in 16 bits (j mod 2^16)                 | tier1 (the long cases: CUDA,  |
|                       |                                                              | or `--long on`)               |
| hardcoded_scale       | σ fixed at DeepSeek-V3's 0.1352338, the batch's ignored      | tier1 (the smoke prefix's     |
|                       |                                                              | other σ)                      |
| merge_order_varies    | split partials summed in an order that changes from call to  | repeat (>= 3 splits)          |
|                       | call (as atomics do), while declared deterministic (the      |                               |
|                       | plug-in default)                                             |                               |
| stale_plan            | its graph-capturable step keeps the lengths of its first     | step.replan (any)             |
|                       | plan: a replay after the next step was written into its      |                               |
|                       | buffers decodes it with the captured step's lengths          |                               |
| fast_path_plan        | its graph-capturable step's plan() keeps its pieces (the     | step.decode (any)             |
|                       | lengths it planned) when the same requests come back grown   |                               |
|                       | by at most their q_len: one decode step's new tokens unread  |                               |
| realloc_workspace     | its graph-capturable step allocates a new workspace at each  | step.freed (any; CUDA only)   |
|                       | plan(): the replay after the next plan writes the freed one  |                               |
|                       | (right answers, another tensor's memory overwritten)         |                               |
| max_init_zero         | the running max starts at 0, not -inf: rows whose scores all | tier1 / finite (the shifted   |
|                       | lie below about -87 flush to 0                               | case)                         |
| max_before_mask       | each tile's max over every slot it loads (whole pages to the | padding (a partial last page, |
|                       | tile's end, entries past the request's read as page 0)       | or a tile past the last       |
|                       | before the mask, NaN-blind                                   | page); tier1 (shifted case)   |
| packed_rows_wrap      | the packed (row, head) index r H + h kept in 8 bits          | tier1 (128 heads, MTP 3-4)    |
| plan_cached_by_ptr    | its eager call memoises its plan (the lengths) by the        | rerun (any)                   |
|                       | addresses of the batch's length and block-table tensors      |                               |
| eager_fast_path       | its eager call memoises its plan by the addresses of the     | rerun.decode (any)            |
|                       | batch's tensors and keeps it when the same requests come     |                               |
|                       | back grown by at most their q_len: a step's new tokens unread|                               |
| splits_follow_batch   | a request cut into pieces of the batch's tokens / 16, while  | batch (a request of more      |
|                       | it declares itself batch-invariant (as `correct` does: its   | than one piece)               |
|                       | splits depend on the request alone)                          |                               |
| splits_follow_longest | a request cut into pieces sized as the batch's longest       | batch (a request of more than |
|                       | request's (its blocks over 4 splits), while it declares      | one piece, a longest request  |
|                       | itself batch-invariant                                       | of >= 1 full page)            |
| tiles_follow_q_len    | online-softmax steps of 64 / (the batch's largest q_len)     | batch.mtp (a request longer   |
|                       | tokens, while it declares itself batch-invariant             | than the smaller of the case's|
|                       |                                                              | and the mtp batch's steps)    |
| big_batch_mtp_mask    | past 16 requests, every request masked as if it had the      | tier1 (the 260-request smoke  |
|                       | batch's largest q_len (a [B, max q_len] row grid read from   | case, MTP rows among single   |
|                       | its first row)                                               | ones)                         |
| rope_width_64         | scores over the latent and the last 64 channels, DeepSeek's  | tier1 (the MiniCPM3 smoke     |
|                       | rope width, whatever the batch's rope_dim                    | case: latent 256, rope 32)    |
| full_tile_fast_path   | a request of whole 64-token tiles skips the causal mask:     | tier1 (MTP rows on a length   |
|                       | its MTP rows see the newer tokens                            | of whole tiles)               |
| shared_page_reuse     | a request on an earlier one's pages (same first page, length | batch.shared (any with a      |
|                       | and q_len) takes that request's results: per-page results    | token)                        |
|                       | kept by page id for the first reader                         |                               |
| alpha_bf16            | the running output's rescale factor exp(m_old - m_new)       | rescale (a request of more    |
|                       | rounded to bf16, the row sum's not                           | than one 64-token step)       |
| dtype_unchecked       | fp16 read as bf16 bits, e4m3fnuz and e5m2 codes as e4m3fn    | tier1 / finite (the smoke     |
|                       | ones (no dtype check behind data_ptr())                      | prefix's dtype cases)         |
| head0_max             | each tile's max of head 0 used for every head of its row (a  | tier1 / finite (the heads     |
|                       | max broadcast from the wrong lane)                           | smoke case)                   |
| prefix_by_first_page  | requests starting on one page taken to share every page up   | batch.shared.added (a longest |
|                       | to the shorter one's full pages (a cascade kernel's prefix   | request of >= 2 full pages)   |
|                       | detection): each reads the first such request's pages there |                               |
| prefix_first_pair     | requests starting on one page take the full pages the first  | batch.shared.added (as        |
|                       | two of them share as shared by all (a cascade kernel)        | prefix_by_first_page)         |
| request_index_8bit    | a request's block-table row read at its index mod 256        | tier1 / finite (the 260-      |
|                       |                                                              | request smoke case)           |
| head_tiles_floor      | H // 64 tiles of 64 heads: heads past the last whole tile    | tier1 / empty (the 96-head    |
|                       | never computed                                               | smoke case)                   |
| slot_8bit             | a token's slot in its page kept in 8 bits                    | tier1 (pages of 528)          |
| mtp_row_3bit          | an MTP row's index kept in 3 bits in the causal mask         | tier1 (12 MTP rows)           |
| page_div_magic16      | a token's page from a 16-bit magic multiply (j m) >> 16      | tier1 / finite (700 tokens on |
|                       |                                                              | pages of 528)                 |
| unit_kv_fastpath      | a kv scale of 1 taken for "no scales": fp8 q's scale dropped | tier1 (fp8: the kv_unit case) |
| reduce_pad_weight0    | a reduce over the batch's most splits per request whose      | nan.first (a request of fewer |
|                       | padding slots read the first request's first partial with    | splits than another)          |
|                       | weight 0 (0 NaN = NaN)                                       |                               |
| active_index_8bit     | the k-th non-empty request reads non-empty request k mod     | tier1 (520 non-empty          |
|                       | 256's pages and length (a work list's 8-bit slot)            | requests)                     |
| request_index_9bit    | request_index_8bit with 9 bits: past a CUDA graph's 512      | tier1 (520 non-empty          |
|                       |                                                              | requests)                     |
| packed_rows_10bit     | the packed (row, head) index r H + h kept in 10 bits         | tier1 (128 heads, 9 MTP rows) |
| mtp_row_5bit          | an MTP row's index kept in 5 bits in the causal mask         | tier1 (40 MTP rows)           |
| consecutive_pages_flat| a request on >= 4 consecutive ascending pages read flat, its | layout (a request of 4 pages  |
|                       | last page unmasked                                           | or more, the last partial)    |
| big_batch_heads16     | past 64 requests, H // 16 tiles of 16 heads computed         | tier1 (66 requests, 20 heads) |
| big_batch_q_scale     | past 64 requests, fp8 q used without its scale               | tier1 (fp8: the same case)    |
| split_empty_nan       | a split request's rows that see no token: 0 / 0 = NaN        | tier1 / empty (72 MTP rows    |
|                       |                                                              | over 70 tokens)               |
| out_index_16bit       | the output's (row, head) index t H + h kept in 16 bits       | tier1 (long: 528 MTP rows of  |
|                       |                                                              | 128 heads)                    |
| block_column_12bit    | a request's block-table column kept in 12 bits               | tier1 (long: 65601 pages of 1)|
"""

from __future__ import annotations

import math
import weakref

import torch

from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import round_p
from verify.cases import SM_SCALE

BLOCK = 64  # KV tokens per online-softmax step
MAX_SPLITS = 4  # KV splits per request (split-KV decode), merged by LSE
DENSE_ROWS = 8  # query rows per step of the graph-capturable steps' dense decode (`_dense_decode`)


def _decode(
    batch: DecodeBatch,
    *,
    sm_scale: float | None = None,
    rope: bool = True,
    page_shift: int = 0,
    int32_offsets: bool = False,
    full_last_page: bool = False,
    lse_base2: bool = False,
    use_kv_scale: bool = True,
    use_q_scale: bool = True,
    merge: str = "lse",
    causal_slack: int = 0,
    empty_nan: bool = False,
    max_sub: bool = True,
    gain: float = 1.0,
    acc_dtype: torch.dtype = torch.float32,
    p_fmt: str | None = None,
    p_scale: float = 1.0,
    partial_dtype: torch.dtype = torch.float32,
    position_bits: int | None = None,
    merge_shift: int = 0,
    max_init: float = -math.inf,
    max_before_mask: bool = False,
    packed_row_bits: int | None = None,
    l_rounded: bool = False,
    batch_splits: bool = False,
    longest_splits: bool = False,
    rows_tiles: bool = False,
    big_batch_rows: int | None = None,
    request_bits: int | None = None,
    active_bits: int | None = None,
    page_id_bits: int | None = None,
    rope_width: int | None = None,
    full_tiles_unmasked: bool = False,
    head0_max: bool = False,
    alpha_fmt: str | None = None,
    head_tile: int | None = None,
    slot_bits: int | None = None,
    row_bits: int | None = None,
    page_magic_bits: int | None = None,
    unit_kv_drops_q_scale: bool = False,
    pad_weight0: bool = False,
    consecutive_flat: int | None = None,
    split_empty_nan: bool = False,
    out_index_bits: int | None = None,
    column_bits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV online-softmax MLA decode -> (out [T, H, L] bf16, lse [T, H] fp32). Defaults = no bug.

    Per request: gather its pages, cut its tokens into up to MAX_SPLITS splits (on BLOCK boundaries), run an online
    softmax over BLOCK-token steps inside each split (running max m, sum l and output acc in ``acc_dtype``), then
    merge the splits with the LSE formula (or, ``merge="mean"``, by averaging them), their sums starting at split
    ``merge_shift`` (mod the number of splits) instead of the first. P is rounded to ``p_fmt`` (times ``p_scale``,
    then divided by it) for P.V; the row sum l adds the unrounded P, or (``l_rounded``) the rounded one. With
    ``batch_splits`` a request is cut into pieces of ceil(the batch's tokens / 16) tokens instead, as a planner
    spreading the batch over 16 workers cuts it; with ``longest_splits`` into the pieces of the batch's longest
    request, as a kernel that sizes its splits once for the batch, from its longest request, cuts it; with
    ``rows_tiles`` the online softmax steps over BLOCK / (the batch's largest q_len) tokens, as a kernel that keeps
    its tile's rows x tokens fixed and sizes it once for the batch does. With ``big_batch_rows`` = R, a batch of
    more than R requests masks every request's rows as if it had the batch's largest q_len. With ``request_bits``
    a request's block-table row is read at its index modulo 2^bits (a request index that wraps); with
    ``active_bits`` the k-th non-empty request reads the pages and length of non-empty request k mod 2^bits (a
    work list of the non-empty requests whose entries keep a request's slot in that many bits); with
    ``page_id_bits`` each page id modulo 2^bits (a page id that wraps). With ``rope_width`` = W the scores take the
    latent's L channels plus the last W (a rope width fixed at W while L is read from the batch). With
    ``full_tiles_unmasked`` a request whose length is a whole number of BLOCK-token tiles has every row see every
    token (a fast path for full tiles that skips the causal mask). With ``head0_max`` each tile's max of head 0
    serves every head of its row (a max broadcast from the wrong lane). With ``alpha_fmt`` the factor
    exp(m_old - m_new) that rescales the running output is rounded to that format (the row sum takes it unrounded).
    With ``head_tile`` = N, max(1, H // N) tiles of N heads are computed, the heads past them left at out 0, lse
    -inf. With ``slot_bits`` a token's slot in its page is read modulo 2^bits; with ``row_bits`` an MTP row's index
    modulo 2^bits in its causal mask; with ``page_magic_bits`` = b a token's logical page is (j ceil(2^b / P)) >> b
    (a division by a magic multiply, exact for every j below about 2^b / P, and wherever P is a power of two), its
    slot j mod P. With ``unit_kv_drops_q_scale`` a kv scale of exactly 1 takes the path without scales, q's
    dropped too. With ``pad_weight0`` every request's merge runs over the batch's most splits, its missing ones
    padding slots that read the first request's first split partial (its row r, or its last) with weight 0, so
    0 NaN = NaN there. With ``consecutive_flat`` = N a request on N pages or more whose page ids ascend one by one
    is read as a flat run of whole pages, its last page unmasked (``full_last_page`` for that request only). With
    ``split_empty_nan`` the rows of a split request that see no token get out NaN (a merge that divides by its
    weights' sum, 0 / 0 there). With ``out_index_bits`` the (row, head) pair t H + h is written to out and lse at
    that index modulo 2^bits, pairs in order (a later pair overwrites an earlier one), the slots from 2^bits on
    left at out 0, lse -inf. With ``column_bits`` a request's j-th page is read from its block-table column j modulo
    2^bits (a column index that wraps).
    """
    L, H, ps = batch.kv_lora_rank, batch.num_heads, batch.page_size
    sigma = batch.sm_scale if sm_scale is None else sm_scale
    if unit_kv_drops_q_scale and is_fp8(batch.kv_cache.dtype) and float(batch.kv_scale) == 1.0:
        use_q_scale = False  # the "no scales" path, picked by the cache's scale alone
    q = batch.q.float() * (batch.q_scale if is_fp8(batch.q.dtype) and use_q_scale else 1.0)  # [T, H, D]
    if rope_width is not None:  # channel c counts once for c < L and once for c >= D - W: twice, or not at all
        c = torch.arange(batch.head_dim, device=batch.device)  # [D]
        q = q * ((c < L).float() + (c >= batch.head_dim - rope_width).float())  # [T, H, D]
    kv_scale = batch.kv_scale if is_fp8(batch.kv_cache.dtype) and use_kv_scale else 1.0
    D = batch.head_dim if rope else L  # channels the scores use
    dev = batch.device
    out = torch.zeros(batch.num_tokens, H, L, dtype=torch.float32, device=dev)  # [T, H, L]
    lse = torch.full((batch.num_tokens, H), -math.inf, dtype=torch.float32, device=dev)  # [T, H]
    qo = batch.qo_indptr.tolist()
    seq_lens, q_lens = batch.seq_lens.tolist(), batch.q_lens.tolist()  # read once, for the loop and the knobs
    batch_piece = max(1, -(-sum(seq_lens) // 16)) if batch_splits else None  # tokens per piece
    q_max = max(q_lens, default=1)  # the batch's largest q_len
    block = BLOCK // q_max if rows_tiles else BLOCK  # tokens per softmax step
    if longest_splits:  # the longest request's piece: its whole pages' blocks over up to MAX_SPLITS splits
        s_max = max(seq_lens, default=0)
        longest_blocks = -(-(-(-s_max // ps) * ps) // BLOCK)  # blocks of its whole pages
        batch_piece = -(-longest_blocks // min(MAX_SPLITS, max(longest_blocks, 1))) * BLOCK or BLOCK
    splits, first_o = [], None  # pad_weight0: each request's split count; the first request's first partial
    active = [b for b, s in enumerate(seq_lens) if s > 0]  # active_bits: the work list of non-empty requests
    rank = {b: k for k, b in enumerate(active)}
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        read = b if active_bits is None or s == 0 else active[rank[b] % 2**active_bits]  # the request it reads
        s = seq_lens[read]
        n_pages = -(-s // ps)
        row = read % 2**request_bits if request_bits is not None else read  # the block-table row it reads
        cols = torch.arange(n_pages, device=dev)  # [n_pages] the block-table columns it reads
        if column_bits is not None:
            cols = cols % 2**column_bits  # [n_pages]
        pages = (batch.block_table[row, cols].long() + page_shift) % batch.num_pages  # [n_pages]
        if page_id_bits is not None:
            pages = pages % 2**page_id_bits  # [n_pages]
        if int32_offsets:  # the page's first element as int32 arithmetic leaves it: wrapped past 2^31, and read
            # modulo the cache's size (a GPU would read outside the allocation, or fault)
            first = (pages.to(torch.int32) * (ps * batch.head_dim)).long() % batch.kv_cache.numel()  # [n_pages]
            pages = first // (ps * batch.head_dim)  # [n_pages]
        K = batch.kv_cache[pages].reshape(n_pages * ps, batch.head_dim)  # [n_pages * ps, D] whole pages
        whole = full_last_page or (consecutive_flat is not None and n_pages >= consecutive_flat
                                   and bool((pages.diff() == 1).all()))  # the last page read to its end
        tail = None  # max_before_mask: the slots the last tile loads past the request's tokens
        if max_before_mask:  # whole pages up to the tile's end; entries past the request's pages read as page 0
            tile_pages = -(-(-(-s // BLOCK) * BLOCK) // ps)  # pages the last 64-token tile spans
            ids = torch.zeros(tile_pages, dtype=torch.long, device=dev)  # masked loads: other=0 (>= n_pages)
            ids[:n_pages] = pages
            tail = batch.kv_cache[ids].reshape(-1, batch.head_dim)[s : tile_pages * ps].float() * kv_scale
        if slot_bits is not None or page_magic_bits is not None:  # token j read at page * P + slot as computed
            j = torch.arange(n_pages * ps, device=dev)  # [n_pages P]
            page, slot = j // ps, j % ps  # [n_pages P] each
            if page_magic_bits is not None:
                page = (j * -(-(2**page_magic_bits) // ps)) >> page_magic_bits  # [n_pages P] may be one too many
            if slot_bits is not None:
                slot = slot % 2**slot_bits  # [n_pages P]
            K = K[(page * ps + slot) % (n_pages * ps)]  # [n_pages P, D] (past the last page: wrapped to the first)
        K = (K if whole else K[:s]).float() * kv_scale  # [s, D]
        if position_bits is not None:  # token j read at position j mod 2^bits: a counter that wraps
            K = K[torch.arange(K.shape[0], device=dev) % 2**position_bits]  # [s, D]
        r = torch.arange(n, device=dev)  # [n] MTP row index
        if row_bits is not None:
            r = r % 2**row_bits  # [n] the row index the mask takes
        rows_as = q_max if big_batch_rows is not None and batch.batch_size > big_batch_rows else n  # the mask's q_len
        visible = s - rows_as + r + 1 + torch.where(r < n - 1, causal_slack, 0)  # [n] tokens each row sees
        if full_tiles_unmasked and s % BLOCK == 0:
            visible = torch.full_like(visible, s)  # [n] every row every token
        visible = (visible + (K.shape[0] - s)).clamp(min=0) if whole else visible.clamp(0, s)  # [n]
        rows = q[qo[b] : qo[b + 1]]  # [n, H, D]
        if packed_row_bits is not None:  # packed (row, head) index r H + h read modulo 2^bits: a counter that wraps
            packed = torch.arange(n * H, device=dev) % 2**packed_row_bits  # [n H]
            rows = rows.reshape(n * H, -1)[packed].reshape(n, H, -1)  # [n, H, D]
        n_blocks = -(-K.shape[0] // BLOCK)
        per_split = -(-n_blocks // min(MAX_SPLITS, max(n_blocks, 1))) * BLOCK if n_blocks else BLOCK
        if batch_splits or longest_splits:
            per_split = batch_piece
        starts = range(0, max(K.shape[0], 1), per_split)
        parts = [_split(rows, K[j : j + per_split], j, visible, sigma, D, L, acc_dtype, empty_nan, max_sub, p_fmt,
                        max_init, max_before_mask, tail if j == starts[-1] else None, l_rounded, p_scale, block,
                        head0_max, alpha_fmt)
                 for j in starts]
        o_s = torch.stack([p[0] for p in parts])  # [S, n, H, L]
        lse_s = torch.stack([p[1] for p in parts])  # [S, n, H]
        if len(parts) > 1:  # split outputs stored in partial_dtype for the merge (their lse in fp32)
            o_s = o_s.to(partial_dtype).float()
        order = torch.arange(len(parts), device=dev).roll(-merge_shift)  # [S] the order the merge sums them in
        out[qo[b] : qo[b + 1]], lse[qo[b] : qo[b + 1]] = _merge(o_s[order], lse_s[order], merge, empty_nan)
        if split_empty_nan and len(parts) > 1:  # 0 / 0 on the rows that see no token (lse -inf)
            out[qo[b] : qo[b + 1]][torch.isinf(lse[qo[b] : qo[b + 1]])] = math.nan  # [n, H, L] where lse is -inf
        splits.append(len(parts))
        first_o = o_s[0] if first_o is None and s and n else first_o  # [n0, H, L]
    if pad_weight0 and first_o is not None:  # each padding slot: 0 x the first partial's row r (or its last)
        most = max(splits)
        for b, n in enumerate(q_lens):
            if splits[b] < most and n:
                r = torch.arange(n, device=dev).clamp(max=first_o.shape[0] - 1)  # [n]
                out[qo[b] : qo[b + 1]] += 0.0 * first_o[r]  # [n, H, L] 0, or NaN where the partial is
    if head_tile is not None:  # the heads past the last whole tile: never computed
        computed = max(1, H // head_tile) * head_tile
        out[:, computed:], lse[:, computed:] = 0.0, -math.inf
    if out_index_bits is not None:  # slot i holds the last pair written there: i + k 2^bits, the largest below T H
        pairs, wrap = out.shape[0] * H, 2**out_index_bits
        i = torch.arange(pairs, device=dev)  # [T H] slots
        last = i + (pairs - 1 - i) // wrap * wrap  # [T H] the last pair written to slot i (i itself past 2^bits)
        unwritten = (i >= wrap).reshape(-1, H)  # [T, H]
        out = out.reshape(pairs, L)[last].reshape(-1, H, L).masked_fill(unwritten[..., None], 0.0)  # [T, H, L]
        lse = lse.reshape(pairs)[last].reshape(-1, H).masked_fill(unwritten, -math.inf)  # [T, H]
    out = (out * gain).to(torch.bfloat16)
    return out, lse * math.log2(math.e) if lse_base2 else lse


def _split(rows, K, start, visible, sigma, D, L, acc_dtype, empty_nan, max_sub, p_fmt, max_init=-math.inf,
           max_before_mask=False, tail=None, l_rounded=False, p_scale=1.0, block=BLOCK, head0_max=False,
           alpha_fmt=None):
    """One split: online softmax over ``block``-token steps. rows [n, H, D'], K [m, D'] -> (o [n, H, L], lse [n, H]).
    ``tail`` [e, D'] (max_before_mask, the last split): the slots its last tile loads past the request's tokens
    (whole pages to the tile's end, entries past the request's pages read as page 0): they enter that tile's max."""
    n, H = rows.shape[:2]
    dev = rows.device
    m = torch.full((n, H), max_init, device=dev)  # [n, H] running max
    l = torch.zeros(n, H, dtype=acc_dtype, device=dev)  # [n, H] running Σ exp(s - m)
    acc = torch.zeros(n, H, L, dtype=acc_dtype, device=dev)  # [n, H, L] running Σ exp(s - m) v
    for j in range(0, K.shape[0], block):
        Kb = K[j : j + block]  # [b, D]
        pos = start + j + torch.arange(Kb.shape[0], device=dev)  # [b] token positions
        s = sigma * torch.einsum("nhd,bd->nhb", rows[..., :D], Kb[:, :D])  # [n, H, b]
        masked = s.masked_fill(~(pos[None, :] < visible[:, None])[:, None, :], -math.inf)  # [n, H, b]
        # [n, H] the tile's max; max_before_mask: over every slot it loads, masked or not, NaN-blind
        tile_max = (s.nan_to_num(nan=-math.inf) if max_before_mask else masked).amax(dim=-1)
        if tail is not None and tail.shape[0] and j + block >= K.shape[0]:  # the last tile: the page's rest too
            s_tail = sigma * torch.einsum("nhd,ed->nhe", rows[..., :D], tail[:, :D])  # [n, H, e]
            tile_max = torch.maximum(tile_max, s_tail.nan_to_num(nan=-math.inf).amax(dim=-1))
        if head0_max:
            tile_max = tile_max[:, :1].expand(n, H)  # [n, H] head 0's for every head
        s = masked
        m_new = torch.maximum(m, tile_max) if max_sub else torch.zeros_like(m)  # [n, H] (0: exp(s) unshifted)
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # [n, H] no token seen yet: shift by 0
        alpha = torch.exp(m - m_safe)  # [n, H] rescale of the old sums (0 while m = -inf)
        p = torch.exp(s - m_safe[..., None])  # [n, H, b]
        p_pv = p if p_fmt is None else round_p(p, p_fmt, p_scale)  # [n, H, b] P as P.V sees it
        l = (alpha * l.float() + (p_pv if l_rounded else p).sum(dim=-1)).to(acc_dtype)  # l: unrounded p by default
        alpha_acc = alpha if alpha_fmt is None else round_p(alpha, alpha_fmt)  # [n, H] the output's factor
        acc = (alpha_acc[..., None] * acc.float() + torch.einsum("nhb,bc->nhc", p_pv, Kb[:, :L])).to(acc_dtype)
        m = m_new
    l, acc = l.float(), acc.float()
    if empty_nan:
        return acc / l[..., None], m + torch.log(l)  # 0 / 0 = NaN on a row that saw nothing
    seen = l != 0  # [n, H] a NaN row sum (a NaN token) is no empty row: it stays NaN
    o = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)  # [n, H, L]
    return o, torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)


def _merge(o_s, lse_s, how, empty_nan):
    """Merge split partials o_s [S, n, H, L], lse_s [S, n, H] -> (out [n, H, L], lse [n, H]) (numerics.md §3)."""
    if how == "drop_nan":  # aiter's reduce: a NaN partial merged as an empty split
        nan = torch.isnan(lse_s)  # [S, n, H]
        lse_s, o_s = lse_s.masked_fill(nan, -math.inf), o_s.masked_fill(nan[..., None], 0.0)
    M = lse_s.amax(dim=0)  # [n, H] NaN when a split is NaN
    M_safe = torch.where(torch.isinf(M), 0.0, M)
    total = torch.exp(lse_s - M_safe).sum(dim=0)  # [n, H]
    lse = torch.where(total != 0, M_safe + torch.log(total), -math.inf)  # [n, H] NaN stays NaN
    if how == "mean":
        has = torch.isfinite(lse_s)  # [S, n, H] splits that saw a token
        cnt = has.sum(dim=0).clamp(min=1)  # [n, H]
        return torch.where(has[..., None], o_s, 0.0).sum(dim=0) / cnt[..., None], lse
    w = torch.exp(lse_s - torch.where(total != 0, lse, 0.0))  # [S, n, H] merge weights (0 for empty splits)
    if empty_nan:
        return (w[..., None] * o_s).sum(dim=0), lse  # NaN partials of empty splits propagate
    return (w[..., None] * torch.where(w[..., None] > 0, o_s, 0.0)).sum(dim=0), lse


# ---- the plug-ins ---------------------------------------------------------------------------------------------------


def _dense_decode(batch: DecodeBatch, seq_lens: torch.Tensor, q_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention `_decode` computes, unsplit, in shapes fixed by the batch's tensors (its block table's capacity,
    q's rows) with the lengths ``seq_lens`` / ``q_lens`` [B] read on the device only: no host read, no shape that
    depends on a length, so a CUDA graph of it replays right with other lengths -> (out [T, H, L] bf16, lse [T, H]).
    Rows go DENSE_ROWS at a time, each over its request's whole block-table row (a batch of 264 requests with one of
    12288 tokens took 24 GB in one piece)."""
    L, ps, dev = batch.kv_lora_rank, batch.page_size, batch.device
    B, W = batch.block_table.shape
    q = batch.q.float() * (batch.q_scale if is_fp8(batch.q.dtype) else 1.0)  # [T, H, D]
    kv_scale = batch.kv_scale if is_fp8(batch.kv_cache.dtype) else 1.0
    pages = batch.block_table.long().clamp(0, batch.num_pages - 1)  # [B, W] unused entries: any page, masked below
    pos = torch.arange(W * ps, device=dev)  # [S] token positions, S = W * ps slots
    ends = torch.cumsum(q_lens.long(), 0)  # [B] one past each request's last row
    t = torch.arange(batch.num_tokens, device=dev)  # [T]
    req = torch.searchsorted(ends, t, right=True).clamp(max=max(B - 1, 0))  # [T] request of each row
    visible = seq_lens.long()[req] - (ends[req] - t) + 1  # [T] tokens row t sees (causal MTP)
    valid = pos[None, :] < seq_lens.long()[req][:, None]  # [T, S] its request's tokens
    out = torch.empty(batch.num_tokens, batch.num_heads, L, device=dev)  # [T, H, L]
    lse = torch.empty(batch.num_tokens, batch.num_heads, device=dev)  # [T, H]
    for r in range(0, batch.num_tokens, DENSE_ROWS):
        rows = slice(r, r + DENSE_ROWS)
        Kt = batch.kv_cache[pages[req[rows]]].flatten(1, 2).float() * kv_scale  # [R, S, D] each row's request
        Kt = torch.where(valid[rows, :, None], Kt, 0.0)  # [R, S, D] NaN padding out of P.V
        s = batch.sm_scale * torch.einsum("thd,tsd->ths", q[rows], Kt)  # [R, H, S]
        s = s.masked_fill(~(pos[None, :] < visible[rows, None])[:, None, :], -math.inf)
        m = s.amax(dim=-1)  # [R, H]
        m_safe = torch.where(torch.isinf(m), 0.0, m)  # [R, H] no token seen: shift by 0
        p = torch.exp(s - m_safe[..., None])  # [R, H, S]
        l = p.sum(dim=-1)  # [R, H]
        seen = l != 0  # [R, H] a NaN row sum (a NaN token) is no empty row
        o = torch.einsum("ths,tsc->thc", p, Kt[..., :L]) / torch.where(seen, l, 1.0)[..., None]  # [R, H, L]
        out[rows] = torch.where(seen[..., None], o, 0.0)
        lse[rows] = torch.where(seen, m_safe + torch.log(torch.where(seen, l, 1.0)), -math.inf)
    return out.to(torch.bfloat16), lse


def _one_decode_step(seq_lens: torch.Tensor, q_lens: torch.Tensor, batch: DecodeBatch) -> bool:
    """``batch`` holds the requests of the lengths ``seq_lens`` / ``q_lens`` [B] one decode step later: the same
    q_lens, each length grown by 0 to its q_len (the condition a plan's fast path keys on)."""
    grew = batch.seq_lens - seq_lens  # [B]
    return torch.equal(batch.q_lens, q_lens) and bool(((grew >= 0) & (grew <= batch.q_lens)).all())


class _Step:
    """A graph-capturable step (the plug-in contract's ``.step``) of the unsplit decode `_dense_decode`: plan(batch)
    copies the batch's lengths into the step's own device buffers, as a serving step's plan fills its metadata
    buffers, and run() decodes the step's batch with them into an fp32 workspace, then out and lse from it.
    ``stale``: only the first plan() copies the lengths, as a step that bakes the captured step's lengths into its
    launch does. ``realloc``: every plan() allocates a new workspace (a buffer sized to the plan), dropping the one
    a captured graph writes. ``fast_path``: a plan() for the same q_lens with every length grown by 0 to its q_len
    keeps the planned lengths, as a plan that reuses its pieces for the next decode step does."""

    def __init__(self, batch: DecodeBatch, max_q_len: int, stale: bool = False, realloc: bool = False,
                 fast_path: bool = False):
        self.batch, self.max_q_len, self.stale, self.realloc, self.planned = batch, max_q_len, stale, realloc, False
        self.fast_path = fast_path
        self.seq_lens, self.q_lens = batch.seq_lens.clone(), batch.q_lens.clone()  # [B] each, the step's buffers
        self.workspace = self._workspace()  # [T, H, L + 1] fp32: out's channels, then lse

    def plan(self, batch: DecodeBatch) -> None:
        if batch is not self.batch:
            raise ValueError("plan: batch must be the step's own (refill its tensors in place)")
        if batch.batch_size and int(batch.q_lens.max()) > self.max_q_len:
            raise ValueError(f"plan: q_lens must be <= the step's max_q_len {self.max_q_len}, got "
                             f"{batch.q_lens.tolist()}")
        one_step = _one_decode_step(self.seq_lens, self.q_lens, batch)
        if not (self.stale and self.planned) and not (self.fast_path and self.planned and one_step):
            self.seq_lens.copy_(batch.seq_lens)
            self.q_lens.copy_(batch.q_lens)
        if self.realloc:
            self.workspace = self._workspace()
        self.planned = True

    def _workspace(self) -> torch.Tensor:
        b = self.batch
        return torch.empty(b.num_tokens, b.num_heads, b.kv_lora_rank + 1, dtype=torch.float32, device=b.device)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.planned:
            raise RuntimeError("run() before plan()")
        out, lse = _dense_decode(self.batch, self.seq_lens, self.q_lens)  # [T, H, L] bf16, [T, H] fp32
        L = self.batch.kv_lora_rank
        self.workspace[..., :L].copy_(out)  # exact: bf16 into fp32
        self.workspace[..., L].copy_(lse)
        return self.workspace[..., :L].to(torch.bfloat16), self.workspace[..., L].clone()


def correct(batch):
    """No bug: must pass every check, its graph-capturable step's too."""
    return _decode(batch)


correct.step = _Step
correct.batch_invariant = True  # each request's splits and sums depend on that request alone


def wrong_scale(batch):
    """Softmax scale 576^-1/2 (FlashMLA's default) instead of the batch's σ with YaRN mscale²."""
    return _decode(batch, sm_scale=576**-0.5)


def drop_rope(batch):
    """Scores from the 512 latent channels only: the 64 RoPE channels of q and k are lost."""
    return _decode(batch, rope=False)


def page_off_by_one(batch):
    """Physical page id off by one: every token is read from the neighbouring page."""
    return _decode(batch, page_shift=1)


def last_page_unmasked(batch):
    """The last page is read in full: unused slots (NaN) enter the softmax."""
    return _decode(batch, full_last_page=True)


def lse_base2(batch):
    """LSE returned in base 2 (log2 Σ exp(s)) where the contract says natural log."""
    return _decode(batch, lse_base2=True)


def kv_scale_ignored(batch):
    """fp8 KV dequantized without kv_scale."""
    return _decode(batch, use_kv_scale=False)


def q_scale_ignored(batch):
    """fp8 q dequantized without q_scale."""
    return _decode(batch, use_q_scale=False)


def average_splits(batch):
    """Split-KV partials averaged instead of LSE-weighted."""
    return _decode(batch, merge="mean")


def mtp_causal_off_by_one(batch):
    """MTP rows (all but a request's last) see one future token: the causal diagonal compared with <=."""
    return _decode(batch, causal_slack=1)


def nan_empty(batch):
    """A row that sees no token computes 0 / 0: out NaN instead of 0."""
    return _decode(batch, empty_nan=True)


def nan_dropped(batch):
    """A split whose partial is NaN (a NaN in a token it reads) merged as an empty one, as aiter's reduce does: a
    finite answer from a NaN input on split rows."""
    return _decode(batch, merge="drop_nan")


def no_max_subtraction(batch):
    """Softmax without subtracting the running max: exp(s) overflows fp32 once a logit passes 88.7."""
    return _decode(batch, max_sub=False)


def int32_offsets(batch):
    """Cache rows addressed through int32 element offsets (page x page_size x 576): right on a test's small cache,
    wrong once pages lie past element 2^31 of a production one."""
    return _decode(batch, int32_offsets=True)


def p_rounded_bf16(batch):
    """P rounded to bf16 before P.V (the row sum from unrounded P) while the kernel declares fp32 P, the plug-in
    default: 2^-9-relative errors on the weights, of the size of the bf16 output's own rounding on drawn data."""
    return _decode(batch, p_fmt="bf16")


def bf16_partials(batch):
    """Split outputs stored in bf16 for the merge (their lse in fp32, as FlashInfer's merge_state takes them) while
    the kernel declares fp32 partials, the plug-in default: a 2^-9-relative error on each split's output, hidden on
    drawn data by the output's own bf16 rounding."""
    return _decode(batch, partial_dtype=torch.bfloat16)


def out_gain(batch):
    """A systematic relative error of 2^-7 on out (two bf16 ulps): cos-diff 3e-5 passes vLLM's fp8 check (1e-4)."""
    return _decode(batch, gain=1 + 2**-7)


def bf16_accumulation(batch):
    """Running softmax sum and output accumulator stored in bf16 between 64-token blocks: precision loss over long
    sequences."""
    return _decode(batch, acc_dtype=torch.bfloat16)


def seq_lens_cleared(batch):
    """Writes its input: zeroes batch.seq_lens, then decodes what is left (every row empty: out 0, lse -inf). An
    oracle computed after the kernel would agree with it."""
    batch.seq_lens.zero_()
    return _decode(batch)


def cache_padding_written(batch):
    """A correct output, but the kernel then writes 0 into the cache slots no token uses (NaN in built batches): a
    write into its inputs that no output comparison sees."""
    out = _decode(batch)
    kv = batch.kv_cache  # [P, page_size, D]
    raw = kv.view(torch.uint8).view(*kv.shape, kv.element_size())  # [P, page_size, D, bytes]
    raw[torch.isnan(kv.float())] = 0
    return out


def _read_dense(t: torch.Tensor) -> torch.Tensor:
    """t's storage read from its first element as if t were contiguous: addresses from its shape, not its strides
    (the identity on a contiguous tensor)."""
    strides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * t.shape[d + 1]
    return t.as_strided(t.shape, strides, t.storage_offset())


def ignores_strides(batch):
    """q, the cache and the block table addressed from their shapes (row t of q at t x H x 576, page p of the cache
    at p x page_size x 576, a block-table row at b x max_pages): right on every contiguous batch, wrong on the views
    a serving engine passes (a block table that is the first rows of a wider buffer, a padded cache)."""
    return _decode(batch.replace(q=_read_dense(batch.q), kv_cache=_read_dense(batch.kv_cache),
                                 block_table=_read_dense(batch.block_table)))


def hardcoded_scale(batch):
    """Softmax scale fixed at DeepSeek-V3's (YaRN mscale² with mscale_all_dim 1) whatever the batch's σ: right on
    three drawn cases of four (they take V3's), wrong for the same model without YaRN or for DeepSeek-V2-Lite."""
    return _decode(batch, sm_scale=SM_SCALE)


def uint16_positions(batch):
    """Token positions kept in 16 bits: token j of a request read at position j mod 2^16, right on every request of
    up to 65536 tokens (every drawn case), wrong on the long cases (`mla-verify --long`, on CUDA devices by default)."""
    return _decode(batch, position_bits=16)


_calls: dict[int, int] = {}  # merge_order_varies: calls so far per live batch (id), dropped with the batch


def merge_order_varies(batch):
    """Split partials merged in an order that changes from call to call (the k-th call on a batch starts the
    merge's sums at split k, as atomic adds in the order splits finish do), while the kernel declares itself
    deterministic, the plug-in default: every result is right, but two runs on the same batch may differ in their
    last bits (in rows of three or more splits: the lse's fp32 sum, and out where its bf16 rounding tips). Counted
    per batch, so that a case replayed alone (`--case`) sees the orders it saw in its campaign."""
    key = id(batch)
    if key not in _calls:
        weakref.finalize(batch, _calls.pop, key, None)
    k = _calls[key] = _calls.get(key, -1) + 1
    return _decode(batch, merge_shift=k)


def splits_follow_batch(batch):
    """A request's pieces are ceil(the batch's tokens / 16) tokens long, as a planner that spreads the batch's work
    over 16 workers cuts them, while the kernel declares itself batch-invariant: every result is right (within
    the merge bound), but a request's bits change with its neighbours."""
    return _decode(batch, batch_splits=True)


splits_follow_batch.batch_invariant = True


def splits_follow_longest(batch):
    """A request's pieces are the batch's longest request's (its 64-token blocks over up to 4 splits), as a kernel
    that sizes its splits once per batch from the longest request does, while it declares itself batch-invariant:
    every result is right, but a request's bits change when the batch's longest length does, even where two
    requests share it."""
    return _decode(batch, longest_splits=True)


splits_follow_longest.batch_invariant = True


def tiles_follow_q_len(batch):
    """The online softmax steps over 64 / (the batch's largest q_len) tokens, as a kernel that keeps its tile's
    rows x tokens fixed and sizes the tile once per batch does, while it declares itself batch-invariant: every
    result is right, but a plain decode request's bits change when an MTP request joins its batch."""
    return _decode(batch, rows_tiles=True)


tiles_follow_q_len.batch_invariant = True


def big_batch_mtp_mask(batch):
    """In batches of more than 16 requests (a large-batch path: a [B, largest q_len] grid of query rows) every
    request's causal mask is that of the batch's largest q_len, its rows taken as the grid's first ones: a request
    with fewer rows sees that many tokens fewer. Right in every drawn case (at most 8 requests); only the smoke
    prefix's 260-request batch, whose MTP requests sit among single-row ones, shows it."""
    return _decode(batch, big_batch_rows=16)


def page_ids_16bit(batch):
    """Page ids kept in 16 bits (a block table narrowed to uint16 for its metadata, say): page 65536 + p is read as
    page p. Right on every cache of fewer than 2^16 pages; the far check, whose pages lie past id 2^16 with NaN in
    front, shows it (found by a review: on pages of 64 and 128 the far check's ids stayed under 2^16)."""
    return _decode(batch, page_id_bits=16)


def block_column_12bit(batch):
    """A request's block-table column kept in 12 bits: its page 4096 + j is read from column j. Right on every
    request of at most 4096 pages (a quarter of a million tokens on pages of 64); the long cases' request of 2^16 + 65
    tokens on pages of 1 shows it (a review's bug, seventy-first session: no request had more than 4096 pages)."""
    return _decode(batch, column_bits=12)


def request_index_8bit(batch):
    """A request's block-table row read at its index modulo 256, as a kernel that keeps the request index of its
    work items in 8 bits does: request 256 reads request 0's pages. Right in every batch of at most 256 requests;
    only the smoke prefix's 260-request batch, whose request 256 has tokens, shows it (found by a review: the
    largest batch built then had 65 requests)."""
    return _decode(batch, request_bits=8)


def request_index_9bit(batch):
    """`request_index_8bit` with 9 bits: request 512 reads request 0's pages. Right in every batch of at most 512
    requests (a CUDA graph's largest); the smoke prefix's 520 non-empty requests show it (a review's bug,
    seventy-first session: the largest batch built had 302 requests)."""
    return _decode(batch, request_bits=9)


def active_index_8bit(batch):
    """A work list of the non-empty requests (a persistent kernel's, which skips a CUDA graph's padding requests of
    length 0) keeps each entry's request slot in 8 bits: the 257th non-empty request reads the first one's pages and
    length. Right while a batch has at most 256 non-empty requests; the smoke prefix's 520 non-empty requests show
    it (a review's bug, sixty-ninth session: the most non-empty requests of any case were 64)."""
    return _decode(batch, active_bits=8)


def packed_rows_10bit(batch):
    """`packed_rows_wrap` with 10 bits: right up to 1024 (row, head) pairs per request, so on the 128-head case of
    4 MTP rows (512); the smoke prefix's 128 heads with 9 MTP rows (1152) show it (a review's bug, sixty-ninth
    session)."""
    return _decode(batch, packed_row_bits=10)


def mtp_row_5bit(batch):
    """`mtp_row_3bit` with 5 bits: right up to 32 MTP rows; the smoke prefix's request of 40 rows shows it (a
    review's bug, sixty-ninth session: drawn q_lens stop at 16, the smoke prefix's were 12)."""
    return _decode(batch, row_bits=5)


def out_index_16bit(batch):
    """The output's (row, head) index t H + h kept in 16 bits: past 65536 pairs a pair overwrites the one 2^16
    before it, and the slots from 2^16 on stay unwritten. Right on every batch of at most 512 rows of 128 heads;
    the long cases' 128-head MTP batch (528 rows) shows it (a review's bug, seventy-first session: no case had more
    than 1930 pairs)."""
    return _decode(batch, out_index_bits=16)


BIG_BATCH_PATH = 64  # requests past which the two large-batch mutants take their own path


def big_batch_heads16(batch):
    """In batches of more than 64 requests (a large-batch path) the heads are computed in H // 16 tiles of 16
    (`head_tiles_floor`'s bug with tiles of 16): at 20 heads, heads 16-19 come out 0 with lse -inf. Right at
    multiples of 16 heads, at fewer than 16 and in smaller batches; the smoke prefix's 66 split requests at 20 heads
    show it (a review's bug, seventieth session: both larger batches had 2 heads)."""
    return _decode(batch, head_tile=16 if batch.batch_size > BIG_BATCH_PATH else None)


def big_batch_q_scale(batch):
    """In batches of more than 64 requests (a large-batch path) fp8 q's scale is dropped (`q_scale_ignored` there
    only). Right on bf16 q and in smaller batches; the smoke prefix's 66 split requests with fp8 q show it in fp8
    campaigns (a review's bug, seventieth session: both larger batches had bf16 q)."""
    return _decode(batch, use_q_scale=batch.batch_size <= BIG_BATCH_PATH)


def split_empty_nan(batch):
    """A reduce that divides the merged output by its weights' sum: the rows of a split request that see no token
    (more MTP rows than tokens, in a request longer than one 64-token tile) get 0 / 0 = NaN, where an unsplit
    request's get 0. Our kernels take 64 rows at most, too few for such a row; the smoke prefix's 72 rows over 70
    tokens show it (a review's bug, seventieth session: no case had a split request with such rows)."""
    return _decode(batch, split_empty_nan=True)


def consecutive_pages_flat(batch):
    """A request on 4 pages or more whose page ids ascend one by one (what an allocator mostly gives a request)
    takes a flat fast path that reads its pages whole, the last one unmasked: NaN from its unused slots. Right on
    every batch a campaign builds (pages in a random order); the layout check, which lays each request's pages out
    consecutively (`pages_in_use_order`), shows it (a review's bug, sixty-ninth session: it was caught only by the
    rerun check, whose grown requests happen to take consecutive pages)."""
    return _decode(batch, consecutive_flat=4)


def max_init_zero(batch):
    """The running max starts at 0 instead of -inf: right while a row has a score above about -87; where every
    score it sees is lower (the shifted smoke case's earlier MTP rows, at -120) exp flushes to 0 and the row comes
    out empty."""
    return _decode(batch, max_init=0.0)


def max_before_mask(batch):
    """Each tile's max taken over every slot it loads, before the causal and length mask, NaN ignored as GPU max
    instructions do (so the NaN padding hides it); the last 64-token tile loads whole pages to its end, the
    block-table entries past the request's pages read as page 0 (masked loads with other=0). A row that may not
    see a dominant newer token (the shifted smoke case's +120), or a finite stale token in the slots past its
    length (the padding probe's, on the last page and on page 0), is shifted by it, and its own tokens flush to 0."""
    return _decode(batch, max_before_mask=True)


def packed_rows_wrap(batch):
    """The packed (query row, head) index r H + h of a request kept in 8 bits: right up to 256 pairs (every drawn
    case past 64 heads has one or two rows), wrong for 128 heads with MTP rows of 3 or 4 (the smoke case of DeepSeek-V3
    as served)."""
    return _decode(batch, packed_row_bits=8)


_PLANS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # plan_cached_by_ptr's memo


def _address_key(batch: DecodeBatch) -> tuple:
    """The addresses and shapes of the batch's length and block-table tensors: what an eager wrapper that skips
    replanning keys its plan by."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in (batch.seq_lens, batch.q_lens, batch.block_table))


def plan_cached_by_ptr(batch):
    """An eager wrapper that memoises its plan (host copies of the lengths it splits by) keyed by the addresses and
    shapes of the batch's length and block-table tensors, as a wrapper that skips the host sync of replanning
    does: right on every new batch, wrong once a serving loop rewrites those tensors in place for the next step
    (the rerun check); caught elsewhere only where the allocator hands a later case the same addresses."""
    key = _address_key(batch)
    if key not in _PLANS:
        _PLANS[key] = (batch.seq_lens.clone(), batch.q_lens.clone())
    seq_lens, q_lens = _PLANS[key]
    return _decode(batch.replace(seq_lens=seq_lens, q_lens=q_lens))


def rope_width_64(batch):
    """The scores over the latent's L channels and the last 64, DeepSeek's rope width, whatever the batch's rope_dim
    is: right for every DeepSeek-shaped batch; with MiniCPM3's latent of 256 and rope of 32, q_c k_c counts twice on
    latent channels 224-255 (found by a review: every drawn case had the rope of 64)."""
    return _decode(batch, rope_width=64)


def full_tile_fast_path(batch):
    """A request whose length is a whole number of 64-token tiles takes a fast path without the causal mask: each
    of its MTP rows sees every token, the newer ones too (found by a review: no smoke case had MTP rows on such a
    length)."""
    return _decode(batch, full_tiles_unmasked=True)


_AS_ITS_OWN = {torch.float16: torch.bfloat16, torch.float8_e4m3fnuz: torch.float8_e4m3fn,
               torch.float8_e5m2: torch.float8_e4m3fn}  # dtype_unchecked: the bits of each read as these


def dtype_unchecked(batch):
    """A kernel built for bf16 and e4m3fn and fed through data_ptr() without a dtype check: an fp16 q and cache are
    read as bf16 bits, e4m3fnuz and e5m2 codes as e4m3fn ones (found by a review: every case of a campaign had its
    --dtype and --fp8-format, so no such input ever came)."""
    q, kv = batch.q, batch.kv_cache
    return _decode(batch.replace(q=q.view(_AS_ITS_OWN.get(q.dtype, q.dtype)),
                                 kv_cache=kv.view(_AS_ITS_OWN.get(kv.dtype, kv.dtype))))


def alpha_bf16(batch):
    """The factor exp(m_old - m_new) that rescales the running output when the max rises rounded to bf16, while
    the row sum takes the fp32 one, as a warp-specialized kernel that hands it from its softmax warps to its
    correction warps through bf16 shared memory does: up to 2^-9 per rise, undeclared (found by a review: on drawn
    data the output's bf16 rounding hides it, and the rounding probe's max never rises)."""
    return _decode(batch, alpha_fmt="bf16")


def head_tiles_floor(batch):
    """Heads computed in tiles of 64 with H // 64 tiles launched (at least one): right for every head count up to 64
    and every multiple of 64; at 96 heads, heads 64-95 are never computed (out 0, lse -inf). A review's bug: drawn
    heads are at most 64 or 128, so the smoke prefix's 96-head case is the one that shows it."""
    return _decode(batch, head_tile=64)


def slot_8bit(batch):
    """A token's slot in its page kept in 8 bits: right on pages of up to 256 tokens; on pages of 512, slot 256 + i
    reads slot i (a review's bug: drawn pages stop at 64, the smoke prefix's at 128 until its 528 case)."""
    return _decode(batch, slot_bits=8)


def mtp_row_3bit(batch):
    """An MTP row's index kept in 3 bits in the causal mask: right for up to 8 query rows; row 8 + i of a request is
    masked as row i (a review's bug: drawn q_lens stop at 4, the smoke prefix's at 8 until its 12-row case)."""
    return _decode(batch, row_bits=3)


def page_div_magic16(batch):
    """A token's logical page from a 16-bit magic multiply, (j ceil(2^16 / P)) >> 16, its slot j mod P: exact on
    pages of a power of two and, elsewhere, below j of about 2^16 / (P e), e = ceil(2^16 / P) - 2^16 / P: on pages
    of 3 below 32768, so the drawn pages of 3 never show it (a review's bug); on pages of 528 token 527 (page 0's
    last slot) reads page 1's last slot, the smoke prefix's case of 700 tokens there."""
    return _decode(batch, page_magic_bits=16)


def unit_kv_fastpath(batch):
    """A kv scale of exactly 1 taken for "no scales": the kernel's unscaled path, which drops fp8 q's scale too.
    Right wherever both scales are 1 or the cache's is not; vLLM's default k_scale of 1.0 beside a dynamically
    quantized fp8 q shows it (a review's bug: every case's scale mode set both scales, so the smoke prefix's
    kv_unit case is the one that shows it)."""
    return _decode(batch, unit_kv_drops_q_scale=True)


def head0_max(batch):
    """Each tile's running max of a row taken from its head 0 for every head, as a kernel that packs (row, head)
    pairs into a tile and broadcasts the row max from the wrong lane does: softmax ignores a shift, so it is right
    unless another head's scores lie about 88 nats above head 0's (exp overflows: inf, then NaN) or 103 below (its
    tokens flush to 0) (found by a review: no case shifted one head against another)."""
    return _decode(batch, head0_max=True)


def shared_page_reuse(batch):
    """A request on the same pages as an earlier one in its batch (the same first page, length and q_len: a
    sibling on one prefix, as parallel sampling makes them) takes that request's results, as a kernel that keeps
    its per-page results by physical page id for the rows of the first request to read the page does: right while
    such requests have the same queries (found by a review: no batch the checks built had two requests with other
    queries on one page)."""
    out, lse = _decode(batch)  # [T, H, L], [T, H]
    qo, first_page = batch.qo_indptr.tolist(), batch.block_table[:, 0].tolist()
    readers: dict[tuple[int, int, int], int] = {}  # (first page, length, q_len) -> the first request reading it
    for b, (s, n) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens.tolist())):
        if s:
            a = readers.setdefault((first_page[b], s, n), b)
            out[qo[b] : qo[b + 1]], lse[qo[b] : qo[b + 1]] = out[qo[a] : qo[a + 1]], lse[qo[a] : qo[a + 1]]
    return out, lse


def _first_page_groups(batch: DecodeBatch, min_tokens: int) -> list[list[int]]:
    """The requests of ``min_tokens`` tokens or more grouped by the physical page they start on, each group in
    batch order (what a cascade kernel's prefix detection by first page id groups)."""
    groups: dict[int, list[int]] = {}  # first page -> its requests
    for b, s in enumerate(batch.seq_lens.tolist()):
        if s >= min_tokens:
            groups.setdefault(int(batch.block_table[b, 0]), []).append(b)
    return list(groups.values())


def prefix_by_first_page(batch):
    """Requests that start on one physical page are taken to share a prefix up to the shorter one's full pages, as a
    cascade kernel that detects shared prefixes by the first page id alone (not the run of equal pages) does: each
    reads the pages of the first request starting there for those pages. Right while such requests share every one
    of them, as siblings on one block-table row do (found by a review: every sibling the checks built shared all its
    pages with the longest request)."""
    table, P, seq_lens = batch.block_table.clone(), batch.page_size, batch.seq_lens.tolist()  # [B, W]
    for lead, *later in _first_page_groups(batch, 1):
        for b in later:
            common = min(seq_lens[b], seq_lens[lead]) // P  # the shorter one's full pages
            table[b, :common] = batch.block_table[lead, :common]
    return _decode(batch.replace(block_table=table))


def prefix_first_pair(batch):
    """Requests (of a full page or more) that start on one physical page form a group whose shared prefix is the
    run of full pages its first two members share; every later member reads the first one's pages for that run (up
    to its own full pages), as a cascade kernel that sizes a group's prefix from its first pair does. Right while
    every member shares at least as much (found by a review: the shared batch's partial sibling came first, so the
    first pair always shared least)."""
    table, P, seq_lens = batch.block_table.clone(), batch.page_size, batch.seq_lens.tolist()  # [B, W]
    for lead, second, *later in (g for g in _first_page_groups(batch, P) if len(g) >= 3):
        full = min(seq_lens[lead], seq_lens[second]) // P
        shared = int((batch.block_table[lead, :full] == batch.block_table[second, :full]).long().cumprod(0).sum())
        for b in later:
            run = min(shared, seq_lens[b] // P)
            table[b, :run] = batch.block_table[lead, :run]
    return _decode(batch.replace(block_table=table))


_FAST_PLANS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # eager_fast_path's memo


def eager_fast_path(batch):
    """An eager wrapper that memoises its plan (the lengths it splits by) keyed by the addresses and shapes of the
    batch's length and block-table tensors, as plan_cached_by_ptr does, but replans whenever the lengths change,
    except when the same requests come back one decode step later (the same q_lens, each length grown by at most its
    q_len): then it keeps the pieces it planned, here the lengths, and never reads that step's new tokens. The eager
    twin of fast_path_plan (found by a review: the rerun check's next step rotates the requests, so only a plain
    decode step after it, ``rerun.decode``, takes that path)."""
    key = _address_key(batch)
    seq_lens = batch.seq_lens
    if key in _FAST_PLANS and _one_decode_step(*_FAST_PLANS[key], batch):
        seq_lens = _FAST_PLANS[key][0]
    _FAST_PLANS[key] = (seq_lens.clone(), batch.q_lens.clone())
    return _decode(batch.replace(seq_lens=seq_lens))


def reduce_pad_weight0(batch):
    """A reduce that merges every request over the batch's most splits, its padding slots reading the first
    request's first split partial with weight 0: right on finite data, NaN for every request of fewer splits where
    that partial is NaN (found by a review that mutated the emulated path's reduce: the nan probe's NaN sat in the
    newest token, the last piece, which no padding slot reads)."""
    return _decode(batch, pad_weight0=True)


def stale_plan(batch):
    """Right when called; its graph-capturable step plans once: plan() copies the lengths of the step it was built
    for and keeps them, so a replay after the batch buffers were refilled with the next step decodes the new q and
    cache with the old lengths (metadata written, or a launch sized, at capture time only)."""
    return _decode(batch)


stale_plan.step = lambda batch, max_q_len: _Step(batch, max_q_len, stale=True)


def realloc_workspace(batch):
    """Right when called, and its step's replays are right too: its graph-capturable step allocates a new workspace
    at every plan(), so a replay after the next plan writes its results into the freed one and reads them back from
    there, overwriting whatever tensor the caching allocator gave that block. Only a CUDA graph keeps the old
    address: a CPU run (run() again) uses the new workspace."""
    return _decode(batch)


realloc_workspace.step = lambda batch, max_q_len: _Step(batch, max_q_len, realloc=True)


def fast_path_plan(batch):
    """Right when called; its graph-capturable step's plan() takes a fast path when the same requests come back
    grown by at most their q_len (one decode step): it keeps the pieces, here the lengths, it planned last, so a
    replay reads each request as it was a step before and never its newest tokens (found by a review: a step check
    whose next step always rotated the requests never took that path)."""
    return _decode(batch)


fast_path_plan.step = lambda batch, max_q_len: _Step(batch, max_q_len, fast_path=True)


MUTANTS = (
    "wrong_scale", "drop_rope", "page_off_by_one", "last_page_unmasked", "lse_base2", "kv_scale_ignored",
    "q_scale_ignored", "average_splits", "mtp_causal_off_by_one", "nan_empty", "out_gain", "bf16_accumulation",
    "seq_lens_cleared", "cache_padding_written", "nan_dropped", "no_max_subtraction", "int32_offsets",
    "p_rounded_bf16", "bf16_partials", "ignores_strides", "uint16_positions", "hardcoded_scale", "merge_order_varies",
    "stale_plan", "fast_path_plan", "realloc_workspace", "max_init_zero", "max_before_mask", "packed_rows_wrap",
    "plan_cached_by_ptr", "eager_fast_path", "splits_follow_batch", "splits_follow_longest", "tiles_follow_q_len",
    "big_batch_mtp_mask", "request_index_8bit", "page_ids_16bit", "rope_width_64", "full_tile_fast_path",
    "shared_page_reuse", "prefix_by_first_page", "prefix_first_pair", "head0_max", "dtype_unchecked",
    "alpha_bf16", "head_tiles_floor", "slot_8bit", "mtp_row_3bit", "page_div_magic16", "unit_kv_fastpath",
    "reduce_pad_weight0", "active_index_8bit", "packed_rows_10bit", "mtp_row_5bit", "consecutive_pages_flat",
    "big_batch_heads16", "big_batch_q_scale", "split_empty_nan", "request_index_9bit", "out_index_16bit",
    "block_column_12bit",
)  # fmt: skip
# need fp8 inputs (a scale != 1; unit_kv_fastpath a kv scale of 1 beside fp8 q's own, big_batch_q_scale fp8 q)
FP8_ONLY = ("kv_scale_ignored", "q_scale_ignored", "unit_kv_fastpath", "big_batch_q_scale")
FAR_ONLY = ("int32_offsets", "page_ids_16bit")  # need the far check, on by default on CUDA devices only (--far on)
# need the long cases, on by default on CUDA devices only (mla-verify --long on)
LONG_ONLY = ("uint16_positions", "out_index_16bit", "block_column_12bit")
CUDA_ONLY = ("realloc_workspace",)  # needs a CUDA graph: its replay keeps the address plan() freed
