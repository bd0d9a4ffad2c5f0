"""The scripts of benchmarks/ and scripts/ imported as modules by the tests (neither folder is a package)."""

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _module_in(folder: Path, name: str):
    """<folder>/<name>.py as the module `name` (imported once; later calls return the same module)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def benchmark_module(name: str):
    """benchmarks/<name>.py as the module `name`."""
    return _module_in(BENCHMARKS, name)


def script_module(name: str):
    """scripts/<name>.py as the module `name`."""
    return _module_in(ROOT / "scripts", name)
