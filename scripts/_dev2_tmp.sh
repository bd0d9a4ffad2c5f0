source scripts/device_env.sh /tmp/o2
mps_start
step "peer step tests, fp8"
python3 -m pytest -q -m gpu tests/test_peers_gpu.py -k "step and fp8" -x 2>&1 | tail -40 | cut -c1-400 | tee -a "$log"
step campaigns
pool_campaign r_triton_bf16 40 --backend triton --dtype bf16 --cases 300
pool_campaign r_triton_fp8 35 --backend triton --dtype fp8 --cases 300
pool_campaign r_seesaw_bf16 35 --backend seesaw --dtype bf16 --cases 300
pool_campaign r_gluon_fp8 35 --backend gluon_fp8 --dtype fp8 --cases 300
pool_campaign r_flashmla_fp8 30 --backend flashmla --dtype fp8 --cases 300
pool_campaign r_flashmla_bf16 30 --backend flashmla --dtype bf16 --cases 300

mps_stop
python3 - "$OUT" <<'PY' | tee -a "$log"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "r_*.json"))):
    r = json.load(open(path))
    failing = sorted(k for k, v in r["checks"].items() if v.get("failed"))
    t1 = r["checks"].get("tier1.out", {})
    print(os.path.basename(path), r["cases"], "failed", r["failed"], failing[:6], "unsupported", r["unsupported"],
          "tier1.out", t1.get("median_err_over_bound"), t1.get("max_err_over_bound"), "far", r["checks"].get("far", {}).get("cases"), "nan.first", r["checks"].get("nan.first", {}).get("cases"),
          r["warnings"])
    for f in r["failures"][:3]:
        print("  FAILED", f["describe"], [(c["name"], c.get("detail", "")[:300]) for c in f["checks"][:2]])
PY
step done
