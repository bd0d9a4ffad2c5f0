"""Untested before a mutation review (sixty-fifth session):
verify/regrouped.py (source mutants that tests/test_batch_invariance.py missed).

- The grown and mtp batches' added request is the last one, and `RegroupedBatch.added` / `added_batch` name it: a
  kernel wrong only on that request fails ``batch.added`` (mutants: ``added=(B - 1,)``, the case's last request
  judged in its place, and ``added=()``, nothing judged, both passed every test).
- The shared batch of a case whose longest request is exactly one full page on a one-entry block-table row: the
  partial sibling reads that page twice (2 P tokens), wider than the case's table (mutant: the table kept at the
  case's width, which raised on such a case, passed every test; no test case had a one-page longest request).

Comparisons are of indices, lengths and pages, the checks' own verdicts, or the oracle against itself up to fp64
rounding (FP64_ROWS, as tests/test_batch_invariance.py).
"""

import torch
from test_batch_invariance import CASE, FP64_ROWS, _check

from mla_ref.decode import INVALID_PAGE, mla_decode_ref
from verify import mutants
from verify.cases import Case
from verify.regrouped import regrouped_batches, shared_batch


def test_the_added_request_of_the_grown_and_mtp_batches_is_the_last_and_is_what_added_batch_gives():
    """Wherever a regrouped batch has one request more than its compared part, `added` names exactly that last
    request, and `added_batch` gives it with its query rows: the rows of ``batch`` after the case's."""
    for q_lens in ((1, 2, 1, 1), (1, 1, 1, 1)):  # mixed q_lens: mtp drops a request; single rows: mtp adds one
        batch, _ = Case(seq_lens=CASE.seq_lens, q_lens=q_lens, heads=2, page_size=16, kv_lora_rank=64, rope_dim=32,
                        seed=1).materialize()
        grew = 0
        for r in regrouped_batches(batch):
            B = r.compared.batch_size
            if r.batch.batch_size == B:
                assert r.added == (), r.how
                continue
            grew += 1
            assert r.batch.batch_size == B + 1 and r.added == (B,), (r.how, r.added)
            added, rows = r.added_batch()
            assert rows.tolist() == list(range(r.rows.shape[0], r.batch.num_tokens)), r.how
            assert added.seq_lens.tolist() == r.batch.seq_lens[B:].tolist()
            assert torch.equal(added.q, r.batch.q[r.rows.shape[0]:])
        assert grew == (2 if q_lens == (1, 1, 1, 1) else 1)  # grown (and mtp with one q_len)


def last_request_off_in_bigger_batches(batch):
    """Right on the case's batch and on every batch of no more requests; in a batch of more requests (the grown one's
    added request, the shared one's last sibling) its last request's out is scaled by 1.5."""
    out, lse = mutants.correct(batch)
    if batch.batch_size > len(CASE.seq_lens):
        n = int(batch.q_lens[-1])
        out[-n:] = (out[-n:].float() * 1.5).to(out.dtype)
    return out, lse


def test_a_kernel_wrong_only_on_the_grown_batchs_added_request_fails_batch_added():
    """The added requests' rows are judged against the oracle (`_added_rows`): a kernel that is wrong on the last
    request of a bigger batch fails exactly the two checks of added requests that end such a batch, and no check of
    the case's rows."""
    results = _check(last_request_off_in_bigger_batches)
    failed = {name for name, r in results.items() if not r.ok}
    assert failed == {"batch.added.out", "batch.shared.added.out"}, results
    assert results["batch"].ok and results["batch.shared"].ok  # the case's rows: the bits of the case's run
    # the grown batch's added request: f P + s_max = 18 x 16 + 300 tokens
    assert "then a request of 588 tokens" in results["batch.added.out"].detail


def test_a_longest_request_of_one_full_page_on_a_one_entry_row_gets_its_partial_sibling():
    """seq_lens (16, 3) on pages of 16: the longest has f = 1 full page and the case's block table one column. The
    partial sibling reads that page, then it again (max(f, 2) P = 32 tokens, every slot valid), in a table widened
    for it; the grown batch's added request reads f P + s_max = 32 tokens on the same page twice. Both batches are
    valid, the siblings' rows finite and the added batches' oracle their rows in the whole batch's."""
    batch, _ = Case(seq_lens=(16, 3), q_lens=(1, 1), heads=2, page_size=16, kv_lora_rank=64, rope_dim=32,
                    seed=5).materialize()
    assert batch.block_table.shape[1] == 1  # the case: one column
    page = int(batch.block_table[0, 0])
    shared = shared_batch(batch)
    assert shared.batch.validate() is shared.batch and shared.added == (0, 3, 4)
    table = shared.batch.block_table  # [5, 2]
    assert table[3].tolist() == [page, page] and int(shared.batch.seq_lens[3]) == 32
    assert table[0, 0] == page and table[4, 0] == page and (table[[0, 4], 1] == INVALID_PAGE).all()
    grown = regrouped_batches(batch)[0]
    assert grown.how == "grown" and grown.batch.validate() is grown.batch
    assert grown.batch.block_table[-1].tolist() == [page, page] and int(grown.batch.seq_lens[-1]) == 32
    for r in (shared, grown):
        out, lse = mla_decode_ref(r.batch)
        added, rows = r.added_batch()
        out_a, lse_a = mla_decode_ref(added)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        for got, want in ((out[rows], out_a), (lse[rows], lse_a)):
            assert (got - want).abs().max() <= FP64_ROWS * want.abs().max()
