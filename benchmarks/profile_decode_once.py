"""One decode call of a bench_decode case for a profiler to catch (dev tool, H100): builds the case's module
and inputs, warms up, then makes `--calls` more calls. Run it under ncu, e.g.

    ncu --kernel-name regex:gluon --launch-skip 3 --launch-count 1 --section WarpStateStats \\
        python benchmarks/profile_decode_once.py --heads 128 --cache fp8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import make_inputs, module_for, v3_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--spec", help="a bundled spec (default: DeepSeek-V3's for --heads)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--cache", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--backend", default="gluon", choices=("gluon", "triton"))
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--variant", default="", help="fp8_converter_variants edits ('+'-joined) of the module")
    parser.add_argument(
        "--l2-resident", action="store_true", help="every sequence reads the first sequence's pages (cache in L2)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        module = module_for(args.spec or v3_spec(args.heads), args.heads, Path(tmp), args.cache)
        if args.variant:
            from fp8_converter_variants import variant_module

            module = variant_module(module, args.variant.split("+"), Path(tmp))
        q, kv, table, lens, kv_scale = make_inputs(module, [args.seqlen] * args.batch, 1, torch.Generator())
        if args.l2_resident:
            table = table[:1].expand_as(table).contiguous()
        schedule = module.get_decode_schedule(args.batch, 1, q.device, backend=args.backend)
        extra = {} if kv_scale is None else {"kv_scale": kv_scale}
        for _ in range(3 + args.calls):
            module.mla_decode(q, kv, table, lens, schedule=schedule, **extra)
        torch.cuda.synchronize()
        print(schedule)
    return 0


if __name__ == "__main__":
    sys.exit(main())
