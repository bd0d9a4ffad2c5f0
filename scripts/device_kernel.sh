#!/usr/bin/env bash
# Issue #5's measurements in one device call (carry .whl): mla-bench with the peers (bf16, fp8 KV, fp8 q + KV), the
# verifier on our kernel (2000 fp8 cases, MPS), then the GPU tests of the Triton kernel (shape grid, varlen, every
# candidate config, determinism, graph replay, compute-sanitizer memcheck). Writes bench.json, v_triton_fp8.json,
# log.txt to $OUT.
source "$(dirname "$0")/device_env.sh" /tmp/mla_kernel_out

step "mla-bench with peers"
timeout 240 python3 -m mla_fast.bench --dtypes bf16,fp8kv,fp8 --json "$OUT/bench.json" 2>&1 | tail -45 | tee -a "$log"

step "mla-verify --backend triton --dtype fp8 --cases 2000 (MPS)"
mps_start
timeout 100 python3 -m verify --backend triton --dtype fp8 --cases 2000 --json "$OUT/v_triton_fp8.json" 2>&1 \
  | tail -16 | tee -a "$log"
mps_stop

step "tests/test_triton_gpu.py"
timeout 330 python3 -m pytest tests/test_triton_gpu.py -q -p no:cacheprovider 2>&1 | tail -8 | tee -a "$log"
step done
