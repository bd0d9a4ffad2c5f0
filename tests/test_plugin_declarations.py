"""Untested before a mutation review (sixty-fifth session):
verify/kernels.py (source mutants that the tests of plug-in loading, declarations and the
output contract missed).

- Declarations: a misspelling a little further off (``.steps``, ``.numerical``) is refused too (mutant: cutoff 0.9
  passed); ``.deterministic`` / ``.batch_invariant`` of 1 or 0 and ``.max_splits`` of True are refused (mutants that
  compared by value or took bool for int passed); a static ``.max_splits`` is taken as declared (mutant: raised to
  the default passed).
- `outputs`: a list [out, lse] is taken (a binding returning std::vector<Tensor> gives one; mutant: tuples only
  passed); out or lse of the right size but the wrong shape (transposed) and an out of None are refused (mutants:
  sizes compared by numel, a None out skipped, passed).
- DEFAULT_NUMERICS' accumulation charges are the derivation its comment gives, our kernel's at 64-token tiles
  (mutants: the epilogue halved, the per-tile term at 128-token tiles passed: every test compared it with itself).
- from_backend carries a backend's batch_invariant and step (mutants dropping them passed on the CPU).
- --impl-path is put first on sys.path: its module wins over one of the same name elsewhere (mutant: appended
  passed).
"""

import dataclasses
import sys

import pytest
import torch

from mla_fast.backends import BACKENDS
from mla_fast.numerics import HOPPER_PV_PER_TOKEN, triton_numerics
from verify import mutants
from verify.cases import Case
from verify.kernels import BATCH_INVARIANT, DEFAULT_NUMERICS, from_backend, from_callable, from_impl, outputs

U32_CHOPPED = 2**-23  # one chopped fp32 addition (mla_fast/numerics.py point 2)
EX2_APPROX = 2**-22  # the hardware ex2 approximation (numerics.py point 3)


def _plug_in():
    def decode(batch):
        return mutants.correct(batch)

    return decode


@pytest.mark.parametrize("attr, meant", [("steps", "step"), ("numerical", "numerics"), ("run_worker", "run_workers")])
def test_a_declaration_misspelt_a_little_further_is_refused_too(attr, meant):
    decode = _plug_in()
    setattr(decode, attr, True)
    with pytest.raises(ValueError, match=rf"\.{attr} is not an attribute the verifier reads; did you mean \.{meant}\?"):
        from_callable(decode)


def test_a_callable_objects_misspelt_declaration_is_refused_and_its_own_declarations_are_read():
    """A plug-in that is a callable object carries its declarations on the instance: a misspelt one there is refused
    as on a function (it was read only on functions until the sixty-eighth session), and a right one is taken."""

    class Decode:
        def __call__(self, batch):
            return mutants.correct(batch)

    decode = Decode()
    decode.batch_invarient = True
    with pytest.raises(ValueError, match=r"\.batch_invarient is not an attribute the verifier reads; did you mean "
                                         r"\.batch_invariant\?"):
        from_callable(decode)
    decode = Decode()
    decode.deterministic = False
    assert from_callable(decode).deterministic is False


@pytest.mark.parametrize("attr, value", [("deterministic", 1), ("deterministic", 0), ("batch_invariant", 1),
                                         ("batch_invariant", 0)])
def test_a_flag_declared_as_an_int_is_refused(attr, value):
    decode = _plug_in()
    setattr(decode, attr, value)
    with pytest.raises(ValueError, match=rf"\.{attr} must be True or False, got {value}"):
        from_callable(decode)


