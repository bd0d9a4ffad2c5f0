"""Source mutants of the Gluon kernels: single edits of mla_fast/gluon_decode.py and gluon_fp8.py, screened on this
CPU by their sm_90a PTX and run on a GPU against the tests that judge the kernels. The interpreter runs neither
kernel, so this is how a slipped kernel bug is looked for there (the Triton kernel's review ran under
TRITON_INTERPRET=1: docs/verification_log.md, sixty-first session).

    python scripts/kernel_mutants.py screen scripts/gluon_mutants.json --json /tmp/screen.json   # CPU, no GPU
    python scripts/kernel_mutants.py run scripts/gluon_mutants.json --json $OUT/run.json --jobs 8  # one GPU

A mutant file is a JSON list of {"id", "file", "old", "new", "why", "may_hang"} and optionally "selection" (a
pytest -k expression on tests/test_triton_gpu.py, for tests that judge it where GATES[file] leaves them out): `old`
occurs exactly once in `file`, and the mutant is that file with `old` replaced by `new`.

`screen` compiles each mutant, in a copy of the repository, for the geometries of SCREEN_GEOMETRIES (seesaw and
Gluon fp8, bf16 and fp8, MTP and pages of 16; scripts/offline_compile.py's stand-in driver) and compares each
PTX, without its debug records, with the unmutated source's: "compile_error", "same_ptx" (an edit in kernel code,
a @gluon.jit or @constexpr_function function, that changes none of these kernels: equivalent there) or "changed".
An edit in launch code is "launch" whatever its PTX (it changes arguments and constexprs: only a GPU run judges it).

`run` runs the tests on the unmutated copy (they must pass: a mutant is judged against a green baseline) and each
mutant in a copy of its own, `jobs` at a time on the one GPU, stopping at its first failing test (`-x`): "caught" (a
test failed; its id is kept), "slipped" (every test passed, at least one ran), "timeout" (killed at `timeout`
seconds, the test in flight named), "hang" (a test outlasted the GPU test watchdog, `--test-timeout` seconds, and
verify.gpu_watchdog ended the run, the test named: an mbarrier waited on with the wrong phase, say) or "error"
(pytest's exit status 2-5, or every test skipped: nothing was judged). The baseline's outcome is "passed" where a
mutant's would be "slipped". Mutants marked may_hang run last. The JSON is rewritten after each mutant, so a run cut
off at a device call's limit keeps what finished.
"""

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from verify.gpu_watchdog import ENV as WATCHDOG_ENV  # noqa: E402  (the repository's, whatever is installed)

