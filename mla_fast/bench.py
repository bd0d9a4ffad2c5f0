"""mla-bench: time mla_fast's Triton MLA decode beside FlashInfer (FA3) and FlashMLA on one GPU.

For each shape (b, s_k, h) with q_len 1, page 64, uniform lengths, random page order, randn inputs (std 1, fp8 = plain
cast with scales 0.5 / 0.25, peers.md §2 conditions), and each dtype combination:

- bf16:  bf16 q, bf16 cache (FlashInfer fa3, FlashMLA bf16)
- fp8kv: bf16 q, e4m3fn cache (FlashInfer fa3 fp8 KV)
- fp8:   e4m3fn q and cache (FlashMLA dense fp8, `use_legacy=True`)

it reports µs per call (median and 20/80 % quantiles of the calls timed by `triton.testing.do_bench`, which flushes
the L2 before every call, timing CUDA-graph replays of each callable so that Python launch overhead is not timed;
the callables of a row take turns in `--rounds` rounds (default 3, each starting at the next one), so that a slow
phase of the GPU falls on all of them alike, and each round's median is kept in the JSON; `--eager`: plain calls;
`--flush read`: the L2 flushed by reading do_bench's 256 MB buffer instead of zeroing it, so that no call pays for
writing back the flush's dirty lines), effective GB/s = (cache bytes read + q bytes + out bytes) / time,
and % of the device-to-device copy bandwidth measured in the same run (a ~2 GB copy, bytes read + written). Ours is
timed as one `launch` (decode + reduce), with the plan made beforehand; FlashInfer as `run()` after `plan()`;
FlashMLA as the whole call, schedule cached after the first call (peers.md §2); vLLM's Triton MLA decode as its
`decode_attention_fwd` called the way vLLM calls it (`mla_fast/vllm_peer.py`: from an installed vLLM or a copy of
its file named by $MLA_BENCH_VLLM_SRC), with the largest |out - our out| recorded beside its time. Missing peers are
reported as "not installed". "ours / best peer" is ours over the better of FlashInfer and FlashMLA.

Beside them, the **read floor** (`mla_fast/read_floor.py`, `--no-floor` skips it): a kernel that only streams the
row's cache bytes, timed the same way. It counts what the copy rate does not (the replay's fixed cost, the flush's
dirty lines), so "ours / floor" is what is left to win for any kernel that reads the cache once. `--shared-pages`
builds batches whose requests all read one request's pages: after the first touch the cache comes from the L2, and
the times show each kernel's SM-side rate (MMAs, shared memory, softmax, per-item overheads) instead of HBM's.

Each row also reports the SM clock (median and lowest, MHz), the highest board power and the clock-event reasons
(e.g. sw_power_cap, with the share of samples it was active in) sampled by nvidia-smi while its callables were timed
(`mla_fast.gpu_clocks`): at 128 heads the H200 runs at its power cap and its clock moves.

Output: a rich table on stdout and, with --json, every number in a JSON file.
"""

import argparse
import contextlib
import json
import math
import time

import numpy as np
import torch

from mla_fast.gpu_clocks import ClockSampler, smi_id
from mla_fast.read_floor import read_floor_fn
from mla_fast.report_path import unwritable
from mla_fast.vllm_peer import vllm_fn
from mla_ref.decode import DecodeBatch

SHAPES = [(1, 8192, 16), (32, 4096, 16), (64, 4096, 16), (128, 4096, 16), (128, 8192, 16), (32, 16384, 16),
          (1, 8192, 128), (32, 4096, 128), (128, 4096, 128)]
COMBOS = ("bf16", "fp8kv", "fp8")
L, R = 512, 64
SM_SCALE = 192**-0.5  # peers.md §2 timing conditions
KV_SCALE, Q_SCALE = 0.5, 0.25  # fp8 per-tensor scales: real = fp8 * scale


