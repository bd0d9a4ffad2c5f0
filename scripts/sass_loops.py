"""The MMA loops of a Hopper kernel's SASS (cuobjdump -sass): for each innermost loop that issues at least MIN_MMA
wgmma instructions (HGMMA / QGMMA), its static instruction count and its HGMMA, QGMMA, BAR, SYNCS, STL and LDL counts
(the last two: spill traffic inside the loop).

    python scripts/sass_loops.py /tmp/seesaw.sass                 # from scripts/offline_compile.py --sass
    cuobjdump -sass -fun NAME peer.so > peer.sass && python scripts/sass_loops.py peer.sass

A loop is a predicated backward branch (`@P0 BRA <earlier address>`) and the code between its target and itself;
the unconditional backward branches of mbarrier-wait retry stubs (placed after the kernel's end) are not loops.
Static counts: a loop's cold paths (e.g. a last tile's masking) are counted as if they ran. The thirty-second session
compared our seesaw with FlashMLA's bf16 decode this way (docs/perf_history.md): 44 HGMMA per loop in both, 4 BAR in
FlashMLA's loops.
"""

import re
import sys
from collections import Counter

MIN_MMA = 8
_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.M)
COUNTED = ("HGMMA", "QGMMA", "BAR", "SYNCS", "STL", "LDL")  # STL / LDL: spilled registers stored / reloaded


def instructions(sass: str) -> list[tuple[int, bool, str, str]]:
    """(address, predicated, opcode with its modifiers, operands) of each instruction of a SASS listing."""
    return [(int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]


def mma_loops(sass: str, min_mma: int = MIN_MMA) -> list[dict]:
    """[{instructions, HGMMA, QGMMA, BAR, SYNCS, STL, LDL}, ...] of the innermost loops with >= min_mma wgmmas, in
    address order."""
    ins = [(address, predicated, op.split(".")[0], args) for address, predicated, op, args in instructions(sass)]
    index = {address: i for i, (address, *_) in enumerate(ins)}
    loops = []
    for i, (address, predicated, op, args) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" and predicated else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            j = index[int(target.group(1), 16)]
            ops = Counter(o for _, _, o, _ in ins[j:i + 1])
            if ops["HGMMA"] + ops["QGMMA"] >= min_mma:
                loops.append((j, i, ops))
    inner = [(j, i, ops) for j, i, ops in loops
             if not any((j2, i2) != (j, i) and j <= j2 and i2 <= i for j2, i2, _ in loops)]
    return [{"instructions": i - j + 1, **{k: ops[k] for k in COUNTED}} for j, i, ops in sorted(inner)]


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit(__doc__)
    for path in paths:
        with open(path) as f:
            print(path, mma_loops(f.read()))


if __name__ == "__main__":
    main(sys.argv[1:])
