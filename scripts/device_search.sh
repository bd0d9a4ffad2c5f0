#!/usr/bin/env bash
# Search campaigns on the default dispatch (mla-verify --backend triton --profile search), six at once under one MPS
# daemon in one device call: fp8 on pages of 16 at 128 heads, pages of 32 at 64 heads, pages of 1, and drawn; bf16
# on pages of 16 at 128 heads, and drawn. Each starts no case after SECONDS (--time-limit, default 240) and writes its
# JSON report to $OUT/s_<name>.json (6 files + log.txt: the device tool returns 8). The log holds each campaign's
# summary and its worst cases as @example lines; pin the tier-1 and split ones in tests/test_regressions.py
# (TRITON_FP8_WORST / TRITON_BF16_WORST). Thirty-eighth session, one H200: 295-1334 cases per campaign in 240 s.
#   bash scripts/device_search.sh [SECONDS] [SEED]
seconds=${1:-240}
seed=${2:-100}
source "$(dirname "$0")/device_env.sh" /tmp/mla_search_out
mps_start
export OMP_NUM_THREADS=2  # six processes' fp64 oracles on 16 cores
campaign() {  # name, mla-verify args...
  local name=$1; shift
  timeout $((seconds + 90)) python3 -m verify --backend triton --profile search --cases 100000 \
    --time-limit "$seconds" --json "$OUT/s_$name.json" "$@" > "/tmp/s_$name.txt" 2>&1
  local rc=$?
  { echo "=== s_$name: exit $rc, $*"; grep -E "cases|stopped|^@example|FAILED|Error" "/tmp/s_$name.txt"; } \
    > "/tmp/s_$name.log"
}
step "six search campaigns, ${seconds} s each"
campaign fp8_p16_h128 --dtype fp8 --page-size 16 --heads 128 --seed $((seed + 1)) &
campaign fp8_p32_h64 --dtype fp8 --page-size 32 --heads 64 --seed $((seed + 2)) &
campaign fp8_p1 --dtype fp8 --page-size 1 --seed $((seed + 3)) &
campaign fp8 --dtype fp8 --seed $((seed + 4)) &
campaign bf16_p16_h128 --dtype bf16 --page-size 16 --heads 128 --seed $((seed + 5)) &
campaign bf16 --dtype bf16 --seed $((seed + 6)) &
wait
cat /tmp/s_*.log >> "$log"
mps_stop
step done
