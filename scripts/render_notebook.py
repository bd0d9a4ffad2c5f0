"""Execute notebooks/fp8_error_analysis.ipynb headless and write its summary figure.

    python scripts/render_notebook.py                      # size ci, writes docs/fp8_error_analysis.png
    python scripts/render_notebook.py --size full          # on a GPU machine
    python scripts/render_notebook.py --executed /tmp/nb.ipynb   # also keep the executed notebook (not committed)

The committed notebook has no outputs; this script runs it in a fresh kernel (nbclient) with MLA_NB_SIZE and
MLA_NB_SUMMARY set, from the repository root.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "fp8_error_analysis.ipynb"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("ci", "full"), default="ci")
    p.add_argument("--summary", default=str(ROOT / "docs" / "fp8_error_analysis.png"), help="summary PNG path")
    p.add_argument("--executed", default=None, help="also write the executed notebook here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = p.parse_args(argv)

    os.environ["MLA_NB_SIZE"] = args.size  # the kernel inherits this process's environment
    os.environ["MLA_NB_SUMMARY"] = str(Path(args.summary).resolve())
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    resources = {"metadata": {"path": str(ROOT)}}  # run from the repository root
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", resources=resources)
    client.execute()
    print(f"executed {NOTEBOOK.name} (size {args.size}) in {time.perf_counter() - start:.1f} s; wrote {args.summary}")
    if args.executed:
        nbformat.write(nb, args.executed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
