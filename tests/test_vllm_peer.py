"""mla_fast.vllm_peer on the CPU: where vLLM's decode comes from, its split rule, its refusals, and mla-bench's vLLM
columns. vLLM's kernel itself runs only on a GPU (tests/test_peers_gpu.py): Triton 3.6's interpreter cannot run its
`tl.range` over tensor bounds."""

import sys

import pytest
import torch

from mla_fast import bench, vllm_peer
from mla_ref.decode import make_decode_batch

FAKE = '''
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

IS_HIP = current_platform.is_rocm()


def decode_attention_fwd():
    return IS_HIP, tl, triton
'''


def _vllm_from(monkeypatch, src=None):
    """As if vLLM were absent (its module renamed away), with $MLA_BENCH_VLLM_SRC set to ``src`` (None: unset)."""
    monkeypatch.setattr(vllm_peer, "MODULE", "no_such_package.triton_decode_attention")
    if src is None:
        monkeypatch.delenv(vllm_peer.ENV_SRC, raising=False)
    else:
        monkeypatch.setenv(vllm_peer.ENV_SRC, str(src))


def _vllm_modules() -> list[str]:
    """The vllm modules imported now (the loader's two stubs must not outlive it)."""
    return [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]


def test_loader_gives_a_copied_file_the_two_vllm_names_and_leaves_no_vllm_module(tmp_path, monkeypatch):
    import triton
    import triton.language as tl

    path = tmp_path / "triton_decode_attention.py"
    path.write_text(FAKE)
    _vllm_from(monkeypatch, path)
    fwd = vllm_peer.load_decode_attention_fwd()
    assert fwd() == (torch.version.hip is not None, tl, triton)
    assert not _vllm_modules()


def test_loader_without_vllm_or_a_file_says_not_installed(monkeypatch):
    _vllm_from(monkeypatch)
    reason = vllm_peer.load_decode_attention_fwd()
    assert isinstance(reason, str) and reason.startswith("not installed") and vllm_peer.ENV_SRC in reason


def test_loader_names_the_variable_when_its_file_is_missing(tmp_path, monkeypatch):
    _vllm_from(monkeypatch, tmp_path / "missing.py")
    with pytest.raises(ValueError, match=r"MLA_BENCH_VLLM_SRC must name .*missing\.py"):
        vllm_peer.load_decode_attention_fwd()


@pytest.mark.parametrize("seq_len, sms, splits", [
    (100, 132, 1),  # fewer than 512 tokens: one split
    (4096, 132, 8),  # 4096 // 512 = 8
    (5000, 132, 16),  # 9 rounded up to a power of two
    (16384, 132, 32),
    (2**20, 132, 264),  # 2048 capped at two programs per SM
])
def test_split_count_follows_vllm_rule(seq_len, sms, splits):
    assert vllm_peer.num_kv_splits(seq_len, sms) == splits


def _batch(q_dtype, q_len=1, cache="bf16"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2 * q_len, 16, 576, generator=g)  # [T, H, 576]
    kv_dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    kvs = [torch.randn(s, 576, generator=g).to(kv_dtype) for s in (5, 9)]
    q = q.to(torch.float8_e4m3fn) if q_dtype == "fp8" else q.bfloat16()
    scales = {"q_scale": 1.0} if q_dtype == "fp8" else {}
    if cache == "fp8":
        scales["kv_scale"] = 0.5
    return make_decode_batch(q, kvs, sm_scale=0.1, kv_lora_rank=512, page_size=4, generator=g,
                             q_lens=[q_len, q_len], **scales)


CALLS = '''
CALLS = []


def decode_attention_fwd({params}):
    CALLS.append(dict(locals()))
'''
NEW = "q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale, page_size=1, " \
      "logit_cap=0.0, k_scale=None, v_scale=None, is_mla=False"  # vLLM 0.33
OLD = "q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale, page_size=1, " \
      "logit_cap=0.0"  # vLLM 0.15


