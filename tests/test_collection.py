"""conftest.NEEDS_TRITON is exact: without triton, the modules it lists fail to import and every other test module
imports or skips itself with pytest.importorskip (so a machine without triton collects the rest)."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import NEEDS_TRITON

HERE = Path(__file__).resolve().parent

# a child without triton: a finder that refuses it, as a missing install would
CHILD = r"""
import importlib, importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
sys.path.insert(0, sys.argv[1])
result = {}
for module in sys.argv[2:]:
    try:
        importlib.import_module(module)
        result[module] = "ok"
    except ImportError as e:
        result[module] = f"ImportError: {e}"
    except BaseException as e:  # pytest.importorskip's Skipped: the module skips itself, with its reason
        if type(e).__name__ != "Skipped":
            raise
        result[module] = "skipped"
print(json.dumps(result))
"""


def test_needs_triton_lists_exactly_the_modules_that_import_it():
    modules = sorted(p.stem for p in HERE.glob("test_*.py"))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(HERE), *modules], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    listed = {Path(name).stem for name in NEEDS_TRITON}
    needs = {m for m, r in result.items() if r.startswith("ImportError")}
    assert needs == listed, f"import fails without triton: {sorted(needs)}; conftest.NEEDS_TRITON: {sorted(listed)}"
    assert all("triton" in result[m] for m in needs), {m: result[m] for m in needs}
