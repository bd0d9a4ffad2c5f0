"""Caches past 2^31 elements: the kernels address pages with int64 offsets (CPU, Triton's interpreter).

A production cache is many GB: 2^31 elements are 3.7 M tokens of bf16 MLA (576 per token), 4.3 GB. An element
offset page x page_stride computed in int32 wraps there, and the kernel then reads another page, or faults.
verify.checks.far_pages (the verifier's far check) moves a batch's used pages to the end of a cache of more than
2^31 elements (two of them below, the rest above) and poisons the pages in front with NaN: the same lengths give
the same plan, so a correct kernel returns the bits of the compact batch. The interpreter computes int32
arithmetic in numpy int32 and wraps as the device does.

Only fp8 caches run here (D = 96, one byte per element: a 2.1 GB cache; bf16 would need 4.3 GB); the address
arithmetic is the same code for every cache dtype, and tests/test_triton_gpu.py runs bf16 too at DeepSeek-V3 widths.
Each case runs in a worker subprocess of its own (TRITON_INTERPRET must be set before triton is imported; a
wrapped offset may fault the process).
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from triton_cases import INTERPRETER_TILES, TritonCase, same_bits

from verify.checks import far_pages
from verify.metrics import compare

HERE = Path(__file__).resolve().parent
CASES = {  # pages of 16 (each 16-token tile in one page: the page's base offset) and of 3 (one offset per token)
    "fp8kv_p16_mtp2_w3": TritonCase((40, 0, 70), (2, 1, 1), page_size=16, combo="fp8kv", num_workers=3, seed=60),
    "fp8_p3_w3": TritonCase((50, 9), (1, 2), page_size=3, combo="fp8", num_workers=3, seed=61),
}


def _worker(name: str) -> dict:
    from mla_fast import triton_decode as td
    from mla_fast.backends import get_backend
    from mla_ref.decode import mla_decode_ref

    case = CASES[name]
    batch = case.batch()
    far = far_pages(batch)
    config = replace(td.default_config(case.combo, case.heads, max(case.q_lens)), **INTERPRETER_TILES)
    plan = td.make_plan(batch, config, case.num_workers)
    near_run = td.decode(batch, plan=plan, config=config)
    far_run = td.decode(far, plan=plan, config=config)
    offsets = far.block_table.long() * far.kv_cache.stride(0)  # [B, max_pages] element offset of each page
    used = far.used_entries
    emulated = get_backend("emulated")
    em_near, em_far = emulated(batch), emulated(far)  # (out [T, H, L] bf16, lse [T, H] fp32) each
    return {
        "cache_elements": far.kv_cache.numel(),
        "pages_past_2_31": int((offsets[used] >= 2**31).sum()),
        "pages_below_2_31": int((offsets[used] < 2**31).sum()),
        "split": plan.num_partial_rows > 0,
        "kernel_bits": same_bits(near_run, far_run),
        "kernel_nan": bool(torch.isnan(far_run[0].float()).any()),
        "emulated_bits": same_bits(em_near, em_far),
        # for a failure's diagnosis (one in a CI run of the seventy-second session, not reproduced in six reruns):
        # whether the emulation repeats its own bits on the compact batch, and how the far run differs (compare():
        # the greatest difference, where, its ULPs, the non-finite positions)
        "emulated_repeats": same_bits(em_near, emulated(batch)),
        "emulated_far_vs_compact": [compare(f, n, name=k, out_dtype=f.dtype).describe()
                                    for k, f, n in zip(("out", "lse"), em_far, em_near)],
        "oracle_equal": all(torch.equal(a, b) for a, b in zip(mla_decode_ref(batch), mla_decode_ref(far))),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_pages_past_2_31_elements_give_the_bits_of_the_compact_cache(name):
    pytest.importorskip("triton", reason="needs triton (pip install triton==3.6.0, as .ci/run does)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode >= 0, f"{name}: the worker died of signal {-proc.returncode} (a wrapped page offset?)"
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["cache_elements"] > 2**31 and r["pages_past_2_31"] > 0 and r["pages_below_2_31"] > 0, r  # the setup
    assert r["split"], r  # the partials and the reduce run too
    assert r["kernel_bits"] and not r["kernel_nan"], f"{name}: the Triton kernel read a wrapped page offset {r}"
    assert r["emulated_bits"] and r["oracle_equal"], r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2])
def test_far_pages_keeps_unused_block_table_entries_and_poisons_the_new_pages(dtype):
    """The used entries shift, the others keep their values; the new pages hold the format's NaN (e4m3fnuz: 0x80,
    not e4m3fn's 0x7F, which is a finite 240 there); two shifted pages start below the threshold."""
    batch = CASES["fp8_p3_w3"].batch()
    batch = batch.replace(kv_cache=batch.kv_cache.float().to(dtype))  # the values do not matter here
    far = far_pages(batch, beyond=2**12, page_ids=0)  # a small threshold: the same construction, a small cache
    shift = far.kv_cache.shape[0] - batch.kv_cache.shape[0]
    used = batch.used_entries
    assert torch.equal(far.block_table[used], batch.block_table[used] + shift)
    assert torch.equal(far.block_table[~used], batch.block_table[~used])
    assert torch.isnan(far.kv_cache[:shift].float()).all()
    assert torch.equal(far.kv_cache[shift:].view(torch.uint8), batch.kv_cache.view(torch.uint8))
    per_page = far.kv_cache.stride(0)
    assert (shift + 1) * per_page < 2**12 <= (shift + 2) * per_page


