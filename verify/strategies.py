"""Hypothesis strategies over `Case`, weighted toward the edges where decode kernels break, and the smoke prefix.

Edges (each gets its own branch, so Hypothesis draws them often, not once in a million):
- sequence lengths 0 (empty: out 0, lse -inf), 1, page boundaries ±1, 2 pages ±1;
- one very long request among short ones (uneven splits, long accumulations), in a quarter of the cases;
- more workers than KV blocks (every block its own split);
- MTP: q_len 2..4, and in one case of 8 one request of 5..16 (a row index of 2 or 3 bits wraps), including
  q_len > seq_len (leading rows see nothing);
- pages of 1, 16, 32, 64, 128 and 3 tokens, and of 528 (past 256 slots, no power of two: an in-page slot of 8 bits,
  or a page index from a 16-bit magic division, breaks past token 527 of a long request); up to 8 requests
  (``max_batch``); 1 to 128 heads, some not a power of two, 96 above 64 and no multiple of it (a kernel launching
  H // 64 tiles of 64 drops heads 64-95);
- the softmax scale: DeepSeek-V3's in three cases of four (the model these kernels serve), else that of another
  MLA config (q·k head dim, YaRN factor and mscale_all_dim drawn: 0.072-0.22). Drawn last in each case.
Sizes are kept moderate so that a CPU campaign runs hundreds of cases a minute: heads are drawn after the
lengths, from the counts that keep ``Case.work`` (q rows × heads × tokens) under ``work_budget`` (so 32 to 128
heads come with short requests; ``--heads`` fixes them, ``--max-seq-len`` reaches past 4096).

`smoke_cases` is a fixed, hand-picked list that every campaign runs first: each planted bug of `verify.mutants`
is exposed by at least one of them, whatever Hypothesis draws afterwards.
"""

from __future__ import annotations

from hypothesis import strategies as st

from mla_ref.config import yarn_get_mscale
from verify.cases import (
    CASE_FP8_FORMATS,
    DISTRIBUTIONS,
    FP8_FORMATS,
    MINICPM3_SM_SCALE,
    NO_YARN_SM_SCALE,
    SM_SCALE,
    V2_LITE_SM_SCALE,
    Case,
)

HEADS = (1, 2, 4, 5, 8, 16, 20, 32, 40, 64, 96, 128)  # above 16: drawn where the lengths leave room in the work
# budget; 40, 20 and 5: MiniCPM3's 40 MLA heads and their tensor-parallel shares, not a power of two; 96: above 64
# and no multiple of it (the fifty-ninth session's review: first only in the smoke prefix)
PAGE_SIZES = (64, 16, 1, 32, 3, 128, 528)  # 3: a page that no power-of-two tile divides; 128: vLLM's CUTLASS MLA
# block, larger than a 64-token tile; 528: past 256 slots and no power of two (the review's, as HEADS' 96)
Q_LENS = (1, 1, 1, 2, 3, 4)  # a request's query rows: mostly 1, MTP otherwise
LONG_Q_LENS = tuple(range(5, 17))  # one request's in one case of 8: MTP rows past 4 and 8 (2- and 3-bit row indices
# wrap); sampled, not st.integers, which draws its lower bound in about half the draws
WORKERS = (1, 2, 4, 8, 32, 132)  # 132: an H200's SMs, more workers than blocks for all but long requests
WORK_BUDGET = 1 << 15  # q rows × heads × KV tokens per drawn case (a few tens of ms of fp64 oracle on a CPU)
SHORT_MAX = 512  # the bulk of drawn sequence lengths
QK_HEAD_DIMS = (192, 96)  # qk_nope + qk_rope: DeepSeek-V2/V3 and Kimi K2; MiniCPM3
YARN_FACTORS = (1, 99)  # YaRN factors drawn (1: no YaRN; DeepSeek-V3 40, Kimi K2 32), below 100: _sm_scale
MSCALE_ALL_DIMS = (0.707, 1.0)  # DeepSeek-V2(-Lite); DeepSeek-V3


