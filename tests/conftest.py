"""Shared test configuration: Hypothesis profiles and hardware markers.

Profiles (`verify.testing.PROFILES`; select with HYPOTHESIS_PROFILE or --hypothesis-profile):
- ``ci``     derandomized, no deadline, no example database: the same examples on every run (the default,
  with or without CI set).
- ``dev``    random, more examples, database on: for local exploration.
- ``search`` many examples, target() phase, no shrinking: hunts worst err/bound cases (see verify.strategies).
- ``triage`` ci's examples without shrinking: a failure is reported as first drawn, inside a device call's limit
  (scripts/device_gpu_tests.sh uses it).

Without triton (the README's install line and .ci/run install triton==3.6.0) the modules that import it are not
collected, and the end of the report says which.

A GPU test that hangs ends the test process after $MLA_GPU_TEST_TIMEOUT seconds (`verify.gpu_watchdog`).

MLA_TEST_FAILURES=PATH appends each failure's traceback to PATH as it happens (`pytest_runtest_logreport`), so that
a run killed at a time limit (a device call's) keeps them: pytest prints its failures section only at the end.
"""

import os
import sys

import pytest
import torch

from verify.testing import register_profiles

register_profiles()  # verify.testing.PROFILES, chosen by $HYPOTHESIS_PROFILE (default ci)
pytest_plugins = ["verify.gpu_watchdog"]  # a GPU test past $MLA_GPU_TEST_TIMEOUT s (default 600) ends the run

# test modules that import triton at collection (directly or through mla_fast.bench / mla_fast.triton_decode)
NEEDS_TRITON = ["test_bench_helpers.py", "test_bench_rounds.py", "test_dsmem.py", "test_fp8_qk_numerics.py",
                "test_gpu_clocks.py", "test_kernel_mutants.py", "test_launch_rules.py", "test_launcher_glue.py",
                "test_offline_compile.py", "test_read_floor.py", "test_triton_gpu.py", "test_vllm_peer.py",
                "test_vllm_peer_edges.py"]
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
collect_ignore = [] if HAS_TRITON else NEEDS_TRITON


def pytest_terminal_summary(terminalreporter):
    if not HAS_TRITON:
        terminalreporter.write_line(f"triton is not installed: {len(NEEDS_TRITON)} test modules not collected "
                                    f"({', '.join(NEEDS_TRITON)}); pip install triton==3.6.0 to run them")


def pytest_runtest_logreport(report):
    path = os.environ.get("MLA_TEST_FAILURES")
    if path and report.failed:  # under pytest-xdist this runs in the controller, for every worker's report
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available() and torch.version.hip is None
    has_rocm = torch.cuda.is_available() and torch.version.hip is not None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    skip_rocm = pytest.mark.skip(reason="needs ROCm and amd-aiter (none here)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "rocm" in item.keywords and not has_rocm:
            item.add_marker(skip_rocm)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of many tiny ops (decode steps, small fp64 sums): on a 2-core runner a
    second thread only adds contention. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["0.1.7", "head"])
def fake(request, monkeypatch):
    """A fake `aiter` (tests/fake_aiter.py) with the signatures of v0.1.7 or of HEAD, as `import aiter` gives it."""
    from fake_aiter import make_fake_aiter

    module = make_fake_aiter(request.param)
    monkeypatch.setitem(sys.modules, "aiter", module)
    monkeypatch.setitem(sys.modules, "aiter.mla", module.mla)
    return module
