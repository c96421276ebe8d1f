"""One row per case and tool from the joined logs of `SANITIZE_PER_CASE=1 scripts/sanitize.sh`, then the
racecheck sites: every (access, access) pair of source lines it reported, with its hazard count, and the
text of those lines where the generated modules can be found (mlagen's cache, on the machine that ran).

    python benchmarks/sanitize_summary.py OUT/sanitize-plain.log OUT/sanitize-racecheck.log ...
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

HEADER = re.compile(r"^### case: (?P<args>.*) \| tool (?P<tool>\S+) \| exit (?P<rc>-?\d+) \| (?P<secs>\d+) s$")
RESULT = re.compile(r"^(san-\S+)\s+(\S+)\s+(.+?)\s+(PASS|FAIL.*)$")
RACE_HEAD = re.compile(r"^========= (Error|Warning): Race reported between (\w+) access at (\S+) in (\S+?):(\d+)")
RACE_AND = re.compile(r"^=========\s+and (\w+) access at (\S+) in (\S+?):(\d+) \[(\d+) hazards\]")
SUMMARY = re.compile(
    r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: \d+ hazards displayed \(\d+ errors, \d+ warnings\))"
)


def parse(path: str):
    """(tool, case args, exit, seconds, results, summary, {(read site, write site, kind): hazards})."""
    cases = []
    current = None
    first_access = None
    for line in Path(path).read_text(errors="replace").splitlines():
        head = HEADER.match(line)
        if head:
            current = dict(head.groupdict(), results=[], summary="", sites=collections.Counter())
            cases.append(current)
            continue
        if current is None:
            continue
        result = RESULT.match(line)
        if result:
            current["results"].append(result.group(4).split()[0])
        summary = SUMMARY.search(line)
        if summary:
            current["summary"] = summary.group(1)
        race = RACE_HEAD.match(line)
        if race:
            first_access = (race.group(1), race.group(2), f"{race.group(4)}:{race.group(5)}")
            continue
        other = RACE_AND.match(line)
        if other and first_access:
            kind, access, site = first_access
            pair = (f"{access} {site}", f"{other.group(1)} {other.group(3)}:{other.group(4)}", kind)
            current["sites"][pair] += int(other.group(5))
    return cases


def _sources() -> dict[str, Path]:
    """Generated module file name -> path, for the specs of sanitize_cases (empty where it cannot load)."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sanitize_cases import SPECS

        from mlagen_compiler import load, spec_from_dict
    except Exception:  # no torch / mlagen here: sites without their text
        return {}
    found = {}
    for fields in SPECS:
        try:
            spec = spec_from_dict(
                dict(qk_nope_head_dim=128, v_head_dim=128, dtype="bfloat16", kernels=["decode", "prefill"], **fields)
            )
            path = Path(load(spec).__file__)
            found[path.name] = path
        except Exception:
            continue
    return found


def main(paths: list[str]) -> int:
    rows = []
    all_sites = collections.Counter()
    for path in paths:
        for case in parse(path):
            hazards = sum(case["sites"].values())
            results = ",".join(case["results"]) or "-"
            rows.append((case["args"], case["tool"], case["rc"], case["secs"], results, case["summary"], hazards))
            all_sites.update(case["sites"])
    print("| case | tool | exit | s | result | sanitizer summary | racecheck hazards |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for args, tool, rc, secs, results, summary, hazards in rows:
        verdict = "timeout" if rc in ("124", "137") else rc
        print(f"| {args} | {tool} | {verdict} | {secs} | {results} | {summary or '-'} | {hazards or '-'} |")
    if all_sites:
        sources = _sources()
        print("\nracecheck sites (all cases): hazards, first access, other access, severity")
        for (first, other, kind), count in all_sites.most_common():
            print(f"  {count:>8}  {first:<32} {other:<32} {kind}")
        lines = sorted({site.split(" ", 1)[1] for pair in all_sites for site in pair[:2]})
        print("\nsource of those lines:")
        for site in lines:
            name, number = site.rsplit(":", 1)
            path = sources.get(name)
            text = path.read_text().splitlines()[int(number) - 1].strip() if path else "(module not found here)"
            print(f"  {site:<24} {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
