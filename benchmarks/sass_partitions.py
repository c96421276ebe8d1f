"""Where a warp-specialised kernel spends its instructions, spills and stalls, partition by partition (dev
tool; runs anywhere, reads files).

Input: the per-instruction table of one launch that Nsight Compute prints from a report taken with the
SourceCounters section, e.g.

    ncu --section SourceCounters --kernel-name regex:gluon --launch-count 1 -o rep python ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/sass_partitions.py src.csv [other.csv ...] [--top 12]

A partition's code starts at its `USETMAXREG` (the register count each partition of gl.warp_specialize
sets) and runs to the next one in address order, which is how ptxas lays out the partitions' bodies; the
lines before the first belong to the kernel's prologue. Per partition: warp instructions executed, local
loads and stores executed (spills: LDL / STL) and the L2 sectors they cost, global loads, warpgroup MMAs, and
the stall samples with their three largest reasons; then the hottest spill instructions.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Partition:
    name: str
    instructions: int = 0
    executed: int = 0
    spill_loads: int = 0
    spill_stores: int = 0
    local_sectors: int = 0
    global_loads: int = 0
    mmas: int = 0
    samples: int = 0
    stalls: Counter = field(default_factory=Counter)
    #: (stall samples, instruction, its largest stall reason) of every instruction
    stalled: list = field(default_factory=list)


def _number(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(float(text)) if text and text not in ("-", "n/a") else 0


def read_rows(path: Path) -> list[dict[str, str]]:
    """The instruction rows of ncu's source-page CSV (the first line names the kernel; the header follows)."""
    with path.open(newline="") as handle:
        lines = handle.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(lines[start:]))


def partitions(rows: list[dict[str, str]]) -> tuple[list[Partition], list[tuple[int, str, str, dict]]]:
    """Rows grouped by partition, and (executed, partition, instruction, row) of every local load / store."""
    stall_columns = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    current = Partition("prologue")
    parts = [current]
    spills = []
    for row in rows:
        text = row["Source"].strip()
        maxnreg = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text)
        if maxnreg:
            current = Partition(f"{maxnreg.group(1).lower()} {int(maxnreg.group(2), 16)} regs @{row['Address'][-5:]}")
            parts.append(current)
        executed = _number(row["Instructions Executed"])
        current.instructions += 1
        current.executed += executed
        opcode = text.split()[0] if text else ""
        if opcode.startswith("@"):
            opcode = text.split()[1]
        if opcode.startswith(("LDL", "STL")):
            if opcode.startswith("LDL"):
                current.spill_loads += executed
            else:
                current.spill_stores += executed
            spills.append((executed, current.name, text, row))
        current.local_sectors += _number(row.get("L2 Theoretical Sectors Local", "0"))
        if opcode.startswith("LDG"):
            current.global_loads += executed
        if opcode.startswith("HGMMA"):
            current.mmas += executed
        samples = _number(row["Warp Stall Sampling (All Samples)"])
        current.samples += samples
        reasons = Counter({column[len("stall_") :]: _number(row[column]) for column in stall_columns})
        current.stalls.update(reasons)
        if samples:
            current.stalled.append((samples, text, reasons.most_common(1)[0][0] if reasons else ""))
    return [p for p in parts if p.instructions], spills


def report(path: Path, top: int, stalled: int = 0) -> None:
    parts, spills = partitions(read_rows(path))
    total_samples = sum(p.samples for p in parts) or 1
    print(f"\n## {path}\n")
    print(
        "| partition | SASS lines | warp instr. executed | LDL executed | STL executed | local L2 sectors | "
        "LDG executed | HGMMA executed | stall samples | top stall reasons |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in parts:
        reasons = ", ".join(f"{name} {count / (p.samples or 1):.0%}" for name, count in p.stalls.most_common(5))
        print(
            f"| {p.name} | {p.instructions} | {p.executed:,} | {p.spill_loads:,} | {p.spill_stores:,} | "
            f"{p.local_sectors:,} | {p.global_loads:,} | {p.mmas:,} | {p.samples / total_samples:.0%} | {reasons} |"
        )
    print(f"\nhottest local loads / stores (of {len(spills)}):\n")
    print("| executed | partition | instruction | stall samples | L2 sectors |\n|---|---|---|---|---|")
    for executed, name, text, row in sorted(spills, key=lambda s: -s[0])[:top]:
        print(
            f"| {executed:,} | {name} | `{text}` | {row['Warp Stall Sampling (All Samples)']} | "
            f"{row.get('L2 Theoretical Sectors Local', '')} |"
        )
    for p in parts:
        if stalled and p.samples >= 0.1 * total_samples:
            print(f"\nmost stalled instructions of {p.name} (of {p.samples:,} samples):\n")
            print("| samples | instruction | largest reason |\n|---|---|---|")
            for samples, text, reason in sorted(p.stalled, key=lambda s: -s[0])[:stalled]:
                print(f"| {samples:,} | `{text}` | {reason} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12, help="hottest spill instructions listed")
    parser.add_argument("--stalled", type=int, default=0, help="most stalled instructions of each busy partition")
    args = parser.parse_args(argv)
    for path in args.csv:
        report(path, args.top, args.stalled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
