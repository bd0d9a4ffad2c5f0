# Sourced by the scripts/device_*.sh measurement scripts (device tool call, carry .whl): from the repository root,
# $OUT created (default: the first argument), the carried peer wheels installed into /tmp/site (exit status in
# $wheels_rc), PYTHONPATH set, $MLA_BENCH_VLLM_SRC set when .whl/vllm/triton_decode_attention.py was carried, `step`
# logging a headed line to $OUT/log.txt, `mps_start` / `mps_stop` for campaigns in worker processes (without an
# MPS daemon their kernels time-slice the GPU: 1560 vs 4166 cases/min on one H200).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$1}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
wheels_rc=$?  # scripts that need the peers stop on a failed install; the others report them as not installed
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# vLLM's Triton MLA decode for mla-bench and tests/test_peers_gpu.py, when its file was carried (mla_fast/vllm_peer.py)
[ -f .whl/vllm/triton_decode_attention.py ] && export MLA_BENCH_VLLM_SRC=$PWD/.whl/vllm/triton_decode_attention.py
log="$OUT/log.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
# a daemon is running when its control socket accepts a connection (verify.cli.mps_running: after `quit` the socket
# file stays, so its existence alone would skip starting a new daemon)
mps_start() { python3 -c "import sys; from verify.cli import mps_running; sys.exit(not mps_running())" \
  || nvidia-cuda-mps-control -d || echo "no MPS daemon"; }
mps_stop() { echo quit | nvidia-cuda-mps-control 2>/dev/null; }
# `pool_campaign NAME SECONDS [mla-verify args...]`: one mla-verify campaign through the pool (14 jobs, under the MPS
# daemon mps_start started) with a time limit of SECONDS, its JSON at $OUT/NAME.json and its output at /tmp/NAME.txt;
# its exit status, arguments and summary lines go to the log. The limit counts the pool's start (spawned workers'
# imports and compiles: up to ~100 s on a fresh machine) and, since the seventy-sixth session, stops the workers in
# their cases in flight (before, it was checked only as results came in); a limit shorter than the start leaves no
# case run (exit 5). Killed 120 s past the limit (a backstop).
pool_campaign() {
  local name=$1 seconds=$2; shift 2
  timeout $((seconds + 120)) python3 -m verify --jobs 14 --time-limit "$seconds" --json "$OUT/$name.json" "$@" \
    > "/tmp/$name.txt" 2>&1
  echo "=== $name: exit $?, $*" >> "$log"
  grep -E "cases|stopped|FAILED|Error" "/tmp/$name.txt" | head -5 >> "$log"
}
# `peer_campaigns SECONDS`: the peers' GPU step tests, then FlashInfer bf16 and fp8 and FlashMLA bf16 and fp8 campaigns
# (pool_campaign, SECONDS each, 300 cases at most), their JSON at $OUT/r_<backend>_<dtype>.json.
peer_campaigns() {
  step "GPU step tests of the peers"
  python3 -m pytest -q -m gpu tests/test_peers_gpu.py -k step 2>&1 | tail -3 | tee -a "$log"
  step "campaigns, $1 s each"
  pool_campaign r_flashinfer_bf16 "$1" --backend flashinfer --dtype bf16 --cases 300
  pool_campaign r_flashinfer_fp8 "$1" --backend flashinfer --dtype fp8 --cases 300
  pool_campaign r_flashmla_bf16 "$1" --backend flashmla --dtype bf16 --cases 300
  pool_campaign r_flashmla_fp8 "$1" --backend flashmla --dtype fp8 --cases 300
}
