"""The scripts of benchmarks/ imported as modules by the tests (benchmarks/ is not a package)."""

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """benchmarks/<name>.py as the module `name` (imported once; later calls return the same module)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
