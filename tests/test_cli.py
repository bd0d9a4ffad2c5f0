"""mla-verify: help, usage errors (exit 2, one line), unavailable backends (exit 5 with the reason), --case replay of a
repro line, the JSON report (schema, allow_nan=False, atomic), broken plug-ins as failed cases, unsupported cases
(counted per reason; exit 5 when all are), a CUDA fault stopping the campaign, the model subcommand."""

import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import re
import shlex
import signal
import socket
import sys
import threading
import time
import types

import pytest
import torch

from mla_fast.backends import BACKENDS, Unsupported
from verify import cli, kernels
from verify.cases import Case
from verify.checks import CaseResult, CheckResult, is_device_fault
from verify.kernels import DEFAULT_NUMERICS
from verify.mutants import correct
from verify.next_step import grown_length
from verify.strategies import smoke_cases

SMALL = Case(seq_lens=(0, 70), q_lens=(2, 1), heads=2, seed=3)


@pytest.fixture(autouse=True)
def cpu_campaigns(monkeypatch):
    """Every campaign here runs on the CPU, on a GPU machine too (where the default device would be cuda): these tests
    are about the CLI's behaviour on a CPU (forked workers that inherit a patched function, thread counts, backends
    that cannot run there). On an H100 two of them failed without it, their workers spawned for the GPU and so
    without the patch (seventy-seventh session). The GPU's campaigns are the device scripts' (scripts/device_*.sh)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def raises(batch):
    raise RuntimeError("kernel exploded")


def wrong_shape(batch):
    out, lse = correct(batch)
    return out[..., :-1], lse  # [T, H, L - 1]


def int_output(batch):
    out, lse = correct(batch)
    return out.to(torch.int32), lse


def out_only(batch):
    return correct(batch)[0]


not_callable = 3


def no_four_heads(batch):
    if batch.num_heads == 4:
        raise Unsupported("no kernel for 4 heads")
    return correct(batch)


def never(batch):
    raise Unsupported("no kernel at all")


def unsupported_then_wrong(batch):
    """Unsupported on 8 heads (the first smoke case), wrong on 4 heads (the third)."""
    if batch.num_heads == 8:
        raise Unsupported("no kernel for 8 heads")
    out, lse = correct(batch)
    return (out * 2 if batch.num_heads == 4 else out), lse


ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def faults_on_two_heads(batch):
    if batch.num_heads == 2:
        raise torch.AcceleratorError(ILLEGAL_ADDRESS)
    return correct(batch)


CALLS = [0]
CASE_QS: list = []  # the q of every case seen (held, so that no later q reuses its id)
CASE_KVS: list = []  # and its cache


def wrong_from_the_150th_call(batch):
    """Right for the first 149 cases of this process, then out doubled: a failure late in a search. A case is a new
    q: the nan check's second call on the same case shares it, and neither the rounding probe's q (0 on every latent
    channel), the layout check's strided copy of the case's q nor the rerun check's copy (a block table with room
    for `grown_length`; its q is rewritten in place for its second call) nor the batch check's regrouped batch (a
    new q over the case's own cache) is a case."""
    probe = not batch.q[..., : batch.kv_lora_rank].any()  # verify.rounding_probe's q
    strided = batch.q.untyped_storage().nbytes() > batch.q.numel() * batch.q.element_size()  # a view into padding
    roomy = batch.block_table.shape[1] * batch.page_size >= grown_length(batch.seq_lens, batch.page_size)  # rerun's
    regrouped = any(kv is batch.kv_cache for kv in CASE_KVS)
    if not probe and not strided and not regrouped and not any(q is batch.q for q in CASE_QS):
        CASE_QS.append(batch.q)
        CASE_KVS.append(batch.kv_cache)
        CALLS[0] += not roomy
    out, lse = correct(batch)
    return (out * 2 if CALLS[0] >= 150 else out), lse


def split_workers(batch, num_workers):
    """A split-KV plug-in's run over num_workers persistent workers: the emulated backend's (the planner's plan in
    fp32, bf16 out)."""
    return BACKENDS["emulated"].run_workers(batch, num_workers)


def split_plugin(batch):
    return split_workers(batch, 4)


split_plugin.run_workers = split_workers


def drifts_unsplit(batch, num_workers):
    """Right when split, σ 1 % off on one worker: only a second run with another worker count shows it."""
    return split_workers(batch.replace(sm_scale=batch.sm_scale * (1.01 if num_workers == 1 else 1.0)), num_workers)


def shrinks_unsplit(batch, num_workers):
    out, lse = split_workers(batch, num_workers)
    return (out[..., :-1], lse) if num_workers == 1 else (out, lse)  # [T, H, L - 1] on one worker


def lse_when_split(batch, num_workers):
    out, lse = split_workers(batch, num_workers)
    return out if num_workers == 1 else (out, lse)


def loose_declaration(batch):
    """A correct kernel declaring a score error of half the scale: a declaration that loose would pass the drop_rope
    mutant too (found by a review)."""
    return correct(batch)


loose_declaration.numerics = dataclasses.replace(DEFAULT_NUMERICS, gamma_qk=0.5)


def declares_bf16_p(batch):
    """A correct kernel (fp32 P) declaring bf16 P: a declaration looser than the kernel by the P rounding alone."""
    return correct(batch)


declares_bf16_p.numerics = dataclasses.replace(DEFAULT_NUMERICS, p_fmt="bf16")


def declares_bf16_partials(batch):
    """A correct kernel (fp32 split outputs) declaring bf16 ones: looser than the kernel by the partials alone."""
    return correct(batch)


declares_bf16_partials.numerics = dataclasses.replace(DEFAULT_NUMERICS, partial_dtype=torch.bfloat16)


def declares_nondeterminism(batch):
    """A correct, deterministic kernel declaring run-to-run variation: looser than the kernel by the repeat check."""
    return correct(batch)


declares_nondeterminism.deterministic = False


def varies_as_declared(batch):
    """The merge_order_varies mutant declaring its run-to-run variation."""
    from verify.mutants import merge_order_varies

    return merge_order_varies(batch)


varies_as_declared.deterministic = False


