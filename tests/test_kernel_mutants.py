"""scripts/kernel_mutants.py, the Gluon kernels' source mutants, on the CPU: the committed mutant list still applies
to today's kernels, edits are placed in kernel code or launch code, bad lists are refused by field, the screen tells
an equivalent edit from a compile error by PTX, and a run's pytest outcomes are read as caught, slipped, timeout or
error (on a stand-in test file: the real selection needs a GPU)."""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton
from benchmark_scripts import script_module

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "scripts" / "gluon_mutants.json"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


km = script_module("kernel_mutants")


def test_every_committed_mutant_applies_once_to_todays_kernels_and_parses():
    """A kernel change that moves a mutant's text makes the list stale: re-place that mutant (its `why` says what it
    plants) instead of dropping it."""
    mutants = km.load(MUTANTS)
    assert {m.file for m in mutants} == set(km.KERNEL_FILES)
    for m in mutants:
        ast.parse(km.mutated_source(m))  # raises ValueError unless `old` occurs once
        assert m.why.strip(), m.id


def test_edits_are_placed_in_kernel_code_or_launch_code():
    def at(old, file="mla_fast/gluon_decode.py"):
        return km.jit_function(km.Mutant("X", file, old, old + " ", "", False))

    assert at("def _alpha(m_old, m_new):") == "_alpha"  # @gluon.jit
    assert at('    return gl.exp2(m_old - gl.where(m_new == float("-inf"), 0.0, m_new))\n') == "_alpha"  # its last line
    assert at("def _halves(grouped, kv_fp8):") == "_halves"  # @constexpr_function: run while tracing
    assert at("def supported(batch) -> bool:") is None  # launch code
    assert at("def _k_split(lead0, lead1):", "mla_fast/gluon_fp8.py") == "_k_split"
    kernel_line = "            l_t = l_t * alpha[None, :] + p\n"  # in a @gluon.jit(do_not_specialize=...) kernel
    assert at(kernel_line, "mla_fast/gluon_fp8.py") == "_mla_decode_fp8_kernel"
    # the seesaw's file holds helpers of both kernels; the fp8 file, the Gluon fp8 kernel's code alone
    assert km.geometries("mla_fast/gluon_decode.py") == km.SCREEN_GEOMETRIES
    fp8 = km.geometries("mla_fast/gluon_fp8.py")
    assert fp8 and all(g.split()[0] == "gluon_fp8" for g in fp8)
    assert {g.split()[0] for g in km.SCREEN_GEOMETRIES} == {"seesaw", "gluon_fp8"}


@pytest.mark.parametrize("entry, message", [
    ({"file": "mla_fast/triton_decode.py"}, "file must be one of"),
    ({"new": "ROWS = 64"}, "new must differ from old"),
])
def test_load_refuses_a_foreign_file_and_a_null_edit_by_field(tmp_path, entry, message):
    mutant = {"id": "X1", "file": "mla_fast/gluon_decode.py", "old": "ROWS = 64", "new": "ROWS = 32", "why": "w",
              "may_hang": False, **entry}
    path = tmp_path / "m.json"
    path.write_text(json.dumps([mutant]))
    with pytest.raises(ValueError, match=message):
        km.load(path)
    path.write_text(json.dumps([{**mutant, **{"file": "mla_fast/gluon_decode.py", "new": "ROWS = 32"}}] * 2))
    with pytest.raises(ValueError, match="ids must be unique, repeated: \\['X1'\\]"):
        km.load(path)


def test_an_edit_must_occur_exactly_once():
    with pytest.raises(ValueError, match="found 0 times"):
        km.mutated_source(km.Mutant("X", "mla_fast/gluon_decode.py", "no such text", "x", "w"))
    with pytest.raises(ValueError, match=r"found ([2-9]|\d\d+) times"):
        km.mutated_source(km.Mutant("X", "mla_fast/gluon_decode.py", "gl.constexpr", "x", "w"))


def test_a_mutants_copy_holds_the_edit_and_leaves_the_repository_alone(tmp_path):
    m = km.Mutant("X", "mla_fast/gluon_decode.py", "ROWS = 64  #", "ROWS = 32  #", "w")
    before = (ROOT / m.file).read_text()
    repo = km.copy_repo(tmp_path / "repo", m)
    assert "ROWS = 32  #" in (repo / m.file).read_text() and (ROOT / m.file).read_text() == before
    assert (repo / "tests" / "test_triton_gpu.py").exists() and (repo / "scripts" / "offline_compile.py").exists()
    # the copy's modules are the ones imported under its environment, ahead of an editable install
    code = "import mla_fast.gluon_decode as g; print(g.ROWS)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=km._with_path(repo),
                          cwd=tmp_path)
    assert proc.stdout.strip() == "32", proc.stderr[-2000:]


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_the_screen_tells_an_equivalent_edit_from_a_changed_kernel_and_a_compile_error(monkeypatch):
    """One geometry (the Gluon fp8 kernel, 3 s a compile) and the work-item reader it shares with the seesaw: a
    comment edit keeps its PTX, a causal limit one token short changes it, a name that does not exist does not
    compile."""
    monkeypatch.setattr(km, "SCREEN_GEOMETRIES", ("gluon_fp8 --combo fp8kv --heads 16 --q-len 2 --page-size 64",))
    line = "    item = WORK_ITEMS + it * 8"
    limit = "(qo_start - req_qo_start) + 1"
    mutants = [km.Mutant("SAME", "mla_fast/gluon_decode.py", line, line + "  # a comment", "w"),
               km.Mutant("CHANGED", "mla_fast/gluon_decode.py", limit, limit[:-4], "w"),
               km.Mutant("BROKEN", "mla_fast/gluon_decode.py", line, line + " + no_such_name", "w")]
    got = {r["id"]: r for r in km.screen(mutants, 1, None)}
    assert [got[i]["outcome"] for i in ("SAME", "CHANGED", "BROKEN")] == ["same_ptx", "changed", "compile_error"]
    assert got["CHANGED"]["ptx_changed"] == list(km.SCREEN_GEOMETRIES) and got["SAME"]["function"] == "_item"


