"""The scheduling control bits of a Hopper kernel's SASS (cuobjdump -sass, which prints each 128-bit instruction as two
64-bit words): per instruction its stall cycles, the dependency barrier (scoreboard, 0-5) that it sets
when its result is written (wr) and when its sources have been read (rd), the barriers it waits for (wait), and its
operand-reuse flags. What the listing does not print: which loads a wait waits for.

    python scripts/sass_barriers.py /tmp/seesaw.sass --opcode LDG                 # write barriers of the loads
    python scripts/sass_barriers.py /tmp/seesaw.sass --from 0x7800 --to 0x9f00    # a range, decoded line by line

The bits sit in the high word (bits 105-125 of the instruction): stall 41-44, wr 46-48, rd 49-51 (7: none), wait mask
52-57, reuse 58-61 (operands a, b, c, d); bit 45 (yield) is left out. In the offline sm_90a build of the fp8 seesaw
(scripts/offline_compile.py) the `.reuse` flags that cuobjdump prints agree with bits 58-61 at all 5488 instructions,
and each mbarrier try-wait (wr 0) is followed by a branch that waits on barrier 0.
A wait is for the barrier's count to reach zero, so a consumer of one load on a barrier shared by many loads waits for
all of them (the thirty-fourth, thirty-sixth and thirty-eighth sessions: 71 of the fp8 loader's 72 `LDG.E.64` per pair
on barrier 5; docs/perf_history.md).
"""

import argparse
import re
from collections import Counter

_PAIR = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/\s*\n\s*/\* 0x([0-9a-f]{16}) \*/")
NONE = 7  # barrier field value: no barrier


def controls(sass: str, lo: int = 0, hi: int | None = None) -> list[dict]:
    """[{address, text, stall, wr, rd, wait, reuse}, ...] per instruction of a cuobjdump -sass listing at addresses
    lo..hi (hi None: to the end): wr / rd the barrier index or None, wait the sorted barrier indices waited for, reuse
    the operand letters flagged."""
    out = []
    for m in _PAIR.finditer(sass):
        address = int(m.group(1), 16)
        if address < lo or (hi is not None and address > hi):
            continue
        word = int(m.group(4), 16)
        wr, rd = (word >> 46) & 7, (word >> 49) & 7
        out.append({"address": address, "text": " ".join(m.group(2).split()),
                    "stall": (word >> 41) & 0xF,
                    "wr": None if wr == NONE else wr, "rd": None if rd == NONE else rd,
                    "wait": [b for b in range(6) if (word >> (52 + b)) & 1],
                    "reuse": "".join(c for b, c in enumerate("abcd") if (word >> (58 + b)) & 1)})
    return out


def opcode(text: str) -> str:
    """The opcode of an instruction's text, its predicate removed: '@!P5 LDG.E.64 R52, ...' -> 'LDG.E.64'."""
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def write_barriers(sass: str, prefix: str, lo: int = 0, hi: int | None = None) -> Counter:
    """{barrier (None: none): count} over the instructions whose opcode starts with prefix, addresses lo..hi."""
    return Counter(c["wr"] for c in controls(sass, lo, hi) if opcode(c["text"]).startswith(prefix))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sass")
    p.add_argument("--from", dest="lo", type=lambda s: int(s, 16), default=0, help="first address (hex)")
    p.add_argument("--to", dest="hi", type=lambda s: int(s, 16), default=None, help="last address (hex)")
    p.add_argument("--opcode", help="only count the write barriers of opcodes starting with this (e.g. LDG)")
    args = p.parse_args(argv)
    with open(args.sass) as f:
        sass = f.read()
    if args.opcode:
        counts = write_barriers(sass, args.opcode, args.lo, args.hi)
        print({("none" if b is None else b): n for b, n in sorted(counts.items(), key=lambda kv: (kv[0] is None,
                                                                                                kv[0] or 0))})
        return
    bar = lambda b: "-" if b is None else str(b)  # noqa: E731
    for c in controls(sass, args.lo, args.hi):
        print(f"{c['address']:6x} stall {c['stall']:2d} wr {bar(c['wr'])} rd {bar(c['rd'])} "
              f"wait {''.join(map(str, c['wait'])):6s} {c['text']}")


if __name__ == "__main__":
    main()
