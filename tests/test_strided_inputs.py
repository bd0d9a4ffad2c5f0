"""The layout check: a batch's inputs as views into NaN-padded buffers (verify/strided_inputs.py), run again.

Every drawn batch is contiguous, so a kernel that addresses q, the cache or the block table from their shapes
(the mutant ``ignores_strides``) passed every other check; the strided copy keeps the oracle's answer and changes
every stride but the channels'. Each of the three tensors is tested alone: a kernel that honours two strides and
not the third fails too.
"""

import pytest
import torch

from mla_ref.decode import mla_decode_ref
from verify import mutants
from verify.checks import run_case
from verify.kernels import from_backend, from_callable
from verify.strategies import smoke_cases
from verify.strided_inputs import CHANNEL_PAD, TABLE_PAD, strided_batch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_strided_batch_keeps_every_value_and_changes_every_stride_but_the_channels(dtype):
    for case in smoke_cases(dtype):
        batch, _ = case.materialize("cpu")
        strided = strided_batch(batch)
        s = strided.batch
        P, ps, D = batch.kv_cache.shape
        B, W = batch.block_table.shape
        for name in ("q", "kv_cache", "block_table"):
            view, dense = getattr(s, name), getattr(batch, name)
            assert view.stride(-1) == 1 and view.shape[1:] == dense.shape[1:], (name, view.stride())
            padded = [a > b for a, b in zip(view.stride()[:-1], dense.stride()[:-1])]
            assert all(padded), (name, view.stride(), dense.stride())  # every stride but the channels' is larger
        assert torch.equal(_bits(s.q), _bits(batch.q)) and torch.equal(s.block_table, batch.block_table)
        assert torch.equal(_bits(s.kv_cache[:P]), _bits(batch.kv_cache))  # unused slots keep their NaN
        assert s.kv_cache.shape == (P + 1, ps, D) and bool(s.kv_cache[P].float().isnan().all())  # the unowned page
        H = batch.num_heads
        assert s.kv_cache.storage_offset() == (ps + 1) * (D + CHANNEL_PAD)  # a NaN page in front of the view
        assert s.q.storage_offset() == (H + 1) * (D + CHANNEL_PAD) and s.block_table.storage_offset() == W + TABLE_PAD
        table = strided.buffers["block_table"]
        assert table.shape == (B + 1, W + TABLE_PAD) and bool((table[0] == P).all() and (table[:, W:] == P).all())
        for name in ("q", "kv_cache"):  # every byte outside the view is NaN
            buf, view = strided.buffers[name].float(), getattr(s, name).float()
            assert int(buf.isnan().sum()) == buf.numel() - int((~view.isnan()).sum()), name
        ref, ref_strided = mla_decode_ref(batch), mla_decode_ref(s)
        for a, b in zip(ref, ref_strided):
            assert torch.equal(_bits(a), _bits(b)), case.describe()  # the same oracle answer, NaN included


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["emulated", "verify.mutants:correct"])
def test_correct_kernels_give_the_bits_of_the_contiguous_run(dtype, kernel):
    k = from_backend(kernel) if ":" not in kernel else from_callable(mutants.correct)
    result = run_case(smoke_cases(dtype)[0], k, "cpu")
    layout = {c.name: c for c in result.checks}["layout"]
    assert result.ok and layout.detail.endswith("the bits of the run on the contiguous inputs"), result.describe()


@pytest.mark.parametrize("dense", [("q",), ("kv_cache",), ("block_table",), ("q", "kv_cache", "block_table")])
def test_a_kernel_that_ignores_a_stride_fails_the_layout_check_alone(dense):
    """Reading any one of the three tensors from its shape instead of its strides (on the smoke case: 8 heads,
    pages of 64, six requests, MTP rows) fails layout.out and layout.lse, and no other check: every other batch is
    contiguous, where the bug is the identity."""
    def partly_dense(batch):
        return mutants._decode(batch.replace(**{n: mutants._read_dense(getattr(batch, n)) for n in dense}))

    for dtype in ("bf16", "fp8"):
        result = run_case(smoke_cases(dtype)[0], from_callable(partly_dense), "cpu")
        failed = {c.name: c.detail for c in result.checks if not c.ok}
        assert set(failed) == {"layout.out", "layout.lse"}, result.describe()
        assert "out elements differ from the run on the contiguous inputs" in failed["layout.out"]


@pytest.mark.parametrize("name", ["q", "kv_cache", "block_table"])
def test_a_kernel_that_drops_a_storage_offset_fails_the_layout_check_alone(name):
    """Each view starts one row or page into its buffer: a kernel that takes the buffer's start for the tensor's
    (its strides right, its storage offset dropped) reads the NaN padding and fails layout.out and layout.lse."""
    def from_the_start(batch):
        t = getattr(batch, name)
        return mutants._decode(batch.replace(**{name: t.as_strided(t.shape, t.stride(), 0)}))

    result = run_case(smoke_cases("bf16")[0], from_callable(from_the_start), "cpu")
    failed = {c.name for c in result.checks if not c.ok}
    assert failed == {"layout.out", "layout.lse"}, result.describe()