def _seq_len(page: int, short_max: int) -> st.SearchStrategy[int]:
    """A KV length: an edge (0, 1, page ±1, 2 pages ±1) or a uniform short length."""
    edges = sorted({n for n in (0, 1, page - 1, page, page + 1, 2 * page - 1, 2 * page + 1) if 0 <= n <= short_max})
    if short_max < 2:  # only the edges 0 and 1 fit
        return st.sampled_from(edges)
    return st.one_of(st.sampled_from(edges), st.integers(2, short_max), st.integers(2, short_max))


def _campaign_format(where: str, fp8_format: str) -> None:
    """A campaign's fp8 format is one of FP8_FORMATS (`mla-verify --fp8-format`): its draws and smoke prefix place
    values past e4m3's max (near_max), which an e5m2 Case refuses; e5m2 caches come as the smoke prefix's other
    formats."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"{where}.fp8_format: expected one of {FP8_FORMATS} (e5m2 caches are in the smoke prefix's "
                         f"other formats), got {fp8_format!r}")


@st.composite
def cases(
    draw,
    dtype: str = "bf16",
    *,
    fp8_format: str = "e4m3fn",
    max_seq_len: int = 4096,
    heads: int | None = None,
    page_size: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    max_batch: int = 8,
    work_budget: int = WORK_BUDGET,
) -> Case:
    """Draw a `Case` of the given kernel dtype ("bf16": bf16 q and KV; "fp8": fp8 KV, q bf16 or fp8).

    heads / page_size: fixed when given, else drawn. Lengths never exceed max_seq_len; 1 to max_batch requests.
    kv_lora_rank / rope_dim: the latent and rope widths L and R (None: DeepSeek's 512 and 64).
    """
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"cases.dtype: expected 'bf16' or 'fp8', got {dtype!r}")
    _campaign_format("cases", fp8_format)
    if max_seq_len < 1:
        raise ValueError(f"cases.max_seq_len: expected an int >= 1, got {max_seq_len!r}")
    if max_batch < 1:
        raise ValueError(f"cases.max_batch: expected an int >= 1, got {max_batch!r}")
    page = page_size or draw(st.sampled_from(PAGE_SIZES), label="page_size")
    short_max = min(SHORT_MAX, max_seq_len)
    n_req = draw(st.integers(1, max_batch), label="batch")
    seq_lens = [draw(_seq_len(page, short_max)) for _ in range(n_req)]
    if max_seq_len > short_max and draw(st.sampled_from((False, False, False, True)), label="one_long"):
        i = draw(st.integers(0, n_req - 1))
        seq_lens[i] = draw(st.integers(max(short_max + 1, max_seq_len // 4), max_seq_len), label="long_len")
    q_lens = [draw(st.sampled_from(Q_LENS)) for _ in range(n_req)]
    if draw(st.sampled_from((False,) * 7 + (True,)), label="long_q"):
        q_lens[draw(st.integers(0, n_req - 1))] = draw(st.sampled_from(LONG_Q_LENS), label="long_q_len")
    rows_tokens = sum(n * s for n, s in zip(q_lens, seq_lens))
    if heads is None:
        fit = [h for h in HEADS if h * rows_tokens <= work_budget] or [1]
        heads = draw(st.sampled_from(fit), label="heads")

    dist = draw(st.sampled_from(DISTRIBUTIONS), label="dist")
    q_dtype, scale_mode = "bf16", "dynamic"
    if dtype == "fp8":
        q_dtype = draw(st.sampled_from(("bf16", "fp8")), label="q_dtype")
        if dist == "coherent":
            scale_mode = draw(st.sampled_from(("unit", "static")))  # every value an fp8 tie (numerics.md §5.1)
        elif dist == "near_max":
            scale_mode = "static"  # the values sit beyond max · (static scale)
        else:
            scale_mode = draw(st.sampled_from(("dynamic", "static", "unit")), label="scale_mode")
    return Case(
        seq_lens=tuple(seq_lens),
        q_lens=tuple(q_lens),
        heads=heads,
        page_size=page,
        kv_lora_rank=kv_lora_rank or 512,
        rope_dim=rope_dim or 64,
        q_dtype=q_dtype,
        kv_dtype=dtype,
        fp8_format=fp8_format,
        scale_mode=scale_mode,
        dist=dist,
        num_workers=draw(st.sampled_from(WORKERS), label="num_workers"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
        sm_scale=draw(_sm_scale(), label="sm_scale"),
    )


def _sm_scale() -> st.SearchStrategy[float]:
    """σ: DeepSeek-V3's in three draws of four, else that of an MLA config drawn as such configs set it,
    d_qk^-1/2 · m(factor, mscale_all_dim)² (mla_ref.config: 0.072-0.22 over these fields). Hypothesis takes some
    draws from the constants of the local modules a process has loaded (15 % of floats; 5 % of integers, from
    constants of 100 and more), which differ between a test process and a spawned `--jobs` worker: with st.floats,
    or factors up to 160 (128 and 132 are such constants), one seed drew other σ in each (tests/test_cli.py's
    search jobs). So σ comes from choices and integers below 100."""
    config = st.builds(lambda d, f, m: d**-0.5 * yarn_get_mscale(f, m) ** 2, st.sampled_from(QK_HEAD_DIMS),
                       st.integers(*YARN_FACTORS), st.sampled_from(MSCALE_ALL_DIMS))
    return st.one_of(st.just(SM_SCALE), st.just(SM_SCALE), st.just(SM_SCALE), config)


def drawn_inputs(case: Case, dtype: str, fp8_format: str = "e4m3fn") -> bool:
    """Whether `cases(dtype, fp8_format=...)` draws ``case``'s input dtypes (bf16: bf16 q and cache; fp8: a cache
    of fp8_format, q bf16 or fp8). The smoke prefix's other inputs (fp16 q and cache for bf16, the other fp8 formats
    for fp8) are the cases outside it: a kernel may refuse those (`Unsupported`) in a property test too."""
    if dtype == "bf16":
        return (case.q_dtype, case.kv_dtype) == ("bf16", "bf16")
    return case.kv_dtype == "fp8" and case.fp8_format == fp8_format and case.q_dtype in ("bf16", "fp8")


BIG_BATCH = 260  # requests of the smoke prefix's largest batch: indices past 2^8 (one CUDA-graph padding step past 256)


def smoke_cases(
    dtype: str = "bf16",
    *,
    fp8_format: str = "e4m3fn",
    max_seq_len: int = 4096,
    heads: int | None = None,
    page_size: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
) -> list[Case]:
    """The fixed prefix of every campaign: empty rows, length 1, page edges, MTP, splits, a long request, peaky
    and sink scores, 128 heads on pages of 32 with logits past fp32 exp's overflow, a dominant newest token in a
    long request, pages of 128, two softmax scales other than DeepSeek-V3's (which most drawn cases take), for fp8
    both q dtypes, every scale mode, subnormals, ties and saturation; then 128 heads with MTP rows of 3 and 4, MTP
    rows of 5 and 8, scores shifted by -120 with a newest token at +120, each head's scores shifted by its own
    offset, 96 heads, pages of 528 under 700 tokens, 12 MTP rows, for fp8 a cache scale of 1 beside
    fp8 q's dynamic one, the inputs the campaign does not draw (fp16 for bf16, the other fp8 formats for fp8),
    MiniCPM3's shape
    (40 heads, a latent of 256 and a rope of 32, with MTP rows on lengths of whole tiles), 128 heads with 9 MTP
    rows, MTP rows of 20 and 40, 520 non-empty requests, 66 split requests on 132 workers (20 heads, pages of 64, fp8
    q), 72 MTP rows over 70 tokens, and a batch of 260 requests (64 of them non-empty: every
    fourth from request 4).

    Lengths are clipped to max_seq_len; heads / page_size / kv_lora_rank / rope_dim override the hand-picked values
    when given (the latent and rope are DeepSeek-V3's 512 and 64 but in MiniCPM3's case).
    """
    _campaign_format("smoke_cases", fp8_format)
    fp8 = dtype == "fp8"
    base = dict(kv_lora_rank=512, rope_dim=64, kv_dtype=dtype, fp8_format=fp8_format)
    picked = [
        # empty request, length 1, page edges, MTP rows (one with q_len > seq_len), 8 workers
        dict(seq_lens=(0, 1, 63, 65, 300, 2), q_lens=(2, 1, 2, 1, 3, 4), heads=8, num_workers=8, dist="gauss1",
             q_dtype="fp8" if fp8 else "bf16", seed=1),
        # one long request among short ones, split across 16 workers
        dict(seq_lens=(4096, 17, 0), q_lens=(1, 2, 1), heads=2, num_workers=16, dist="gauss1", seed=2),
        # peaky MTP rows
        dict(seq_lens=(1000, 129), q_lens=(4, 1), heads=4, num_workers=4, dist="gauss4",
             q_dtype="fp8" if fp8 else "bf16", seed=3),
        # a dominant sink token, small pages, more workers than blocks
        dict(seq_lens=(129, 2, 200), q_lens=(1, 1, 2), heads=4, page_size=16, num_workers=132, dist="sink", seed=4),
        # 128 heads (over 64 packed rows), pages of 32, logits past fp32 exp's overflow
        dict(seq_lens=(90, 5, 130), q_lens=(1, 2, 1), heads=128, page_size=32, num_workers=8, dist="wide", seed=9),
        # a dominant newest token (read by the last MTP row only) in a long request
        dict(seq_lens=(1500, 3), q_lens=(2, 1), heads=2, num_workers=4, dist="recent", seed=10),
        # pages of 128 (vLLM's CUTLASS MLA block size), larger than a 64-token tile, with its edges and MTP (drawn
        # pages of 128 seldom meet both edges)
        dict(seq_lens=(300, 129, 0, 127), q_lens=(1, 2, 1, 3), heads=16, page_size=128, num_workers=8,
             dist="gauss1", seed=11),
        # other softmax scales than DeepSeek-V3's, which most drawn cases take: YaRN off, and DeepSeek-V2-Lite's
        # (fp8: with fp8 q and a static scale, the path where kernels fold q_scale into σ)
        dict(seq_lens=(200, 77, 1), q_lens=(1, 2, 1), heads=8, num_workers=4, dist="gauss4",
             sm_scale=NO_YARN_SM_SCALE, seed=13),
        dict(seq_lens=(129, 300), q_lens=(3, 1), heads=16, page_size=16, num_workers=8, dist="sink",
             sm_scale=V2_LITE_SM_SCALE, q_dtype="fp8" if fp8 else "bf16", scale_mode="static", seed=14),
    ]
    if fp8:
        picked += [
            dict(seq_lens=(500, 70), q_lens=(1, 2), heads=4, dist="outlier", scale_mode="dynamic", seed=5),
            dict(seq_lens=(300, 1), q_lens=(2, 1), heads=4, dist="coherent", scale_mode="unit", seed=6),
            dict(seq_lens=(257, 64), q_lens=(1, 1), heads=4, dist="near_max", scale_mode="static", q_dtype="fp8",
                 seed=7),
            dict(seq_lens=(700,), q_lens=(3,), heads=8, dist="gauss1", scale_mode="static", q_dtype="fp8", seed=8),
        ]
    else:
        picked += [
            dict(seq_lens=(500, 70), q_lens=(1, 2), heads=4, dist="outlier", seed=5),
            dict(seq_lens=(300, 1), q_lens=(2, 1), heads=4, dist="coherent", seed=6),
        ]
    picked += [  # shapes of serving that the drawn cases, held to a work budget, reach seldom or never
        # DeepSeek-V3 as served: 128 heads with MTP rows of 3 and 4 (512 packed (row, head) pairs: an index that
        # wraps at 256 shows), fp8 q with its dynamic scale
        dict(seq_lens=(130, 65, 200), q_lens=(4, 3, 1), heads=128, num_workers=8, dist="gauss1",
             q_dtype="fp8" if fp8 else "bf16", seed=15),
        # MTP rows past 4 (a row index of two bits wraps; drawn in one case of 8)
        dict(seq_lens=(300, 9), q_lens=(8, 5), heads=8, num_workers=4, dist="gauss1", seed=16),
        # every score shifted to -120 but the newest token's, +120, which only the last MTP row sees, in requests
        # of several tiles and splits: a running max started at 0, or a merge or tile that keeps its first max
        dict(seq_lens=(700, 3, 130), q_lens=(2, 1, 3), heads=4, num_workers=8, dist="shifted", seed=18),
        # each head's scores shifted by its own 0, +120, -120, +60 or -60 nats, in split requests with MTP rows: a
        # max, lse or merge shift taken from another head (head 0's, or one over the tile's heads) overflows exp or
        # flushes a head's tokens to 0, where a shift shared by every head (the shifted case's) changes nothing
        dict(seq_lens=(600, 1, 129), q_lens=(2, 1, 3), heads=8, page_size=16, num_workers=8, dist="heads",
             q_dtype="fp8" if fp8 else "bf16", seed=20),
        # shapes a review's kernels broke on while every case passed them (fifty-ninth session): 96 heads, above
        # 64 and no multiple of it (a kernel launching H // 64 tiles of 64 heads drops heads 64-95), over 132
        # workers (seventy-first session: no case of 64 heads or more had rows cut in more than 3 pieces, so a
        # reduce for 64+ heads that merges at most 8 pieces a row passed; 600 tokens here are cut in 10)
        dict(seq_lens=(600, 5, 0), q_lens=(1, 2, 1), heads=96, page_size=16, num_workers=132, dist="gauss1",
             seed=25),
        # pages of 528: past 256 slots (an in-page slot of 8 bits wraps) and no power of two, under a request of
        # more than a page (a page index from a 16-bit magic multiply, (j ceil(2^16 / P)) >> 16, first misses
        # j // P at j = 527; on the drawn pages of 3 only past 32767)
        dict(seq_lens=(700, 300, 0), q_lens=(1, 2, 1), heads=4, page_size=528, num_workers=8, dist="gauss1",
             seed=26),
        # 12 MTP rows, past 8 (a row index of 3 bits wraps)
        dict(seq_lens=(40, 20), q_lens=(12, 1), heads=4, num_workers=4, dist="gauss1", seed=28),
    ]
    if fp8:  # a cache scale of 1 beside fp8 q's dynamic scale (vLLM's default k_scale): a kernel that takes a unit
        # kv scale for "no scales" drops q's
        picked.append(dict(seq_lens=(130, 40), q_lens=(1, 2), heads=4, num_workers=4, dist="gauss1",
                           scale_mode="kv_unit", q_dtype="fp8", seed=24))
    # the inputs DecodeBatch takes besides the campaign's: fp16 q and cache (bf16 campaigns), the other fp8 formats
    # (fp8: e4m3fn or e4m3fnuz, with fp8 q, and e5m2 caches, vLLM's fp8_e5m2, with bf16 q): a kernel must compute
    # them or refuse them (Unsupported); one that reads their bits as its own format's fails (found by a review: a
    # kernel templated on bf16 / e4m3fn, fed by data_ptr() without a dtype check, passed every campaign)
    others = [f for f in CASE_FP8_FORMATS if f != fp8_format] if fp8 else ["fp16"]
    picked += [dict(seq_lens=(300, 65, 0), q_lens=(2, 1, 1), heads=8, page_size=16, num_workers=8, dist="gauss1",
                    seed=22 + i, **(dict(q_dtype="fp16", kv_dtype="fp16") if f == "fp16" else
                                    dict(fp8_format=f, q_dtype="bf16" if f == "e5m2" else "fp8")))
               for i, f in enumerate(others)]
    picked += [
        # MiniCPM3's shape (every drawn case is DeepSeek's 512 + 64): a latent of 256 and a rope of 32, so a rope
        # width or latent read as 64 / 512 shows; 40 heads; MTP rows on lengths of whole 64-token tiles (a fast
        # path for full tiles that skips the causal mask shows), an empty request, a split one
        dict(seq_lens=(300, 0, 128, 64), q_lens=(2, 1, 3, 2), heads=40, kv_lora_rank=256, rope_dim=32, page_size=16,
             num_workers=8, dist="gauss1", sm_scale=MINICPM3_SM_SCALE, q_dtype="fp8" if fp8 else "bf16", seed=19),
        # counts past the other cases' largest (a review's bugs, sixty-ninth session: an index one bit wider than
        # each of those passed every case): 128 heads with 9 MTP rows, 1152 (row, head) pairs in one request (the
        # 128-head case above has 512: an index of 10 bits wraps here only) ...
        dict(seq_lens=(130, 40), q_lens=(5, 9), heads=128, page_size=16, num_workers=8, dist="gauss1",
             q_dtype="fp8" if fp8 else "bf16", seed=29),
        # ... MTP rows past 16 and 32 (a long speculative draft; drawn q_lens stop at 16, the case above at 12: a
        # row index of 4 or 5 bits wraps), one request's rows outnumbering its tokens ...
        dict(seq_lens=(60, 7, 200), q_lens=(40, 1, 20), heads=4, page_size=16, num_workers=8, dist="gauss1", seed=30),
        # ... and 520 requests, every one of them non-empty (the batch of 260 below has 64), past a CUDA graph's
        # largest batch of 512: a work list of the non-empty requests whose entries keep a request's slot in 8
        # bits, or a request index of 9 bits (seventy-first session; 300 requests before), wraps; 965 query rows
        dict(seq_lens=tuple(1 + 13 * j % 40 for j in range(520)),
             q_lens=tuple(1 if j % 7 == 0 else 2 for j in range(520)), heads=2, page_size=16, num_workers=16,
             dist="gauss1", seed=31),
        # a big batch as served (a review's bugs, seventieth session: the two big batches have 2 heads, pages of 16,
        # bf16 q and few split requests, and no case gave work to more than 120 of 132 workers): 66 requests of
        # 65-128 tokens, two 64-token tiles each (132 tiles on 132 workers, every request split), 20 heads, pages of
        # 64, fp8 q, MTP rows of 2: a large-batch path that computes one tile of 16 heads, takes pages of 16 or drops
        # fp8 q's scale, or metadata sized for 16 split requests or 128 workers shows ...
        dict(seq_lens=tuple(65 + 37 * j % 64 for j in range(66)),
             q_lens=tuple(2 if j % 5 == 0 else 1 for j in range(66)), heads=20, page_size=64, num_workers=132,
             dist="gauss1", q_dtype="fp8" if fp8 else "bf16", seed=32),
        # ... and rows that see no token in a split request (72 rows over 70 tokens; our kernels refuse q_len past 64):
        # a reduce that divides by the merge weights' sum gives 0 / 0 there
        dict(seq_lens=(70, 5), q_lens=(72, 1), heads=4, num_workers=8, dist="gauss1", seed=33),
        # a batch of 260 requests (drawn: up to --max-batch, 8), as a CUDA graph padded past 256 holds them: 64 of
        # them non-empty, every fourth from request 4 (37 (j / 4) mod 101 is 0 at j = 0), so that requests past index
        # 127 and 255 read tokens (a request index of 8 bits, signed or not, wraps), MTP rows of 3 in every ninth of
        # those and of 4 in the last among single rows (a large-batch path that takes the batch's largest q_len for
        # every request)
        dict(seq_lens=tuple(37 * (j // 4) % 101 if j % 4 == 0 else 0 for j in range(BIG_BATCH)),
             q_lens=tuple(1 if j % 4 else 4 if j == 4 * 64 else 3 if j // 4 % 9 == 4 else 1 for j in range(BIG_BATCH)),
             heads=2, page_size=16, num_workers=16, dist="gauss1", seed=17),
    ]
    out = []
    for kw in picked:
        kw = {**base, **kw}
        kw["seq_lens"] = tuple(min(s, max_seq_len) for s in kw["seq_lens"])
        if heads is not None:
            kw["heads"] = heads
        if page_size is not None:
            kw["page_size"] = page_size
        if kv_lora_rank is not None:
            kw["kv_lora_rank"] = kv_lora_rank
        if rope_dim is not None:
            kw["rope_dim"] = rope_dim
        out.append(Case(**kw))
    return out


LONG_SEQ_LEN = 2**16 + 65  # past 2^16 positions, one token into a page of 64: 1026 blocks of 64
BIG_SPLIT_BATCH = 264  # requests of the long cases' big split batch: split ones past index 255
SERVED_MTP_BATCH = 132  # requests of the long cases' 128-head MTP batch: 528 rows x 128 heads, past 2^16 pairs


def long_cases(
    dtype: str = "bf16",
    *,
    fp8_format: str = "e4m3fn",
    heads: int | None = None,
    page_size: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    **_ignored,
) -> list[Case]:
    """The long cases (`mla-verify --long`, on CUDA devices by default): one request of LONG_SEQ_LEN tokens, past
    2^16 (a token counter or position kept in 16 bits wraps there) and, over 132 workers, cut into more than 64
    pieces (a workspace or merge sized for 64 splits per row overflows), with MTP rows and a dominant newest token
    that only its last row sees (`recent`), beside requests of 3 and 1 tokens (no empty one: FlashMLA's fp8 kernel
    refuses those, and the smoke prefix has them); fp8 with bf16 and with fp8 q. Then a big split batch: 264
    requests, 65 of them of 700-1199 tokens and request 256 of 3 x 4096, all of them split over 132 workers (found
    by a review: no batch the checks built had more than about 16 split tiles, or a split request past index 10, or a
    request between 4097 and 65600 tokens). Then a request of LONG_SEQ_LEN tokens on pages of 1: more than 2^16
    pages in one request. Last, 132 requests of 4 MTP rows with 128 heads: more than 2^16 (row, head) pairs.
    Drawn cases stay within --max-seq-len (4096 by default), which the long cases ignore: on a 2-core CPU each long
    request costs about 20 s (85 s on pages of 1), the big split batch about 5 minutes and the 128-head batch 9 (12
    with fp8, on a CPU about half as fast as the one that timed the others); milliseconds to seconds on a GPU.
    heads / page_size / kv_lora_rank / rope_dim override the hand-picked values as in `smoke_cases`: a page size
    overrides the pages of 1 too, and heads the 128 heads (fewer than 125 leave the batch under 2^16 pairs)."""
    q_dtypes = ("bf16", "fp8") if dtype == "fp8" else ("bf16",)
    shape = dict(page_size=page_size or 64, kv_lora_rank=kv_lora_rank or 512, rope_dim=rope_dim or 64, kv_dtype=dtype,
                 fp8_format=fp8_format, num_workers=132)
    longest = [Case(seq_lens=(LONG_SEQ_LEN, 3, 1), q_lens=(2, 1, 1), heads=heads or 16, q_dtype=q_dtype,
                    dist="recent", seed=12 + i, **shape) for i, q_dtype in enumerate(q_dtypes)]
    # the big split batch: 264 requests, every fourth non-empty (700-1199 tokens; request 256 of 3 * 4096 tokens
    # with 3 MTP rows), which a planner over 132 workers cuts into pieces (plan_decode: 52 split tiles, up to 11
    # pieces a row), so that a reduce sized for a few split tiles, a request index of 8 bits in its metadata, or a
    # last chunk of a long request taken as its length mod the chunk (0 for a whole number of 4096-token chunks) shows
    seq_lens = [700 + 37 * j % 500 if j % 4 == 0 else 0 for j in range(BIG_SPLIT_BATCH)]
    q_lens = [2 if j in (24, 96, 200) else 1 for j in range(BIG_SPLIT_BATCH)]
    seq_lens[256], q_lens[256] = 3 * 4096, 3
    big = Case(seq_lens=tuple(seq_lens), q_lens=tuple(q_lens), heads=heads or 4, dist="gauss1", seed=21, **shape)
    # the longest request again on pages of 1 (aiter's paged layout in vLLM on ROCm): 2^16 + 65 pages, so that a
    # block-table column kept in 12 or 16 bits wraps (a review's bug, seventy-first session: no case had more
    # than 4096 pages in a request; smoke lengths stop at --max-seq-len)
    pages_of_1 = Case(seq_lens=(LONG_SEQ_LEN, 17), q_lens=(1, 2), heads=heads or 2, dist="gauss1", seed=27,
                      **{**shape, "page_size": page_size or 1})
    # DeepSeek-V3 as served with MTP: 132 requests of 4 query rows (a draft of 3 tokens) and 128 heads, 528 x 128 =
    # 67584 (row, head) pairs in the output, past 2^16 (a review's bug, seventy-first session: an output index
    # t H + h kept in 16 bits passed every case: the fixed ones had at most 1930 pairs, 965 rows x 2 heads, and
    # drawn ones have at most 7 x 4 + 16 rows of 128 heads, 5632); 9 minutes on a 2-core CPU, so a long case
    served = Case(seq_lens=tuple(4 + 53 * j % 400 for j in range(SERVED_MTP_BATCH)), q_lens=(4,) * SERVED_MTP_BATCH,
                  heads=heads or 128, dist="gauss1", seed=32, **shape)
    return longest + [big, pages_of_1, served]