def _fake_vllm(tmp_path, monkeypatch, params):
    path = tmp_path / "triton_decode_attention.py"
    path.write_text(CALLS.format(params=params))
    _vllm_from(monkeypatch, path)
    monkeypatch.delenv(vllm_peer.ENV_SPLITS, raising=False)
    calls = []
    monkeypatch.setattr(vllm_peer, "_load_file", lambda p, load=vllm_peer._load_file: _recording(load(p), calls))
    return calls


def _recording(module, calls):
    module.CALLS = calls
    return module


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_vllm_033_is_called_with_its_split_rule_scales_and_is_mla(tmp_path, monkeypatch, cache):
    calls = _fake_vllm(tmp_path, monkeypatch, NEW)
    batch = _batch("bf16", cache=cache)  # 9 tokens at most: one split; kv_scale 0.5 for the fp8 cache
    fn = vllm_peer.vllm_fn(batch)
    (a,) = calls
    assert a["is_mla"] is True and a["num_kv_splits"] == fn.num_kv_splits == 1
    assert float(a["k_scale"]) == float(a["v_scale"]) == (0.5 if cache == "fp8" else 1.0)
    assert a["attn_logits"].shape == (2, 16, 1, 513) and a["v_buffer"].shape[-2:] == (1, 512)
    assert a["req_to_token"] is batch.block_table and a["page_size"] == 4 and a["sm_scale"] == batch.sm_scale


def test_vllm_015_gets_its_four_splits_and_no_fp8_cache(tmp_path, monkeypatch):
    calls = _fake_vllm(tmp_path, monkeypatch, OLD)
    fn = vllm_peer.vllm_fn(_batch("bf16"))
    (a,) = calls
    assert a["num_kv_splits"] == fn.num_kv_splits == 4 and a["attn_logits"].shape == (2, 16, 4, 513)
    assert vllm_peer.vllm_fn(_batch("bf16", cache="fp8")) == "n/a (this vLLM's Triton MLA has no fp8 cache)"
    assert len(calls) == 1


@pytest.mark.parametrize("signature, value, splits", [
    (OLD, "rule", 1),  # 9 tokens: the rule gives one split
    (NEW, "3", 3),
    (OLD, "", 4),  # empty: as unset
])
def test_split_count_override(tmp_path, monkeypatch, signature, value, splits):
    calls = _fake_vllm(tmp_path, monkeypatch, signature)
    monkeypatch.setenv(vllm_peer.ENV_SPLITS, value)
    vllm_peer.vllm_fn(_batch("bf16"))
    assert calls[0]["num_kv_splits"] == splits and calls[0]["attn_logits"].shape[2] == splits


@pytest.mark.parametrize("value", ["0", "four", "-2"])
def test_bad_split_override_names_the_variable(tmp_path, monkeypatch, value):
    _fake_vllm(tmp_path, monkeypatch, NEW)
    monkeypatch.setenv(vllm_peer.ENV_SPLITS, value)
    with pytest.raises(ValueError, match=f"MLA_BENCH_VLLM_SPLITS must be 'rule' or a positive integer, got '{value}'"):
        vllm_peer.vllm_fn(_batch("bf16"))


def test_fp8_q_is_not_a_vllm_input():
    assert vllm_peer.vllm_fn(_batch("fp8")) == "n/a (bf16 q only)"


def test_vllm_inputs_refuse_mtp_batches():
    with pytest.raises(ValueError, match="q_len 1"):
        vllm_peer.vllm_inputs(_batch("bf16", q_len=2))


def test_bench_table_shows_vllm_over_ours(capsys):
    ok = {"status": "ok", "us": 10.0, "us_p20": 9.0, "us_p80": 11.0, "gbs": 1.0, "pct_copy": 1.0}
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": ok, "flashinfer": {**ok, "us": 20.0},
           "flashmla": {"status": "not installed"}, "vllm": {**ok, "us": 17.0}}
    bench.print_table({"device": "test", "copy_gbs": 1.0, "rows": [row]})
    line = next(t for t in capsys.readouterr().out.splitlines() if "bf16" in t)
    cells = [c.strip() for c in line.split("│")]
    assert "17.0" in cells and "1.70" in cells and "0.50" in cells  # vLLM µs, vLLM / ours, ours / best peer
