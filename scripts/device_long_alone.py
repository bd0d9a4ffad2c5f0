"""The long cases alone (verify.strategies.long_cases, from index FIRST on) through backends on CUDA, every check, in
one process: a line per case (status, seconds, tier1.out err / bound, failing checks) and $OUT/long_alone.json.
Usage: python3 scripts/device_long_alone.py BACKEND:DTYPE:FIRST...  (a device call; source scripts/device_env.sh
first for the peers' carried wheels)"""

import json
import os
import sys
import time

from verify.checks import run_case
from verify.kernels import from_backend
from verify.strategies import long_cases

rows = []
for spec in sys.argv[1:]:
    backend, dtype, first = spec.split(":")
    kernel = from_backend(backend)
    for case in long_cases(dtype)[int(first):]:
        t0 = time.perf_counter()
        r = run_case(case, kernel, "cuda")
        failing = sorted(c.name for c in r.checks if not c.ok)
        tier1 = next((c.err_over_bound for c in r.checks if c.name == "tier1.out"), None)
        row = dict(backend=backend, dtype=dtype, requests=len(case.seq_lens), heads=case.heads,
                   page_size=case.page_size, q_dtype=case.q_dtype, status=r.status, tier1_out=tier1,
                   failing=failing, unsupported=r.unsupported, seconds=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)
        if failing:
            print(r.describe()[:3000], flush=True)
        rows.append(row)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "long_alone.json"), "w"), indent=1)
