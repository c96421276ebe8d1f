"""Every kernel once on shapes that cross page and tile edges, with Sq > 1 and empty sequences: the
workload `scripts/sanitize.sh` runs under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

Results are also checked against the reference, so a run that the sanitizer passes is a correct run.
Usage: python benchmarks/sanitize_cases.py [--backends triton,gluon] [--merges fused,kernel]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlagen_compiler import load, spec_from_dict  # noqa: E402
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
#: fp8 caches (portable decode only) both ways
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="", help="decode backends to force, comma-separated (default: auto)")
    parser.add_argument("--merges", default="", help="merges of split sequences to force (default: auto)")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b] or [None]
    merges = [m for m in args.merges.split(",") if m] or [None]
    device = torch.device("cuda")
    failed = 0
    for fields in SPECS:
        spec = spec_from_dict(
            dict(qk_nope_head_dim=128, v_head_dim=128, dtype="bfloat16", kernels=["decode", "prefill"], **fields)
        )
        module = load(spec)
        results = []
        for backend in backends:
            if backend == "gluon" and spec.cache_scaled:
                continue  # the Gluon decode reads 16-bit caches only
            if backend is not None:
                os.environ["MLAGEN_DECODE_BACKEND"] = backend
            for merge in merges:
                if merge is not None:
                    os.environ["MLAGEN_DECODE_MERGE"] = merge
                for i, case in enumerate(DECODE):
                    results.append(run_decode_case(module, case, torch.Generator().manual_seed(i), device))
        for i, case in enumerate(PREFILL):
            results += run_prefill_case(module, case, torch.Generator().manual_seed(100 + i), device)
        for i, case in enumerate(CACHE_WRITE):
            results.append(run_cache_write_case(module, case, torch.Generator().manual_seed(200 + i), device))
        torch.cuda.synchronize()
        for r in results:
            failed += not r.passed
            print(f"{r.spec:<12} {r.kernel:<12} {r.case:<18} {'PASS' if r.passed else 'FAIL ' + r.detail}")
    print(f"cases failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