KERNEL_FILES = ("mla_fast/gluon_decode.py", "mla_fast/gluon_fp8.py")
COPIED = ("mla_fast", "mla_ref", "verify", "scripts", "tests", "pyproject.toml")  # what a mutant's copy holds
# offline_compile.py arguments: every kernel and path a mutant can reach (gluon_fp8 imports gluon_decode's helpers,
# so gluon_decode's mutants compile all of these, gluon_fp8's the Gluon fp8 kernel's: `geometries`)
SCREEN_GEOMETRIES = (
    "seesaw --combo bf16 --heads 128 --q-len 1 --page-size 64",
    "seesaw --combo bf16 --heads 16 --q-len 4 --page-size 64",  # MTP rows
    "seesaw --combo bf16 --heads 32 --q-len 2 --page-size 16",  # the grouped layout
    "seesaw --combo fp8kv --heads 128 --q-len 1 --page-size 16",  # the fp8 loader partition
    "seesaw --combo fp8kv --heads 128 --q-len 1 --page-size 16 --fp8-in-place",  # tiles expanded in place instead
    "seesaw --combo fp8 --heads 16 --q-len 4 --page-size 64",
    "gluon_fp8 --combo fp8kv --heads 16 --q-len 2 --page-size 64",
    "gluon_fp8 --combo fp8 --heads 16 --q-len 1 --page-size 16",  # fp8 score MMAs, small pages
    "gluon_fp8 --combo fp8kv --heads 32 --q-len 1 --page-size 128",
)
# The GPU tests that judge each file's mutants: a gate of tests/test_triton_gpu.py's Gluon tests, each case another
# compile of the mutated kernels (about 5 s each on a CPU core), so that a pool of mutants fits one device call (the
# first try, on the 121 Gluon tests but the 2^31-element caches, ran no mutant to its end in 560 s on an H100). Each
# gate takes one case of every geometry the kernels specialise on: bf16, fp8 KV and fp8 q; heads 16-128 with head
# splits; q_len 1-4; pages of 16, 32, 64 and 128 (the grouped layouts, the fp8 loader and the in-place expansion);
# one request over all SMs and several items per worker (a seesaw case of those since S28, which passed the rest
# and most likely hangs there); NaN inputs, determinism and graph replay. Cheap and broad cases first: a mutant stops at
# its first failing test.
_GPU = "tests/test_triton_gpu.py::"
_SHARED = [  # the pinned backends: both Gluon kernels (gluon_fp8 imports the seesaw file's helpers)
    "test_pinned_gluon_backends_run_their_kernel_within_kernel_bound[seesaw-bf16_h128]",
    "test_pinned_gluon_backends_run_their_kernel_within_kernel_bound[seesaw-fp8kv_h64]",
    "test_pinned_gluon_backends_run_their_kernel_within_kernel_bound[gluon_fp8-fp8_h32]",
]
_SEESAW = [
    "test_gluon_seesaw_within_kernel_bound[bf16_h128_p128_q1_s41]",
    "test_gluon_seesaw_within_kernel_bound[bf16_h16_p64_q4_s45]",
    "test_gluon_seesaw_within_kernel_bound[fp8_h128_p128_q1_s141]",
    "test_gluon_seesaw_within_kernel_bound[fp8kv_h128_p32_q1_s71]",
    "test_gluon_seesaw_within_kernel_bound[bf16_h32_p16_q2_s75]",
    "test_gluon_seesaw_within_kernel_bound[bf16_h128_p64_q1_s43]",
    "test_gluon_seesaw_within_kernel_bound[bf16_h128_p64_q1_s49]",  # several items per worker (added for S28)
    "test_gluon_seesaw_small_pages_give_the_bits_of_pages_of_64[bf16_p16_s70]",
    "test_gluon_seesaw_fp8_loader_gives_the_bits_of_the_in_place_expansion[fp8_h128_p128_q1]",
    "test_gluon_seesaw_deterministic_and_graph_replay_equals_eager[fp8kv_q2]",
]
_FP8 = [
    "test_gluon_fp8_within_kernel_bound[fp8kv_h16_p64_s50]",
    "test_gluon_fp8_within_kernel_bound[fp8_h16_p128_s59]",
    "test_gluon_fp8_within_kernel_bound[fp8kv_h32_p64_s54]",
    "test_gluon_fp8_within_kernel_bound[fp8_h16_p16_s66]",
    "test_gluon_fp8_within_kernel_bound[fp8kv_h16_p64_s81]",  # several items per worker, cheap (added for F17)
    "test_gluon_fp8_within_kernel_bound[fp8kv_h16_p16_s68]",
    "test_gluon_fp8_within_kernel_bound[fp8kv_h16_p16_s67]",
    "test_gluon_fp8_small_pages_give_the_bits_of_pages_of_64[fp8_p32_s64]",
    "test_gluon_fp8_grouped_layout_gives_the_bits_of_per_page_boxes[fp8kv_p16_q1]",
    "test_gluon_fp8_with_fp16_scores_for_fp8_q_within_kernel_bound[h32_q4_s61]",
    "test_a_nan_input_gives_nan_out_and_lse_split_or_not[gluon_fp8-fp8kv-16-64-q2]",
    "test_gluon_fp8_deterministic_and_graph_replay_equals_eager[8-lens_list2]",
]
GATES = {
    "mla_fast/gluon_decode.py": [_GPU + t for t in _SHARED + _SEESAW + [t for t in _FP8 if
                                                                          t.endswith(("s50]", "s59]", "s68]"))]],
    "mla_fast/gluon_fp8.py": [_GPU + t for t in _SHARED[2:] + _FP8],
}
BASELINE = list(dict.fromkeys(GATES["mla_fast/gluon_decode.py"] + GATES["mla_fast/gluon_fp8.py"]))  # both gates
BASELINE_WORKERS = 2  # pytest-xdist workers of the unmutated run (every test of both gates, in one pool slot)


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    why: str
    may_hang: bool = False
    selection: str | None = None  # pytest -k of tests/test_triton_gpu.py in place of GATES[file]