def test_every_gate_names_collected_gpu_tests_of_its_kernels():
    """A renamed test or case would leave a gate judging less than it says (pytest errors on an unknown node id, so
    the device run's baseline would stop there); each gate starts with the pinned backends and holds its kernel's
    bound tests, and the baseline runs both."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q", "-m", "gpu",
                           "-p", "no:cacheprovider", "tests/test_triton_gpu.py"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert len(collected) > 100, proc.stdout[-2000:]
    for file, gate in km.GATES.items():
        assert set(gate) <= collected, sorted(set(gate) - collected)
        assert len(set(gate)) == len(gate) and gate[0].split("::")[1].startswith("test_pinned_gluon_backends")
        kernel = "gluon_seesaw" if file.endswith("gluon_decode.py") else "gluon_fp8"
        assert any(f"test_{kernel}_within_kernel_bound[" in t for t in gate), file
    assert set(km.BASELINE) == set(km.GATES["mla_fast/gluon_decode.py"]) | set(km.GATES["mla_fast/gluon_fp8.py"])


def _workers_with(case, config, workers: int, pair) -> int:
    """Workers of `config`'s plan for `case` on `workers` workers that run an item of a tiles and next one of b tiles
    with pair(a, b) true. The plan from the case's lengths alone: building an fp8 batch quantizes its whole cache
    (26 s on this CPU at 1000 requests)."""
    from types import SimpleNamespace

    import torch

    from mla_fast import planner
    from mla_fast import triton_decode as td

    lengths = SimpleNamespace(q=torch.empty(0), num_heads=case.heads)  # what make_plan reads besides the lengths
    plan = td.make_plan(lengths, config, workers, seq_lens=torch.tensor(case.seq_lens),
                        q_lens=torch.tensor(case.q_lens))
    items, bounds = plan.work_items.long(), plan.worker_indptr.long().tolist()
    tiles = ((items[:, planner.KV_END] - items[:, planner.KV_START] + config.block_n - 1) // config.block_n).tolist()
    return sum(any(pair(tiles[i], tiles[i + 1]) for i in range(lo, hi - 1)) for lo, hi in zip(bounds, bounds[1:]))


def _odd_then_longer(case) -> int:
    """Workers of the seesaw's plan for `case` (132 workers, an H100's or H200's SMs) that run an item of an odd tile
    count and then one of two tiles or more."""
    from mla_fast import triton_decode as td

    config = td.default_config("bf16", case.heads, max(case.q_lens), 32, seesaw=True)
    return _workers_with(case, config, 132, lambda a, b: a % 2 == 1 and b >= 2)


def test_one_seesaw_case_runs_an_odd_tile_item_before_a_longer_one_on_most_workers():
    """The seesaw's two tile slots count their uses apart (barrier phases): they part after an item of an odd tile
    count. Mutant S28 (slot 1 waits with slot 0's phase) passed every seesaw case but the one added for it, whose
    plan gives most workers that sequence (the sixty-eighth session's cases gave none)."""
    from test_triton_gpu import GLUON_CASES

    counts = [_odd_then_longer(case) for case in GLUON_CASES]
    assert counts[-1] > 100 and len(GLUON_CASES[-1].q_lens) == 600, counts


def _slots_then_another(case) -> int:
    """Workers of the Gluon fp8 kernel's plan for `case` (132 SMs, its workers_per_sm programs each) that run an item
    of num_stages tiles or more and then another item."""
    from mla_fast import triton_decode as td

    config = td.forced_config(case.combo, case.heads, max(case.q_lens), "gluon_fp8")
    return _workers_with(case, config, 132 * config.workers_per_sm, lambda a, b: a >= config.num_stages and b >= 1)


def test_a_cheap_gluon_fp8_case_runs_an_item_of_every_tile_slot_then_another_on_most_workers():
    """Mutant F17 (a tile issued past an item's end, into a slot the next item then uses with the wrong barrier
    phase) needs a program to run an item of num_stages tiles or more and then another. Of the Gluon fp8 cases
    only the two of 1000 requests, s57 and s68, did that (17.6 s on an H100 for s68, 8.5 s for s81); s81, of 700
    requests and a fifth of their tokens, does it on most workers."""
    from test_triton_gpu import GLUON_FP8_CASES

    by_seed = {case.seed: case for case in GLUON_FP8_CASES}
    counts = {seed: _slots_then_another(case) for seed, case in by_seed.items()}
    assert {seed for seed, n in counts.items() if n} == {57, 68, 81}, counts
    assert counts[81] > 200 and sum(by_seed[81].seq_lens) < sum(by_seed[68].seq_lens) / 4, counts


def _stand_in(tmp_path, body: str) -> Path:
    """A repository whose tests/test_triton_gpu.py is `body` (marker gpu declared; no conftest skips it here)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["gpu: a GPU test"]\n')
    (tmp_path / "tests" / "test_triton_gpu.py").write_text(
        "import os, time\nimport pytest\npytestmark = pytest.mark.gpu\n" + textwrap.dedent(body))
    return tmp_path


@pytest.mark.parametrize("body, outcome, first, seconds, test_timeout", [
    ("def test_gluon_a(): pass\ndef test_gluon_b(): assert 1 == 2\ndef test_gluon_c(): pass\n", "caught",
     "tests/test_triton_gpu.py::test_gluon_b", 60, None),
    ("def test_gluon_a(): pass\ndef test_other(): assert False\n", "slipped", None, 60, None),  # outside the selection
    ("def test_gluon_a(): pytest.skip('no GPU')\n", "error", None, 60, None),  # nothing judged
    ("def test_gluon_a(): pass\ndef test_gluon_b(): time.sleep(60)\n", "timeout", None, 5, None),  # watchdog: 300 s
    ("def test_gluon_a(): pass\ndef test_gluon_b(): time.sleep(60)\n", "hang", None, 60, 1.5),  # ended at 1.5 s
    ("import no_such_module\ndef test_gluon_a(): pass\n", "error", None, 60, None),
], ids=["caught", "slipped", "all_skipped", "timeout", "hang", "collection_error"])
def test_a_runs_pytest_outcome_is_read_from_its_exit_status_and_summary(tmp_path, monkeypatch, body, outcome, first,
                                                                         seconds, test_timeout):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # verify.gpu_watchdog, which the runner loads, for the stand-in
    r = km._pytest(_stand_in(tmp_path, body), ["-k", "gluon", "tests/test_triton_gpu.py"], seconds, [],
                   test_timeout=test_timeout)
    assert (r["outcome"], r["first_failure"]) == (outcome, first), r["tail"]
    if outcome in ("slipped", "timeout", "hang"):  # a timeout or hang keeps the tests passed before it
        assert r["counts"]["passed"] == 1, r
    if outcome in ("timeout", "hang"):  # and names the one in flight
        assert r["in_flight"] == "tests/test_triton_gpu.py::test_gluon_b", r
    if outcome == "hang":
        assert r["seconds"] < 30, r


def _fake_runs(monkeypatch, baseline: dict):
    """run() with the copies and pytest runs stubbed: the baseline returns `baseline`, each mutant is caught."""
    monkeypatch.setattr(km, "copy_repo", lambda dest, m=None: dest)  # (run removes it afterwards)
    monkeypatch.setattr(km, "jit_function", lambda m: None)
    calls = []

    def fake_pytest(repo, targets, timeout, extra, workers=0, test_timeout=None):
        calls.append((targets, timeout, test_timeout))
        return dict(baseline) if targets == km.BASELINE else {"outcome": "caught", "first_failure": "t", "counts": {},
                                                              "seconds": 1.0}

    monkeypatch.setattr(km, "_pytest", fake_pytest)
    return calls


def test_a_run_calls_the_baseline_passed_and_passes_the_watchdog_limit_on(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, {"outcome": "slipped", "counts": {"passed": 3}, "seconds": 2.0})
    mutants = km.load(MUTANTS)[:2]
    report = km.run(mutants, 2, 60, str(tmp_path / "r.json"), [], test_timeout=42.0)
    assert report["baseline"]["outcome"] == "passed"
    assert [r["outcome"] for r in report["mutants"]] == ["caught", "caught"]
    assert sorted(c[1:] for c in calls) == [(60, 42.0), (60, 42.0), (120, 42.0)]  # the baseline: twice the time
    assert json.loads((tmp_path / "r.json").read_text())["baseline"]["outcome"] == "passed"


@pytest.mark.parametrize("outcome", ["caught", "hang", "timeout", "error"])
def test_a_run_whose_baseline_did_not_pass_counts_no_mutant(monkeypatch, tmp_path, outcome):
    _fake_runs(monkeypatch, {"outcome": outcome, "counts": {"failed": 1}, "seconds": 2.0, "tail": "x"})
    with pytest.raises(SystemExit, match=f"did not pass \\({outcome}"):
        km.run(km.load(MUTANTS)[:1], 1, 60, None, [])
