#!/usr/bin/env bash
# The step check's decode step (verify.next_step.decode_layout: the same requests one plain decode step later, new
# tokens of weight about 1/2, `step.decode`) on one H200: the GPU step tests, then campaigns on every backend that runs
# there, through one MPS daemon, each writing $OUT/s_<name>.json, and a table of step, step.graph, step.replan and
# step.decode (cases, largest err / bound, refused) in $OUT/log.txt. Fifty-sixth session: docs/verification_log.md's
# "The step check's decode step on the H200".
# Two device tool calls (each within the 600 s a call may take; carry .whl, the peers' wheels):
#   bash scripts/device_step_check.sh [SECONDS] ours      the GPU step tests, our Triton backend, the step mutants
#   bash scripts/device_step_check.sh [SECONDS] peers     the peers' GPU step tests, FlashInfer and FlashMLA
seconds=${1:-50}
group=${2:-ours}
source "$(dirname "$0")/device_env.sh" /tmp/mla_step_out
if [ "$group" = ours ]; then
  step "GPU step tests"
  python3 -m pytest -q -m gpu tests/test_step_check.py 2>&1 | tail -3 | tee -a "$log"
else
  step "GPU step tests of the peers"
  python3 -m pytest -q -m gpu tests/test_peers_gpu.py -k step 2>&1 | tail -3 | tee -a "$log"
fi
mps_start
step "campaigns, ${seconds} s each"
if [ "$group" = ours ]; then
  pool_campaign s_triton_bf16 "$seconds" --backend triton --dtype bf16 --cases 300
  pool_campaign s_triton_fp8 "$seconds" --backend triton --dtype fp8 --cases 300
  pool_campaign s_fast_path_plan "$seconds" --impl verify.mutants:fast_path_plan --dtype bf16 --cases 100
  pool_campaign s_correct "$seconds" --impl verify.mutants:correct --dtype bf16 --cases 100
else
  pool_campaign s_flashinfer_bf16 "$seconds" --backend flashinfer --dtype bf16 --cases 300
  pool_campaign s_flashmla_bf16 "$seconds" --backend flashmla --dtype bf16 --cases 300
  pool_campaign s_flashmla_fp8 "$seconds" --backend flashmla --dtype fp8 --cases 300
fi
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
names = ("step", "step.graph", "step.replan.out", "step.decode.out", "step.decode.lse", "step.refused")
print("| campaign | cases | failed | " + " | ".join(f"{n}: cases (max)" for n in names) + " | wall s |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "s_*.json"))):
    r = json.load(open(path))
    c = r["checks"]
    def cell(name):
        entry = {**c.get(name, {})}
        if name == "step":  # bits kept, else step.out within the bound
            bound = c.get("step.out", {})
            return f"{entry.get('cases', 0)} bits, {bound.get('cases', 0)} bound"
        worst, failed = entry.get("max_err_over_bound"), entry.get("failed", 0)
        return f"{entry.get('cases', 0)}" + (f" ({worst:.3f})" if worst is not None else "") + \
            (f", {failed} failed" if failed else "")
    unsupported = sum(v if isinstance(v, int) else len(v) for v in r["unsupported"].values())
    print(f"| {os.path.basename(path)[2:-5]} | {r['cases']} ({unsupported} unsupported) | {r['failed']} | "
          + " | ".join(cell(n) for n in names) + f" | {r.get('seconds', 0):.1f} |")
PY
step done