def load(path: str | Path) -> list[Mutant]:
    """The mutants of a JSON file, each checked: a kernel file, an edit that changes something, unique ids."""
    mutants = [Mutant(**m) for m in json.loads(Path(path).read_text())]
    ids = [m.id for m in mutants]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: mutant ids must be unique, repeated: {sorted({i for i in ids if ids.count(i) > 1})}")
    for m in mutants:
        if m.file not in KERNEL_FILES:
            raise ValueError(f"mutant {m.id}: file must be one of {KERNEL_FILES}, got {m.file!r}")
        if m.old == m.new:
            raise ValueError(f"mutant {m.id}: new must differ from old")
    return mutants


def mutated_source(m: Mutant, root: Path = ROOT) -> str:
    """`m.file` under root with the edit made; ValueError unless `old` occurs exactly once there."""
    src = (root / m.file).read_text()
    if src.count(m.old) != 1:
        raise ValueError(f"mutant {m.id}: old must occur exactly once in {m.file}, found {src.count(m.old)} times")
    return src.replace(m.old, m.new)


def jit_function(m: Mutant, root: Path = ROOT) -> str | None:
    """The name of the kernel-code function the edit lies in (@gluon.jit, or @constexpr_function, which the
    compiler runs while it traces), or None for an edit outside the kernels (launch code)."""
    src = (root / m.file).read_text()
    text = m.old.strip("\n")  # the lines the edit spans, not the line after a closing newline
    start = src.index(m.old) + m.old.index(text)
    first = src.count("\n", 0, start) + 1
    last = first + text.count("\n")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.lineno <= first and last <= node.end_lineno:
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] for d in node.decorator_list]
            if {"jit", "constexpr_function"} & set(names):  # @gluon.jit, @gluon.jit(...), @constexpr_function
                return node.name
    return None