def run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_every_flag(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for flag in ["--dtype", "--fp8-format", "--backend", "--impl", "--cases", "--seed", "--max-seq-len", "--heads",
                 "--page-size", "--kv-lora-rank", "--rope-dim", "--max-batch", "--profile", "--device", "--json",
                 "--plot", "--case", "--jobs", "--threads", "--impl-path",
                 "--time-limit", "--exitfirst", "--far", "--long", "exit codes", "plug-in contract", "model"]:
        assert flag in out, flag


@pytest.mark.parametrize(
    "argv", [["--bogus"], ["--dtype", "fp4"], ["--cases", "0"], ["--impl", "nocolon"], ["--impl", "no_such_pkg.x:f"],
             ["--impl", "tests.test_cli:not_callable"], ["--impl", "verify.mutants:no_such_fn"],
             ["--case", "{not json"], ["--case", '{"heads": 0}'], ["--device", "nonsense"],
             # found by a review: checked before the campaign (it ran, then lost its report, exit 1)
             ["--json", "/no/such/folder/report.json"], ["--plot", "/no/such/folder/p.png"], ["--json", "/tmp"],
             ["--max-seq-len", str(2**18 + 1)], ["--max-batch", "0"], ["--far", "maybe"],
             # found by a review: JSON's true passed as the int 1, and sizes past memory were reported as a failed
             # case (exit 1) when their allocation failed
             ["--case", '{"seed": true}'], ["--case", '{"seq_lens": [true]}'],
             ["--case", '{"seq_lens": [10000000000]}'], ["--case", '{"heads": 1099511627776}'], ["--heads", "1025"],
             ["--case", '{"page_size": 100000000}'], ["--page-size", "4097"], ["--case", '{"sm_scale": 1e-40}'],
             # found by a review: flags that had no effect, silently (the report then named the flag's dtype)
             ["--case", '{"seq_lens": [70]}', "--dtype", "fp8"], ["--case", '{"seq_lens": [70]}', "--seed", "3"],
             ["--case", '{"seq_lens": [70]}', "--fp8-format", "e4m3fnuz", "--dtype", "fp8"],
             ["--case", '{"seq_lens": [70]}', "--heads", "4"], ["--case", '{"seq_lens": [70]}', "--cases", "9"],
             ["--impl", "verify.mutants:correct", "--backend", "emulated"], ["--fp8-format", "e4m3fnuz"],
             ["--plot", "-"], ["--kv-lora-rank", "0"], ["--rope-dim", "4097"], ["--case", '{"rope_dim": 100000}'],
             ["--case", '{"seq_lens": [70]}', "--kv-lora-rank", "256"]],
)
def test_bad_usage_exits_2_with_one_line(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err, err
    assert out == ""


def test_latent_and_rope_widths_reach_every_case(capsys, tmp_path):
    """--kv-lora-rank / --rope-dim fix L and R in every case, the smoke prefix's and the drawn ones (MiniCPM3's
    shape here), and the correct kernel passes them; the fixed rope width of rope_width_64 fails every case with
    tier1."""
    path = tmp_path / "r.json"
    flags = ["--kv-lora-rank", "256", "--rope-dim", "32", "--max-seq-len", "64", "--cases", "20", "--jobs", "1"]
    code, _, err = run(capsys, "--impl", "verify.mutants:correct", *flags, "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["cases"] == 20, err
    assert {(r["case"]["kv_lora_rank"], r["case"]["rope_dim"]) for r in report["results"]} == {(256, 32)}
    code, _, _ = run(capsys, "--impl", "verify.mutants:rope_width_64", *flags, "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and report["checks"]["tier1.out"]["failed"] >= 18, report["checks"]["tier1.out"]


def test_max_batch_bounds_the_drawn_requests_and_far_is_reported(capsys, tmp_path):
    """--max-batch B: every drawn case has 1..B requests (the smoke prefix keeps its fixed batches); the JSON says
    whether the far check ran (auto: only on CUDA devices)."""
    from verify.strategies import smoke_cases

    path = tmp_path / "r.json"
    n_smoke = len(smoke_cases("bf16"))
    code, _, err = run(capsys, "--backend", "ref", "--max-seq-len", "64", "--max-batch", "1", "--cases",
                       str(n_smoke + 12), "--jobs", "1", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["far"] is False and "the far check is off" in err
    drawn = [r["case"] for r in report["results"]][n_smoke:]
    assert len(drawn) == 12 and all(len(c["seq_lens"]) == 1 for c in drawn)


def test_unavailable_backend_exits_5_with_reason(capsys, tmp_path):
    """A backend whose package is missing exits 5, and the reason names the package to install."""
    if importlib.util.find_spec("flash_mla") is not None:  # not is_available(): this file's fixture makes it False
        pytest.skip("sgl-flash-mla is installed here")
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "flashmla", "--json", str(path))
    assert code == 5 and "flashmla" in err and "cannot run here" in err
    report = json.loads(path.read_text())
    assert report["cases"] == 0 and "sgl-flash-mla" in report["nothing_ran"]


@pytest.mark.parametrize("backend", ["seesaw", "gluon_fp8"])
def test_pinned_gluon_backends_are_cli_choices(capsys, backend):
    """--backend seesaw / gluon_fp8 are accepted; without a CUDA sm_90 GPU they exit 5 with the probe's reason."""
    if torch.cuda.is_available():
        pytest.skip("the Gluon kernels may run on this GPU machine")
    code, _, err = run(capsys, "--backend", backend, "--cases", "1")
    assert code == 5 and backend in err and "cannot run here" in err, err


def test_replay_of_repro_line(capsys, tmp_path):
    path = tmp_path / "r.json"
    argv = shlex.split(SMALL.repro("--backend emulated"))[1:]  # the repro line, as a shell splits it
    code, _, err = run(capsys, *argv, "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    assert report["cases"] == 1 and report["failed"] == 0
    assert Case(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["results"][0]["case"].items()}) == SMALL
    assert "[tier1.out] OK" in err and "[empty] OK" in err


def test_cases_run_at_the_thread_count_their_repro_lines_carry(capsys, tmp_path, monkeypatch):
    """On a CPU the cases run at one torch thread count, in this process (--jobs 1) as in forked workers, and every
    repro line carries it as --threads (a replay had run at torch's default count while the CPU workers ran one, so
    a plug-in's fp32 reductions could differ in their last bits: a review's replays). main gives this process its
    count back at the end."""
    (tmp_path / "threads_plugin_mod.py").write_text(
        "import torch\nfrom verify.mutants import out_gain\n"
        "def decode(batch):\n    print('threads', torch.get_num_threads())\n    return out_gain(batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = torch.get_num_threads()
    for argv, threads in ((("--jobs", "1", "--threads", "1"), 1), (("--jobs", "2"), max(1, cli._usable_cores() // 2)),
                          (("--jobs", "1"), before)):
        path = tmp_path / "r.json"
        code, out, err = run(capsys, "--impl", "threads_plugin_mod:decode", "--cases", "2", "--max-seq-len", "64",
                             *argv, "--json", str(path))
        report = json.loads(path.read_text())
        assert code == cli.EXIT_FAILED and report["threads"] == threads, (argv, err)
        assert all(f["repro"].endswith(f" --threads {threads}") for f in report["failures"]), argv
        if "2" not in argv:  # the cases ran here (a forked worker's print does not reach capsys)
            assert {ln for ln in out.splitlines() if ln.startswith("threads ")} == {f"threads {threads}"}, argv
        assert torch.get_num_threads() == before
        code, out, err = run(capsys, *shlex.split(report["failures"][0]["repro"])[1:])
        assert code == cli.EXIT_FAILED and {ln for ln in out.splitlines() if ln.startswith("threads ")} == {
            f"threads {threads}"}, (argv, out)


def test_json_report_schema(capsys, tmp_path):
    path, png = tmp_path / "r.json", tmp_path / "r.png"
    code, _, _ = run(capsys, "--impl", "verify.mutants:out_gain", "--cases", "2", "--max-seq-len", "256", "--jobs", "1",
                     "--json", str(path), "--plot", str(png))
    assert code == 1
    text = path.read_text()
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    for key in ["schema_version", "backend", "device", "versions", "cases", "failed", "failures", "checks", "seed"]:
        assert key in report, key
    assert report["backend"]["impl"] == "verify.mutants:out_gain" and report["versions"]["torch"] == torch.__version__
    assert report["cases"] == 2 and report["failed"] == len(report["failures"]) >= 1
    failure = report["failures"][0]
    assert failure["repro"].startswith("mla-verify --case ")
    assert failure["repro"].endswith(f"--impl verify.mutants:out_gain --threads {torch.get_num_threads()}")
    tier1 = next(c for c in failure["checks"] if c["name"] == "tier1.out")
    assert tier1["err_over_bound"] > 1
    summary = report["checks"]["tier1.out"]
    assert summary["failed"] >= 1 and summary["max_err_over_bound"] > 1 and summary["median_err_over_bound"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))  # atomic writes leave no temporaries


@pytest.mark.parametrize(
    "impl, message",
    [("raises", "RuntimeError: kernel exploded"), ("wrong_shape", "expected shape"), ("int_output", "float dtype")],
)
def test_broken_plugin_is_a_failed_case(capsys, tmp_path, impl, message):
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", f"tests.test_cli:{impl}", "--case", SMALL.to_json(), "--json", str(path))
    assert code == 1
    (check,) = json.loads(path.read_text())["failures"][0]["checks"]
    assert check["name"] == "contract" and message in check["detail"]


def test_unsupported_cases_are_counted_not_failed(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:no_four_heads", "--cases", "3", "--max-seq-len", "128",
                       "--jobs", "1", "--json", str(path))  # smoke cases with 8, 2 and 4 heads
    assert code == 0, err
    report = json.loads(path.read_text())
    assert report["cases"] == 3 and report["failed"] == 0 and report["unsupported"] == {"no kernel for 4 heads": 1}
    assert [r["status"] for r in report["results"]] == ["passed", "passed", "unsupported"]
    assert "unsupported, 1 case(s) like [2]: no kernel for 4 heads" in err  # the summary shows count and reason


def test_exitfirst_stops_at_a_failure_not_at_an_unsupported_case(capsys, tmp_path):
    """-x: an unsupported case is no failure, so the campaign goes on to the failing third case and exits 1 (a
    review's mutant that stopped at the unsupported first case exited 0 and survived)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:unsupported_then_wrong", "--cases", "5", "--max-seq-len",
                       "128", "--jobs", "1", "-x", "--json", str(path))
    assert code == 1, err
    report = json.loads(path.read_text())
    assert [r["status"] for r in report["results"]] == ["unsupported", "passed", "failed"]
    assert report["stopped"]["reason"] == "--exitfirst: case 3 of 5 failed" and report["not_run"] == 2


def test_all_unsupported_exits_5(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:never", "--cases", "2", "--max-seq-len", "64", "--jobs", "1",
                       "--json", str(path))
    assert code == 5 and "nothing ran" in err
    report = json.loads(path.read_text())
    assert report["cases"] == 2 and report["failed"] == 0 and report["unsupported"] == {"no kernel at all": 2}


def test_cuda_fault_stops_the_campaign(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:faults_on_two_heads", "--cases", "4", "--max-seq-len", "128",
                       "--jobs", "1", "--json", str(path))  # smoke cases with 8, 2, 4 and 4 heads
    assert code == 1
    report = json.loads(path.read_text())
    assert report["cases"] == 2 and report["failed"] == 1 and report["not_run"] == 2  # no follow-on failures
    faulting = report["failures"][0]
    assert report["stopped"]["repro"] == faulting["repro"] and ILLEGAL_ADDRESS in report["stopped"]["detail"]
    assert "STOPPED at case 2 of 4" in err and faulting["repro"] in err


def test_device_fault_detection(monkeypatch):
    """torch.AcceleratorError always; a RuntimeError naming a CUDA or HIP error (a C++ extension's own check) only
    once the process holds a GPU context: without one, no GPU error can be sticky."""
    assert is_device_fault(torch.AcceleratorError("an illegal memory access was encountered"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU process (on a GPU machine too)
    assert not is_device_fault(RuntimeError(ILLEGAL_ADDRESS))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert is_device_fault(RuntimeError(ILLEGAL_ADDRESS)) and is_device_fault(RuntimeError("HIP error: invalid"))
    assert not is_device_fault(RuntimeError("kernel exploded")) and not is_device_fault(ValueError(ILLEGAL_ADDRESS))


def says_cuda_error(batch):
    """A plug-in whose own RuntimeError quotes a CUDA error message, in a CPU run."""
    raise RuntimeError(f"my_kernel: {ILLEGAL_ADDRESS} (my own check, no GPU here)")


def test_a_cuda_error_text_without_a_gpu_context_fails_cases_but_stops_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU process, also on a GPU machine
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:says_cuda_error", "--cases", "3", "--max-seq-len", "64",
                       "--device", "cpu", "--jobs", "1", "--json", str(path))
    assert code == cli.EXIT_FAILED, err
    report = json.loads(path.read_text())
    assert report["cases"] == 3 and report["failed"] == 3 and report.get("not_run", 0) == 0, report.get("stopped")
    assert report["stopped"] is None and "STOPPED" not in err


def test_plugin_without_lse_is_checked_on_out(capsys):
    code, _, err = run(capsys, "--impl", "tests.test_cli:out_only", "--case", SMALL.to_json())
    assert code == 0, err
    assert "[tier1.out] OK" in err and "[tier1.lse]" not in err


def test_forked_workers_match_one_process(capsys, tmp_path):
    reports = []
    for jobs in ("1", "2"):
        path = tmp_path / f"r{jobs}.json"
        assert run(capsys, "--backend", "emulated", "--cases", "3", "--max-seq-len", "128", "--jobs", jobs,
                   "--json", str(path))[0] == 0
        reports.append(json.loads(path.read_text())["results"])
    assert [r["case"] for r in reports[0]] == [r["case"] for r in reports[1]]
    assert [r["err_over_bound"] for r in reports[0]] == [r["err_over_bound"] for r in reports[1]]


def test_spawned_workers_match_one_process(capsys, tmp_path, monkeypatch):
    """The GPU pool (spawned workers that resolve the kernel themselves), forced on the CPU: the same cases and
    results as one process."""
    monkeypatch.setattr(cli, "_start_method", lambda device: "spawn")
    reports = []
    for jobs in ("1", "2"):
        path = tmp_path / f"r{jobs}.json"
        assert run(capsys, "--backend", "emulated", "--cases", "3", "--max-seq-len", "128", "--jobs", jobs,
                   "--json", str(path))[0] == 0
        reports.append(json.loads(path.read_text()))
    assert reports[1]["jobs"] == 2
    assert [r["case"] for r in reports[0]["results"]] == [r["case"] for r in reports[1]["results"]]
    assert [r["err_over_bound"] for r in reports[0]["results"]] == [r["err_over_bound"] for r in reports[1]["results"]]


def test_a_cpu_without_fork_spawns_the_workers(capsys, tmp_path, monkeypatch):
    """Where the platform cannot fork (Windows), both pools spawn their workers on a CPU instead of raising or
    falling back to one process: --jobs 2 gives the cases and results of one process."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: [m for m in methods if m != "fork"])
    assert cli._start_method("cpu") == "spawn" and cli._start_method("cuda:0") == "spawn"
    spawned = []
    get_context = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: spawned.append(method) or get_context(method))
    reports = []
    for argv in (("--cases", "3", "--jobs", "1"), ("--cases", "3", "--jobs", "2"),
                 ("--profile", "search", "--cases", "10", "--seed", "5", "--jobs", "2")):
        path = tmp_path / "r.json"
        code, _, err = run(capsys, "--backend", "ref", "--max-seq-len", "64", "--json", str(path), *argv)
        assert code == 0, err
        reports.append(json.loads(path.read_text()))
    assert spawned == ["spawn", "spawn"]  # the --jobs 2 pool and the parallel search
    assert [r["case"] for r in reports[0]["results"]] == [r["case"] for r in reports[1]["results"]]
    assert reports[2]["jobs"] == 2 and reports[2]["cases"] == 10


def test_run_all_spawning_needs_the_kernel_spec(monkeypatch):
    monkeypatch.setattr(cli, "_start_method", lambda device: "spawn")
    with pytest.raises(ValueError, match="kernel_spec"):
        cli._run_all([SMALL, SMALL], 2, lambda r: True)


def test_mps_detection_needs_a_daemon_behind_the_control_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not cli.mps_running()  # no control socket
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # stands in for nvidia-cuda-mps-control -d
    daemon.bind(str(tmp_path / "control"))
    daemon.listen()
    assert cli.mps_running()
    daemon.close()  # the daemon quit: its socket file stays behind
    assert (tmp_path / "control").exists() and not cli.mps_running()
    (tmp_path / "control").unlink()
    (tmp_path / "control").touch()  # a plain file of that name
    assert not cli.mps_running()


def test_mps_detection_without_unix_seqpacket_sockets_says_no(monkeypatch):
    def no_socket(*args):
        raise OSError("address family not supported")  # as on an OS without them, where MPS does not exist

    monkeypatch.setattr(cli.socket, "socket", no_socket)
    assert cli.mps_running() is False


def test_model_subcommand_dispatch(capsys, monkeypatch):
    fake = types.ModuleType("verify.model_check")
    fake.main = lambda argv: 7 if argv == ["--size", "ci"] else 0
    monkeypatch.setitem(sys.modules, "verify.model_check", fake)
    assert cli.main(["model", "--size", "ci"]) == 7


def test_model_subcommand_missing(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "verify.model_check", None)  # import raises ModuleNotFoundError
    code, _, err = run(capsys, "model")
    assert code == 2 and "model_check" in err


def test_search_prints_pasteable_examples(capsys):
    code, _, err = run(capsys, "--profile", "search", "--cases", "8", "--max-seq-len", "64", "--seed", "1")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("@example(case=Case(")]
    assert lines and "tier1.out" in "".join(lines)
    for line in lines:
        expr = line.removeprefix("@example(case=").split("  # ")[0][:-1]  # Case(...)
        assert isinstance(eval(expr, {"Case": Case}), Case)


def test_search_runs_in_one_process_by_default(capsys, tmp_path):
    """--profile search draws each case from the results before it, so by default it is one search in this process:
    the report says jobs 1 (not the usable cores)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--profile", "search", "--cases", "3", "--max-seq-len", "64", "--seed", "1",
                       "--json", str(path))
    assert code == 0, err
    assert json.loads(path.read_text())["jobs"] == 1 and "searches" not in err


def wrong_on_one_head(batch):
    """out doubled at 1 head (drawn, but never a smoke case's head count), right otherwise."""
    out, lse = correct(batch)
    return (out * 2 if batch.num_heads == 1 else out), lse


def test_search_jobs_run_searches_side_by_side(capsys, tmp_path, monkeypatch):
    """--profile search --jobs 2: two searches in worker processes (seeds S and S + 1), all cases reported; with
    --exitfirst the first failure stops both, and what they had in flight is dropped (one failure reported)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "ref", "--profile", "search", "--cases", "40", "--max-seq-len", "64",
                       "--seed", "5", "--jobs", "2", "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    assert report["cases"] == 40 and report["jobs"] == 2 and "2 searches, seeds 5..6" in err
    assert "@example(case=Case(" in err
    code, _, err = run(capsys, "--impl", "tests.test_cli:wrong_on_one_head", "--profile", "search", "--cases", "300",
                       "--max-seq-len", "64", "--seed", "5", "--jobs", "2", "--exitfirst", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and report["failed"] == 1 and report["not_run"] > 0, err
    assert report["failures"][0]["case"]["heads"] == 1 and report["cases"] < 300


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_search_jobs_are_the_searches_of_their_seeds(capsys, tmp_path, monkeypatch, method):
    """--jobs 2 runs the same searches as two one-process runs with seeds S and S + 1, each with its share of the
    cases (after the common smoke prefix): the same cases and results, in another order. Spawned workers (the GPU
    path) forced on the CPU resolve the kernel themselves."""
    monkeypatch.setattr(cli, "_start_method", lambda device: method)

    def cases(*argv):
        path = tmp_path / "r.json"
        code, _, err = run(capsys, "--backend", "ref", "--profile", "search", "--max-seq-len", "64", "--json",
                           str(path), *argv)
        assert code == 0, err
        return [(json.dumps(r["case"], sort_keys=True), json.dumps(r["err_over_bound"])) for r in
                json.loads(path.read_text())["results"][smoke:]]  # after the smoke cases

    smoke = len(smoke_cases("bf16"))
    both = cases("--cases", str(smoke + 20), "--seed", "5", "--jobs", "2")  # smoke + 10 per search
    one_by_one = cases("--cases", str(smoke + 10), "--seed", "5") + cases("--cases", str(smoke + 10), "--seed", "6")
    assert len(both) == 20 and sorted(both) == sorted(one_by_one)


def test_search_jobs_stop_at_the_time_limit(capsys, tmp_path, monkeypatch):
    """A time limit inside parallel searches (no smoke prefix here) stops both after the first result (the check
    while waiting put off, as above; and the timer of the smoke prefix, run in this process, which would stop the
    campaign before the searches start)."""
    import verify.strategies

    monkeypatch.setattr(cli, "_POLL_S", 60.0)
    no_timer(monkeypatch)
    monkeypatch.setattr(verify.strategies, "smoke_cases", lambda *a, **k: [])
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "ref", "--profile", "search", "--cases", "50", "--max-seq-len", "64",
                       "--seed", "5", "--jobs", "2", "--time-limit", "1e-9", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["cases"] == 1 and report["not_run"] == 49, err
    assert report["stopped"]["reason"].startswith("time limit")


def _search_raises(strategy, n, seed, on_result):
    raise ValueError("hypothesis broke")


def _search_dies(strategy, n, seed, on_result):
    import os

    os._exit(3)


@pytest.mark.parametrize("search, message", [(_search_raises, "hypothesis broke"),
                                             (_search_dies, "exited with code 3 without reporting")])
def test_a_search_worker_that_fails_stops_the_campaign_with_its_report(capsys, monkeypatch, tmp_path, search,
                                                                       message):
    """A worker whose search raises, or that dies without a word, stops the campaign (exit 1) with the reason in the
    report, instead of being taken for a search that ran out of cases; the cases that ran are reported (until the
    fortieth session it raised, and every result was lost). Forked workers inherit the patched function."""
    import verify.strategies

    monkeypatch.setattr(verify.strategies, "smoke_cases", lambda *a, **k: [])
    monkeypatch.setattr(cli, "_search", search)
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "ref", "--profile", "search", "--cases", "6", "--jobs", "2", "--json",
                       str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and message in report["stopped"]["reason"] and report["not_run"] == 6, err
    assert "STOPPED" in err


def dies(batch):
    """A kernel that crashes its process on every batch."""
    import os

    os._exit(11)


def test_a_search_worker_the_kernel_crashes_names_its_case(capsys, monkeypatch, tmp_path):
    """--profile search --jobs 2: a search worker that the kernel kills names the case it was running, with a repro
    line (the case is drawn inside the worker, so only its in-flight file tells)."""
    import verify.strategies

    monkeypatch.setattr(verify.strategies, "smoke_cases", lambda *a, **k: [])
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:dies", "--profile", "search", "--cases", "4", "--jobs", "2",
                       "--max-seq-len", "64", "--json", str(path))
    stopped = json.loads(path.read_text())["stopped"]
    assert code == cli.EXIT_FAILED and "exited with code 11" in stopped["reason"], err
    case = Case.from_json(shlex.split(stopped["repro"])[2])
    assert f"while running case {case.describe()}" in stopped["reason"] and max(case.seq_lens) <= 64


def dies_on_page_16(batch):
    """A kernel that crashes its process (as a segfault does) on pages of 16, right otherwise."""
    import os

    if batch.page_size == 16:
        os._exit(11)
    return correct(batch)


@pytest.mark.parametrize("method", ["fork", "spawn"])  # spawn: the GPU pool's start method, forced on the CPU
def test_a_pool_worker_the_kernel_crashes_stops_the_campaign_naming_the_case(capsys, tmp_path, monkeypatch, method):
    """--jobs 2: a kernel that kills its worker process stops the campaign with a reason and exit 1, reporting the
    cases before it. A multiprocessing Pool replaced the dead worker and waited for its result forever (found by a
    review); the executor breaks instead. The case that crashed it is named with its repro line (until the
    fifty-seventh session it was not: the executor kills the other worker too, so each case in flight is run alone
    again), and that line replays it."""
    monkeypatch.setattr(cli, "_start_method", lambda device: method)
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:dies_on_page_16", "--cases", "20", "--max-seq-len", "128",
                       "--jobs", "2", "--json", str(path))
    report = json.loads(path.read_text())
    stopped = report["stopped"]
    assert code == cli.EXIT_FAILED and "worker died" in stopped["reason"], err
    assert report["not_run"] > 0 and report["cases"] + report["not_run"] == 20
    assert " ps16 " in stopped["case"] and "\n" not in stopped["repro"], stopped
    assert "faulting case:\n  mla-verify --case " in err
    replayed = Case.from_json(shlex.split(stopped["repro"])[2])
    assert replayed.page_size == 16 and replayed.to_json() in err


def test_a_crash_among_several_cases_in_flight_is_named_by_running_each_alone(monkeypatch):
    """The pool's crash report with two suspects: the one that crashes a fresh worker alone is named, not the one
    that runs (a worker killed while the crash broke the pool)."""
    import multiprocessing

    crashing, fine = Case(seq_lens=(5,), page_size=16), Case(seq_lens=(5,), page_size=4)
    monkeypatch.setattr(cli, "_KERNEL", kernels.from_impl("tests.test_cli:dies_on_page_16"))
    e = cli._crash_named([fine, crashing], multiprocessing.get_context("fork"), (1,))
    assert e.cases == (crashing,) and "crashed its worker again" in str(e), e
    e = cli._crash_named([], multiprocessing.get_context("fork"), (1,))
    assert e.cases == () and "unknown" in str(e)


def test_exitfirst_says_why_the_campaign_stopped(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, _ = run(capsys, "--impl", "verify.mutants:wrong_scale", "--cases", "10", "--max-seq-len", "64",
                     "--jobs", "1", "-x", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and report["stopped"]["reason"] == "--exitfirst: case 1 of 10 failed"
    assert report["cases"] == 1 and report["not_run"] == 9


def numerics_refuses(batch):
    return correct(batch)


def _refuse(batch):
    raise Unsupported("no numerics for this batch")


numerics_refuses.numerics = _refuse


def test_numerics_that_raise_unsupported_make_unsupported_cases(capsys):
    """A plug-in's numerics(batch) may refuse a batch as its kernel would: unsupported, not a verifier failure."""
    code, out, err = run(capsys, "--impl", "tests.test_cli:numerics_refuses", "--cases", "3", "--max-seq-len", "64",
                         "--jobs", "1")
    assert code == cli.EXIT_NOTHING_RAN, out + err
    assert "no numerics for this batch" in out + err


def test_plot_without_matplotlib_is_a_usage_error(capsys, monkeypatch, tmp_path):
    """--plot without matplotlib stops before any case runs (exit 2, one line naming the extra), instead of running
    the campaign and then skipping the plot."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    png = tmp_path / "p.png"
    code, _, err = run(capsys, "--backend", "ref", "--cases", "2", "--plot", str(png))
    assert code == cli.EXIT_USAGE and "--plot needs matplotlib" in err and "cases:" not in err
    assert not png.exists()


@pytest.mark.parametrize("profile, jobs", [("ci", "1"), ("ci", "2"), ("search", "1")])
def test_time_limit_stops_starting_cases_and_reports_the_rest(capsys, tmp_path, monkeypatch, profile, jobs):
    """--time-limit: a campaign past its limit starts no further case; the report counts the cases not run and says
    why, and the exit code is that of the cases that ran (here all held). A limit shorter than any case stops after
    the first, in one process, in a pool of workers (the rest of the pool's work dropped; the pool's check while it
    waits is put off here, so that the first result comes in first: that check has a test of its own below) and with
    the search profile (in its smoke prefix, which runs first; a stop inside the search itself: the target-phase test
    below). The cases in this process run here without the timer that cuts them short at the limit (`no_timer`)."""
    monkeypatch.setattr(cli, "_POLL_S", 60.0)
    no_timer(monkeypatch)
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "ref", "--profile", profile, "--cases", "4", "--max-seq-len", "64",
                       "--seed", "1", "--jobs", jobs, "--time-limit", "1e-9", "--json", str(path))
    assert code == cli.EXIT_OK, err
    report = json.loads(path.read_text())
    assert report["cases"] == 1 and report["not_run"] == 3 and report["failed"] == 0
    assert report["stopped"]["reason"].startswith("time limit") and "repro" not in report["stopped"]
    assert "STOPPED by the time limit" in err and "3 cases not run" in err
    code, _, err = run(capsys, "--backend", "ref", "--cases", "2", "--time-limit", "0")
    assert code == cli.EXIT_USAGE and "--time-limit" in err and "got 0" in err


def sleeps_on_page_16(batch):
    """A kernel whose every call on pages of 16 takes a minute (as a long case, or an interpreted kernel, may; a case
    calls it several times), right otherwise."""
    if batch.page_size == 16:
        time.sleep(60)
    return correct(batch)


def test_time_limit_stops_a_pool_waiting_on_a_slow_case(capsys, tmp_path):
    """--jobs 2 --time-limit 2: a campaign whose workers are stuck in minute-long cases stops within a second or so of
    its limit, not when those cases end; their cases are reported as not run (until the seventy-sixth session the
    limit was checked only as results came in, so a campaign overran it by a case in flight: an interpreted Triton
    campaign with --time-limit 420 reported at 599 s). No result at all by then is exit 5, no case ran."""
    path = tmp_path / "r.json"
    start = time.monotonic()
    code, _, err = run(capsys, "--impl", "tests.test_cli:sleeps_on_page_16", "--cases", "20", "--max-seq-len", "64",
                       "--jobs", "2", "--time-limit", "2", "--json", str(path))
    assert time.monotonic() - start < 20, err
    report = json.loads(path.read_text())
    assert report["stopped"]["reason"].startswith("time limit: --time-limit 2 s passed"), err
    assert report["failed"] == 0 and 0 < report["not_run"] and report["cases"] + report["not_run"] == 20
    assert code == (cli.EXIT_OK if report["cases"] else cli.EXIT_NOTHING_RAN), err


def no_timer(monkeypatch) -> None:
    """--time-limit without `cli._deadline`'s timer (as where there is no SIGALRM, on Windows): cases run in this
    process are then checked as each ends, so that a limit shorter than any case stops after the first."""
    monkeypatch.delattr(signal, "setitimer")


def _passes_then_sleeps(fast: int):
    """A stand-in for `cli._run_one` in this process: the first `fast` cases pass at once, every later one takes a
    minute (as a long case, or a kernel under Triton's interpreter, may)."""
    calls = []

    def run_one(case):
        calls.append(case)
        if len(calls) > fast:
            time.sleep(60)
        return CaseResult(case, [CheckResult("stand-in", True)])

    return run_one


@pytest.mark.parametrize("profile", ["ci", "search"])
def test_time_limit_cuts_a_case_in_this_process_short(capsys, tmp_path, monkeypatch, profile):
    """--jobs 1 --time-limit 2: the case in flight in this process is cut short at the limit (`cli._deadline`), not
    run to its end, and reported as not run; in the ci profile after its first case, in the search profile after the
    smoke prefix, in the search itself. The timer is disarmed and SIGALRM's handler given back afterwards. Until the
    seventy-seventh session such a case ran to its end (a minute here)."""
    smoke = len(smoke_cases("bf16", max_seq_len=64))
    fast = 1 if profile == "ci" else smoke
    monkeypatch.setattr(cli, "_run_one", _passes_then_sleeps(fast))
    handler = signal.getsignal(signal.SIGALRM)
    path = tmp_path / "r.json"
    start = time.monotonic()
    code, _, err = run(capsys, "--backend", "ref", "--profile", profile, "--cases", str(smoke + 5), "--max-seq-len",
                       "64", "--jobs", "1", "--time-limit", "2", "--json", str(path))
    assert time.monotonic() - start < 20, err
    report = json.loads(path.read_text())
    assert code == cli.EXIT_OK and report["cases"] == fast and report["not_run"] == smoke + 5 - fast, err
    assert report["stopped"]["reason"] == f"time limit: --time-limit 2 s passed after {fast} of {smoke + 5} cases"
    assert "STOPPED by the time limit" in err
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_deadline_raises_once_its_seconds_pass_and_only_then():
    """`cli._deadline`: TimeLimitReached cuts a sleep short at its seconds; a block that ends first is left alone, and
    so is one that runs off the main thread (no timer there) or without seconds; the handler is given back each time."""
    handler = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(cli.TimeLimitReached):
        with cli._deadline(0.2):
            time.sleep(10)
    assert time.monotonic() - start < 5
    with cli._deadline(5):
        time.sleep(0.01)
    with cli._deadline(None):
        time.sleep(0.3)
    ended = []

    def off_main():
        with cli._deadline(0.01):
            time.sleep(0.3)
        ended.append(True)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert ended == [True]
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def _first_fast_rest_slow(case):
    """A pool worker's stand-in for `cli._run_one`: the campaign's first case returns at once, every other one takes a
    minute (as a long case or a kernel under Triton's interpreter may)."""
    if case != 0:
        time.sleep(60)
    return case


def _no_new_children(before: set, seconds: float = 20) -> bool:
    """Every child process started since `before` is gone within `seconds`."""
    deadline = time.monotonic() + seconds
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    return not set(multiprocessing.active_children()) - before


@pytest.mark.parametrize("how", ["stop", "raise", "stop-while-waiting"])
def test_an_early_stop_kills_the_workers_cases_in_flight(monkeypatch, how):
    """A campaign stopped early (--time-limit, -x, a device fault: `on_result` says stop, or `on_wait` while the next
    result is late; or an exception out of on_result, as Ctrl-C's) leaves no pool worker running a case whose result
    it drops. Before, the workers ran their cases in flight, and those the executor had queued for them, to the end:
    an interpreted Triton campaign with --time-limit 420 wrote its report at 599 s and its processes lived on for
    twelve more minutes, until killed (the seventy-fifth session mended the stop, the seventy-sixth the exception and
    the stop while waiting). Here a worker would sleep for a minute; the call must return, and the worker be gone,
    within 20 s. (The stop while waiting comes once the first result is in, as a time limit would on a slow case:
    a worker's start may take longer than one poll on a loaded machine.)"""
    monkeypatch.setattr(cli, "_run_one", _first_fast_rest_slow)  # forked workers inherit it
    before = set(multiprocessing.active_children())
    seen = []

    def on_result(result) -> bool:
        seen.append(result)
        if how == "raise":
            raise RuntimeError("the report broke")
        return how == "stop-while-waiting"

    start = time.monotonic()
    with contextlib.suppress(RuntimeError):
        cli._run_all([0, 1, 2, 3], 2, on_result, on_wait=lambda: not (how == "stop-while-waiting" and seen))
    assert seen == [0] and time.monotonic() - start < 20
    assert _no_new_children(before)


def _report_then_sleep(strategy, n, seed, on_result):
    """A search worker's stand-in for `cli._search`: one result at once, then a minute on its next case."""
    on_result(seed)
    time.sleep(60)


@pytest.mark.parametrize("stop_while_waiting", [False, True])
def test_a_stopped_search_kills_its_workers_cases_in_flight(monkeypatch, stop_while_waiting):
    """--profile search --jobs 2, stopped at its first result (or, after it, at a poll that finds no new one, as at a
    time limit): the searches are killed in their cases in flight, and the campaign ends at once. Until the
    seventy-sixth session each worker was asked to stop after its case in flight and joined for up to 60 s before
    being killed (a minute's wait here), and a time limit was checked only as results came in."""
    monkeypatch.setattr(cli, "_search", _report_then_sleep)  # forked workers inherit it
    before = set(multiprocessing.active_children())
    seen = []
    start = time.monotonic()
    cli._search_parallel("bf16", {}, 4, 0, 2, lambda result: seen.append(result) or stop_while_waiting, None,
                         on_wait=lambda: not (stop_while_waiting and seen))  # after a result: see the test above
    assert 1 <= len(seen) <= 2 and set(seen) <= {0, 1}  # the seeds of the searches: one result each at most
    assert stop_while_waiting or len(seen) == 1
    assert time.monotonic() - start < 20
    assert _no_new_children(before)


def test_a_search_worker_that_dies_is_reported_even_when_the_limit_passes_at_that_poll(monkeypatch):
    """A search worker found dead at a poll where on_wait also says stop (a time limit passing then) raises
    WorkerDied: the crash is not taken for a time limit. Its first version checked on_wait first and returned. The
    poll is stretched to 5 s so that the worker, which exits at once, is surely gone by the first one."""
    monkeypatch.setattr(cli, "_search", _search_dies)  # forked workers inherit it
    monkeypatch.setattr(cli, "_POLL_S", 5.0)
    with pytest.raises(cli.WorkerDied, match="exited with code 3 without reporting"):
        cli._search_parallel("bf16", {}, 2, 0, 1, lambda result: True, None, on_wait=lambda: False)


def test_search_stopped_in_its_target_phase_reports_the_cases_that_ran(capsys, tmp_path):
    """A search stopped late (here by --exitfirst at a failure in the 150th case, in Hypothesis's target phase; a time
    limit stops the same way) ends with the report of the cases that ran, not with Hypothesis's ExceptionGroup of
    the stop raised by the calls it still makes after it (report_multiple_bugs=False)."""
    CALLS[0] = 0
    CASE_QS.clear()
    CASE_KVS.clear()
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:wrong_from_the_150th_call", "--profile", "search", "--cases",
                       "200", "--max-seq-len", "64", "--seed", "1", "--exitfirst", "--json", str(path))
    assert code == cli.EXIT_FAILED, err
    report = json.loads(path.read_text())
    assert report["cases"] == 150 and report["failed"] == 1 and report["not_run"] == 50
    assert "worst cases" in err and "ExceptionGroup" not in err


def test_summary_table_is_whole_in_a_log(capsys, monkeypatch):
    """stderr captured (a log, CI): the summary table keeps every header and check name whole instead of rich's
    80-column cut ("cas…", "median err/bou…"); $COLUMNS, when set, still rules."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, _, err = run(capsys, "--backend", "ref", "--dtype", "fp8", "--cases", "2", "--jobs", "1")
    assert code == 0, err
    for header in ("cases", "median err/bound", "max err/bound", "worst case", "tier2.post.out"):
        assert f" {header} " in err, header
    assert "…" not in err
    monkeypatch.setenv("COLUMNS", "80")
    code, _, err = run(capsys, "--backend", "ref", "--dtype", "fp8", "--cases", "2", "--jobs", "1")
    assert code == 0 and "…" in err


def fp8_out(batch):
    """A correct kernel whose out is e4m3fn (the contract takes any float dtype), declaring that rounding."""
    out, lse = correct(batch)
    return out.float().to(torch.float8_e4m3fn), lse


fp8_out.numerics = dataclasses.replace(DEFAULT_NUMERICS, out_dtype=torch.float8_e4m3fn)


def test_an_fp8_output_is_checked_not_crashed_on():
    """out in e4m3fn: the finite and empty checks widen it (torch has no isfinite for fp8: every case failed as a
    verifier error), and tier 1 charges the output's absolute rounding below e4m3fn's normal range (an output
    rounded to 0 from a tiny expected value read 8x its relative-only bound). Found by a review."""
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = Case(seq_lens=(0, 1, 63, 300), q_lens=(1, 2, 1, 3), heads=4, dist="gauss1", seed=2)
    result = run_case(case, from_callable(fp8_out), "cpu")
    assert result.ok, result.describe()
    assert {c.name for c in result.checks} >= {"tier1.out", "empty", "finite"}


def test_split_check_compares_two_different_worker_counts():
    """check_split runs the kernel a second time with another worker count (1, or ALT_WORKERS after a 1-worker run)
    and fails a kernel whose result depends on it: here the emulated backend with σ 1 % off whenever it runs with
    another count than the case's. (A review's mutant that reran the same count compared the run with itself and
    survived every test.)"""
    from mla_ref.decode import mla_decode_ref
    from verify.checks import _tier1_bound, check_split, run_case
    from verify.kernels import from_backend

    emulated = from_backend("emulated")
    case = Case(seq_lens=(300, 5, 129), q_lens=(1, 2, 1), heads=8, num_workers=8, seed=4)

    def drifting(batch, workers):
        return emulated.run_workers(batch.replace(sm_scale=batch.sm_scale * (1.01 if workers != 8 else 1.0)), workers)

    kernel = dataclasses.replace(emulated, run_workers=drifting)
    batch, _ = case.materialize("cpu")
    first = emulated.run_workers(batch, 8)
    ref = mla_decode_ref(batch)  # [T, H, L], [T, H] fp64
    bound = _tier1_bound(batch, emulated, emulated.numerics(batch), ref)
    results = {r.name: r for r in check_split(batch, kernel, emulated.numerics(batch), first, 8, ref, bound)}
    assert not results["split.out"].ok and not results["split.lse"].ok, results
    assert "8 workers vs 1" in results["split.out"].detail
    # the drifting run is the 1-worker one, and the split check says so (found by a review: it was named "actual"
    # only as the 8-worker run's counterpart)
    assert not results["split.tier1.out"].ok and not results["split.tier1.lse"].ok, results
    assert results["split.tier1.out"].detail.startswith("the 1-worker run vs the oracle: ")
    right = {r.name: r for r in check_split(batch, emulated, emulated.numerics(batch), first, 8, ref, bound)}
    assert all(r.ok for r in right.values()) and {"split.tier1.out", "split.out"} <= set(right), right
    assert run_case(case, emulated, "cpu").ok  # the same case passes without the drift


def test_json_check_summary_is_the_statistics_of_its_cases(capsys, tmp_path):
    """Each check's summary in the JSON report is computed from the per-case err/bound: the median (the mean of the
    middle two for an even count), the max, and the repro of the case that reached the max (review mutants that
    reported the max as the median, or the first case as the worst, survived)."""
    import statistics

    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--backend", "emulated", "--dtype", "bf16", "--cases", "4", "--jobs", "1",
                       "--max-seq-len", "300", "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    values = [r["err_over_bound"]["tier1.lse"] for r in report["results"]]
    summary = report["checks"]["tier1.lse"]
    assert len(set(values)) == 4 and values.index(max(values)) > 0  # every statistic told apart, the worst not first
    assert summary["max_err_over_bound"] == max(values)
    assert summary["median_err_over_bound"] == statistics.median(values)
    worst = Case.from_json(json.dumps(report["results"][values.index(max(values))]["case"]))
    assert summary["worst_repro"] == worst.repro(f"--backend emulated --threads {torch.get_num_threads()}")


def test_a_plugin_with_run_workers_gets_the_split_check(capsys, tmp_path):
    """`decode.run_workers = fn(batch, num_workers)` opts a plug-in into split invariance: every case runs with its
    drawn worker count and again with another (the JSON has split.out and split.lse for every case); without it no
    split check runs (a review found the README listing the check for every kernel)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:split_plugin", "--cases", "4", "--max-seq-len", "300",
                       "--jobs", "1", "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    assert "split invariance through .run_workers" in report["backend"]["reason"]
    assert report["checks"]["split.out"]["cases"] == 4 and report["checks"]["split.lse"]["cases"] == 4
    code, _, err = run(capsys, "--impl", "tests.test_cli:out_only", "--cases", "2", "--max-seq-len", "300",
                       "--jobs", "1", "--json", str(path))
    assert code == 0, err
    assert not any(name.startswith("split") for name in json.loads(path.read_text())["checks"])


@pytest.mark.parametrize("workers, failing, message", [
    (drifts_unsplit, "split.out", "8 workers vs 1"),
    (shrinks_unsplit, "split.out", "1-worker run: kernel out: expected shape"),
    (lse_when_split, "split.lse", "lse returned by only one"),
])
def test_a_plugins_second_run_is_held_to_the_split_bound_and_the_contract(workers, failing, message):
    """The second run of a plug-in's run_workers passes the same contract check as its first (a wrong shape is
    named, not a crash) and must agree within split_bound: a kernel right when split and 1 % off in σ unsplit
    passes tier 1 on the case's 8 workers and fails only the split check."""
    from verify.checks import run_case
    from verify.kernels import from_callable

    def decode(batch):
        return workers(batch, 8)

    decode.run_workers = workers
    case = Case(seq_lens=(300, 5, 129), q_lens=(1, 2, 1), heads=8, num_workers=8, seed=4)
    result = run_case(case, from_callable(decode, "drift"), "cpu")
    checks = {c.name: c for c in result.checks}
    assert checks["tier1.out"].ok and not checks[failing].ok, result.describe()
    assert message in checks[failing].detail
    assert not result.ok


def test_run_workers_must_be_callable():
    from verify.kernels import from_callable

    def decode(batch):
        return correct(batch)

    decode.run_workers = 4
    with pytest.raises(ValueError, match=r"\.run_workers must be a callable"):
        from_callable(decode, "x")


def test_the_readmes_replay_line_runs_as_written(capsys):
    """The README's `mla-verify --case '...'` example replays as written (it had held a `...` that exited 2)."""
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("mla-verify --case ")]
    argv = shlex.split(line.split("  #")[0])[1:]
    code, _, err = run(capsys, *argv, "--backend", "emulated")
    assert code == 0, err


def test_a_declared_p_rounding_coarser_than_the_kernels_is_warned_about(capsys, tmp_path):
    """A kernel that computes fp32 P but declares bf16 P passes every check (its bounds are the looser), and its
    tier-1 bound is not vacuous by LOOSE_RATIO; the rounding probe shows it: its rounding.out stays below
    ROUNDING_MATCHED, where P rounded as declared lands (the emulated backend: no warning)."""
    path = tmp_path / "r.json"
    argv = ("--cases", str(cli.LOOSE_CASES + 5), "--max-seq-len", "256", "--jobs", "1", "--json", str(path))
    code, _, err = run(capsys, "--impl", "tests.test_cli:declares_bf16_p", *argv)
    report = json.loads(path.read_text())
    assert code == 0 and [w.split(":")[0] for w in report["warnings"]] == ["rounding.out"], err
    assert report["checks"]["rounding.out"]["max_err_over_bound"] < cli.ROUNDING_MATCHED
    assert report["checks"]["tier1.out"]["max_err_over_bound"] > cli.LOOSE_RATIO
    code, _, err = run(capsys, "--backend", "emulated", *argv)
    report = json.loads(path.read_text())
    assert code == 0 and report["warnings"] == [] and "warning" not in err
    assert report["checks"]["rounding.out"]["max_err_over_bound"] >= cli.ROUNDING_MATCHED
    assert report["checks"]["partials.out"]["max_err_over_bound"] >= cli.PARTIALS_MATCHED


def test_a_declared_partial_dtype_coarser_than_the_kernels_is_warned_about(capsys, tmp_path):
    """A kernel that stores fp32 split outputs but declares bf16 ones passes every check; the partials probe shows
    it: its partials.out stays below PARTIALS_MATCHED, where partials stored as declared land (the emulated backend,
    fp32 stored and declared, is the other half of the test above: no warning)."""
    path = tmp_path / "r.json"  # about 3 in 4 cases have a split row: twice LOOSE_CASES for LOOSE_CASES probed
    argv = ("--cases", str(2 * cli.LOOSE_CASES), "--max-seq-len", "256", "--jobs", "1", "--json", str(path))
    code, _, err = run(capsys, "--impl", "tests.test_cli:declares_bf16_partials", *argv)
    report = json.loads(path.read_text())
    warned = [w.split(":")[0] for w in report["warnings"]]
    # the declared bf16 partials loosen the rounding probe's merge charge on split rows too: its warning may join
    assert code == 0 and "partials.out" in warned and set(warned) <= {"partials.out", "rounding.out"}, err
    assert report["checks"]["partials.out"]["max_err_over_bound"] < cli.PARTIALS_MATCHED


def test_a_declared_nondeterminism_the_kernel_never_shows_is_warned_about(capsys, tmp_path):
    """A deterministic kernel that declares run-to-run variation passes (its repeat check takes the tier-1 bound),
    and every second run gives the first run's bits: the report warns. A kernel whose bits do vary as declared is
    not warned about (merge_order_varies differs in some smoke case)."""
    path = tmp_path / "r.json"
    argv = ("--cases", str(cli.LOOSE_CASES), "--max-seq-len", "256", "--jobs", "1", "--json", str(path))
    code, _, err = run(capsys, "--impl", "tests.test_cli:declares_nondeterminism", *argv)
    report = json.loads(path.read_text())
    assert code == 0 and [w.split(":")[0] for w in report["warnings"]] == ["repeat"], err
    assert report["checks"]["repeat"]["cases"] == cli.LOOSE_CASES and "repeat.out" not in report["checks"]
    code, _, err = run(capsys, "--impl", "tests.test_cli:varies_as_declared", *argv)
    report = json.loads(path.read_text())
    assert code == 0 and "repeat.out" in report["checks"] and report["warnings"] == [], err


def test_failed_second_runs_are_no_sign_of_a_loose_nondeterminism_declaration():
    """The repeat check's entry also counts second runs that failed (raised, other dtypes): none of them is a run
    that gave the first run's bits, so they raise no warning (found by a review)."""
    assert cli._warnings({"repeat": {"cases": 25, "failed": 25}}, deterministic=False) == []
    assert cli._warnings({"repeat": {"cases": 25, "failed": 1}}, deterministic=False) == []
    assert [w.split(":")[0] for w in cli._warnings({"repeat": {"cases": 25, "failed": 0}}, deterministic=False)] == [
        "repeat"]
    assert cli._warnings({"repeat": {"cases": 25, "failed": 0}}, deterministic=True) == []


def test_the_probe_warnings_are_not_given_for_a_declared_fp32_output():
    """ROUNDING_MATCHED and PARTIALS_MATCHED are calibrated on a bf16 output, whose rounding dominates the probes'
    bounds; a correct kernel that declares fp32 output, P and partials lands near 0.005 there (a review's fp32
    kernel: 0.0048 and 0.0067), and was told it rounds more finely than declared. With every case declaring an
    fp32 (or fp64) output neither warning is given; one bf16-output case, or no declaration known, keeps them."""
    summary = {"rounding.out": {"cases": 99, "max_err_over_bound": 0.0048},
               "partials.out": {"cases": 99, "max_err_over_bound": 0.0067}}
    wide = {"float32", "float64"}
    assert cli._warnings(summary, out_dtypes=wide) == []
    bf16 = cli._warnings(summary, out_dtypes={"bfloat16"})
    assert [w.split(":")[0] for w in bf16] == ["rounding.out", "partials.out"]
    for kept in ({"float32", "bfloat16"}, {"float32", None}, set(), None):  # a bf16 case, an undeclared one, none
        assert len(cli._warnings(summary, out_dtypes=kept)) == 2, kept


def test_the_declared_out_dtypes_come_from_each_cases_numerics():
    """`_out_dtypes` reads the out dtype each case's KernelNumerics declared (not its describe() text); a case with
    no declaration (its numerics raised) gives nothing. The kernel here declares, then refuses the case (cheap)."""
    from verify.checks import CaseResult, run_case

    def refuses(batch):
        raise Unsupported("declared, then refused")

    case = Case(seq_lens=(3,), q_lens=(1,), heads=1, seed=0)
    results = []
    for out_dtype in (torch.float32, torch.bfloat16):
        refuses.numerics = dataclasses.replace(DEFAULT_NUMERICS, out_dtype=out_dtype)
        results.append(run_case(case, kernels.from_callable(refuses)))
    assert [r.out_dtype for r in results] == ["float32", "bfloat16"]
    assert cli._out_dtypes(results[:1]) == {"float32"} and cli._out_dtypes(results) == {"float32", "bfloat16"}
    assert cli._out_dtypes([CaseResult(case)]) == set()


def test_a_kernel_that_returns_no_lse_is_warned_about():
    """A kernel may return out alone, and every lse check then goes away without a word (a review): the report
    warns when tier1 ran with no lse in any case, and not when one case returned it."""
    (warning,) = cli._warnings({"tier1.out": {"cases": 7, "max_err_over_bound": 0.5}})
    assert warning.startswith("tier1.lse: the kernel returned no lse in all 7 cases")
    assert cli._warnings({"tier1.out": {"cases": 7, "max_err_over_bound": 0.5},
                          "tier1.lse": {"cases": 1, "max_err_over_bound": 0.5}}) == []


def refuses_strided_caches(batch):
    """The mutants' correct kernel, refusing a cache that is not contiguous (a ValueError naming it)."""
    if not batch.kv_cache.is_contiguous():
        raise ValueError("refuses_strided_caches.kv_cache: expected a contiguous cache")
    return correct(batch)


def test_strided_inputs_a_kernel_refuses_pass_and_are_warned_about(capsys, tmp_path):
    """A kernel may refuse strides it does not take (a ValueError): the campaign passes, its layout.refused check
    counts the cases and mla-verify warns with the kernel's message, since the layout check did not run there."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:refuses_strided_caches", "--cases", "3", "--jobs", "1",
                       "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["checks"]["layout.refused"] == {**report["checks"]["layout.refused"], "cases": 3,
                                                                "failed": 0}, err
    (warning,) = report["warnings"]
    assert warning.startswith("layout.refused: the kernel refused strided inputs in 3 cases")
    assert "expected a contiguous cache" in warning and "layout" not in report["checks"]


def refuses_shared_pages(batch):
    """The mutants' correct kernel, refusing (Unsupported) two requests that read the same page, which the batch
    check's grown batch always holds (the longest request twice, or it and a longer request on its pages) and a
    case's batch never does."""
    pages = batch.block_table[batch.used_entries].tolist()
    if len(set(pages)) < len(pages):
        raise Unsupported("two requests that read the same page")
    return correct(batch)


def test_regrouped_batches_a_kernel_refuses_pass_and_are_warned_about(capsys, tmp_path):
    """An Unsupported for the batch check's regrouped batch passes as batch.refused, counted, and warned about."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:refuses_shared_pages", "--cases", "3", "--jobs", "1",
                       "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["checks"]["batch.refused"]["cases"] == 3, err
    (warning,) = [w for w in report["warnings"] if w.startswith("batch.refused")]
    assert "regrouped batches in 3 cases" in warning and "two requests that read the same page" in warning


def refuses_long_requests(batch):
    """The mutants' correct kernel, refusing (Unsupported) a request longer than the default --max-seq-len."""
    if batch.batch_size and int(batch.seq_lens.max()) > 4096:
        raise Unsupported("a request longer than 4096 tokens")
    return correct(batch)


def test_the_long_cases_follow_the_smoke_prefix_when_on(capsys, tmp_path):
    """--long on appends verify.strategies.long_cases to the smoke prefix (a request of 2^16 + 65 tokens, past the
    default --max-seq-len of 4096: the plug-in refuses it, so the case shows as unsupported; --cases stops before
    the second long case, the big split batch); auto leaves them out
    on a CPU and says so, and so does a --cases that stops within the smoke prefix (report["long"] had stayed True
    there: found by a review)."""
    from verify.strategies import smoke_cases

    path = tmp_path / "r.json"
    n = len(smoke_cases("bf16")) + 1
    code, _, err = run(capsys, "--impl", "tests.test_cli:refuses_long_requests", "--cases", str(n), "--long", "on",
                       "--jobs", "1", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["long"] is True and report["unsupported"] == {"a request longer than 4096 tokens": 1}
    assert report["cases"] == n and "long cases are off" not in err, err
    code, _, err = run(capsys, "--impl", "tests.test_cli:refuses_long_requests", "--cases", str(n), "--jobs", "1",
                       "--json", str(path))
    report = json.loads(path.read_text())
    assert code == 0 and report["long"] is False and report["unsupported"] == {} and "the long cases are off" in err
    code, _, err = run(capsys, "--impl", "tests.test_cli:refuses_long_requests", "--cases", str(n - 1), "--long", "on",
                       "--jobs", "1", "--json", str(path))  # --cases cuts them off: the report says so
    report = json.loads(path.read_text())
    assert code == 0 and report["long"] is False and report["unsupported"] == {}
    # the 2^16 + 65 tokens, the big batch, the 2^16 + 65 pages of 1, the 128-head MTP batch
    assert f"--cases {n - 1} leaves out 4 of the 4 long cases" in err, err


def nonzero_everywhere(batch):
    """out + 1 everywhere: empty rows give 1 against a bound of 0, an err/bound of inf."""
    out, lse = correct(batch)
    return out + 1, lse


def test_non_finite_err_over_bound_gives_a_report_not_a_traceback(capsys, tmp_path):
    """An err/bound of inf (a nonzero out where 0 is exact) is kept as the string "inf" in the summary; the loose-bound
    warnings compared it with a float and the campaign died in its summary (found by a review)."""
    assert cli._warnings({"tier1.out": {"cases": 99, "max_err_over_bound": "inf"},
                          "tier1.lse": {"cases": 99, "max_err_over_bound": 0.5},  # lse given: no lse warning
                          "rounding.out": {"cases": 99, "max_err_over_bound": "nan"},
                          "partials.out": {"cases": 99, "max_err_over_bound": "inf"}}) == []
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:nonzero_everywhere", "--cases", str(cli.LOOSE_CASES + 5),
                       "--max-seq-len", "256", "--jobs", "1", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and report["checks"]["empty"]["failed"] > 0, err
    assert report["checks"]["tier1.out"]["max_err_over_bound"] == "inf" and report["warnings"] == []


def test_a_plugin_in_the_working_directory_resolves_as_the_repro_line_names_it(tmp_path, monkeypatch):
    """The console script `mla-verify` (unlike `python -m verify`) does not put the working directory on sys.path:
    `mla-verify --impl mymod:decode`, and the repro line it prints for a failure, exited 2 ("No module named") for a
    plug-in file in the working directory (found by a review)."""
    from verify.kernels import from_impl

    (tmp_path / "wd_plugin_mod.py").write_text("from verify.mutants import correct as decode\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert from_impl("wd_plugin_mod:decode").name == "wd_plugin_mod:decode"


def test_a_repro_line_names_the_directory_a_plugin_was_found_in_and_replays_from_anywhere(capsys, tmp_path,
                                                                                            monkeypatch):
    """A plug-in module found only in the working directory (or under --impl-path) gets ``--impl-path DIR`` in its
    repro lines, which then replay from another directory with the same failing check (they had resolved only
    from there: a review's repro replays); one found elsewhere too (an installed package) gets none."""
    plugins, elsewhere = tmp_path / "plugins", tmp_path / "elsewhere"
    plugins.mkdir(), elsewhere.mkdir()
    (plugins / "gain_plugin_mod.py").write_text("from verify.mutants import out_gain as decode\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(plugins), str(elsewhere))])
    monkeypatch.delitem(sys.modules, "gain_plugin_mod", raising=False)
    monkeypatch.chdir(plugins)
    code, out, err = run(capsys, "--impl", "gain_plugin_mod:decode", "--cases", "1", "--jobs", "1")
    (line,) = {ln.strip()[len("repro: "):] for ln in (out + err).splitlines() if ln.strip().startswith("repro: ")}
    assert code == cli.EXIT_FAILED and line.endswith(f"--impl gain_plugin_mod:decode --impl-path {plugins} --threads "
                                                      f"{torch.get_num_threads()}"), line
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(plugins)])
    monkeypatch.delitem(sys.modules, "gain_plugin_mod")
    code, out, err = run(capsys, *shlex.split(line)[1:])
    assert code == cli.EXIT_FAILED and "[tier1.out] FAILED" in out + err, out + err
    from verify.kernels import impl_path_flag

    assert impl_path_flag("verify.mutants:out_gain") == "" and impl_path_flag("never_imported_mod:f") == ""
    assert run(capsys, "--impl-path", str(plugins))[0] == cli.EXIT_USAGE
    code, _, err = run(capsys, "--impl", "gain_plugin_mod:decode", "--impl-path", str(tmp_path / "none"))
    assert code == cli.EXIT_USAGE and "--impl-path" in err and "expected a directory" in err


def test_the_report_names_the_declared_numerics_and_warns_when_the_bound_is_vacuous(capsys, tmp_path):
    """A kernel bound far above every error seen is a sign of a declaration looser than the kernel: the report
    prints what the bound assumed (text and JSON) and warns below LOOSE_RATIO over LOOSE_CASES cases; a correct
    kernel with its honest numerics gets no warning."""
    path = tmp_path / "r.json"
    n = cli.LOOSE_CASES + 5  # the rounding check counts only cases with a request of two tokens
    argv = ("--cases", str(n), "--max-seq-len", "256", "--jobs", "1", "--json", str(path))
    code, _, err = run(capsys, "--impl", "tests.test_cli:loose_declaration", *argv)
    report = json.loads(path.read_text())
    assert code == 0 and len(report["warnings"]) == 2 and "tier1.out" in report["warnings"][0], err
    assert "mla-verify: warning: tier1.out" in err
    assert report["warnings"][1].startswith("rounding.out") and "mla-verify: warning: rounding.out" in err
    (described,) = report["numerics"]
    assert "QK float32 gamma 0.5" in described and f"declared numerics ({n} cases)" in err
    assert all(r["numerics"] == described for r in report["results"])
    code, _, err = run(capsys, "--impl", "verify.mutants:correct", *argv)
    assert code == 0 and json.loads(path.read_text())["warnings"] == [] and "warning" not in err


@pytest.mark.parametrize("source, error", [("def decode(batch) return 0\n", "SyntaxError"),
                                           ("raise RuntimeError('needs a GPU at import')\n", "RuntimeError")])
def test_a_plugin_module_that_fails_to_import_is_a_usage_error(capsys, tmp_path, monkeypatch, source, error):
    """A plug-in module that raises while it is imported (a SyntaxError, a RuntimeError from an import-time device
    probe) exits 2 with one line naming the error: it had exited 1, "a check failed", with a traceback (found by a
    review)."""
    (tmp_path / "broken_plugin_mod.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--impl", "broken_plugin_mod:decode", "--cases", "1")
    assert code == cli.EXIT_USAGE, err
    assert f"--impl broken_plugin_mod:decode: cannot resolve it ({error}" in err and "Traceback" not in err


@pytest.mark.parametrize("attr, value, wanted", [("numerics", "bf16", "a KernelNumerics"),
                                                 ("max_splits", 0, "an int >= 1"),
                                                 ("max_splits", 2.0, "an int >= 1")])
def test_a_per_batch_declaration_with_a_bad_value_fails_naming_it(attr, value, wanted, monkeypatch):
    """A plug-in's callable `.numerics` or `.max_splits` that returns a bad value raises naming the plug-in and the
    attribute (the campaign fails the case with that message; it had been an AttributeError deep in the bounds, or
    the planner's "num_splits: expected an int >= 1", naming neither)."""
    from verify.checks import run_case
    from verify.kernels import DeclarationError, from_callable

    def decode(batch):
        return correct(batch)

    setattr(decode, attr, lambda batch: value)
    message = f"--impl mine: .{attr}(batch) must return {wanted}, got {value!r}"
    case = Case(seq_lens=(70, 3), q_lens=(1, 1), heads=2)
    with pytest.raises(DeclarationError, match=re.escape(message)):
        run_case(case, from_callable(decode, "mine"), "cpu")
    from verify import cli  # a campaign reports it as the plug-in's failed declaration, not a verifier error

    monkeypatch.setattr(cli, "_KERNEL", from_callable(decode, "mine"))
    result = cli._run_one(case)
    assert [(c.name, c.ok, c.detail) for c in result.checks] == [("declaration", False, message)]


def test_a_replay_reports_the_cases_dtype_not_the_flags_default(capsys, tmp_path):
    """The JSON of a --case replay names what ran: the case's fp8 dtype and format, no profile or Hypothesis seed (it
    had said bf16 and seed 0, the flags' defaults, over an fp8 case)."""
    path = tmp_path / "r.json"
    case = dataclasses.replace(SMALL, kv_dtype="fp8", q_dtype="fp8", fp8_format="e4m3fnuz")
    code, _, err = run(capsys, "--backend", "emulated", "--case", case.to_json(), "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    assert (report["dtype"], report["fp8_format"], report["seed"], report["profile"]) == ("fp8", "e4m3fnuz", None, None)
    assert report["results"][0]["case"]["fp8_format"] == "e4m3fnuz"


def exits(batch):
    sys.exit(3)


def test_a_plugin_that_calls_sys_exit_fails_its_case_with_a_report(capsys, tmp_path):
    """A kernel that calls sys.exit(3) fails the case with the SystemExit named, and the campaign writes its report
    (it had ended the campaign with exit 3, no message and no report; found by a review)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:exits", "--case", SMALL.to_json(), "--json", str(path))
    assert code == cli.EXIT_FAILED, err
    (check,) = json.loads(path.read_text())["failures"][0]["checks"]
    assert check["name"] == "contract" and "SystemExit: 3" in check["detail"]


def test_an_output_coarser_than_declared_fails_the_contract_naming_both_dtypes():
    """An e4m3fn `out` under the default bf16 declaration fails `contract` with both dtypes named (it had passed the
    contract and failed tier1.out at 64x its bound, with no word of the dtype; found by a review); declared, the
    same output passes (test_an_fp8_output_is_checked_not_crashed_on)."""
    from verify.checks import run_case
    from verify.kernels import from_callable

    def decode(batch):
        return fp8_out(batch)

    case = Case(seq_lens=(0, 1, 63, 300), q_lens=(1, 2, 1, 3), heads=4, seed=2)
    [check] = run_case(case, from_callable(decode), "cpu").failed
    assert check.name == "contract"
    assert "torch.float8_e4m3fn is coarser than the declared out_dtype torch.bfloat16" in check.detail


@pytest.mark.parametrize("argv", [[], ["--dtype", "fp8", "--cases", "3", "-x"], ["--far", "on", "--heads", "16"],
                                  ["--case", SMALL.to_json(), "--seed", "0"]])
def test_one_parse_gives_argparses_arguments_and_the_flags_given(argv):
    """main parses argv once, every option starting unset so that the flags given show (defaults given explicitly
    too, e.g. --seed 0): the same arguments as a plain parse_args, and the set of flags on the command line."""
    parser = cli.build_parser()
    args, given = cli._parse(parser, argv)
    assert vars(args) == vars(parser.parse_args(argv))
    assert given == {a.dest for a in parser._actions if set(a.option_strings) & set(argv)}



def test_jobs_1_leaves_a_report_naming_the_case_a_crash_ended(tmp_path):
    """--jobs 1 runs the cases in this process, so a kernel that kills it takes the campaign with it; the --json
    report, rewritten before each case, then names the case in flight with its repro and reports the cases before it
    (until the fifty-ninth session nothing was left: no report, no repro). A subprocess: the crash ends it."""
    import os
    import subprocess

    path, n = tmp_path / "r.json", 6
    first = next(i for i, c in enumerate(smoke_cases("bf16")) if c.page_size == 16)  # the crash's case
    done = subprocess.run([sys.executable, "-m", "verify", "--impl", "tests.test_cli:dies_on_page_16", "--cases",
                           str(n), "--jobs", "1", "--json", str(path)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=900)
    assert done.returncode == 11 and 0 < first < n, done.stderr
    report = json.loads(path.read_text())
    stopped = report["stopped"]
    assert report["cases"] == first and report["failed"] == 0 and report["not_run"] == n - first, report
    assert stopped["fault"] and stopped["reason"].startswith(f"the process ended while running case {first + 1} of "
                                                             f"{n}"), stopped
    case = Case.from_json(shlex.split(stopped["repro"])[2])
    assert case == smoke_cases("bf16")[first] and stopped["case"] == case.describe()


# the source-mutation review of verify/cli.py (sixty-fourth session): each test fails on the edit it names (L..)


def _case(seed: int) -> Case:
    """A one-request case for results made up without a kernel."""
    return Case(seq_lens=(3,), q_lens=(1,), heads=1, seed=seed)


def test_summary_worst_repro_of_a_failed_check_is_its_largest_err_over_bound():
    """Mutant L04 (the worst case of a failed check taken as its first failed case): the summary's worst_repro and
    worst_detail name the failed case with the largest err/bound, not the first (values made up, no kernel)."""
    results = [CaseResult(_case(seed), [CheckResult("tier1.out", False, ratio, ratio, f"case {seed}")])
               for seed, ratio in ((1, 2.0), (2, 7.0), (3, 3.0))]
    summary = cli._summary(results, "--impl m:f")["tier1.out"]
    assert summary["failed"] == 3 and summary["max_err_over_bound"] == 7.0
    assert summary["worst_repro"] == _case(2).repro("--impl m:f") and summary["worst_detail"] == "case 2"


def test_report_entries_of_unsupported_cases_are_not_ok():
    """Mutant L08 (a result entry's ok taken as "not failed"): an unsupported case is neither passed nor failed, and
    its entry in the report's results says ok false (CaseResult.ok), beside status "unsupported"."""
    results = [CaseResult(_case(1), [CheckResult("tier1.out", True, 0.5, 0.5)]),
               CaseResult(_case(2), unsupported="no kernel for this"),
               CaseResult(_case(3), [CheckResult("tier1.out", False, 2.0, 2.0)])]
    report = {}
    cli._complete(report, results, cli._summary(results, ""), 1.0, "", True, 0, {})
    assert [(r["ok"], r["status"]) for r in report["results"]] == [(True, "passed"), (False, "unsupported"),
                                                                  (False, "failed")]
    assert report["failed"] == 1 and report["unsupported"] == {"no kernel for this": 1}
    json.dumps(report, allow_nan=False)  # the report stays standard JSON


@pytest.mark.parametrize("name", ["batch.refused", "batch.shrunk.refused", "batch.mtp.refused", "batch.shared.refused"])
def test_every_refused_regrouping_is_warned_about(name):
    """Mutant L12 (batch.shared.refused left out of the warned names): a kernel that refuses any of the batch
    check's regrouped batches, the shared-prefix one included, is warned about by that name."""
    summary = {name: {"cases": 3, "failed": 0, "max_err_over_bound": None, "worst_detail": "refused: X"}}
    (warning,) = cli._warnings(summary)
    assert warning.startswith(f"{name}: the kernel refused the batch check's regrouped batches in 3 cases")


def test_no_nondeterminism_warning_once_some_second_run_varied():
    """Mutant L15 (the repeat warning without its "repeat.out" guard): a kernel declared nondeterministic whose
    second runs gave the first run's bits in LOOSE_CASES or more cases but varied in another (repeat.out in the
    summary) shows the declared variation, and is not warned about; with no varied case it is."""
    same = {"repeat": {"cases": cli.LOOSE_CASES + 5, "failed": 0}}
    varied = {**same, "repeat.out": {"cases": 1, "failed": 0, "max_err_over_bound": 0.3}}
    assert cli._warnings(varied, deterministic=False) == []
    assert [w.split(":")[0] for w in cli._warnings(same, deterministic=False)] == ["repeat"]


def test_a_loose_bound_is_warned_about_from_exactly_loose_cases():
    """Mutant L16 (``largest`` asking for more than LOOSE_CASES cases): the vacuous-bound warning needs at least
    LOOSE_CASES cases (``_warnings``' docstring), so exactly that many warn, one fewer does not."""
    def summary(cases):
        return {"tier1.out": {"cases": cases, "max_err_over_bound": cli.LOOSE_RATIO / 2},
                "tier1.lse": {"cases": cases, "max_err_over_bound": 0.5}}

    assert [w.split(":")[0] for w in cli._warnings(summary(cli.LOOSE_CASES))] == ["tier1.out"]
    assert cli._warnings(summary(cli.LOOSE_CASES - 1)) == []


def test_the_first_unsupported_case_of_a_reason_is_shown_as_it_happens(capsys):
    """Mutant L17 (on_result printing failed cases only): the first case of each unsupported reason is printed
    when it ends (its describe() line and repro), once per reason, not only counted in the summary."""
    code, _, err = run(capsys, "--impl", "tests.test_cli:never", "--cases", "2", "--max-seq-len", "64", "--jobs", "1")
    assert code == cli.EXIT_NOTHING_RAN, err
    assert err.count("UNSUPPORTED by the kernel: no kernel at all") == 1, err
    assert "  repro: mla-verify --case " in err


def test_a_time_limit_that_passes_during_the_last_case_stops_nothing(capsys, tmp_path, monkeypatch):
    """Mutant L19 (the time-limit stop without its ``len(results) < n``): a limit that passes during the campaign's
    last case leaves no case unrun, so the report says nothing stopped it (without the timer, which would cut that
    case short)."""
    no_timer(monkeypatch)
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:never", "--cases", "1", "--max-seq-len", "64", "--jobs", "1",
                        "--time-limit", "1e-9", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_NOTHING_RAN and report["cases"] == 1 and report["not_run"] == 0, err
    assert report["stopped"] is None and "STOPPED" not in err and "stopped early" not in err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_time_limit_must_be_finite(capsys, value):
    """Mutant L20 (``_positive_seconds`` without its inf test): --time-limit takes finite seconds > 0 only."""
    code, out, err = run(capsys, "--backend", "ref", "--cases", "2", "--time-limit", value)
    assert code == cli.EXIT_USAGE and "--time-limit" in err and out == "", err


_CASE_FLAG_VALUES = {"--dtype": ("fp8",), "--fp8-format": ("e4m3fnuz",), "--heads": ("2",), "--page-size": ("16",),
                     "--kv-lora-rank": ("256",), "--rope-dim": ("32",), "--max-seq-len": ("64",),
                     "--max-batch": ("2",), "--seed": ("3",), "--cases": ("2",), "--profile": ("dev",),
                     "--long": ("on",), "--time-limit": ("5",), "--exitfirst": ()}


@pytest.mark.parametrize("flag", sorted(_CASE_FLAG_VALUES))
def test_every_case_shaping_flag_is_refused_with_case(capsys, flag):
    """Mutant L22 (--rope-dim left out of CASE_FIXES): a --case replay takes its widths, dtypes and seed from the
    case's JSON, so each flag that shapes or draws cases is a usage error beside it (exit 2, naming the flag), not
    silently ignored; every value here parses, so only the --case rule can refuse it."""
    extra = ("--dtype", "fp8") if flag == "--fp8-format" else ()  # --fp8-format alone is refused for bf16
    code, out, err = run(capsys, "--case", '{"seq_lens": [70]}', *extra, flag, *_CASE_FLAG_VALUES[flag])
    assert code == cli.EXIT_USAGE and "--case replays the case" in err and flag in err and out == "", err


def test_a_failures_checks_are_its_failed_checks_only():
    """Mutant L23 (a failure's "checks" listing every check): the report's failure entry lists the checks that
    failed, each once, and none that held."""
    r = CaseResult(_case(1), [CheckResult("tier1.out", False, 3.0, 1.0, "worse"), CheckResult("tier1.lse", True, 0.2),
                              CheckResult("empty", True), CheckResult("inputs", False, detail="q (2 bytes)")])
    failure = cli._failure(r, "--impl m:f")
    assert [c["name"] for c in failure["checks"]] == ["tier1.out", "inputs"]
    assert all(c["ok"] is False for c in failure["checks"]) and failure["repro"] == _case(1).repro("--impl m:f")


def test_example_lines_take_each_checks_largest_finite_ratio():
    """Mutant L25 (`_example_lines` without its finite filter): a check whose err/bound was inf in some case (a NaN
    where the oracle is finite) names its largest finite case as its worst, as Hypothesis'
    target does (verify.testing); a check with no finite ratio gives no line."""
    results = [CaseResult(_case(1), [CheckResult("tier1.out", True, 0.5), CheckResult("empty.x", False, float("inf"))]),
               CaseResult(_case(2), [CheckResult("tier1.out", False, float("inf"))]),
               CaseResult(_case(3), [CheckResult("tier1.out", True, 0.75)])]
    (line,) = cli._example_lines(results)
    assert line == f"@example(case={_case(3)!r})  # max err/bound: tier1.out 0.75"


@pytest.mark.parametrize("profile, drawn", [("ci", False), ("dev", True), ("search", True)])
def test_only_the_ci_profile_fixes_the_seed(capsys, tmp_path, monkeypatch, profile, drawn):
    """Mutant L27 (the search profile given seed 0 like ci): without --seed, dev and search draw a fresh seed from
    os.urandom (here made to give 0x01020304), ci takes 0; the report records it."""
    monkeypatch.setattr(cli.os, "urandom", lambda n: bytes([4, 3, 2, 1])[:n])
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:never", "--profile", profile, "--cases", "1",
                        "--max-seq-len", "64", "--jobs", "1", "--json", str(path))
    assert code == cli.EXIT_NOTHING_RAN, err
    assert json.loads(path.read_text())["seed"] == (0x01020304 if drawn else 0)


@pytest.mark.parametrize("flag, limit", [("--max-seq-len", cli.MAX_SEQ_LEN), ("--heads", cli.MAX_CASE_HEADS),
                                         ("--page-size", cli.MAX_PAGE_SIZE), ("--kv-lora-rank", cli.MAX_WIDTH),
                                         ("--rope-dim", cli.MAX_WIDTH)])
def test_each_size_flag_takes_its_limit_and_refuses_one_more(flag, limit):
    """Mutant L29 (`_at_most` refusing its own limit): the limits are inclusive ("at most", --help), so the limit
    parses and limit + 1 is a usage error (exit 2)."""
    parser = cli.build_parser()
    dest = flag.lstrip("-").replace("-", "_")
    assert getattr(parser.parse_args([flag, str(limit)]), dest) == limit
    with pytest.raises(SystemExit) as e:
        parser.parse_args([flag, str(limit + 1)])
    assert e.value.code == cli.EXIT_USAGE


def test_exitfirst_at_the_last_case_stops_nothing(capsys, tmp_path):
    """Mutant L28 (-x recording a stop after the last case too): a failure in the campaign's last case leaves no
    case unrun, so the report's stopped is None (exit 1 for the failure)."""
    path = tmp_path / "r.json"
    code, _, err = run(capsys, "--impl", "tests.test_cli:raises", "--cases", "1", "--max-seq-len", "64", "--jobs", "1",
                        "-x", "--json", str(path))
    report = json.loads(path.read_text())
    assert code == cli.EXIT_FAILED and report["failed"] == 1 and report["not_run"] == 0, err
    assert report["stopped"] is None and "stopped early" not in err
