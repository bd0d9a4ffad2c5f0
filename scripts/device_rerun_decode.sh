#!/usr/bin/env bash
# The fifty-seventh session's checks on one H200: the rerun check's plain decode step (`rerun.decode`: the eager kernel
# called once more after the same requests grew by their q_len), the batch check's shared batch (`batch.shared`: the
# case between two siblings of its longest request on its very pages, other q), the MiniCPM3-shaped smoke case (latent
# 256, rope 32, 40 heads) and a pool worker the kernel kills, named by its case on CUDA (spawned workers). Campaigns
# through one MPS daemon, each writing $OUT/r_<name>.json, and a table of rerun.decode (cases, median and largest err /
# bound), batch.shared (bits kept / within the bound) and of the MiniCPM3 case's result in $OUT/log.txt.
# docs/verification_log.md's "rerun.decode, batch.shared and the MiniCPM3 case".
# Two device tool calls (each within the 600 s a call may take; carry .whl, the peers' wheels):
#   bash scripts/device_rerun_decode.sh [SECONDS] ours    the crash naming, our Triton backends, the new mutants
#   bash scripts/device_rerun_decode.sh [SECONDS] peers   FlashInfer and FlashMLA, and their GPU step tests
seconds=${1:-45}
group=${2:-ours}
source "$(dirname "$0")/device_env.sh" /tmp/mla_rerun_out
mps_start
if [ "$group" = ours ]; then
  step "a kernel that kills its worker on pages of 16, spawned CUDA workers"
  timeout 300 python3 -m verify --impl tests.test_cli:dies_on_page_16 --device cuda --jobs 4 --cases 20 \
    --max-seq-len 128 --json "$OUT/crash.json" > /tmp/crash.txt 2>&1
  echo "exit $?" | tee -a "$log"
  python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['stopped']; print(s['reason']); print(s['repro'])" \
    "$OUT/crash.json" 2>&1 | tee -a "$log"
  step "campaigns, ${seconds} s each"
  pool_campaign r_triton_bf16 "$seconds" --backend triton --dtype bf16 --cases 300
  pool_campaign r_triton_fp8 "$seconds" --backend triton --dtype fp8 --cases 300
  pool_campaign r_invariant_bf16 "$seconds" --backend triton_invariant --dtype bf16 --cases 300
  pool_campaign r_eager_fast_path "$seconds" --impl verify.mutants:eager_fast_path --dtype bf16 --cases 100
  pool_campaign r_rope_width_64 "$seconds" --impl verify.mutants:rope_width_64 --dtype bf16 --cases 100
  pool_campaign r_full_tile_fast_path "$seconds" --impl verify.mutants:full_tile_fast_path --dtype bf16 --cases 100
  pool_campaign r_shared_page_reuse "$seconds" --impl verify.mutants:shared_page_reuse --dtype bf16 --cases 100
else
  peer_campaigns "$seconds"
fi
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
print("| campaign | cases (unsupported) | failed | rerun.decode.out: cases, median, max | rerun.out max "
      "| batch.shared: bits / bound (max) | the MiniCPM3 case | wall s |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "r_*.json"))):
    r = json.load(open(path))
    c = r["checks"]
    dec, rerun = c.get("rerun.decode.out", {}), c.get("rerun.out", {})
    cell = f"{dec.get('cases', 0)}, {dec.get('median_err_over_bound')}, {dec.get('max_err_over_bound')}"
    cell += f", {dec['failed']} failed" if dec.get("failed") else ""
    minicpm3 = [x for x in r["results"] if x["case"]["kv_lora_rank"] == 256]
    state = "not run"
    if minicpm3:
        x = minicpm3[0]
        state = x["status"] + (f" ({x['unsupported']})" if x["unsupported"] else "")
        if x["err_over_bound"].get("tier1.out") is not None:
            state += f", tier1.out {x['err_over_bound']['tier1.out']}"
        failed = [f["checks"] for f in r["failures"] if f["case"]["kv_lora_rank"] == 256]
        if failed:
            state += " (" + ", ".join(ch["name"] for ch in failed[0][:4]) + ")"
    shared, shared_out = c.get("batch.shared", {}), c.get("batch.shared.out", {})
    sh = f"{shared.get('cases', 0)} / {shared_out.get('cases', 0)} ({shared_out.get('max_err_over_bound')})"
    failed_shared = shared.get("failed", 0) + shared_out.get("failed", 0)
    sh += f", {failed_shared} failed" if failed_shared else ""
    unsupported = sum(v if isinstance(v, int) else len(v) for v in r["unsupported"].values())
    print(f"| {os.path.basename(path)[2:-5]} | {r['cases']} ({unsupported}) | {r['failed']} | {cell} | "
          f"{rerun.get('max_err_over_bound')} | {sh} | {state} | {r.get('seconds', 0):.1f} |")
PY
step done
