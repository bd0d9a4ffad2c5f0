#!/usr/bin/env bash
# The smoke prefix's 260-request batch and the far check past page id 2^16 (fifty-sixth session) on one H200: the GPU
# far tests, then the smoke prefix (with the long cases, every check, far on) on every backend that runs there and the
# two mutants they are for, through one MPS daemon, each writing $OUT/g_<name>.json; a table of cases, failures, the big
# batch's and the far check's results in $OUT/log.txt. docs/verification_log.md's "The 260-request smoke case and the
# far check past page id 2^16".
# One device tool call (carry .whl, the peers' wheels): bash scripts/device_big_far.sh
source "$(dirname "$0")/device_env.sh" /tmp/mla_big_out
step "GPU far tests"
python3 -m pytest -q tests/test_triton_gpu.py -k "pages_past_2_31" 2>&1 | tail -2 | tee -a "$log"
mps_start
step "smoke prefix campaigns"
pool_campaign g_triton_bf16 280 --backend triton --dtype bf16 --cases 15
pool_campaign g_triton_fp8 280 --backend triton --dtype fp8 --cases 17
pool_campaign g_invariant_bf16 280 --backend triton_invariant --dtype bf16 --cases 15
pool_campaign g_flashinfer_bf16 280 --backend flashinfer --dtype bf16 --cases 15
pool_campaign g_flashmla_bf16 280 --backend flashmla --dtype bf16 --cases 15
pool_campaign g_flashmla_fp8 280 --backend flashmla --dtype fp8 --cases 17
pool_campaign g_request_index_8bit 280 --impl verify.mutants:request_index_8bit --dtype bf16 --cases 15
pool_campaign g_page_ids_16bit 280 --impl verify.mutants:page_ids_16bit --dtype bf16 --cases 15
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
print("| campaign | cases | failed | unsupported | the 260-request case | far: cases (failed) | wall s |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "g_*.json"))):
    r = json.load(open(path))
    big = [x for x in r["results"] if len(x["case"]["seq_lens"]) == 260]
    state = big[0]["status"] if big else "not run"
    if big and big[0]["err_over_bound"].get("tier1.out") is not None:
        state += f", tier1.out {big[0]['err_over_bound']['tier1.out']:.3f}"
    failed = [[c["name"] for c in f["checks"]] for f in r["failures"] if len(f["case"]["seq_lens"]) == 260]
    if failed:
        state += " (" + ", ".join(failed[0][:4]) + ")"
    far = {**r["checks"].get("far", {})}
    far_out = r["checks"].get("far.out", {})
    unsupported = sum(v if isinstance(v, int) else len(v) for v in r["unsupported"].values())
    far_failed = far.get("failed", 0) + far_out.get("failed", 0)
    print(f"| {os.path.basename(path)[2:-5]} | {r['cases']} | {r['failed']} | {unsupported} | {state} | "
          f"{far.get('cases', 0)} bits + {far_out.get('cases', 0)} bound ({far_failed} failed) "
          f"| {r.get('seconds', 0):.1f} |")
PY
step done