def test_far_pages_moves_a_lone_first_page_past_the_threshold_and_refuses_bad_arguments():
    """A batch whose only used page is page 0 (one short request) still gets it past the threshold: `below` shrinks
    to the largest used page. beyond and below are checked."""
    from mla_ref.decode import make_decode_batch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 96, generator=g).bfloat16()  # [T, H, D]
    batch = make_decode_batch(q, [torch.randn(5, 96, generator=g).bfloat16()], sm_scale=0.1, kv_lora_rank=64,
                              page_size=16, generator=g)
    batch = batch.replace(block_table=torch.zeros_like(batch.block_table))  # the request on page 0
    far = far_pages(batch, beyond=2**12, page_ids=0)
    assert int(far.block_table[0, 0]) * far.kv_cache.stride(0) >= 2**12
    assert int(far_pages(batch, beyond=1).block_table[0, 0]) == 2**16  # the default page_ids: past 16-bit ids
    for kwargs in (dict(beyond=0), dict(below=-1), dict(below=1.5), dict(beyond=True), dict(page_ids=-1)):
        with pytest.raises(ValueError, match="far_pages.(beyond|below|page_ids): expected an int"):
            far_pages(batch, **kwargs)


def test_far_pages_puts_the_used_pages_past_page_id_2_16_where_that_lies_past_element_2_31():
    """Pages of 64 DeepSeek-V3 tokens (36864 elements) pass element 2^31 at page 58255, under 2^16: a page id kept
    in 16 bits would still be right there (a review found it). The used pages from the third on now get ids past
    2^16 (their offsets past 2^31 too), the two below stay under both; here with a small ``beyond``, so that the
    page ids alone set the shift."""
    batch = CASES["fp8_p3_w3"].batch()
    far = far_pages(batch, beyond=2**12)
    used, below = batch.used_entries, batch.block_table.long() < 2  # [B, max_pages] each
    ids = far.block_table.long()
    assert (ids[used & ~below] >= 2**16).all() and (ids[used & below] < 2**16).all()
    assert (ids[used & below] == batch.block_table.long()[used & below] + 2**16 - 2).all()


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 4294967296 bytes"),
], ids=["cuda", "cpu"])
def test_a_far_cache_that_does_not_fit_fails_the_check_and_says_what_to_do(monkeypatch, error):
    from verify import checks
    from verify.kernels import from_backend
    from verify.strategies import smoke_cases

    def no_room(batch, *args, **kwargs):
        raise error

    monkeypatch.setattr(checks, "far_pages", no_room)
    result = checks.run_case(smoke_cases("bf16")[0], from_backend("emulated"), "cpu", far=True)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"far"} and "does not fit" in failed["far"] and "--far off" in failed["far"], failed



