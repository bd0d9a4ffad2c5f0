#!/usr/bin/env bash
# The smoke prefix and the long cases (verify.strategies.long_cases, on by default on CUDA) through backends, in one
# device call (carry .whl for the peers): one pool campaign per backend and dtype (MPS, 14 jobs), the prefix, the
# long cases and EXTRA drawn cases, stopped by --time-limit SECONDS; $OUT/l_<backend>_<dtype>.json each, and in
# $OUT/log.txt each campaign's summary and each long case's status with its largest err / bound.
# Usage: scripts/device_long_cases.sh SECONDS EXTRA BACKEND:DTYPE...   (e.g. 60 50 triton:bf16 triton:fp8)
source "$(dirname "$0")/device_env.sh" /tmp/mla_long_out
seconds=$1 extra=$2; shift 2
mps_start
for pair in "$@"; do
  backend=${pair%%:*} dtype=${pair##*:}
  n=$(python3 -c "from verify.strategies import long_cases, smoke_cases as s; print(len(s('$dtype')) + len(long_cases('$dtype')) + $extra)")
  pool_campaign "l_${backend}_${dtype}" "$seconds" --backend "$backend" --dtype "$dtype" --cases "$n" --long on
done
mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "l_*.json"))):
    r = json.load(open(path))
    print(os.path.basename(path), "| cases", r.get("cases"), "| failed", len(r.get("failures", [])), "| unsupported",
          r.get("unsupported"), "| long", r.get("long"))
    for c in r["results"]:
        case = c.get("case", {})
        if max(case.get("seq_lens") or [0]) > 2**16 or case.get("heads", 0) * sum(case.get("q_lens") or []) > 2**16:
            print("   ", {k: case.get(k) for k in ("heads", "page_size", "q_dtype", "seed")}, len(case["seq_lens"]),
                  "requests:", c["status"], "| tier1.out", (c.get("err_over_bound") or {}).get("tier1.out"),
                  "| failing", sorted(k for k, v in (c.get("err_over_bound") or {}).items() if v is not None and v > 1))
PY
