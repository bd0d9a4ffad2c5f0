#!/usr/bin/env bash
# The Gluon kernels' source mutants on the GPU (scripts/kernel_mutants.py run; no wheels needed): the unmutated
# kernels' tests and each mutant's, JOBS copies at a time on the one GPU, each mutant stopped at its first failing
# test or at MUTANT_SECONDS. Writes $OUT/kernel_mutants.json (rewritten as each mutant ends) and $OUT/log.txt.
# Usage: scripts/device_kernel_mutants.sh [SECONDS] [JOBS] [MUTANT_SECONDS] [kernel_mutants.py run options...]
# (default 540 s, 14 jobs, 240 s, every mutant of scripts/gluon_mutants.json on its gate), e.g.
#   scripts/device_kernel_mutants.sh 300 2 280 --ids S28 --workers 6 --k "gluon_seesaw_within_kernel_bound"
# The sixty-eighth session's run of all 45 mutants on their gates (14 jobs, H100): 346 s.
source "$(dirname "$0")/device_env.sh" "${OUT:-/tmp/mla_kernel_mutants_out}"
seconds=${1:-540}; jobs=${2:-14}; mutant_seconds=${3:-240}; shift $(( $# < 3 ? $# : 3 ))
step "kernel mutants: $jobs at a time, $mutant_seconds s each, $seconds s in all; $*"
timeout "$seconds" python3 scripts/kernel_mutants.py run scripts/gluon_mutants.json --json "$OUT/kernel_mutants.json" \
  --jobs "$jobs" --timeout "$mutant_seconds" "$@" 2>&1 | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