def test_a_refusal_passes_and_says_why_other_errors_and_writes_fail():
    """A ValueError (Unsupported too) for strides a kernel does not take is within the contract: layout.refused
    passes with the message. A RuntimeError (the emulated backend's flat view of the cache raised one before it
    indexed pages and slots) fails, and so does a write into the padding around the views."""
    case = smoke_cases("bf16")[0]

    def refuses(batch):
        if not batch.kv_cache.is_contiguous():
            raise ValueError("my_kernel.kv_cache: expected a contiguous cache")
        return mutants._decode(batch)

    def flat_view(batch):
        batch.kv_cache.view(-1, batch.head_dim)  # RuntimeError on a padded cache
        return mutants._decode(batch)

    def writes_padding(batch):
        out = mutants._decode(batch)
        if batch.q.stride(1) != batch.q.shape[2]:  # the strided run: q's storage holds padding after each row
            torch.as_strided(batch.q, (1,), (1,), batch.q.storage_offset() + batch.q.shape[2]).zero_()
        return out

    result = run_case(case, from_callable(refuses), "cpu")
    checks = {c.name: c for c in result.checks}
    assert result.ok and "layout" not in checks, result.describe()
    assert "refused: ValueError: my_kernel.kv_cache: expected a contiguous cache" in checks["layout.refused"].detail
    for kernel, words in ((flat_view, "the run raised RuntimeError: view size is not compatible"),
                          (writes_padding, "the kernel wrote into its input buffers: q (2 bytes)")):
        result = run_case(case, from_callable(kernel), "cpu")
        failed = {c.name: c.detail for c in result.checks if not c.ok}
        assert set(failed) == {"layout"} and words in failed["layout"], result.describe()


def test_a_kernel_that_reuses_its_output_buffer_is_judged_on_the_first_runs_copy():
    """A CUDA-graph style plug-in writes every call's results into the buffers it keeps: the first run's results
    are copies (`checks._moved`), or the strided run would overwrite them and the layout check would compare it with
    itself (ignores_strides passed that way; found by a review)."""
    kept = {}

    def persistent_ignores_strides(batch):
        out, lse = mutants.ignores_strides(batch)
        buf = kept.setdefault(tuple(out.shape), (torch.empty_like(out), torch.empty_like(lse)))
        buf[0].copy_(out), buf[1].copy_(lse)
        return buf

    result = run_case(smoke_cases("bf16")[0], from_callable(persistent_ignores_strides), "cpu")
    assert {c.name for c in result.checks if not c.ok} == {"layout.out", "layout.lse"}, result.describe()


def test_numerics_that_refuse_the_strided_batch_the_kernel_ran_fail_the_check():
    """A kernel that runs on the strided batch with other bits is judged by what it declares for that batch; numerics
    that refuse it (a ValueError) fail the layout check with the reason instead of stopping the campaign with a
    verifier error (found by a review)."""
    from mla_fast.backends import Unsupported
    from verify.kernels import DEFAULT_NUMERICS

    def one_ulp_off_when_strided(batch):
        out, lse = mutants._decode(batch)
        return out, (torch.nextafter(lse, torch.full_like(lse, 1e30)) if not batch.kv_cache.is_contiguous() else lse)

    def numerics(batch):
        if not batch.kv_cache.is_contiguous():
            raise Unsupported("numerics: a strided cache")
        return DEFAULT_NUMERICS

    one_ulp_off_when_strided.numerics = numerics
    result = run_case(smoke_cases("bf16")[0], from_callable(one_ulp_off_when_strided), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"layout"}, result.describe()
    assert "numerics for the strided batch raised Unsupported: numerics: a strided cache" in failed["layout"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pages_in_use_order_makes_each_requests_pages_consecutive_and_keeps_every_token(dtype):
    """`pages_in_use_order` on every smoke case: request by request, each request's pages are the next ones in
    ascending order (no smoke case shares a page), the pages no request uses come last, every token keeps its bits
    at its logical position, unused block-table entries are kept, and the oracle gives the same bits."""
    from verify.strided_inputs import pages_in_use_order

    for case in smoke_cases(dtype):
        batch, _ = case.materialize("cpu")
        laid = pages_in_use_order(batch)
        used = batch.used_entries
        assert torch.equal(laid.block_table[used], torch.arange(int(used.sum()), dtype=laid.block_table.dtype))
        assert torch.equal(laid.block_table[~used], batch.block_table[~used]), case.describe()
        in_use = set(batch.block_table[used].tolist())
        unused = [p for p in range(batch.kv_cache.shape[0]) if p not in in_use]  # in their order, after the others
        assert torch.equal(_bits(laid.kv_cache[len(in_use):]), _bits(batch.kv_cache[unused]))
        for b in range(batch.batch_size):
            pages, slots = batch.token_slots(b)
            new_pages, new_slots = laid.token_slots(b)
            assert torch.equal(slots, new_slots)
            assert torch.equal(_bits(laid.kv_cache[new_pages, new_slots]), _bits(batch.kv_cache[pages, slots]))
        ref, ref_laid = mla_decode_ref(batch), mla_decode_ref(laid)
        for a, b in zip(ref, ref_laid):
            assert torch.equal(_bits(a), _bits(b)), case.describe()


def test_pages_in_use_order_keeps_a_shared_page_shared():
    """Two requests on one physical page (a shared prefix) still share it, numbered at its first use."""
    from verify.strided_inputs import pages_in_use_order

    batch, _ = smoke_cases("bf16")[0].materialize("cpu")
    table = batch.block_table.clone()
    b0, b1 = (int(b) for b in torch.nonzero(batch.pages_per_request >= 1)[:2, 0])
    table[b1, 0] = table[b0, 0]  # request b1's first page is request b0's first
    shared = batch.replace(block_table=table)
    laid = pages_in_use_order(shared)
    assert int(laid.block_table[b1, 0]) == int(laid.block_table[b0, 0]) == int(batch.pages_per_request[:b0].sum())
