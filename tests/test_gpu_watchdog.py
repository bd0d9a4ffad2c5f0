"""verify.gpu_watchdog: a test marked gpu that outlasts $MLA_GPU_TEST_TIMEOUT ends the pytest process with every
thread's traceback; other tests are left alone. Each check runs pytest in a subprocess on a stand-in test file (no
conftest there skips the gpu marker on this CPU)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from verify import gpu_watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BODY = """
    import time
    import pytest

    def test_a_slow_cpu_test():
        time.sleep(2.5)

    @pytest.mark.gpu
    def test_b_hanging_gpu_test():
        time.sleep(60)

    def test_c_after():
        pass
"""


def _pytest(tmp_path, timeout: str | None, body: str = BODY, args: tuple[str, ...] = ()):
    (tmp_path / "test_stand_in.py").write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")
    env = {k: v for k, v in os.environ.items() if k != gpu_watchdog.ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if timeout is not None:
        env[gpu_watchdog.ENV] = timeout
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "verify.gpu_watchdog", "-p",
                           "no:cacheprovider", "--strict-markers", *args, "test_stand_in.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_a_gpu_test_past_the_limit_ends_the_run_with_its_traceback_and_other_tests_are_not_timed(tmp_path):
    proc, seconds = _pytest(tmp_path, "1.5")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    # the slow CPU test (2.5 s, over the limit) passed: only gpu tests are timed
    assert "test_a_slow_cpu_test PASSED" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("test_stand_in.py::test_b_hanging_gpu_test"), proc.stdout  # -v: in flight
    assert "Timeout (0:00:01.500000)!" in proc.stderr and "in test_b_hanging_gpu_test" in proc.stderr, proc.stderr
    assert "test_c_after" not in proc.stdout
    assert seconds < 30, seconds  # far short of the test's 60 s sleep


def test_under_xdist_the_hanging_test_fails_as_its_crashed_worker_and_the_run_goes_on(tmp_path):
    pytest.importorskip("xdist")  # not a test dependency; the device's torch venv has it
    proc, seconds = _pytest(tmp_path, "1.5", args=("-n", "2"))
    assert proc.returncode == 1 and "1 failed, 2 passed" in proc.stdout, (proc.stdout, proc.stderr)
    assert "worker 'gw" in proc.stdout and "crashed while running 'test_stand_in.py::test_b_hanging_gpu_test'" in \
        proc.stdout, proc.stdout
    assert "Timeout (0:00:01.500000)!" in proc.stderr and seconds < 30, (proc.stderr, seconds)


def test_zero_turns_the_watchdog_off(tmp_path):
    body = BODY.replace("time.sleep(60)", "time.sleep(2)").replace("time.sleep(2.5)", "pass")
    proc, _ = _pytest(tmp_path, "0", body)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, (proc.stdout, proc.stderr)


def test_a_bad_limit_stops_the_run_before_any_test_naming_the_variable(tmp_path):
    proc, _ = _pytest(tmp_path, "five")
    assert proc.returncode != 0 and "PASSED" not in proc.stdout, proc.stdout
    assert "MLA_GPU_TEST_TIMEOUT must be a finite number of seconds >= 0" in proc.stdout + proc.stderr


@pytest.mark.parametrize("raw, expected", [(None, gpu_watchdog.DEFAULT_TIMEOUT_S), ("", gpu_watchdog.DEFAULT_TIMEOUT_S),
                                           ("0", 0.0), (" 90 ", 90.0), ("2.5", 2.5)])
def test_timeout_from_the_environment(raw, expected, monkeypatch):
    monkeypatch.delenv(gpu_watchdog.ENV, raising=False)
    if raw is not None:
        monkeypatch.setenv(gpu_watchdog.ENV, raw)
    assert gpu_watchdog.timeout_s() == expected


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "5s"])
def test_timeout_refuses_what_is_not_a_finite_number_of_seconds(raw, monkeypatch):
    monkeypatch.setenv(gpu_watchdog.ENV, raw)
    with pytest.raises(ValueError, match=f"MLA_GPU_TEST_TIMEOUT .* got '{raw}'"):
        gpu_watchdog.timeout_s()
