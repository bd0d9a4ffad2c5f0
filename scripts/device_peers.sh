#!/usr/bin/env bash
# Peer adapters (FlashInfer FA3, FlashMLA) on one H200, against the fp64 oracle within the §5(f) kernel bound, and
# vLLM's Triton MLA decode (mla-bench's vLLM column) when its file is in .whl/vllm/ (the pytest run below).
#
# Needs the wheels in .whl/ (git-ignored): flashinfer-python 0.6.14, apache-tvm-ffi 0.1.x (cp312), sgl-flash-mla
# 1.0.0; for vLLM, .whl/vllm/triton_decode_attention.py unzipped from a vLLM wheel (README, "Backends and peers").
# Device tool call (carry .whl):  bash scripts/device_peers.sh
# Writes $OUT/peers.json (one row per case: err/bound ratios, max errors, empty-row convention) and logs.
source "$(dirname "$0")/device_env.sh" /tmp/mla_peers_out
[ "$wheels_rc" = 0 ] || exit 1

python3 - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch, flashinfer, flash_mla
from mla_fast import backends
print("torch", torch.__version__, "| flashinfer", flashinfer.__version__, "| flash_mla", flash_mla.__version__,
      "legacy", flash_mla.has_legacy(), "|", torch.cuda.get_device_name())
for name, (ok, reason) in backends.available().items():
    print(f"  {name:10s} {ok!s:5s} {reason}")
PY

for group in flashinfer:bf16 flashinfer:fp8kv flashmla:bf16 flashmla:fp8; do  # one process each: a CUDA fault
  python3 tests/test_peers_gpu.py --only "$group" --json "$OUT/peers_${group/:/_}.json" 2>&1 | tee -a "$OUT/peers.log"
done                                                                          # stays inside its group
python3 -m pytest tests/test_peers_gpu.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_peers.log"

if [ -f verify/cli.py ]; then  # the verifier against FlashInfer, when its CLI exists
  python3 -m verify --backend flashinfer --dtype bf16 --cases 300 --json "$OUT/verify_flashinfer.json" \
    2>&1 | tail -40 | tee "$OUT/verify_flashinfer.log"
fi