def test_a_far_run_out_of_memory_says_so_and_every_far_check_releases_its_cache(monkeypatch):
    """A run on the far cache that fails to allocate fails the check as memory, not as a kernel error; the check
    hands its cache back to the device however it ends (`release_cached`: worker processes share one GPU)."""
    from verify import checks
    from verify.kernels import from_backend, from_callable
    from verify.strategies import smoke_cases

    emulated = from_backend("emulated")
    far_caches, released = [], []

    def small_far(batch, *args, **kwargs):  # a copy stands in for the 2-4 GB cache
        far = batch.replace(kv_cache=batch.kv_cache.clone())
        far_caches.append(far.kv_cache.data_ptr())
        return far

    def no_room_when_far(batch):
        if batch.kv_cache.data_ptr() in far_caches:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return emulated.run(batch)

    monkeypatch.setattr(checks, "far_pages", small_far)
    monkeypatch.setattr(checks, "release_cached", released.append)
    result = checks.run_case(smoke_cases("bf16")[0], from_callable(no_room_when_far), "cpu", far=True)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"far"} and "the run does not fit" in failed["far"] and "--far off" in failed["far"], failed
    result = checks.run_case(smoke_cases("bf16")[0], emulated, "cpu", far=True)
    assert all(c.ok for c in result.checks) and any(c.name == "far" for c in result.checks)
    assert released == [torch.device("cpu")] * 2


def test_release_cached_empties_the_cuda_cache_only_on_cuda_devices(monkeypatch):
    from verify.checks import release_cached

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    release_cached(torch.device("cpu"))
    assert calls == []
    release_cached(torch.device("cuda", 0))
    assert calls == [1]


def test_a_far_run_without_the_lse_of_the_first_fails():
    """A kernel whose far run drops the lse it returned on the compact cache fails the check (its out alone would
    pass the tier-1 comparison)."""
    from verify.checks import run_case
    from verify.kernels import from_backend, from_callable
    from verify.strategies import smoke_cases

    emulated = from_backend("emulated")

    def lse_only_when_small(batch):
        out, lse = emulated.run(batch)
        return out if batch.kv_cache.numel() > 2**31 else (out, lse)

    result = run_case(smoke_cases("fp8")[0], from_callable(lse_only_when_small), "cpu", far=True)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"far"} and "lse returned by only one" in failed["far"], failed

if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(_worker(sys.argv[2])))


def test_the_far_check_goes_past_page_id_2_16_only_where_that_cache_stays_under_its_cap(monkeypatch):
    """2^16 pages of 528 DeepSeek tokens are 19.9 Gi-elements (40 GB of bf16): three worker processes at once ran an
    H200 out of memory. Past FAR_PAGE_ID_ELEMENTS the check moves the pages past element 2^31 only (page_ids 0) and
    says so; pages of 128 (4.8 Gi-elements) still go past page id 2^16. Here the real far_pages with a small
    ``beyond``, so that the caches stay small."""
    from verify import checks
    from verify.kernels import from_backend
    from verify.strategies import smoke_cases

    asked = []

    def small_far(batch, page_ids):
        asked.append(page_ids)
        return far_pages(batch, beyond=2**12, page_ids=min(page_ids, 4))

    monkeypatch.setattr(checks, "far_pages", small_far)
    big, p128 = (next(c for c in smoke_cases("bf16") if c.page_size == p) for p in (528, 128))
    assert 2**16 * 528 * 576 > checks.FAR_PAGE_ID_ELEMENTS >= 2**16 * 128 * 576
    details = []
    for case in (big, p128):
        result = checks.run_case(case, from_backend("emulated"), "cpu", far=True)
        (far,) = [c for c in result.checks if c.name.startswith("far")]
        assert far.ok, far.detail
        details.append(far.detail)
    assert asked == [0, 2**16]
    assert "not page id 2^16: 65536 pages of 304128 elements would be 19 Gi-elements" in details[0], details[0]
    assert "past element 2^31 and page id 2^16" in details[1], details[1]
