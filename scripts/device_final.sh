#!/usr/bin/env bash
# One H200 session's measurements, in one device call (carry .whl): the verifier against each backend, the
# model-level check at full size, compute-sanitizer on the Triton kernel, and mla-bench with the peers.
# Writes at most 8 files to $OUT (the device tool's limit): 5 x v_*.json, model.json, bench.json, log.txt.
source "$(dirname "$0")/device_env.sh" /tmp/mla_final_out
mps_start  # the campaigns run in spawned worker processes sharing the GPU

verify() {  # backend dtype cases
  step "mla-verify --backend $1 --dtype $2 --cases $3"
  # --time-limit: a slow machine still writes the report of the cases that ran (timeout is the backstop)
  timeout 90 python3 -m verify --backend "$1" --dtype "$2" --cases "$3" --time-limit 70 \
    --json "$OUT/v_$1_$2.json" 2>&1 \
    | tail -16 | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
}
verify flashinfer bf16 300
verify flashmla bf16 300
verify triton fp8 2000

step "model check, full size"
timeout 120 python3 -m verify.model_check --dtype fp8 --size full --device cuda --json "$OUT/model.json" 2>&1 \
  | tail -20 | tee -a "$log"

verify flashinfer fp8 300

step "compute-sanitizer memcheck (Triton, varlen + NaN padding)"
timeout 60 python3 -m pytest tests/test_triton_gpu.py -q -x -k memcheck -p no:cacheprovider 2>&1 | tail -5 | tee -a "$log"

step "mla-bench with peers"
timeout 120 python3 -m mla_fast.bench --json "$OUT/bench.json" 2>&1 | tail -40 | tee -a "$log"
verify flashmla fp8 300  # last: its legacy fp8 kernel has faulted on some h=128 batches (mla_fast/flashmla_backend.py)
mps_stop
step done