def build_batch(b: int, s: int, h: int, combo: str, page_size: int = 64, seed: int = 0, extra_pages: int = 1,
                device: str = "cuda", q_len: int = 1, shared_pages: bool = False) -> DecodeBatch:
    """Uniform batch of b requests x s tokens, h heads, q_len query rows each (MTP, causal); random page order; NaN
    in the spare page(s). shared_pages: every request reads the same s tokens (one request's pages, each block-table
    row the same), so that after the first touch a decode reads its cache from the L2 (`--shared-pages`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = math.ceil(s / page_size)
    owners = 1 if shared_pages else b  # requests with pages of their own
    P = owners * pages + extra_pages
    cache = torch.randn(P, page_size, L + R, generator=g, device=device)  # [P, ps, L+R] fp32
    perm = torch.randperm(P, generator=g, device=device)  # physical page of each logical page, then spare pages
    cache[perm[owners * pages:]] = float("nan")  # pages nobody owns
    tail = pages * page_size - s
    block_table = perm[: owners * pages].view(owners, pages).expand(b, pages).to(torch.int32).contiguous()  # [b, pages]
    if tail:
        cache[block_table[:, -1].long(), page_size - tail:] = float("nan")  # unused slots of each last page
    q = torch.randn(b * q_len, h, L + R, generator=g, device=device)  # [T, H, L+R]
    kw = {}
    if combo == "bf16":
        q, cache = q.to(torch.bfloat16), cache.to(torch.bfloat16)
    elif combo in ("fp8kv", "fp8"):
        cache, kw["kv_scale"] = cache.to(torch.float8_e4m3fn), KV_SCALE  # |randn| < 448: the cast cannot overflow
        if combo == "fp8":
            q, kw["q_scale"] = q.to(torch.float8_e4m3fn), Q_SCALE
        else:
            q = q.to(torch.bfloat16)
    else:
        raise ValueError(f"combo must be one of {COMBOS}, got {combo!r}")
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
    q_lens = torch.full((b,), q_len, dtype=torch.int32, device=device)
    return DecodeBatch(q, cache, block_table, seq_lens, q_lens=q_lens, sm_scale=SM_SCALE, kv_lora_rank=L, **kw)


def cache_bytes(b: int, s: int, combo: str) -> int:
    """Bytes of the KV cache a decode of b requests x s tokens reads (2 B/elem bf16, 1 B/elem fp8)."""
    return b * s * (L + R) * (1 if combo in ("fp8kv", "fp8") else 2)


def bytes_moved(b: int, s: int, h: int, combo: str, q_len: int = 1) -> int:
    """Cache bytes read + q bytes read + bf16 out bytes written (peers.md §2 effective GB/s); q_len query rows per
    request (MTP) read q and write out q_len times."""
    q_bytes = 1 if combo == "fp8" else 2
    rows = b * q_len * h
    return cache_bytes(b, s, combo) + rows * (L + R) * q_bytes + rows * L * 2


FLUSHES = ("zero", "read")  # how the L2 is flushed before each timed call (--flush)
FLUSH = "zero"


@contextlib.contextmanager
def read_flush():
    """Inside: triton.testing.do_bench flushes the L2 by *reading* its 256 MB buffer (a sum) instead of zeroing it.

    do_bench's own flush (`cache.zero_()`) leaves the L2 full of dirty lines, which the timed call's loads then
    write back to HBM; a read leaves clean lines, so the call pays only for its own traffic. Everything else is
    do_bench's loop (estimate, warm-up, repeats, events): only the driver's `clear_cache` is swapped, and restored on
    exit."""
    import triton

    drv = triton.runtime.driver.active
    if "clear_cache" in vars(drv):
        raise RuntimeError("read_flush: the driver's clear_cache is already replaced (nested read_flush?)")
    drv.clear_cache = lambda cache: cache.sum(dtype=torch.int64)  # reads every line; the 8-byte sum is dropped
    try:
        yield
    finally:
        del drv.clear_cache  # the class's method again


def time_samples_us(fn, warmup_ms: int = 25, rep_ms: int = 100, flush: str | None = None) -> list[float]:
    """Every timed call's µs from triton.testing.do_bench (L2 flushed before each call). flush: "zero" (do_bench's
    own: a 256 MB memset, which leaves dirty lines) or "read" (`read_flush`); None: the module's FLUSH (mla-bench
    --flush)."""
    import triton

    flush = FLUSH if flush is None else flush
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    with read_flush() if flush == "read" else contextlib.nullcontext():
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return [1e3 * t for t in ms]


def quantiles_us(samples) -> tuple[float, float, float]:
    """(median, 20 %, 80 %) of timed samples, linear interpolation (as do_bench's quantiles)."""
    return tuple(float(q) for q in np.quantile(np.asarray(samples, dtype=np.float64), [0.5, 0.2, 0.8]))


def time_us(fn, warmup_ms: int = 25, rep_ms: int = 100, flush: str | None = None) -> tuple[float, float, float]:
    """(median, 20 %, 80 %) µs of fn() over `time_samples_us`."""
    return quantiles_us(time_samples_us(fn, warmup_ms, rep_ms, flush))


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy rate in GB/s, bytes read + written (peers.md §3: ~4280 on an H200)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    med, _, _ = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / (med * 1e-6) / 1e9


# ---- timed callables -------------------------------------------------------------------------------------------
def ours(batch: DecodeBatch, config=None, num_workers: int | None = None, plan=None,
         reduce_pieces: int | None = None):
    """() -> None launching our decode on preallocated buffers, plus the compiled kernel's resource report. plan:
    the WorkPlan to launch (default: `make_plan` with config and num_workers); reduce_pieces: launch's (default: the
    plan's `plan_reduce_pieces`)."""
    from mla_fast import triton_decode as td

    q_len = int(batch.q_lens.max())
    config = config or td.batch_config(batch, q_len)
    plan = plan if plan is not None else td.make_plan(batch, config, num_workers)
    T, H, dev = batch.q.shape[0], batch.q.shape[1], batch.q.device
    out = torch.empty(T, H, L, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    pair_merge = td.pair_merge_applies(plan, config, dev, batch.kv_lora_rank)  # launch decides the same way
    workspace = td.alloc_workspace(plan, H, L, dev, pair_merge)
    q_scale = td._scale_tensor(batch.q_scale, batch.q.device)
    kv_scale = td._scale_tensor(batch.kv_scale, batch.q.device)
    qo_indptr = batch.qo_indptr

    def fn():
        return td.launch(batch, plan, out, lse, config, workspace=workspace, q_scale=q_scale, kv_scale=kv_scale,
                         max_rows=q_len * config.head_group, qo_indptr=qo_indptr, reduce_pieces=reduce_pieces)

    fn.outputs = (out, lse)
    kernel = fn()
    info = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
            "num_items": plan.num_items, "split_tiles": plan.split_tiles,
            "pair_merge": pair_merge}
    return fn, info


def step_fn(batch: DecodeBatch):
    """() -> run() of the graph-capturable step (`TritonMLADecode` with its defaults, planned once): what a serving
    loop captures, against `ours`, a launch of the batch's own plan; plus the step's reduce shape."""
    from mla_fast.triton_decode import TritonMLADecode

    step = TritonMLADecode(batch, max_q_len=int(batch.q_lens.max()))
    step.plan()

    def fn():
        return step.run()

    fn.outputs = (step.out, step.lse)
    return fn, {"reduce_pieces": step.reduce_pieces}


def flashinfer_fn(batch: DecodeBatch):
    """() -> run() of FlashInfer's FA3 MLA wrapper after plan() (peers.md §1), or a reason string."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "not installed"
    from mla_fast.flashinfer_backend import _workspace, flashinfer_inputs

    if batch.q.dtype != torch.bfloat16:
        return "n/a (bf16 q only)"
    a = flashinfer_inputs(batch)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(batch.device), backend="fa3")
    wrapper.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], batch.num_heads, L, R,
                 batch.page_size, a["causal"], a["sm_scale"], a["q_dtype"], a["kv_dtype"])
    scales = {} if a["kv_scale"] is None else {"ckv_scale": a["kv_scale"], "kpe_scale": a["kv_scale"]}
    out = torch.empty(batch.q.shape[0], batch.num_heads, L, dtype=torch.bfloat16, device="cuda")

    def fn():
        wrapper.run(a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], out=out, **scales)

    fn()
    return fn


def flashmla_fn(batch: DecodeBatch):
    """() -> flash_mla_with_kvcache(use_legacy=True) with its schedule cached (peers.md §1), or a reason string."""
    try:
        import flash_mla
    except ImportError:
        return "not installed"
    from mla_fast.flashmla_backend import PAGE_SIZE, flashmla_inputs

    if batch.q.dtype != batch.kv_cache.dtype:
        return "n/a (q and cache of one dtype)"
    if batch.page_size != PAGE_SIZE:  # its adapter would time a repaged copy: another layout than ours
        return f"n/a (pages of {PAGE_SIZE} only)"
    a = flashmla_inputs(batch)
    B, s_q, H, _ = a["q"].shape
    meta, _ = flash_mla.get_mla_metadata()
    extra = {}
    if a["descale"] is not None:
        tile_md, num_splits = flash_mla.get_mla_decoding_metadata(a["cache_seqlens"], s_q * H, 1,
                                                                  is_fp8_kvcache=True, use_legacy=True)
        meta.tile_scheduler_metadata, meta.num_splits = tile_md, num_splits
        extra = {"is_fp8_kvcache": True,
                 "descale_q": torch.tensor([a["descale"][0]], dtype=torch.float32, device="cuda"),
                 "descale_k": torch.tensor([a["descale"][1]], dtype=torch.float32, device="cuda")}

    def fn():
        flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], L, meta, None,
                                         softmax_scale=a["softmax_scale"], causal=a["causal"], use_legacy=True,
                                         **extra)

    fn()
    return fn


PEERS = {"flashinfer": flashinfer_fn, "flashmla": flashmla_fn, "vllm": vllm_fn}
BEST_PEERS = ("flashinfer", "flashmla")  # "ours / best peer": the peers; vLLM has its own column


GRAPHS = True  # time CUDA-graph replays (--eager: plain calls)
ROUNDS = 3  # alternating rounds per row (--rounds): ours and the peers take turns, 100 ms of calls each in all


def graphed(fn):
    """fn captured in a CUDA graph -> its replay. Every callable here launches on preallocated buffers after its
    plan, so a replay does the same GPU work without the Python launch path, which at b = 1 (a ~20 µs kernel) would
    otherwise be timed too: do_bench measures between events around each call, CPU gaps included.

    The replay keeps fn alive (through the graph), so the buffers that fn's closure holds (plan, workspace, outputs)
    live as long as the replay: a graph whose buffers were freed and reused replays on garbage work items, whose
    wild addresses failed on one H200 with cudaErrorInvalidAddressSpace (fifteenth session, a script that kept only
    the replays of five configs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, lazy init)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    graph.captured_fn = fn  # what the graph reads and writes lives as long as the graph (and so its replay)
    return graph.replay


def prepare(fn_or_reason):
    """(the callable to time, how it is timed): its graph replay when GRAPHS (falling back to plain calls, with the
    reason, if the capture fails), else plain calls; a reason string passes through as (reason, None)."""
    if isinstance(fn_or_reason, str):
        return fn_or_reason, None
    if GRAPHS:
        try:
            return graphed(fn_or_reason), "graph"
        except Exception as e:
            return fn_or_reason, f"eager (graph capture failed: {type(e).__name__}: {str(e)[:80]})"
    return fn_or_reason, "eager"


def summarize(rounds_us: list, nbytes: int, copy_gbs: float, timing: str) -> dict:
    """A measurement from the timed samples of one or more rounds ([[µs, ...] per round]): median and 20 / 80 %
    over all samples, each round's median (us_rounds), effective GB/s and % of the copy rate at the median."""
    med, p20, p80 = quantiles_us([t for r in rounds_us for t in r])
    gbs = nbytes / (med * 1e-6) / 1e9
    return {"status": "ok", "us": med, "us_p20": p20, "us_p80": p80, "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs,
            "timing": timing, "us_rounds": [quantiles_us(r)[0] for r in rounds_us]}


def measure(fn_or_reason, nbytes: int, copy_gbs: float) -> dict:
    """Time one callable, alone (`prepare`, one round of `time_samples_us`)."""
    fn, timing = prepare(fn_or_reason)
    if timing is None:
        return {"status": fn}
    try:
        samples = time_samples_us(fn)
    except Exception as e:  # a peer failing on one shape must not stop the table
        return {"status": f"error: {type(e).__name__}: {str(e)[:120]}"}
    return summarize([samples], nbytes, copy_gbs, timing)


def measure_in_rounds(fns: dict, nbytes: int, copy_gbs: float, rounds: int, rep_ms: int = 100,
                      timer=None) -> dict:
    """Time several callables of one row ({name: fn or reason}) in `rounds` alternating rounds of rep_ms / rounds
    each, so that a slow phase of the GPU (at 128 heads the H200 runs at its power cap and its clocks move within a
    call: docs/kernels.md) falls on all of them alike; round r starts at the r-th callable (rotation). -> {name:
    measurement}, with `us_rounds` per round. A callable that fails stops being timed and reports the error.
    timer(fn, rep_ms) -> [µs, ...]: default `time_samples_us`."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    timer = timer or (lambda fn, rep: time_samples_us(fn, rep_ms=rep))
    prepared = {name: prepare(fn) for name, fn in fns.items()}
    result = {name: {"status": fn} for name, (fn, timing) in prepared.items() if timing is None}
    samples = {name: [] for name in prepared if name not in result}
    names = list(samples)
    rep = max(1, math.ceil(rep_ms / rounds))
    for r in range(rounds if names else 0):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in result:
                continue
            try:
                samples[name].append(timer(prepared[name][0], rep))
            except Exception as e:  # a peer failing on one shape must not stop the table
                result[name] = {"status": f"error: {type(e).__name__}: {str(e)[:120]}"}
    for name in names:
        if name not in result:
            result[name] = summarize(samples[name], nbytes, copy_gbs, prepared[name][1])
    return {name: result[name] for name in fns}


def check_shared_pages(shapes, combos, l2_bytes: int) -> None:
    """Raise ValueError unless one request's cache fits in half the L2 at every (shape, combo): with shared pages the
    times mean the SM-side rate only if the cache stays in the L2 (an H100/H200 L2 is two halves, and data that every
    SM reads may sit in both)."""
    for s in sorted({shape[1] for shape in shapes}):  # (b, s_k, h)
        for combo in combos:
            need = cache_bytes(1, s, combo)
            if 2 * need > l2_bytes:
                raise ValueError(f"--shared-pages needs one request's cache ({need / 1e6:.1f} MB at s_k={s}, {combo}) "
                                 f"to fit in half the L2 ({l2_bytes / 2e6:.1f} MB); use a shorter s_k")


def diff_vs_ours(fn, ours_out) -> dict:
    """{"max_abs_diff_vs_ours": max |out - our out|} for a timed callable that hands out its outputs (`fn.outputs`,
    read after its timed calls), else {} (no outputs, or ours not timed as one callable)."""
    if not hasattr(fn, "outputs") or ours_out is None:
        return {}
    return {"max_abs_diff_vs_ours": float((fn.outputs[0].float() - ours_out.float()).abs().max())}  # over [T, H, L]


def run_grid(shapes, combos, peers=tuple(PEERS), copy_gbs=None, candidates=False, json_path=None, floor=True,
             shared_pages=False, step=False, rounds: int = ROUNDS, page_size: int = 64) -> dict:
    """Time every (shape, combo) for ours and the named peers, in `rounds` alternating rounds per row
    (`measure_in_rounds`); with json_path, the JSON is rewritten after each row (partial runs keep rows). floor:
    also time the read floor of each row's cache bytes (`mla_fast.read_floor`, once per cache size, alone).
    shared_pages: batches whose requests all read one request's pages (`build_batch`); the floor is then not timed
    (the cache comes from the L2). step: also time the graph-capturable step (`step_fn`). page_size: tokens per
    cache page (FlashMLA takes 64 only)."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"peers must be among {sorted(PEERS)}, got {unknown}")
    if shared_pages:
        check_shared_pages(shapes, combos, torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    copy_gbs = copy_gbs or copy_bandwidth_gbs()
    rows = []
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "shared_pages": shared_pages,
              "page_size": page_size, "flush": FLUSH, "rows": rows}
    floors = {}  # cache bytes -> read floor measurement
    for b, s, h in shapes:
        for combo in combos:
            batch = build_batch(b, s, h, combo, page_size=page_size, shared_pages=shared_pages)
            nbytes = bytes_moved(b, s, h, combo)
            row = {"b": b, "s": s, "h": h, "combo": combo, "bytes": nbytes}
            if not floor or shared_pages:
                row["read_floor"] = {"status": "n/a (shared pages)" if shared_pages else "skipped"}
            else:
                kv_bytes = cache_bytes(b, s, combo)
                if kv_bytes not in floors:
                    floors[kv_bytes] = {**measure(read_floor_fn(kv_bytes), kv_bytes, copy_gbs), "bytes": kv_bytes}
                    torch.cuda.empty_cache()
                row["read_floor"] = floors[kv_bytes]
            fns, infos = {}, {}  # what this row times, in rounds (measure_in_rounds), and what each reports beside
            if candidates:
                row["candidates"] = time_candidates(batch, nbytes, copy_gbs)
                ok = [c for c in row["candidates"] if c.get("status") == "ok" and c.get("correct")]
                row["ours"] = min(ok, key=lambda c: c["us"]) if ok else row["candidates"][0]
            else:
                fns["ours"], infos["ours"] = ours(batch)
            if step:
                fns["step"], infos["step"] = step_fn(batch)
            for name, make in PEERS.items():
                if name in peers:
                    try:
                        fns[name] = make(batch)
                    except Exception as e:
                        fns[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
                else:
                    row[name] = {"status": "skipped"}
            t0 = time.time()
            timed = measure_in_rounds(fns, nbytes, copy_gbs, rounds)
            row["timed_window"] = [t0, time.time()]  # wall seconds: main() reads the SM clock of this range
            # [T, H, L] bf16 after the timed replays (no other callable writes it); None when ours ran as candidates
            ours_out = fns["ours"].outputs[0] if "ours" in fns else None
            for name, m in timed.items():
                diff = diff_vs_ours(fns[name], ours_out) if name != "ours" else {}  # {} for a reason string
                row[name] = {**m, **infos.get(name, {}), **diff}
            del fns, timed
            rows.append(row)
            print({k: v for k, v in row.items() if k != "candidates"}, flush=True)
            for c in row.get("candidates", []):
                print(f"    {c.get('us', 0):8.1f} us  err {c.get('max_abs_err', float('nan')):.2e}  "
                      f"{c.get('status')}  {c['override']}", flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(result, f, indent=1)
            del batch
            torch.cuda.empty_cache()
    return result


# fp8 caches on the Triton kernel's 32-row mma.sync tiles: the h >= 64 default before 64-row tiles (and still at
# batch <= SMALL_BATCH off sm_90)
FP8_32_ROWS = dict(kernel="triton", workers_per_sm=1, fp8_stage=True, head_group=32, head_split=1, num_warps=8,
                   num_stages=3, split_l=8, page_chunk=32, lazy_l=True, unchain=False, qk_fp8=False)


def triton_fp8_64_rows(num_heads: int, **changes) -> dict:
    """fp8 caches on the Triton kernel's 64-row wgmma tiles (default_config's choice at b >= 32 and 64 or 128 heads),
    with changes: a whole config, so that it means the same over any default (the Gluon fp8 kernel's at small
    batches included)."""
    return dict(kernel="triton", workers_per_sm=1, fp8_stage=True, head_group=64,
                head_split=2 if num_heads % 128 == 0 else 1, num_warps=8, num_stages=3, split_l=2, unchain=True,
                page_chunk=32, lazy_l=False, qk_fp8=False, **changes)


def forced_fp8_kernels(combo: str, num_heads: int, q_len: int) -> dict:
    """The two Gluon kernels that take e4m3fn caches, each in default_config's geometry whatever the batch size:
    {"gluon_fp8": the Gluon fp8 kernel on num_heads / head_group programs per worker, "seesaw": the seesaw kernel on
    fp16 operands}; a kernel that cannot take the rows (the seesaw at 32 or fewer) is left out (benchmarks/)."""
    from mla_fast import triton_decode as td

    forced = {name: td.forced_config(combo, num_heads, q_len, name) for name in ("gluon_fp8", "seesaw")}
    return {name: config for name, config in forced.items() if config is not None}


# fp8 caches at 16 rows on the Triton kernel's staged path: the default before the Gluon fp8 kernel (and off sm_90)
TRITON_FP8_16_ROWS = dict(kernel="triton", num_warps=4, num_stages=4, workers_per_sm=1, fp8_stage=True, split_l=8,
                          page_chunk=32, lazy_l=True, qk_fp8=False,
                          page_select=1, gather_chunk_pages=16)  # with triton_decode.FP8_PAGE_GATHER
FP16_SCORES = dict(qk_fp8=False)  # e4m3fn q: the Gluon fp8 kernel's fp16 score operands (before its fp8 score MMAs)
CANDIDATES = {  # (combo, num_heads) -> KernelConfig overrides of default_config timed beside it (--candidates)
    # the Triton staged path, the Gluon fp8 kernel with one program per SM and four slots (the default: two x two)
    ("fp8kv", 16): [TRITON_FP8_16_ROWS, dict(num_stages=4, workers_per_sm=1)],
    ("fp8", 16): [TRITON_FP8_16_ROWS, FP16_SCORES],
    ("bf16", 128): [  # the Triton 64-row layout (the b >= 32 default before the Gluon kernel; at b = 1 31.4 vs 29.4 us
                      # for the small-batch rule), and the Gluon seesaw kernel (the b >= 32 default on an H200)
                    dict(kernel="triton", head_group=64, head_split=2, num_warps=8, num_stages=2, split_l=2,
                         unchain=True, page_chunk=32, interleave=True),
                    dict(kernel="gluon", head_group=64, head_split=2)],
    ("bf16", 64): [dict(kernel="triton", head_group=64, head_split=1, num_warps=8, num_stages=2, split_l=2,
                        unchain=True, page_chunk=32, interleave=True)],  # the Triton 64-row layout at 64 heads
    # fp8 caches at 64 and 128 heads: the 32-row layout, and the Triton staged 64-row path (the default at b >= 32
    # before the Gluon seesaw kernel took fp8 caches; on an H200 the seesaw is the default there now)
    ("fp8kv", 64): [FP8_32_ROWS, triton_fp8_64_rows(64), triton_fp8_64_rows(64, interleave=True)],
    ("fp8kv", 128): [FP8_32_ROWS, triton_fp8_64_rows(128), triton_fp8_64_rows(128, interleave=True)],
    ("fp8", 128): [FP8_32_ROWS, triton_fp8_64_rows(128), triton_fp8_64_rows(128, interleave=True), FP16_SCORES],
}


def reference(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 out [T, H, L], lse [T, H] of a bench batch (q_len 1, uniform lengths), to check each timed config."""
    T, S = batch.q.shape[0], int(batch.seq_lens.max())
    q_scale = 1.0 if batch.q_scale is None else float(batch.q_scale)
    kv_scale = 1.0 if batch.kv_scale is None else float(batch.kv_scale)
    q = batch.q.float() * q_scale  # [T, H, D]
    raw = batch.kv_cache.view(torch.uint8) if batch.kv_cache.element_size() == 1 else batch.kv_cache  # fp8: bytes
    kv = raw[batch.block_table.long()].view(batch.kv_cache.dtype).reshape(T, -1, batch.q.shape[-1])[:, :S]  # [T, S, D]
    kv = kv.float() * kv_scale  # [T, S, D]
    s = torch.einsum("thd,tsd->ths", q, kv) * batch.sm_scale  # [T, H, S]
    lse = torch.logsumexp(s, -1)  # [T, H]
    out = torch.einsum("ths,tsl->thl", torch.exp(s - lse[..., None]), kv[..., : batch.kv_lora_rank])  # [T, H, L]
    return out, lse


def time_candidates(batch: DecodeBatch, nbytes: int, copy_gbs: float) -> list:
    """Time the default config and each CANDIDATES override on `batch`: [{config, us, ..., n_regs, n_spills,
    max_abs_err, correct}]; correct = finite and out error within 2x that of the first config (the default)."""
    from dataclasses import asdict, replace

    from mla_fast import triton_decode as td

    combo = td.dtype_combo(batch.q.dtype, batch.kv_cache.dtype)
    base = td.batch_config(batch, 1)
    out_ref, lse_ref = reference(batch)
    results = []
    for o in [{}] + CANDIDATES.get((combo, batch.num_heads), []):
        try:
            config = replace(base, **o)
            if batch.num_heads % (config.head_group * config.head_split) or (o and config == base):
                continue  # a head split that does not divide the heads, or the default again
            fn, info = ours(batch, config)
            out, lse = fn.outputs
            err = {"max_abs_err": float((out.float() - out_ref).abs().max()),
                   "lse_abs_err": float((lse - lse_ref).abs().max()),
                   "finite": bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}
            m = {**measure(fn, nbytes, copy_gbs), **info, **err}
        except Exception as e:  # a config that fails to compile or launch must not stop the table
            m = {"status": f"error: {type(e).__name__}: {str(e)[:200]}"}
            config = None
        results.append({"config": asdict(config) if config else None, "override": o, **m})
    ref_err = next((r["max_abs_err"] for r in results if "max_abs_err" in r), float("inf"))
    for r in results:
        r["correct"] = bool(r.get("finite") and r["max_abs_err"] <= 2 * ref_err)
    return results


PRECOMPILE_TOKENS = 1024  # per request: 16 pages of 64 (a block-table stride divisible by 16, as in the grid)


def _precompile_one(task):
    """Worker process: compile one (b, h, combo, override, page_size) config by launching it on a short batch of b
    requests (the default config depends on the batch size; the Triton specialisation on the block-table stride, kept
    by PRECOMPILE_TOKENS; PAGE_SIZE is a constexpr), so the bench finds it in Triton's on-disk cache."""
    from dataclasses import replace

    from mla_fast import triton_decode as td

    b, h, combo, o, page_size = task
    t0 = time.time()
    try:
        batch = build_batch(b, PRECOMPILE_TOKENS, h, combo, page_size)
        fn, _ = ours(batch, replace(td.batch_config(batch, 1), **o))
        torch.cuda.synchronize()
        return f"compiled b={b} h={h} {combo} {o} in {time.time() - t0:.1f}s"
    except Exception as e:
        return f"FAILED b={b} h={h} {combo} {o}: {type(e).__name__}: {str(e)[:200]}"


def precompile(sizes, combos, processes: int, page_size: int = 64) -> None:
    """Compile every candidate config of the grid (sizes: its (batch, heads) pairs, on pages of page_size) in
    `processes` spawned processes (Triton compiles on one core)."""
    import multiprocessing as mp

    tasks = [(b, h, c, o, page_size) for b, h in sizes for c in combos for o in [{}] + CANDIDATES.get((c, h), [])]
    from mla_fast import bench  # pickled by module name, also when this file runs as __main__

    with mp.get_context("spawn").Pool(processes) as pool:
        for line in pool.imap_unordered(bench._precompile_one, tasks):
            print(line, flush=True)


def add_clocks(result: dict, clocks: ClockSampler) -> None:
    """Each row's SM clock and board power while its callables were timed (`row["clocks"]`, from its
    `timed_window`; `mla_fast.gpu_clocks`), and whether they could be sampled (`result["clocks"]`)."""
    result["clocks"] = {"sampled": clocks.available, "reason": clocks.reason}
    for row in result["rows"]:
        if "timed_window" in row:
            row["clocks"] = clocks.window(*row["timed_window"])


def clock_cell(clocks: dict | None) -> str:
    """A row's SM clock while it was timed: "median (min)" MHz and the clock-event reasons other than an idle GPU
    with the share of samples they were active in (e.g. "1710 (1530) sw_power_cap 93%"), or why there is none."""
    if not clocks:
        return ""
    if "status" in clocks:
        return clocks["status"]
    if not clocks["samples"]:
        return "no samples"
    reasons = [f"{name} {share:.0%}" for name, share in (clocks.get("reasons") or {}).items() if name != "gpu_idle"]
    return " ".join([f"{clocks['sm_mhz_median']:.0f} ({clocks['sm_mhz_min']:.0f})", *reasons])


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"MLA decode, q_len 1, page {result.get('page_size', 64)} — {result['device']}, "
             f"copy {result['copy_gbs']:.0f} GB/s")
    title += ", shared pages (the cache from the L2)" if result.get("shared_pages") else ""
    title += ", L2 flushed by a read (--flush read)" if result.get("flush") == "read" else ""
    table = Table(title=title)
    for col in ("b", "s_k", "h", "dtype", "ours µs (20–80%)", "GB/s", "% copy", "read floor µs", "ours / floor",
                "flashinfer µs", "flashmla µs", "ours / best peer", "vllm µs", "vllm / ours", "step µs",
                "default µs", "best override", "SM MHz med (min)"):
        table.add_column(col, justify="right")

    def us(m):  # µs of a measurement, None unless it ran
        return m["us"] if m.get("status") == "ok" else None

    def cell(m):
        return f"{m['us']:.1f}" if us(m) is not None else m.get("status", "")

    def ratio(num, den):
        return "—" if num is None or den is None else f"{num / den:.2f}"

    for r in result["rows"]:
        o = r["ours"]
        peers = [us(r[p]) for p in BEST_PEERS if us(r[p]) is not None]
        floor = r.get("read_floor", {"status": "—"})
        ours_cell = f"{o['us']:.1f} ({o['us_p20']:.1f}–{o['us_p80']:.1f})" if us(o) is not None else o["status"]
        table.add_row(str(r["b"]), str(r["s"]), str(r["h"]), r["combo"], ours_cell,
                      *((f"{o['gbs']:.0f}", f"{o['pct_copy']:.0f}") if us(o) is not None else ("—", "—")),
                      cell(floor),
                      ratio(us(o), us(floor)), cell(r["flashinfer"]), cell(r["flashmla"]),
                      ratio(us(o), min(peers, default=None)), cell(r["vllm"]), ratio(us(r["vllm"]), us(o)),
                      cell(r.get("step", {"status": ""})), cell(r["candidates"][0]) if "candidates" in r else "",
                      str(o.get("override", "")), clock_cell(r.get("clocks")))
    Console(width=240).print(table)


def parse_shapes(text: str):
    """Parse --shapes: "b,s,h;b,s,h" (tuples of any length) -> [(b, s, h), ...]."""
    return [tuple(int(x) for x in item.split(",")) for item in text.split(";") if item]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mla-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help='"b,s,h;b,s,h" (default: issue grid)')
    parser.add_argument("--dtypes", default="bf16,fp8kv", help=f"comma list of {COMBOS} (default %(default)s)")
    parser.add_argument("--no-peers", action="store_true", help="time only mla_fast")
    parser.add_argument("--peers", default=None,
                        help=f"comma list of peers to time (default: all, {list(PEERS)})")
    parser.add_argument("--json", help="write all numbers to this file")
    parser.add_argument("--candidates", action="store_true", help="also time CANDIDATES configs; report the best")
    parser.add_argument("--precompile", type=int, default=0, metavar="N",
                        help="with --candidates: compile all configs first in N processes")
    parser.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA-graph replays")
    parser.add_argument("--no-floor", action="store_true", help="skip the read floor (mla_fast.read_floor)")
    parser.add_argument("--shared-pages", action="store_true",
                        help="every request reads one request's pages: the cache comes from the L2, so the times "
                             "show each kernel's SM-side rate instead of HBM's (no read floor)")
    parser.add_argument("--step", action="store_true",
                        help="also time the graph-capturable step (TritonMLADecode: any later plan, a fixed reduce "
                             "shape), what a serving loop captures")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternating rounds per row: ours and the peers take turns, each round starting at the "
                             "next callable, so that the GPU's slow phases (clocks at the power cap) fall on all "
                             "alike; the same number of timed calls in all (default %(default)s)")
    parser.add_argument("--page-size", type=int, default=64, metavar="P",
                        help="tokens per cache page (default %(default)s; vLLM's default block is 16; FlashMLA takes "
                             "64 only and is reported n/a otherwise)")
    parser.add_argument("--flush", choices=FLUSHES, default="zero",
                        help="how the L2 is flushed before each call: zero (do_bench's 256 MB memset, the default; "
                             "it leaves dirty lines that the call writes back) or read (a sum over the same buffer: "
                             "clean lines)")
    args = parser.parse_args(argv)
    global GRAPHS, FLUSH
    GRAPHS = not args.eager
    FLUSH = args.flush
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.page_size < 1:
        parser.error(f"--page-size must be >= 1, got {args.page_size}")
    peers = [] if args.no_peers else (",".join(PEERS) if args.peers is None else args.peers).split(",")
    if set(peers) - set(PEERS) or len(set(peers)) < len(peers):  # "" (no peer named) or one named twice
        parser.error(f"--peers must be a comma list of distinct names of {list(PEERS)} (or --no-peers), "
                     f"got {args.peers!r}")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(COMBOS) or len(set(dtypes)) < len(dtypes):  # a combo named twice would be timed twice
        parser.error(f"--dtypes must be a comma list of distinct names of {list(COMBOS)}, got {args.dtypes!r}")
    if not args.shapes or any(len(shape) != 3 or min(shape) < 1 for shape in args.shapes):
        parser.error(f"--shapes must be b,s,h triples of ints >= 1 separated by ';', got {args.shapes}")
    if args.precompile < 0:
        parser.error(f"--precompile must be >= 0, got {args.precompile}")
    if args.precompile and not args.candidates:
        parser.error("--precompile compiles the --candidates configs: give --candidates too")
    if args.no_peers and args.peers is not None:
        parser.error("--no-peers and --peers: give one")
    if args.json is not None:  # before the GPU work, not after the first row
        if why := unwritable(args.json):
            parser.error(f"--json: cannot write {args.json}: {why}")
    if not torch.cuda.is_available():
        raise SystemExit("mla-bench needs a CUDA GPU")
    t0 = time.time()
    if args.candidates and args.precompile:
        precompile(sorted({(b, h) for b, _, h in args.shapes}), dtypes, args.precompile, args.page_size)
        print(f"precompiled in {time.time() - t0:.1f}s", flush=True)
    dev = torch.cuda.current_device()
    with ClockSampler(smi_id(dev, getattr(torch.cuda.get_device_properties(dev), "uuid", None))) as clocks:
        result = run_grid(args.shapes, dtypes, peers=peers, candidates=args.candidates,
                          json_path=args.json, floor=not args.no_floor, shared_pages=args.shared_pages,
                          step=args.step, rounds=args.rounds, page_size=args.page_size)
    add_clocks(result, clocks)
    result["wall_s"] = time.time() - t0
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
