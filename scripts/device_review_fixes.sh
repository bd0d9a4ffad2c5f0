#!/usr/bin/env bash
# The fifty-eighth session's checks on one H200: the batch check's partial-prefix sibling and judged added requests
# (`batch.shared.added`, `batch.added`, `batch.mtp.added`), the `heads` distribution and its smoke case, the smoke
# prefix's dtype cases (fp16 q and cache; the other e4m3 format and an e5m2 cache), and the long cases' big split batch
# (264 requests split over 132 workers, one of 3 x 4096 tokens). Campaigns through one MPS daemon, each writing
# $OUT/r_<name>.json, and a table in $OUT/log.txt: failing checks, the added rows' largest err / bound, and the status
# of the heads, dtype and big-batch cases, and of the fifty-ninth session's smoke cases (96 heads, pages of 528, 12 MTP
# rows, fp8's kv_unit scales; seeds 24-28), and the sixtieth's nan.first check. docs/verification_log.md, "Sixtieth
# session, the review fixes on the H200".
# Two device tool calls (each within the 600 s a call may take; carry .whl, the peers' wheels):
#   bash scripts/device_review_fixes.sh [SECONDS] ours    our Triton backends, and the new mutants
#   bash scripts/device_review_fixes.sh [SECONDS] peers   FlashInfer and FlashMLA, and their GPU step tests
seconds=${1:-45}
group=${2:-ours}
source "$(dirname "$0")/device_env.sh" /tmp/mla_review_out
mps_start
if [ "$group" = ours ]; then
  step "campaigns, ${seconds} s each"
  pool_campaign r_triton_bf16 "$seconds" --backend triton --dtype bf16 --cases 300
  pool_campaign r_triton_fp8 "$seconds" --backend triton --dtype fp8 --cases 300
  pool_campaign r_invariant_bf16 "$seconds" --backend triton_invariant --dtype bf16 --cases 300
  pool_campaign r_prefix_first_pair 60 --impl verify.mutants:prefix_first_pair --dtype bf16 --cases 60
  pool_campaign r_head0_max 60 --impl verify.mutants:head0_max --dtype bf16 --cases 60
  pool_campaign r_dtype_unchecked 60 --impl verify.mutants:dtype_unchecked --dtype fp8 --cases 60
else
  peer_campaigns "$seconds"
fi
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
print("| campaign | cases (unsupported) | failed | failing checks | added rows: cases, max err/bound | heads case "
      "| dtype cases | big split batch | fifty-ninth's cases | nan.first: cases, failed | wall s |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "r_*.json"))):
    r = json.load(open(path))
    c = r["checks"]
    failing = sorted(k for k, v in c.items() if v.get("failed"))
    added = [c[k] for k in c if k.endswith(".added.out")]
    cell = f"{sum(a['cases'] for a in added)}, {max((a['max_err_over_bound'] or 0 for a in added), default=None)}"
    failed_cases = {json.dumps(f["case"], sort_keys=True) for f in r["failures"]}

    def state(pick):
        picked = [x for x in r["results"] if pick(x["case"])]
        return ", ".join(x["status"] + (f" ({x['unsupported'][:40]})" if x["unsupported"] else "") for x in picked) \
            or "not run"
    heads = state(lambda k: k["dist"] == "heads" and k["seed"] == 20)
    dtypes = state(lambda k: k["seed"] in (22, 23) and k["seq_lens"] == [300, 65, 0])
    big = state(lambda k: len(k["seq_lens"]) == 264)
    new = state(lambda k: k["seed"] in (24, 25, 26, 28) and len(k["seq_lens"]) <= 3)
    unsupported = sum(v if isinstance(v, int) else len(v) for v in r["unsupported"].values())
    print(f"| {os.path.basename(path)[2:-5]} | {r['cases']} ({unsupported}) | {r['failed']} | "
          f"{', '.join(failing[:6]) or '-'} | {cell} | {heads} | {dtypes} | {big} | {new} | "
          f"{c.get('nan.first', {}).get('cases')}, {c.get('nan.first', {}).get('failed')} | {r.get('seconds', 0):.1f} |")
PY
step done
