"""mla_fast.vllm_peer edges that a source-mutation review (a read-only agent, CPU) found untested: each test fails on
a single edit of mla_fast/vllm_peer.py that tests/test_vllm_peer.py and test_bench_helpers.py let through (the
review's mutant ids in the comments). vLLM itself is a fake file, as in test_vllm_peer.py."""

import pytest
import torch
from test_vllm_peer import NEW, _batch, _fake_vllm, _vllm_from, _vllm_modules

from mla_fast import vllm_peer
from mla_ref.decode import make_decode_batch


def test_a_copied_file_that_fails_to_import_raises_and_leaves_no_vllm_module(tmp_path, monkeypatch):
    """"a file that fails to import raises its own error" (load_decode_attention_fwd), and the two vLLM stubs go
    with it (V10: restoring sys.modules only after a successful import left them for the next import)."""
    path = tmp_path / "triton_decode_attention.py"
    path.write_text("from vllm.triton_utils import tl\nraise RuntimeError('broken copy')\n")
    _vllm_from(monkeypatch, path)
    assert not _vllm_modules()
    with pytest.raises(RuntimeError, match="broken copy"):
        vllm_peer.load_decode_attention_fwd()
    assert not _vllm_modules()


def test_a_directory_is_not_vllms_file(tmp_path, monkeypatch):
    """$MLA_BENCH_VLLM_SRC naming a folder (an unzipped wheel's root, say) is refused with the variable's name, as a
    missing file is (V13: os.path.exists let it reach the importer)."""
    _vllm_from(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match=r"MLA_BENCH_VLLM_SRC must name vLLM's triton_decode_attention\.py"):
        vllm_peer.load_decode_attention_fwd()


def test_vllm_fn_says_why_when_vllm_is_absent(monkeypatch):
    """No vLLM and no file: vllm_fn returns the loader's reason (V34: it went on to read the signature of a string)."""
    _vllm_from(monkeypatch)
    reason = vllm_peer.vllm_fn(_batch("bf16"))
    assert isinstance(reason, str) and reason.startswith("not installed")


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_cache_scales_are_fp32_scalars_and_outputs_are_the_buffers_passed(tmp_path, monkeypatch, cache):
    """k_scale / v_scale: fp32 0-d tensors on the batch's device, as vLLM's layer scales are (V27: fp64); fn.outputs:
    the o and lse the call wrote (V33: attn_logits as the second output)."""
    calls = _fake_vllm(tmp_path, monkeypatch, NEW)
    fn = vllm_peer.vllm_fn(_batch("bf16", cache=cache))
    (a,) = calls
    for name in ("k_scale", "v_scale"):
        assert a[name].dtype == torch.float32 and a[name].shape == () and a[name].device == a["q"].device
    assert fn.outputs[0] is a["o"] and fn.outputs[1] is a["lse"]


def test_split_cap_follows_the_devices_sm_count(tmp_path, monkeypatch):
    """The rule's cap is two splits per SM of the batch's device (num_sms): one SM caps 5000 tokens' 16 splits
    (5000 // 512 = 9 -> 16) at 2 (V37: an H200's 132 SMs hard-coded)."""
    calls = _fake_vllm(tmp_path, monkeypatch, NEW)
    monkeypatch.setattr(vllm_peer, "num_sms", lambda device: 1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 576, generator=g).bfloat16()  # [T, H, 576]
    kv = torch.randn(5000, 576, generator=g).bfloat16()  # [s, 576]
    batch = make_decode_batch(q, [kv], sm_scale=0.1, kv_lora_rank=512, page_size=64, generator=g)
    fn = vllm_peer.vllm_fn(batch)
    assert calls[0]["num_kv_splits"] == fn.num_kv_splits == 2 and calls[0]["attn_logits"].shape[2] == 2


@pytest.mark.parametrize("value", [" 3", "3 ", "+3", "\u00b2", "\u0663"])
def test_split_override_integer_is_digits_only(tmp_path, monkeypatch, value):
    """As the word "rule" must be exact (test_bench_helpers), an integer override is ASCII digits alone (V36: strip()
    before isdigit accepted " 3"; the review found str.isdigit taking '²', which int() then refused in its own words,
    and the Arabic-Indic '٣', taken as 3)."""
    _fake_vllm(tmp_path, monkeypatch, NEW)
    monkeypatch.setenv(vllm_peer.ENV_SPLITS, value)
    with pytest.raises(ValueError, match="MLA_BENCH_VLLM_SPLITS must be 'rule' or a positive integer"):
        vllm_peer.vllm_fn(_batch("bf16"))
