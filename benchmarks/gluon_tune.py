"""Knobs of the Gluon decode on the H100 (dev tool): split-KV runs per SM, fewest blocks per run, ring
stages; plus where the time goes (kernel durations from the profiler) for the default schedule.

    python benchmarks/gluon_tune.py [--only NAME,...] [--parts]

--parts: instead, the run count against the merge mode: the default (SMs / row blocks), and k runs per
sequence (k * B: runs end where sequences end when lengths are equal) for every k that keeps the
programs within two waves.
Every timed schedule is checked against the reference first, on NaN-poisoned outputs; prints a table last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_decode import (  # noqa: E402
    Case,
    bytes_and_flops,
    checked_call,
    lengths,
    make_inputs,
    median_ms,
    module_for,
    time_graph,
    v3_spec,
)

CASES = [
    Case("H128 B128 Sq1", v3_spec(128), 128, [8192] * 128),
    Case("H128 B128 Sq2", v3_spec(128), 128, [8192] * 128, 2),
    Case("H128 B32", v3_spec(128), 128, [8192] * 32),
    Case("H16 B128 Sq1", v3_spec(16), 16, [8192] * 128),
    Case("H16 B128 Sq2", v3_spec(16), 16, [8192] * 128, 2),
    Case("H64 B128 Sq1", v3_spec(64), 64, [8192] * 128),
    Case("H16 B64 S32768", v3_spec(16), 16, [32768] * 64),
    Case("Mistral H32 B128", "mistral-small-4", 32, [8192] * 128),
    # lengths uniform in [S/2, 3S/2) (bench_decode's varlen rule): runs no longer end where sequences do
    Case("H128 B32 varlen", v3_spec(128), 128, lengths(32, 8192, True, torch.Generator().manual_seed(7))),
    Case("H16 B128 varlen", v3_spec(16), 16, lengths(128, 8192, True, torch.Generator().manual_seed(7))),
]


def kernel_times(fn) -> str:
    """Device time per kernel name over 5 calls (profiler), to show the split / combine shares."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    parts = []
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            parts.append(f"{event.key[:40]} {total / event.count:.1f}us x{event.count // 5}")
    return "; ".join(parts)


def tune_case(case: Case, tmp: Path, gen: torch.Generator, sms: int) -> list[tuple]:
    module = module_for(case.spec, case.num_heads, tmp)
    q, kv, table, lens, _ = make_inputs(module, case.seqlens, case.seqlen_q, gen)  # bf16: no kv_scale
    batch, max_len = len(case.seqlens), max(case.seqlens)
    nbytes, flops = bytes_and_flops(module, case.seqlens, case.seqlen_q)
    base = module.get_decode_schedule(batch, case.seqlen_q, q.device, backend="gluon")
    times = kernel_times(lambda: module.mla_decode(q, kv, table, lens, schedule=base))
    print(f"[{case.name}] default {base}; {times}", flush=True)
    rows = []
    for parts_per_sm in (1, 2, 3):
        for min_blocks in sorted({base.min_blocks_per_part, 16, 64}):
            for stages in sorted({module.DECODE_GLUON_STAGES, 2}):
                parts = max(1, sms * parts_per_sm // base.row_blocks)
                config = (module.DECODE_GLUON_BLOCK_N, module.DECODE_GLUON_CONSUMER_REGS, stages)
                schedule = module.DecodeSchedule(
                    batch,
                    case.seqlen_q,
                    module.DECODE_GLUON_BLOCK_M,
                    parts,
                    min_blocks,
                    config,
                    sms,
                    "gluon",
                    "",
                    narrow=base.narrow,  # the form the schedule planned
                )

                def call(schedule=schedule):
                    return module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True)

                out, lse = call()
                msg = checked_call(
                    module,
                    lambda schedule=schedule, out=out, lse=lse: module.mla_decode(
                        q, kv, table, lens, schedule=schedule, out=out, lse=lse
                    ),
                    (q, kv, table, lens, None),
                    max_len,
                    out,
                    lse,
                )
                us = median_ms(call, rep=100) * 1e3
                row = (case.name, parts, min_blocks, stages, us, nbytes / us / 1e3, flops / us / 1e6, msg or "ok")
                rows.append(row)
                print(f"  p{parts} mb{min_blocks} s{stages}: {us:.1f} us {row[5]:.0f} GB/s {row[6]:.0f} TFLOP/s "
                      f"{row[7]}", flush=True)  # fmt: skip
    return rows


def parts_case(case: Case, tmp: Path, gen: torch.Generator, sms: int) -> list[tuple]:
    """Runs per row block x merge mode, each checked, then timed (best of eager and graph replay)."""
    module = module_for(case.spec, case.num_heads, tmp)
    q, kv, table, lens, _ = make_inputs(module, case.seqlens, case.seqlen_q, gen)
    batch, max_len = len(case.seqlens), max(case.seqlens)
    nbytes, flops = bytes_and_flops(module, case.seqlens, case.seqlen_q)
    base = module.get_decode_schedule(batch, case.seqlen_q, q.device, backend="gluon")
    candidates = {base.num_parts}
    for k in range(1, 9):
        if k * batch * base.row_blocks <= 2 * sms:
            candidates.add(k * batch)
    rows = []
    for parts in sorted(candidates):
        for merge in ("fused", "kernel"):
            schedule = module.get_decode_schedule(
                batch, case.seqlen_q, q.device, backend="gluon", num_parts=parts, merge=merge
            )

            def call(schedule=schedule):
                return module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True)

            out, lse = call()
            msg = checked_call(
                module,
                lambda schedule=schedule, out=out, lse=lse: module.mla_decode(
                    q, kv, table, lens, schedule=schedule, out=out, lse=lse
                ),
                (q, kv, table, lens, None),
                max_len,
                out,
                lse,
            )
            us = min(median_ms(call, rep=100), time_graph(call)) * 1e3
            row = (
                case.name,
                parts,
                merge,
                parts * base.row_blocks,
                us,
                nbytes / us / 1e3,
                flops / us / 1e6,
                msg or "ok",
                "default" if parts == base.num_parts else "",
            )
            rows.append(row)
            print(f"  {case.name} p{parts} {merge}: {us:.1f} us {row[5]:.0f} GB/s {row[6]:.0f} TFLOP/s {row[7]} "
                  f"{row[8]}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--parts", action="store_true", help="sweep run counts x merge modes instead")
    args = parser.parse_args()
    if args.parts:
        return main_parts(args)
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.only and not any(part in case.name for part in args.only.split(",")):
                continue
            rows_out += tune_case(case, Path(tmp), gen, sms)
            torch.cuda.empty_cache()
    print("\n| case | parts | min blocks | stages | us | GB/s | TFLOP/s | check |")
    print("|---|---|---|---|---|---|---|---|")
    for name, parts, min_blocks, stages, us, gbps, tflops, msg in rows_out:
        print(f"| {name} | {parts} | {min_blocks} | {stages} | {us:.1f} | {gbps:.0f} | {tflops:.0f} | {msg} |")
    return 0


def main_parts(args) -> int:
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.only and not any(part in case.name for part in args.only.split(",")):
                continue
            rows_out += parts_case(case, Path(tmp), gen, sms)
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, best of eager and graph replay, medians")
    print("| case | runs per row block | merge | programs | us | GB/s | TFLOP/s | check | |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, parts, merge, programs, us, gbps, tflops, msg, note in rows_out:
        print(f"| {name} | {parts} | {merge} | {programs} | {us:.1f} | {gbps:.0f} | {tflops:.0f} | {msg} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
