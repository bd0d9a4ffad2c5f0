"""A pytest plugin that ends the test process when a GPU test hangs.

A kernel that hangs (an mbarrier waited on with the wrong phase, say) blocks the host in a CUDA synchronize that
Python cannot interrupt, so pytest would hang with it. With this plugin, when a test marked ``gpu`` has run for
longer than $MLA_GPU_TEST_TIMEOUT seconds (default `DEFAULT_TIMEOUT_S`; 0 turns it off), `faulthandler` writes every
thread's traceback to the stderr that pytest started with and ends the process with exit status 1. Without
pytest-xdist, ``-v``'s line for the test in flight then ends in ``Timeout (h:mm:ss)!``; under pytest-xdist the
controller reports the test as crashed with its worker and goes on.

Use it from your conftest.py with ``pytest_plugins = ["verify.gpu_watchdog"]`` (this project's tests/conftest.py
does) or with ``pytest -p verify.gpu_watchdog``. Setup, call and teardown of a test count together.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

ENV = "MLA_GPU_TEST_TIMEOUT"
# seconds: twice the slowest GPU tests, the Hypothesis property tests of tests/test_triton_gpu.py (many cases, each
# with its compiles; up to 275 s in 4 pytest-xdist workers on an H100, sixty-sixth session)
DEFAULT_TIMEOUT_S = 600.0
MARKER = "gpu"

_stderr_fd: list[int] = []  # a copy of the stderr pytest started with: output capture redirects fd 2 during tests


def timeout_s() -> float:
    """$MLA_GPU_TEST_TIMEOUT in seconds (default DEFAULT_TIMEOUT_S); 0 means no watchdog. ValueError otherwise
    unless a number >= 0."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{ENV} must be a finite number of seconds >= 0 (0: no watchdog), got {raw!r}")
    return value


def _stderr_fileno() -> int:
    """fd of sys.stderr, or of sys.__stderr__ where sys.stderr has none (pytest-xdist's workers replace it)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError):
        fd = -1
    return fd if fd >= 0 else sys.__stderr__.fileno()


def pytest_configure(config):
    timeout_s()  # a bad value stops the run before any test
    _stderr_fd.append(os.dup(_stderr_fileno()))  # output capture is suspended while plugins configure


def pytest_unconfigure(config):
    while _stderr_fd:
        os.close(_stderr_fd.pop())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = timeout_s() if item.get_closest_marker(MARKER) else 0.0
    if limit:
        faulthandler.dump_traceback_later(limit, exit=True, file=_stderr_fd[-1])
    try:
        yield
    finally:
        if limit:
            faulthandler.cancel_dump_traceback_later()
