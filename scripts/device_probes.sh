#!/usr/bin/env bash
# The probe checks on one H200 (carry .whl), in parts named by the first argument (a comma list; each part fits
# one device call with the others' time): tests = the GPU tests of the partials, rounding and layout checks (ours
# through the default dispatch, FlashInfer and FlashMLA); ours / peers = the default campaigns with every check (MPS,
# 14 jobs, the long cases on) of our kernels / of FlashInfer and FlashMLA; mutants = the bf16_partials,
# ignores_strides, uint16_positions and merge_order_varies mutants' campaigns; fp32partials =
# FlashInfer declared with fp32 partials (tests/peer_plugins.py); flashmla = FlashMLA's bf16 campaign three times
# over (the forty-seventh session saw its far check fail 4 of 200 cases once, in a call where it had passed twice);
# step = the step check's GPU tests (CUDA-graph capture; ours, FlashInfer's and FlashMLA's steps) and the correct /
# stale_plan / realloc_workspace mutants' campaigns.
# Writes log.txt and
# campaigns.json (per campaign: cases, failed, unsupported, wall, and per check cases / failed / median / max
# err/bound) to $OUT.
parts=",${1:-tests,ours,peers},"
source "$(dirname "$0")/device_env.sh" /tmp/mla_probes_out
reports=/tmp/mla_probes_reports
mkdir -p "$reports"

[[ $parts == *,step,* ]] && step "GPU tests: the step check" && timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_step_check.py tests/test_peers_gpu.py -k "cuda or graph_step" 2>&1 | tail -12 | tee -a "$log"
[[ $parts == *,tests,* ]] && step "GPU tests: the partials, rounding and layout checks" && timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_gpu.py tests/test_peers_gpu.py \
  -k "partials or rounding_check or strided" 2>&1 | tail -12 | tee -a "$log"

mps_start  # the campaigns run in spawned worker processes sharing the GPU
# the GPU's memory in use every 0.5 s while the campaigns run (MiB; the summary prints the peak): the far and step
# checks hand their memory back when they end, so 14 jobs stay far below the H200's 139 GB
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_memory_mib.txt" 2>/dev/null &
sampler=$!
verify() {  # name, then mla-verify's arguments
  local name=$1; shift
  step "mla-verify $* ($name)"
  timeout 90 python3 -m verify "$@" --jobs 14 --time-limit 45 --json "$reports/$name.json" 2>&1 | tail -24 | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
}
if [[ $parts == *,ours,* ]]; then
verify triton_bf16 --backend triton --dtype bf16 --cases 200 --seed 1
verify triton_fp8 --backend triton --dtype fp8 --cases 200
verify seesaw_fp8_h128 --backend seesaw --dtype fp8 --cases 200 --heads 128
verify gluon_fp8 --backend gluon_fp8 --dtype fp8 --cases 200
fi
if [[ $parts == *,peers,* ]]; then
verify flashinfer_bf16 --backend flashinfer --dtype bf16 --cases 200
verify flashinfer_fp8 --backend flashinfer --dtype fp8 --cases 200
verify flashmla_bf16 --backend flashmla --dtype bf16 --cases 200
verify flashmla_fp8 --backend flashmla --dtype fp8 --cases 200
fi
if [[ $parts == *,flashmla,* ]]; then
for round in 1 2 3; do verify "flashmla_bf16_round$round" --backend flashmla --dtype bf16 --cases 200; done
fi
if [[ $parts == *,step,* ]]; then
verify mutant_correct_bf16 --impl verify.mutants:correct --dtype bf16 --cases 200
verify mutant_stale_plan --impl verify.mutants:stale_plan --dtype bf16 --cases 200
verify mutant_realloc_workspace --impl verify.mutants:realloc_workspace --dtype bf16 --cases 200
fi
if [[ $parts == *,mutants,* ]]; then
verify mutant_bf16_partials --impl verify.mutants:bf16_partials --dtype bf16 --cases 200
verify mutant_ignores_strides --impl verify.mutants:ignores_strides --dtype bf16 --cases 200
verify mutant_uint16_positions --impl verify.mutants:uint16_positions --dtype bf16 --cases 200
verify mutant_merge_order_varies --impl verify.mutants:merge_order_varies --dtype bf16 --cases 200
fi
if [[ $parts == *,fp32partials,* ]]; then
verify flashinfer_fp32_partials_bf16 --impl tests.peer_plugins:flashinfer_fp32_partials --dtype bf16 --cases 200
verify flashinfer_fp32_partials_fp8 --impl tests.peer_plugins:flashinfer_fp32_partials --dtype fp8 --cases 200
fi
mps_stop
kill "$sampler" 2>/dev/null

step "summary"
python3 - "$reports" "$OUT/campaigns.json" <<'EOF' 2>&1 | tee -a "$log"
import json, pathlib, sys
summary = {}
def brief(check):  # a check's counts and ratios, without its worst case's text (kept in campaigns.json)
    return check and {f: v for f, v in check.items() if not f.startswith("worst")}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    summary[path.stem] = {"cases": r["cases"], "failed": r["failed"], "unsupported": r["unsupported"],
                          "seconds": r["seconds"], "warnings": r["warnings"], "long": r.get("long"),
                          "failures": [(f["describe"], [f"{c['name']}: {c['detail'][:400]}" for c in f["checks"]])
                                       for f in r["failures"]][:12],
                          "checks": {k: {f: v.get(f) for f in ("cases", "failed", "median_err_over_bound",
                                                               "max_err_over_bound", "worst_repro", "worst_detail")}
                                     for k, v in r["checks"].items()}}
    c = summary[path.stem]["checks"]
    print(path.stem, r["cases"], "failed", r["failed"], *(f"{k} {brief(c.get(k))}" for k in (
        "partials.out", "rounding.out", "layout", "layout.out", "layout.refused", "repeat", "repeat.out", "step",
        "step.graph", "step.replan.out", "step.refused") if k in c))
pathlib.Path(sys.argv[2]).write_text(json.dumps(summary, indent=1))
samples = [int(x) for x in (pathlib.Path(sys.argv[2]).parent / "gpu_memory_mib.txt").read_text().split() if x.isdigit()]
print("GPU memory in use during the campaigns: peak", f"{max(samples)} MiB over {len(samples)} samples" if samples
      else "not sampled (no nvidia-smi)")
EOF
step done
