"""Probe (dev tool, H100): does the Gluon decode's consumer go faster with 128 cache positions a block (Q K^T as
m64n128 warpgroup MMAs instead of m64n64)? Mistral-Small-4 (H32, Dc 256) bf16 with pages of 128 positions (so a
128-position block is one TMA box), as generated and with text edits that let a caller's configuration take
block_n 128; each configuration checked against the reference on NaN-poisoned outputs, then timed with the cache
read from memory and with every sequence on the first sequence's pages (the cache in L2).

    python benchmarks/block_n_probe.py [--heads 32] [--spec mistral-small-4] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
from fp8_converter_variants import edited_module  # noqa: E402
from fp8_decode_sweep import report, timed  # noqa: E402

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402
from mlagen_compiler.registry import resolve_spec  # noqa: E402

PAGE = 128
#: a caller's configuration may take 128 positions a block (its shared layout of P, and the configuration space)
EDITS = [
    (
        "for block_n in (DECODE_GLUON_BLOCK_N, DECODE_GLUON_SMALL_BATCH_BLOCK_N)}",
        "for block_n in (DECODE_GLUON_BLOCK_N, DECODE_GLUON_SMALL_BATCH_BLOCK_N, 128)}",
    ),
    ("DECODE_GLUON_SPACE = (", "DECODE_GLUON_SPACE = ((128, 200, 2), (128, 184, 2), (128, 168, 2), "),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="mistral-small-4")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--configs", default="64:200:2,128:200:2,128:168:2")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench_decode.PAGE_SIZE = PAGE  # (make_inputs reads it)
    spec = resolve_spec(args.spec)
    fields = {**spec.to_flat_dict(), "name": f"{args.spec}-h{args.heads}-p{PAGE}", "num_heads": args.heads}
    spec = spec_from_dict({**fields, "page_size": PAGE})
    module = import_module_from_path(compile_spec(spec, args.out / spec.name))
    module = edited_module(module, EDITS, args.out, "n128")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z, page {PAGE}",
        flush=True,
    )
    seqlens = [8192] * 128
    gen = torch.Generator().manual_seed(12)
    q, kv, table, lens, _ = bench_decode.make_inputs(module, seqlens, 1, gen)
    nbytes = bench_decode.bytes_and_flops(module, seqlens, 1)[0]
    rows = []
    for l2 in (False, True):
        case = f"{args.spec} H{args.heads} B128 S8192" + (" L2-resident" if l2 else "")
        pages = table[:1].expand_as(table).contiguous() if l2 else table
        base = None
        for text in args.configs.split(","):
            config = tuple(int(v) for v in text.split(":"))
            us, label, msg = timed(module, q, kv, pages, lens, None, max(seqlens), backend="gluon", config=config)
            base = base or us
            rows.append((case, "bf16", label, us, base, msg, nbytes))
            print(rows[-1], flush=True)
    report(rows, args.out / "block_n_probe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
