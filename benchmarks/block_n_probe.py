"""Probe (dev tool, H100): does the Gluon decode's consumer go faster with 128 cache positions a block (Q K^T as
m64n128 warpgroup MMAs instead of m64n64)? Mistral-Small-4 (H32, Dc 256) bf16 with pages of --page positions (128: a
128-position block is one TMA box; 64: two), as generated and with a text edit that lets a caller's configuration
take block_n 128; each configuration checked against the reference on NaN-poisoned outputs, then timed with the cache
read from memory and with every sequence on the first sequence's pages (the cache in L2).

    python benchmarks/block_n_probe.py [--heads 32] [--spec mistral-small-4] [--page 128] [--sq 1] [--no-l2]
        [--configs auto,64:200:2] [--out DIR]
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

#: a caller's configuration may take 128 positions a block (the plan's long blocks: P's shared layout is there)
EDITS = [("DECODE_GLUON_SPACE = (", "DECODE_GLUON_SPACE = ((128, 200, 2), (128, 184, 2), (128, 168, 2), ")]


def parse_configs(text: str) -> list[tuple[int, int, int] | None]:
    """--configs as a list of (block_n, registers, stages) tuples, None for 'auto'; a ValueError naming the entry."""
    configs = []
    for entry in text.split(","):
        if entry == "auto":
            configs.append(None)
            continue
        parts = entry.split(":")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise ValueError(f"--configs: expected 'auto' or block_n:registers:stages, got {entry!r}")
        configs.append(tuple(int(part) for part in parts))
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="mistral-small-4")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument(
        "--configs",
        default="64:200:2,128:200:2,128:168:2",
        help="block_n:registers:stages,... given to get_decode_schedule; 'auto': the module's own choice",
    )
    parser.add_argument("--page", type=int, default=128, help="positions a page (the spec's and the inputs')")
    parser.add_argument("--sq", type=int, default=1, help="query tokens a sequence")
    parser.add_argument("--no-l2", action="store_true", help="only with the cache read from memory")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    try:
        configs = parse_configs(args.configs)
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    bench_decode.PAGE_SIZE = args.page  # (make_inputs reads it)
    spec = resolve_spec(args.spec)
    fields = {**spec.to_flat_dict(), "name": f"{args.spec}-h{args.heads}-p{args.page}", "num_heads": args.heads}
    spec = spec_from_dict({**fields, "page_size": args.page})
    module = import_module_from_path(compile_spec(spec, args.out / spec.name))
    module = edited_module(module, EDITS, args.out, "n128")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z, page {args.page}",
        flush=True,
    )
    seqlens = [8192] * 128
    gen = torch.Generator().manual_seed(12)
    q, kv, table, lens, _ = bench_decode.make_inputs(module, seqlens, args.sq, gen)
    nbytes = bench_decode.bytes_and_flops(module, seqlens, args.sq)[0]
    rows = []
    for l2 in (False,) if args.no_l2 else (False, True):
        case = f"{args.spec} H{args.heads} B128 S8192 Sq{args.sq} page {args.page}" + (" L2-resident" if l2 else "")
        pages = table[:1].expand_as(table).contiguous() if l2 else table
        base = None
        for config in configs:
            us, label, msg = timed(module, q, kv, pages, lens, None, max(seqlens), backend="gluon", config=config)
            label += " (auto)" if config is None else ""
            base = base or us
            rows.append((case, "bf16", label, us, base, msg, nbytes))
            print(rows[-1], flush=True)
    report(rows, args.out / "block_n_probe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