def test_max_splits_of_true_is_refused_and_a_static_one_is_taken_as_declared():
    batch, _ = Case(seq_lens=(300, 5), q_lens=(1, 1), heads=2).materialize()  # 300 tokens: 5 blocks of 64
    decode = _plug_in()
    decode.max_splits = True
    with pytest.raises(ValueError, match=r"\.max_splits must be an int >= 1 or a callable"):
        from_callable(decode)
    decode.max_splits = lambda batch: True
    from verify.kernels import DeclarationError

    with pytest.raises(DeclarationError, match=r"\.max_splits\(batch\) must return an int >= 1, got True"):
        from_callable(decode, "mine").max_splits(batch)
    decode.max_splits = 1  # unsplit: the merge of pieces charged nothing, as declared
    kernel = from_callable(decode)
    assert kernel.max_splits(batch) == 1 and "at most 1 splits per row" in kernel.reason
    decode.max_splits = 2
    assert from_callable(decode).max_splits(batch) == 2


def test_outputs_take_a_list_and_refuse_a_transposed_or_missing_tensor():
    batch, _ = Case(seq_lens=(70, 3, 9), q_lens=(1, 2, 1), heads=2, kv_lora_rank=64, rope_dim=32).materialize()
    out, lse = mutants.correct(batch)  # [T = 4, H = 2, L = 64], [T, H]
    got = outputs([out, lse], batch)
    assert got[0] is out and got[1] is lse
    for bad, words in (((out, lse.t()), r"kernel lse: expected shape \[4, 2\], got \[2, 4\]"),
                       ((out.transpose(0, 1), lse), r"kernel out: expected shape \[4, 2, 64\], got \[2, 4, 64\]"),
                       ((out.reshape(4, 64, 2), lse), r"kernel out: expected shape \[4, 2, 64\], got \[4, 64, 2\]"),
                       ((None, lse), r"kernel out: expected a tensor of shape \[4, 2, 64\], got NoneType")):
        with pytest.raises(ValueError, match=words):
            outputs(bad, batch)


def test_default_numerics_accumulate_as_our_kernel_at_64_token_tiles():
    """The default plug-in: fp32 operands and P, bf16 out; 4 chopped fp32 epilogue steps; per token the Hopper MMA
    into the running output plus, per 64-token tile, one chopped rescale and alpha's ex2 twice (numerics.py points
    5-6): our kernel's declaration at block_n = 64 but for the operands."""
    n = DEFAULT_NUMERICS
    assert (n.p_fmt, n.p_scale, n.qk_operand, n.pv_operand, n.out_dtype) == (None, 1.0, torch.float32, torch.float32,
                                                                             torch.bfloat16)
    assert n.gamma_pv == 4 * U32_CHOPPED
    assert n.gamma_pv_per_token == HOPPER_PV_PER_TOKEN + (U32_CHOPPED + 2 * EX2_APPROX) / 64
    ours = triton_numerics("bf16", 64)
    assert (n.gamma_pv, n.gamma_pv_per_token) == (ours.gamma_pv, ours.gamma_pv_per_token)


def test_from_backend_carries_the_backends_batch_invariance_and_step(monkeypatch):
    def step(batch, max_q_len):
        raise AssertionError("not built here")

    monkeypatch.setitem(BACKENDS, "emulated", dataclasses.replace(BACKENDS["emulated"], batch_invariant=True,
                                                                  step=step))
    kernel = from_backend("emulated")
    assert kernel.batch_invariant and BATCH_INVARIANT in kernel.reason and kernel.step is step


def test_impl_path_comes_first_on_sys_path(tmp_path, monkeypatch):
    """A module of the --impl-path directory is the one resolved, even where another of its name is on sys.path."""
    name = "review_impl_path_dup_mod"
    for where in ("elsewhere", "wanted"):
        (tmp_path / where).mkdir()
        (tmp_path / where / f"{name}.py").write_text(f"WHERE = {where!r}\n\ndef decode(batch):\n    return None\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), *sys.path])  # restored after the test
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        kernel = from_impl(f"{name}:decode", str(tmp_path / "wanted"))
        assert sys.modules[name].WHERE == "wanted" and kernel.run.__module__ == name
    finally:
        sys.modules.pop(name, None)
