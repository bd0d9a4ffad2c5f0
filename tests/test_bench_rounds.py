"""mla-bench's alternating rounds (`bench.measure_in_rounds`, `--rounds`) on the CPU, with a fake timer: the turn
order, the split of the timed calls, the pooled quantiles and each round's median, and failures."""

from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import benchmark_module

from mla_fast import bench


class FakeTimer:
    """timer(fn, rep_ms) -> samples: records (name, rep_ms) per call; fn() returns its name and samples."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, rep_ms):
        name, samples = fn()
        self.calls.append((name, rep_ms))
        return samples


def timed(name, per_round):
    """A callable returning (name, the next round's samples)."""
    it = iter(per_round)
    return lambda: (name, next(it))


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setattr(bench, "GRAPHS", False)  # no CUDA graphs on the CPU: prepare() passes the callables on


def test_rounds_rotate_the_first_callable_and_split_the_timed_calls():
    timer = FakeTimer()
    fns = {n: timed(n, [[1.0]] * 3) for n in ("ours", "flashinfer", "flashmla")}
    bench.measure_in_rounds(fns, nbytes=10**6, copy_gbs=1.0, rounds=3, rep_ms=100, timer=timer)
    assert [n for n, _ in timer.calls] == ["ours", "flashinfer", "flashmla",
                                           "flashinfer", "flashmla", "ours",
                                           "flashmla", "ours", "flashinfer"]
    assert {rep for _, rep in timer.calls} == {34}  # ceil(100 / 3) ms per round


def test_pooled_quantiles_and_round_medians():
    rounds = [[10.0, 11.0, 12.0], [20.0, 21.0, 22.0, 23.0], [30.0]]
    m = bench.measure_in_rounds({"ours": timed("ours", rounds)}, nbytes=2 * 10**6, copy_gbs=100.0, rounds=3,
                                timer=FakeTimer())["ours"]
    pooled = np.array([t for r in rounds for t in r])
    assert (m["us"], m["us_p20"], m["us_p80"]) == tuple(np.quantile(pooled, [0.5, 0.2, 0.8]))
    assert m["us_rounds"] == [11.0, 21.5, 30.0]
    assert m["gbs"] == pytest.approx(2 * 10**6 / (m["us"] * 1e-6) / 1e9, rel=4 * 2**-52)  # 3 fp64 ops, any order
    assert m["pct_copy"] == pytest.approx(m["gbs"], rel=2 * 2**-52)  # copy rate 100 GB/s: % of it is GB/s (x 100 / 100)
    assert m["status"] == "ok" and m["timing"] == "eager"


def test_a_failing_callable_reports_its_error_and_the_others_keep_their_rounds():
    timer = FakeTimer()
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("illegal memory access")
        return "flashmla", [5.0]

    fns = {"ours": timed("ours", [[1.0]] * 3), "flashmla": flaky, "vllm": "not installed"}
    got = bench.measure_in_rounds(fns, nbytes=1, copy_gbs=1.0, rounds=3, timer=timer)
    assert list(got) == ["ours", "flashmla", "vllm"]  # the caller's order
    assert got["vllm"] == {"status": "not installed"}
    assert got["flashmla"]["status"] == "error: RuntimeError: illegal memory access"
    assert got["ours"]["us_rounds"] == [1.0, 1.0, 1.0]
    assert [n for n, _ in timer.calls].count("flashmla") == 1  # not timed again after its failure


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        bench.measure_in_rounds({"ours": timed("ours", [[1.0]])}, nbytes=1, copy_gbs=1.0, rounds=0)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2  # argparse's usage error, before any CUDA work


def test_page_size_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--page-size", "0"])
    assert exit_info.value.code == 2  # argparse's usage error, before any CUDA work
    assert "--page-size must be >= 1, got 0" in capsys.readouterr().err


def _config_ab():
    """benchmarks/config_ab.py as a module."""
    return benchmark_module("config_ab")


def test_config_ab_variants_split_config_fields_from_module_constants():
    ab = _config_ab()
    assert ab.parse_variant("two:page_select=2,GATHER_CHUNK_MAX_ROWS=64,lazy_l=true") == (
        "two", {"page_select": 2, "lazy_l": True}, {"GATHER_CHUNK_MAX_ROWS": 64})
    for bad, words in [("two", "NAME:FIELD=VALUE"), ("two:warps=4", "neither a KernelConfig field"),
                       ("two:NO_SUCH=1", "no constant 'NO_SUCH'")]:
        with pytest.raises(ValueError, match=words):
            ab.parse_variant(bad)
    from mla_fast import gluon_decode as gd
    from mla_fast import triton_decode as td

    before = td.GATHER_CHUNK_MAX_ROWS
    with ab.held({"GATHER_CHUNK_MAX_ROWS": before * 2}):
        assert td.GATHER_CHUNK_MAX_ROWS == before * 2
    assert td.GATHER_CHUNK_MAX_ROWS == before
    # gluon_decode's launch constants, tuples written with slashes
    for raw, value in [("16/32/64", (16, 32, 64)), ("64/", (64,)), ("()", ())]:
        assert ab.parse_variant(f"g:GROUPED_PAGES={raw}") == ("g", {}, {"GROUPED_PAGES": value})
    pages = gd.GROUPED_PAGES
    with ab.held({"GROUPED_PAGES": (64,)}):
        assert gd.GROUPED_PAGES == (64,)
    assert gd.GROUPED_PAGES == pages
    # a constant gluon_fp8 re-exports from gluon_decode is held in both; one of the same name but another value in
    # each module is refused
    from mla_fast import gluon_fp8 as g8

    small = gd.SMALL_PAGES
    with ab.held(ab.parse_variant("s:SMALL_PAGES=16/")[2]):
        assert gd.SMALL_PAGES == g8.SMALL_PAGES == (16,)
    assert gd.SMALL_PAGES is g8.SMALL_PAGES is small
    with pytest.raises(ValueError, match="different ones of that name"):
        ab.parse_variant("h:HEAD_GROUPS=8/16")


def test_config_ab_needs_two_variants():
    with pytest.raises(SystemExit) as exit_info:
        _config_ab().main(["--variant", "one:page_select=1"])
    assert exit_info.value.code == 2


def test_config_ab_shapes_take_an_optional_q_len_and_nothing_else():
    with pytest.raises(SystemExit) as exit_info:
        _config_ab().main(["--shapes", "64,4096,16,2,9", "--variant", "a:page_select=1",
                           "--variant", "b:page_select=2"])
    assert exit_info.value.code == 2


def test_config_ab_variant_runs_another_version_of_a_gluon_module(tmp_path):
    """`gluon_decode=PATH` holds PATH's launch_decode in mla_fast.gluon_decode for that variant (and restores the
    checkout's after); a missing file, a file without launch_decode, or PATH together with a constant of the module it
    replaces (which PATH's kernel would not read) is refused by name."""
    from mla_fast import gluon_decode as gd

    ab = _config_ab()
    source = Path(gd.__file__).read_text()
    version = tmp_path / "gd_lead.py"
    version.write_text(source + "\nLEAD_MARK = 7\n")
    name, config, constants = ab.parse_variant(f"lead:gluon_decode={version},page_select=2")
    assert (name, config, list(constants)) == ("lead", {"page_select": 2}, ["gluon_decode.launch_decode"])
    ours = gd.launch_decode
    with ab.held(constants):
        assert gd.launch_decode is not ours and gd.launch_decode.__globals__["LEAD_MARK"] == 7
    assert gd.launch_decode is ours
    # the same file is loaded once (its module named after its contents)
    assert ab.parse_variant(f"again:gluon_decode={version}")[2]["gluon_decode.launch_decode"].__module__ == \
        constants["gluon_decode.launch_decode"].__module__
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    for bad, words in [(f"x:gluon_decode={tmp_path / 'none.py'}", "no such file"),
                       (f"x:gluon_fp8={empty}", "defines no launch_decode"),
                       (f"x:gluon_decode={version},GROUPED_PAGES=64/", "GROUPED_PAGES would not reach")]:
        with pytest.raises(ValueError, match=words):
            ab.parse_variant(bad)
    # a constant of another module still may go with it
    assert list(ab.parse_variant(f"y:gluon_decode={version},GATHER_CHUNK_MAX_ROWS=64")[2]) == [
        "gluon_decode.launch_decode", "GATHER_CHUNK_MAX_ROWS"]


def test_bench_usage_errors_come_before_any_cuda_work(capsys):
    """--dtypes and --shapes are checked with the other flags (exit 2), not after the copy-rate measurement and the
    first rows (found by a review: a traceback there)."""
    for argv, words in [(["--dtypes", "bf16,fp16"], "--dtypes must be"), (["--dtypes", "bf16,"], "--dtypes must be"),
                        (["--shapes", "1,8192"], "--shapes must be"),
                        (["--shapes", "1,8192,16,2"], "--shapes must be"),
                        (["--shapes", "0,-5,16"], "--shapes must be"), (["--shapes", ";;"], "--shapes must be"),
                        (["--precompile", "-3"], "--precompile must be"),
                        # found by a review: a conflict and a flag that did nothing, and a --json path checked only
                        # after the first timed row
                        (["--no-peers", "--peers", "flashinfer"], "--no-peers and --peers: give one"),
                        (["--precompile", "4"], "give --candidates too"),
                        (["--json", "/no/such/folder/b.json"], "--json: cannot write")]:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err, argv


def test_bytes_moved_counts_every_query_row():
    """q read and out written once per query row: q_len rows per request under MTP (the MTP benchmarks' GB/s counted
    one, 36 % low at (1, 2048, 128) q_len 4; found by a review). Against the tensors of the batch itself."""
    for combo in bench.COMBOS:
        for q_len in (1, 4):
            batch = bench.build_batch(2, 256, 16, combo, q_len=q_len, device="cpu")
            want = (bench.cache_bytes(2, 256, combo) + batch.q.numel() * batch.q.element_size()
                    + batch.q.shape[0] * 16 * bench.L * 2)  # bf16 out [T, H, L]
            assert bench.bytes_moved(2, 256, 16, combo, q_len) == want, (combo, q_len)


def test_a_failed_row_shows_no_bandwidth(capsys):
    """An error row prints dashes for GB/s and % of copy, not real-looking zeros (found by a review)."""
    failed = {"status": "error: boom"}
    row = {"b": 1, "s": 8192, "h": 16, "combo": "bf16", "ours": failed, "flashinfer": failed, "flashmla": failed,
           "vllm": failed}
    bench.print_table({"device": "test", "copy_gbs": 1.0, "rows": [row]})
    line = next(t for t in capsys.readouterr().out.splitlines() if "bf16" in t)
    cells = [c.strip() for c in line.split("│")]
    assert cells[6:8] == ["—", "—"], cells


def test_absent_peers_say_not_installed(monkeypatch):
    """mla-bench's peer columns read "not installed" where FlashInfer or FlashMLA cannot be imported (here both are
    hidden, as on a machine without their wheels), and the row's JSON keeps that status."""
    import builtins

    real_import = builtins.__import__

    def no_peers(name, *args, **kwargs):
        if name.split(".")[0] in ("flashinfer", "flash_mla"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peers)
    batch = bench.build_batch(1, 128, 16, "bf16", device="cpu")
    assert bench.flashinfer_fn(batch) == "not installed" and bench.flashmla_fn(batch) == "not installed"
    got = bench.measure_in_rounds({"ours": timed("ours", [[1.0]]), "flashinfer": bench.flashinfer_fn(batch)},
                                  nbytes=1, copy_gbs=1.0, rounds=1, timer=FakeTimer())
    assert got["flashinfer"] == {"status": "not installed"}
