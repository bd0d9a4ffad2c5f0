#!/usr/bin/env bash
# The batch check (verify.regrouped: the grown batch with its longer request, the shrunk one without every longest
# request, the mtp one without the largest q_len's requests or beside a request of one row more) on one H200: the GPU
# invariance test, then campaigns on every backend that runs there, through one MPS daemon, each writing
# $OUT/b_<name>.json, and a table of how many cases kept their bits and how many stayed within the bound (with the
# largest err / bound) for batch, batch.shrunk and batch.mtp, in $OUT/log.txt. Fifty-fourth session:
# docs/verification_log.md's "The batch check on every backend".
# Two device tool calls (each within the 600 s a call may take; carry .whl, the peers' wheels):
#   bash scripts/device_batch_check.sh [SECONDS] ours      the GPU invariance test, our two backends
#   bash scripts/device_batch_check.sh [SECONDS] peers     FlashInfer and FlashMLA
seconds=${1:-70}
group=${2:-ours}
source "$(dirname "$0")/device_env.sh" /tmp/mla_batch_out
if [ "$group" = ours ]; then
  step "GPU invariance test"
  python3 -m pytest -q tests/test_triton_gpu.py -k "decode_invariant_keeps" 2>&1 | tail -3 | tee -a "$log"
fi
mps_start
step "campaigns, ${seconds} s each"
if [ "$group" = ours ]; then
  pool_campaign b_invariant_bf16 "$seconds" --backend triton_invariant --dtype bf16 --cases 300
  pool_campaign b_invariant_fp8 "$seconds" --backend triton_invariant --dtype fp8 --cases 300
  pool_campaign b_triton_bf16 "$seconds" --backend triton --dtype bf16 --cases 300
  pool_campaign b_triton_fp8 "$seconds" --backend triton --dtype fp8 --cases 300
else
  pool_campaign b_flashinfer_bf16 "$seconds" --backend flashinfer --dtype bf16 --cases 300
  pool_campaign b_flashmla_bf16 "$seconds" --backend flashmla --dtype bf16 --cases 300
  pool_campaign b_flashmla_fp8 "$seconds" --backend flashmla --dtype fp8 --cases 300
fi
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
print("| campaign | cases | failed | batch: bits / bound (max) | batch.shrunk: bits / bound (max) "
      "| batch.mtp: bits / bound (max) | wall s |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "b_*.json"))):
    r = json.load(open(path))
    c = r["checks"]
    def cell(name):
        bits, bound = c.get(name, {}).get("cases", 0), c.get(name + ".out", {})
        refused = c.get(name + ".refused", {}).get("cases", 0)
        worst = bound.get("max_err_over_bound")
        return f"{bits} / {bound.get('cases', 0)}" + (f" ({worst:.3f})" if worst is not None else "") + \
            (f", {refused} refused" if refused else "")
    unsupported = sum(v if isinstance(v, int) else len(v) for v in r["unsupported"].values())
    print(f"| {os.path.basename(path)[2:-5]} | {r['cases']} ({unsupported} unsupported) | {r['failed']} "
          f"| {cell('batch')} | {cell('batch.shrunk')} | {cell('batch.mtp')} | {r.get('seconds', 0):.1f} |")
PY
step done