def copy_repo(dest: Path, mutant: Mutant | None = None, root: Path = ROOT) -> Path:
    """The repository's code and tests under dest, with the mutant's edit made if given."""
    for name in COPIED:
        if (root / name).is_dir():
            shutil.copytree(root / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(root / name, dest / name)
    if mutant is not None:
        (dest / mutant.file).write_text(mutated_source(mutant, root))
    return dest


def _with_path(repo: Path) -> dict:
    """The environment with repo first on PYTHONPATH (the rest kept: a device's carried wheels) and no interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    return env


def _compile_ptx(repo: Path, geometry: str, work: Path) -> str | None:
    """The PTX (no debug records) of one geometry compiled from repo's sources in a Triton cache of its own under
    work, or None if it does not compile."""
    ptx = work / f"{SCREEN_GEOMETRIES.index(geometry)}.ptx"
    env = {**_with_path(repo), "TRITON_CACHE_DIR": str(work / "triton")}
    proc = subprocess.run([sys.executable, str(repo / "scripts" / "offline_compile.py"), *geometry.split(),
                           "--ptx", str(ptx)], capture_output=True, text=True, env=env, timeout=900, cwd=repo)
    return ptx.read_text() if proc.returncode == 0 else None


def geometries(file: str) -> tuple[str, ...]:
    """The SCREEN_GEOMETRIES an edit of `file` can change."""
    return tuple(g for g in SCREEN_GEOMETRIES if file == "mla_fast/gluon_decode.py" or g.startswith("gluon_fp8 "))


def screen_one(m: Mutant, baseline: dict[str, str]) -> dict:
    function = jit_function(m)
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_repo(Path(tmp) / "repo", m)
        ptxs = {g: _compile_ptx(repo, g, Path(tmp)) for g in geometries(m.file)}
    failed = [g for g, p in ptxs.items() if p is None]
    changed = [g for g, p in ptxs.items() if p is not None and p != baseline[g]]
    outcome = ("compile_error" if failed else "launch" if function is None else "changed" if changed
               else "same_ptx")
    return {"id": m.id, "file": m.file, "function": function, "outcome": outcome, "compile_failed": failed,
            "ptx_changed": changed}


def screen(mutants: list[Mutant], jobs: int, json_path: str | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_repo(Path(tmp) / "repo")
        baseline = {g: _compile_ptx(repo, g, Path(tmp)) for g in SCREEN_GEOMETRIES}
    missing = [g for g, p in baseline.items() if p is None]
    if missing:
        raise RuntimeError(f"the unmutated kernels do not compile for {missing}")
    results = []
    with ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(lambda m: screen_one(m, baseline), mutants):
            results.append(r)
            print(f"{r['id']:5} {r['outcome']:13} {r['function'] or '(launch code)'}: {len(r['ptx_changed'])} of "
                  f"{len(geometries(r['file']))} kernels changed", flush=True)
            _write(json_path, {"geometries": SCREEN_GEOMETRIES, "mutants": results})
    return results


def _in_flight(out: str) -> str | None:
    """The test `pytest -v` (no xdist) was running when its output ended: -v writes a test's id as it starts and its
    verdict as it ends, so the last id without a verdict."""
    ids = re.findall(r"^(tests/\S+::\S+) *$", out, flags=re.M)
    return ids[-1] if ids else None


def _pytest(repo: Path, targets: list[str], timeout: int, extra: list[str], workers: int = 0,
            test_timeout: float | None = None) -> dict:
    """pytest -m gpu on `targets` (node ids, or -k and a file) in repo, stopped at its first failure, with the GPU
    test watchdog (verify.gpu_watchdog) at `test_timeout` seconds (None: its default)."""
    env = {**_with_path(repo), "HYPOTHESIS_PROFILE": "triage"}
    if test_timeout is not None:
        env[WATCHDOG_ENV] = str(test_timeout)
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "--strict-markers", "-p", "no:cacheprovider", "-p",
           "verify.gpu_watchdog", "-m", "gpu", "-x", "-v", "--tb=line", "-rf", *targets, *extra]
    cmd += ["-n", str(workers)] if workers else []
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=repo)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"outcome": "timeout", "first_failure": None, "counts": {"passed": len(re.findall(r"\bPASSED\b", out))},
                "in_flight": None if workers else _in_flight(out),  # (not known under xdist)
                "seconds": round(time.monotonic() - start, 1), "tail": out[-1500:]}
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines()
              if line.startswith("FAILED ")]
    # the watchdog's faulthandler line: a test outlasted test_timeout and the process (an xdist worker) was ended
    hung = proc.returncode == 1 and re.search(r"^Timeout \(\d+:\d\d:\d\d", proc.stderr, flags=re.M) is not None
    counts = ({"passed": len(re.findall(r"\bPASSED\b", proc.stdout))} if hung and not workers else  # no summary
              {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped)", proc.stdout)})
    # exit status 0 with nothing passed (every test skipped: no GPU, or not sm_90) judges nothing
    outcome = ("hang" if hung else "caught" if proc.returncode == 1 else
               "slipped" if proc.returncode == 0 and counts.get("passed") else "error")
    r = {"outcome": outcome, "returncode": proc.returncode, "first_failure": failed[0] if failed else None,
         "counts": counts, "seconds": round(time.monotonic() - start, 1),
         "tail": (proc.stdout + proc.stderr)[-1500:]}
    if hung:  # xdist names the crashed worker's test as failed
        r["in_flight"] = r["first_failure"] if workers else _in_flight(proc.stdout)
    return r


def _targets(m: Mutant | None, k: str | None) -> list[str]:
    """What judges m (None: the baseline): `k` for all if given, else the mutant's selection or its file's gate."""
    if k or (m and m.selection):
        return ["-k", k or m.selection, "tests/test_triton_gpu.py"]
    return GATES[m.file] if m else BASELINE


def run(mutants: list[Mutant], jobs: int, timeout: int, json_path: str | None, extra: list[str], k: str | None = None,
        workers: int = 0, test_timeout: float | None = None) -> dict:
    """The baseline (the unmutated copy on both gates, or on `k`) and each mutant (on its gate, or `k`), in one pool
    of `jobs`, each reported as it ends; the report says whether the baseline passed, without which no mutant's
    outcome means anything. workers: pytest-xdist workers of each mutant's run (the baseline's: at least
    BASELINE_WORKERS)."""
    report = {"baseline": None, "mutants": [], "k": k}
    has_xdist = importlib.util.find_spec("xdist") is not None
    if workers and not has_xdist:
        raise SystemExit("--workers needs pytest-xdist")
    with tempfile.TemporaryDirectory() as tmp:

        def one(m: Mutant | None) -> dict:
            repo = copy_repo(Path(tmp) / (m.id if m else "baseline"), m)
            r = {"id": m.id, "file": m.file, "function": jit_function(m)} if m else {}
            n = workers if m else max(workers, BASELINE_WORKERS if has_xdist else 0)
            r.update(_pytest(repo, _targets(m, k), timeout * (1 if m else 2), extra, n, test_timeout))
            if m is None and r["outcome"] == "slipped":
                r["outcome"] = "passed"  # every test passed: what a mutant's run calls slipped
            shutil.rmtree(repo, ignore_errors=True)
            return r

        ordered = [None] + sorted(mutants, key=lambda m: m.may_hang)  # the baseline first, possible hangs last
        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(one, m): m for m in ordered}
            for future in as_completed(futures):
                m, r = futures[future], future.result()
                if m is None:
                    report["baseline"] = r
                    print(f"baseline: {'passed' if r['outcome'] == 'passed' else 'FAILED: ' + r['tail']} in "
                          f"{r['seconds']} s", flush=True)
                else:
                    report["mutants"].append(r)
                    where = r["first_failure"] or r.get("in_flight") or ""
                    print(f"{r['id']:5} {r['outcome']:8} {r['seconds']:6.1f} s  {where}", flush=True)
                _write(json_path, report)
    if report["baseline"]["outcome"] != "passed":
        raise SystemExit(f"the unmutated kernels' tests did not pass ({report['baseline']['outcome']}, "
                         f"{report['baseline']['counts']}): no mutant's outcome counts")
    return report


def _write(path: str | None, data) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["screen", "run"])
    parser.add_argument("mutants", help="the mutant JSON file")
    parser.add_argument("--ids", help="comma-separated mutant ids (default: all)")
    parser.add_argument("--json", help="write the results here (rewritten after each mutant)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants at a time (default 2)")
    parser.add_argument("--timeout", type=int, default=300, help="run: seconds per mutant's tests (default 300)")
    parser.add_argument("--k", help="run: judge the baseline and every mutant by this pytest -k expression on "
                                     "tests/test_triton_gpu.py instead of the gates")
    parser.add_argument("--test-timeout", type=float, help="run: the GPU test watchdog's seconds per test "
                        f"(${WATCHDOG_ENV}; default verify.gpu_watchdog's)")
    parser.add_argument("--workers", type=int, default=0, help="run: pytest-xdist workers per mutant (default 0)")
    parser.add_argument("pytest_args", nargs="*", help="run: more pytest arguments, after --")
    args = parser.parse_args(argv)
    mutants = load(args.mutants)
    if args.ids:
        wanted = args.ids.split(",")
        unknown = sorted(set(wanted) - {m.id for m in mutants})
        if unknown:
            raise SystemExit(f"--ids: no mutants {unknown} in {args.mutants}")
        mutants = [m for m in mutants if m.id in wanted]
    for m in mutants:
        mutated_source(m)  # each applies to today's source, before anything is compiled or run
    if args.command == "screen":
        screen(mutants, args.jobs, args.json)
    else:
        run(mutants, args.jobs, args.timeout, args.json, args.pytest_args, args.k, args.workers,
            args.test_timeout)


if __name__ == "__main__":
    main()
