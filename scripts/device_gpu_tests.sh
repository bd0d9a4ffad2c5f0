#!/usr/bin/env bash
# Every GPU test (`pytest -m gpu`) in one device call (carry .whl): serially they take longer than one call's 600 s
# (the sixty-third session's run passed 48 of 331 in 560 s), so they run in N pytest-xdist workers sharing the GPU
# (no MPS daemon: compute-sanitizer does not run under MPS). The device's torch venv has pytest-xdist 3.8; elsewhere
# carry it and execnet as wheels in .whl (`pip download pytest-xdist execnet --no-deps -d .whl`).
# Usage: scripts/device_gpu_tests.sh [SECONDS] [WORKERS] [PYTEST ARGS...] (default 540 s, 8 workers, tests/).
# Writes $OUT/pytest.txt (a line per test as it ends: `-o addopts=""` drops the project's -q, which would leave -v
# printing dots; then the failures and the slowest 40), $OUT/failures.txt (each failure's traceback as it happens,
# tests/conftest.py's MLA_TEST_FAILURES: a run killed at the limit prints no failures section) and $OUT/log.txt.
# The sixty-fourth session's 8 workers on an H100 failed 6 tests that passed when re-run in smaller calls (the 4
# Gluon fp8 grid rows at (128, 8192, 16) and (32, 16384, 16), the partials check, mla-bench's JSON), tracebacks lost
# at the limit: run the GPU tests in pieces (a file or -k) with fewer workers.
source "$(dirname "$0")/device_env.sh" "${OUT:-/tmp/mla_gpu_tests_out}"
seconds=${1:-540}; workers=${2:-8}; shift $(( $# < 2 ? $# : 2 )); targets=("${@:-tests/}")
python3 -c "import xdist" 2>/dev/null || { echo "pytest-xdist not installed: carry its wheel in .whl" | tee -a "$log"; exit 2; }
step "pytest -m gpu ${targets[*]}, $workers workers, $seconds s"
# the triage profile: ci's examples unshrunk, since shrinking a GPU failure (each try a case with its compiles) outlasts
# the call; a failure comes back as first drawn, its repro line in the traceback
HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-triage} MLA_TEST_FAILURES="$OUT/failures.txt" timeout "$seconds" python3 -m pytest -o addopts="" --strict-markers -m gpu -p no:cacheprovider -n "$workers" -v \
  --tb=short -rfEs --durations=40 "${targets[@]}" > "$OUT/pytest.txt" 2>&1
echo "exit $?" | tee -a "$log"
grep -cE " PASSED " "$OUT/pytest.txt" | sed 's/^/passed lines: /' | tee -a "$log"
grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/pytest.txt" | tail -20 | tee -a "$log"
