"""Every kernel once on shapes that cross page and tile edges, with Sq > 1 and empty sequences: the
workload `scripts/sanitize.sh` runs under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

Results are also checked against the reference, so a run that the sanitizer passes is a correct run.
Usage: python benchmarks/sanitize_cases.py [--backends triton,gluon] [--merges fused,kernel] [--specs A,B]
       [--kernels decode,prefill,cache_write] [--cases 0,1] [--list]
--list prints the arguments of each selected case on its own line, for one process per case (sanitize.sh
SANITIZE_PER_CASE=1: a slow tool then times out one case, not the rest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlagen_compiler import load, spec_from_dict  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402
from mlagen_compiler.verify import (  # noqa: E402
    CacheWriteCase,
    DecodeCase,
    PrefillCase,
    run_cache_write_case,
    run_decode_case,
    run_prefill_case,
)

FP8 = "float8_e4m3fn"
#: (spec fields, decode cases): small pages gather, page 64 takes TMA boxes, Dc 256 is Mistral-Small-4's;
#: fp8 caches on both backends (the Gluon decode converts them in its producer)
SPECS = [
    dict(name="san-page1", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, page_size=1),
    dict(name="san-page16", num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16),
    dict(name="san-page64", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64),
    dict(name="san-dc256", num_heads=32, kv_lora_rank=256, qk_rope_head_dim=64, page_size=64),
    dict(name="san-fp8-page1", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, page_size=1, cache_dtype=FP8),
    dict(name="san-fp8-page64", num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, page_size=64, cache_dtype=FP8),
]
DECODE = [
    DecodeCase("edges Sq1", (0, 1, 63, 64, 65, 300)),
    DecodeCase("edges Sq3 split", (0, 2, 64, 129, 700), seqlen_q=3, num_parts=7, min_blocks_per_part=1),
]
PREFILL = [PrefillCase("edges", (1, 127, 129, 64), (0, 65, 200, 1))]
CACHE_WRITE = [CacheWriteCase("T=300", 300, 16)]


KERNELS = ("decode", "prefill", "cache_write")


def _jobs(args) -> list[tuple[dict, str, str | None, str | None, int]]:
    """(spec fields, kernel, backend, merge, case index) of every case the arguments select."""
    backends = [b for b in args.backends.split(",") if b] or [None]
    merges = [m for m in args.merges.split(",") if m] or [None]
    specs = [s for s in args.specs.split(",") if s]
    kernels = [k for k in args.kernels.split(",") if k] or list(KERNELS)
    cases = [int(c) for c in args.cases.split(",") if c]
    unknown = [s for s in specs if s not in {f["name"] for f in SPECS}] + [k for k in kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(f"unknown spec or kernel: {', '.join(unknown)}")
    jobs = []
    for fields in SPECS:
        if specs and fields["name"] not in specs:
            continue
        for kernel in kernels:
            if kernel == "decode":
                for backend in backends:
                    for merge in merges:
                        jobs += [
                            (fields, kernel, backend, merge, i) for i in range(len(DECODE)) if not cases or i in cases
                        ]
            else:
                count = len(PREFILL) if kernel == "prefill" else len(CACHE_WRITE)
                jobs += [(fields, kernel, None, None, i) for i in range(count) if not cases or i in cases]
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="", help="decode backends to force, comma-separated (default: auto)")
    parser.add_argument("--merges", default="", help="merges of split sequences to force (default: auto)")
    parser.add_argument("--specs", default="", help="spec names, comma-separated (default: all)")
    parser.add_argument("--kernels", default="", help=f"of {', '.join(KERNELS)}, comma-separated (default: all)")
    parser.add_argument("--cases", default="", help="case indexes within each kernel's list (default: all)")
    parser.add_argument("--list", action="store_true", help="print the arguments of each single case, one a line")
    args = parser.parse_args()
    jobs = _jobs(args)
    if args.list:
        for fields, kernel, backend, merge, i in jobs:
            line = f"--specs {fields['name']} --kernels {kernel} --cases {i}"
            line += f" --backends {backend}" if backend else ""
            print(line + (f" --merges {merge}" if merge else ""))
        return 0
    device = torch.device("cuda")
    failed = 0
    modules = {}
    for fields, kernel, backend, merge, i in jobs:
        if fields["name"] not in modules:
            modules[fields["name"]] = load(
                spec_from_dict(
                    dict(
                        qk_nope_head_dim=128, v_head_dim=128, dtype="bfloat16", kernels=["decode", "prefill"], **fields
                    )
                )
            )
        module = modules[fields["name"]]
        label = ""
        if kernel == "decode":
            with use_options(decode_backend=backend or "auto", decode_merge=merge or "auto"):  # (None: the default)
                results = [run_decode_case(module, DECODE[i], torch.Generator().manual_seed(i), device)]
            label = f"/{merge}" if merge else ""
        elif kernel == "prefill":
            results = run_prefill_case(module, PREFILL[i], torch.Generator().manual_seed(100 + i), device)
        else:
            results = [run_cache_write_case(module, CACHE_WRITE[i], torch.Generator().manual_seed(200 + i), device)]
        # finished before its line is printed, so a sanitizer's reports on it come before the line
        torch.cuda.synchronize()
        for r in results:
            failed += not r.passed
            print(f"{r.spec:<12} {r.kernel + label:<18} {r.case:<18} {'PASS' if r.passed else 'FAIL ' + r.detail}")
    print(f"cases failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
