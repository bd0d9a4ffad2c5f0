#!/usr/bin/env bash
# default_config's boundary between the Gluon fp8 kernel and the fp8 seesaw re-measured on one page size in one
# device call (benchmarks/boundary_bench.py): SHAPES with fp8kv and fp8 q (about 75 s each on one H200, thirty-seventh
# session), then MTP_SHAPES on pages of 16 and 64 (about 60 s each with their compiles). Each run writes its table
# (--csv) to $OUT/boundary_h200_{combo}_p{PAGE}[_mtp].csv, with log.txt at most 5 files (the device tool returns 8;
# the JSON with clocks and spills would make 9). To land a re-measurement: copy the
# tables into benchmarks/, add the session to their first comment line, and let tests/test_triton_decode.py's
# BOUNDARY_LOSSES (the rule test) name where default_config now picks the slower kernel.
#   bash scripts/device_boundary.sh PAGE      (PAGE: 16, 32 or 64)
page=${1:?usage: device_boundary.sh PAGE (16, 32 or 64)}
source "$(dirname "$0")/device_env.sh" /tmp/mla_boundary_out
sets="SHAPES"
[ "$page" = 16 ] || [ "$page" = 64 ] && sets="SHAPES mtp"
for shapes in $sets; do
  for combo in fp8kv fp8; do
    name="boundary_h200_${combo}_p${page}"
    args=()
    if [ "$shapes" = mtp ]; then name="${name}_mtp"; args=(--shapes mtp); fi
    step "boundary_bench.py --page-size $page --combo $combo ${args[*]}"
    timeout 150 python3 benchmarks/boundary_bench.py --page-size "$page" --combo "$combo" "${args[@]}" \
      --csv "$OUT/$name.csv" 2>&1 | tail -3 | tee -a "$log"
  done
done
step done
