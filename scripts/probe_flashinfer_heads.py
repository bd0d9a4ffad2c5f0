"""Which head counts and query lengths FlashInfer's MLA decode (FA3, flashinfer-python 0.6.14) gets right: one
case per (heads, q_lens, dtype) through the verifier's checks (far off), printing the failed checks and the tier-1
out err/bound. Device tool call (carry .whl): python3 scripts/probe_flashinfer_heads.py"""

import itertools
import json
import sys

from verify.cases import Case
from verify.checks import run_case
from verify.kernels import from_backend

kernel = from_backend("flashinfer")
rows = []
for dtype, heads, q_lens in itertools.product(("bf16", "fp8"), (5, 8, 16, 20, 24, 32, 40, 48, 64, 80, 128),
                                              ((1, 1), (2, 1), (1, 3), (4, 4))):
    case = Case(seq_lens=(401, 150), q_lens=q_lens, heads=heads, page_size=16, kv_dtype=dtype, num_workers=8,
                dist="gauss1", seed=heads)
    r = run_case(case, kernel, "cuda", far=False)
    checks = {c.name: c for c in r.checks}
    t1 = checks.get("tier1.out")
    row = {"dtype": dtype, "heads": heads, "q_lens": q_lens, "status": r.status,
           "failed": [c.name for c in r.failed], "tier1.out": t1.err_over_bound if t1 else None,
           "unsupported": r.unsupported}
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout, indent=1)
