"""One decode case under several schedules, side by side in one process (dev tool, issue 44): each variant is
checked against the fp32 reference (outputs NaN-poisoned first), then timed eagerly (do_bench, L2 flushed) and by
CUDA-graph replay, and its bandwidth is printed beside a copy's measured in the same run.

    python benchmarks/probes/decode_knobs.py --spec mistral-small-4 --batch 128 --seqlen 8192 \
        [--cache bf16|fp8] [--in-l2] [--variant NAME=KEY:VALUE,...]...

A variant's keys are get_decode_schedule's arguments (config as block_n/regs/stages or block_n/warps/stages,
num_parts, min_blocks_per_part, backend, merge) and the options in force (tma=0 or 1); one experiment of a plan
constant, narrow_rows:N, plans the variant's schedule with the module's DECODE_GLUON_NARROW_ROWS and
DECODE_GLUON_NARROW_ROWS_LARGE_BATCH (plan.NARROW_ROWS and NARROW_ROWS_LARGE_BATCH: the most query rows the Gluon
decode's narrow form takes, at any batch and in large batches) both set to N, restored afterwards.
`auto` (the schedule every call would take) is always the first variant. --in-l2: every sequence reads the first
sequence's pages, so the cache stays in L2 and the time is the kernel's own work, not its bytes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd  # noqa: E402
import harness  # noqa: E402

from mlagen_compiler.options import use_options  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'NAME=key:value,...' as (name, schedule arguments, options; narrow_rows goes with the options)."""
    name, _, fields = text.partition("=")
    schedule, options = {}, {}
    for field in filter(None, fields.split(",")):
        key, _, value = field.partition(":")
        if key == "config":
            schedule[key] = tuple(int(v) for v in value.split("/"))
        elif key in ("num_parts", "min_blocks_per_part"):
            schedule[key] = int(value)
        elif key in ("backend", "merge"):
            schedule[key] = value
        elif key == "tma":
            options["decode_tma"] = value == "1"
        elif key == "narrow_rows":
            if value not in ("0", "16", "32"):
                raise SystemExit(f"--variant {text!r}: narrow_rows must be 0, 16 or 32, got {value!r}")
            options["narrow_rows"] = int(value)
        else:
            raise SystemExit(
                f"--variant {text!r}: unknown key {key!r} (config, num_parts, min_blocks_per_part, backend, merge,"
                " tma, narrow_rows)"
            )
    return name, schedule, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bd.add_fixed_case_arguments(parser)
    parser.add_argument("--in-l2", action="store_true")
    parser.add_argument("--variant", action="append", default=[])
    args = parser.parse_args()
    variants = [("auto", {}, {})] + [parse_variant(v) for v in args.variant]

    module, lens, (q, kv, table, seqlens, kv_scale) = bd.fixed_case(args, Path(tempfile.mkdtemp()))
    if args.in_l2:
        table = table[:1].expand_as(table).contiguous()
    inputs = (q, kv, table, seqlens, kv_scale)
    nbytes, flops = bd.bytes_and_flops(module, lens, args.seqlen_q)
    roof = bd.roofline()
    print(
        f"# {args.spec} H{module.NUM_HEADS} B{args.batch} S{args.seqlen} Sq{args.seqlen_q} {args.cache}"
        f"{' in L2' if args.in_l2 else ''}: {nbytes / 1e6:.1f} MB; copy {roof['copy_gbps']:.0f} GB/s"
    )
    for name, schedule_args, options in variants:
        options = dict(options)
        limits = ("DECODE_GLUON_NARROW_ROWS", "DECODE_GLUON_NARROW_ROWS_LARGE_BATCH")
        planned = {name: getattr(module, name) for name in limits}
        narrow_rows = options.pop("narrow_rows", None)
        with use_options(**options):
            try:
                try:
                    for limit in limits:
                        setattr(module, limit, planned[limit] if narrow_rows is None else narrow_rows)
                    sched = module.get_decode_schedule(args.batch, args.seqlen_q, q.device, **schedule_args)
                finally:
                    for limit in limits:
                        setattr(module, limit, planned[limit])
                out = torch.empty(*q.shape[:3], module.KV_LORA_RANK, dtype=q.dtype, device=q.device)
                lse = torch.empty(q.shape[0], module.NUM_HEADS, q.shape[1], dtype=torch.float32, device=q.device)
                scaled = {} if kv_scale is None else {"kv_scale": kv_scale}
                call = functools.partial(
                    module.mla_decode,
                    q,
                    kv,
                    table,
                    seqlens,
                    schedule=sched,
                    out=out,
                    lse=lse,
                    return_lse=True,
                    **scaled,
                )
                wrong = bd.checked_call(module, call, inputs, args.seqlen, out, lse)
                eager = harness.median_ms(call, warmup=25, rep=200, repeat=2) * 1e3
                graph = bd.time_graph(call) * 1e3
                unrolled = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median") * 1e3
            except Exception as error:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"{name:>14}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                continue
        best = min(eager, graph)
        described = ", ".join(
            f"{k} {getattr(sched, k)}"
            for k in ("backend", "config", "block_m", "num_parts", "narrow", "land_slots", "merge")
        )
        print(
            f"{name:>14}: eager {eager:8.2f} us, graph {graph:8.2f}, unrolled graph {unrolled:8.2f};"
            f" {nbytes / best / 1e3:6.0f} GB/s ({nbytes / best / 1e3 / roof['copy_gbps']:.0%} of copy),"
            f" {flops / best / 1e6:5.0f} TFLOP/s; {described}{' WRONG: ' + wrong if wrong else ''}"
        )


if __name__ == "__main__":
    main()
