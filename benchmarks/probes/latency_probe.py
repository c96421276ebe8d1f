"""Where the time of small and skewed decode batches goes (dev tool, issue 11's graph-replay targets; kept for
benchmarks/flash_mla_dropin.sh, which runs --partials).

    python benchmarks/probes/latency_probe.py [--only NAME,...] [--cache bf16|fp8]
        [--quick | --parts | --partials | --minblocks | --merges | --configs]

For each latency case (B1 H16, B1 H128, B8 H16, the skewed batch at Sq 4 and 1, all S8192 / page 64; a bf16
cache, or an fp8 one of the same geometry with --cache fp8)
and each schedule of a small sweep (backend x merge x split-KV runs x fewest blocks a run), prints the
CUDA-graph replay median, each kernel's device time (torch profiler, eager calls) and the check against the
fp32 reference: outputs are NaN-poisoned before the checked call and again before one replay of the timed
graph, which is checked too. First the floor: replay time of graphs of one and of two empty kernels.

A variant is chosen only through get_decode_schedule's arguments and the options in force
(`mlagen_compiler.options.use_options`), never by patching the launch policy or the module.

--partials: auto's schedule with the split sequences' partial rows in float32 and in the output's dtype
(`use_options(decode_partials=...)`, MLAGEN_DECODE_PARTIALS; the launch policy's rule is
decode_partials_in_dtype), in turn, twice.

--minblocks: the Gluon kernel's default schedule with the plan's fewest cache blocks a run and with 10 (with
short blocks, the cost rule's positions a run), in turn, twice; then 3 and 8.

--configs: the portable kernel's default schedule, then with block_n 32 / 64, 2 / 4 / 8 warps and 1 / 2 stages
given (its runs as the schedule plans them for that block size), then runs of two 32-position blocks in 2 stages.

--merges: the Gluon kernel's default schedule with the combine launch and with the fused merge (the last run of
a split sequence to finish merges it), in turn, twice.

Dropped when the probe stopped patching the launch policy and the module (issue 42): --runs, --keep, --blocks,
--thread-steps and --landing forced the answer of a launch-policy function (decode_sequence_runs,
decode_keep_partials, gluon_short_blocks, combine_step_runs_for_warps, gluon_land_ring), --tiles and --steps
replaced the module's DECODE_COMBINE_TILES. No option chooses those forms, and no job runs them; what they
measured is in docs/performance-log.md ("Measurements behind the launch policy and the plan"), and the probe
that ran them is `benchmarks/probes/latency_probe.py` of commit bb08393 (with the modules of commit e8e1617:
later modules no longer hold the policy functions it patched).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BENCHMARKS = Path(__file__).resolve().parent.parent  # bench_decode and harness (bench_decode adds the repository)
sys.path.insert(0, str(BENCHMARKS))

from bench_decode import (  # noqa: E402
    Case,
    bytes_and_flops,
    capture_graph,
    checked_call,
    make_inputs,
    median_ms,
    module_for,
    time_graph,
    v3_spec,
)

from mlagen_compiler.options import use_options  # noqa: E402  (bench_decode puts the repository on the path)

SKEWED = [4641, 45118, 1730, 1696]
CASES = [
    Case("B1 H16", v3_spec(16), 16, [8192], graph=True),
    Case("skewed Sq4", v3_spec(16), 16, SKEWED, 4, graph=True),
    Case("skewed Sq1", v3_spec(16), 16, SKEWED, 1, graph=True),
    Case("B8 H16", v3_spec(16), 16, [8192] * 8, graph=True),
    Case("B1 H128", v3_spec(128), 128, [8192], graph=True),
    Case("B8 H128", v3_spec(128), 128, [8192] * 8, graph=True),
    Case("Mistral-S4 B8", "mistral-small-4", 32, [8192] * 8, graph=True),
    # bench_hf.py's decode steps: its prompts (256-512 tokens) and a few new ones
    Case("B8 H16 short", v3_spec(16), 16, [520, 444, 276, 266, 400, 378, 321, 305], graph=True),
    Case("B8 H16 S2048", v3_spec(16), 16, [2048] * 8, graph=True),
]


@triton.jit
def _empty_kernel(X, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()
    tl.store(X + tl.program_id(0), 1.0)


def floor_us() -> str:
    """Graph replay time of one and of two dependent empty launches of 132 programs; the second one also
    as a programmatic dependent launch (PDL: it waits in griddepcontrol.wait), the first one triggering
    its dependents at its start or not."""
    x = torch.zeros(132, device="cuda")
    parts = []
    for name, launches in [
        ("1 launch", [{}]),
        ("2 launches", [{}, {}]),
        ("2, PDL", [{}, dict(WAIT=True, launch_pdl=True)]),
        ("2, PDL, trigger", [dict(TRIGGER=True), dict(WAIT=True, launch_pdl=True)]),
    ]:

        def call(launches=launches):
            for options in launches:
                _empty_kernel[(132,)](x, **{"WAIT": False, "TRIGGER": False, **options})

        parts.append(f"{name} {time_graph(call) * 1e3:.2f} us")
    return "floor: " + ", ".join(parts)


def kernel_times(fn) -> dict[str, float]:
    """Device µs per call of each kernel (profiler over 10 eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            name = event.key.replace("_mla_decode_", "").replace("_kernel", "")[:24]
            times[name] = total / 10
    return times


def sweep_for(case: Case, module, sms: int) -> list[dict]:
    """Schedules to time: the default of each backend and merge, and split variations around them."""
    blocks64 = sum(-(-s // 64) for s in case.seqlens)
    out = []
    for backend in ("gluon", "triton"):
        for merge in ("kernel", "fused"):
            out.append(dict(backend=backend, merge=merge))
        out.append(dict(backend=backend, merge="kernel", pdl=False))
        if backend == "gluon":
            for min_blocks in (1, 2, 3):
                for merge in ("kernel", "fused"):
                    out.append(dict(backend=backend, merge=merge, min_blocks_per_part=min_blocks))
            if blocks64 > sms * 5:
                out.append(dict(backend=backend, merge="kernel", num_parts=2 * sms, min_blocks_per_part=1))
        else:
            for min_blocks in (2, 4):
                out.append(dict(backend=backend, merge="kernel", min_blocks_per_part=min_blocks))
            # 32-position blocks: twice the runs
            out.append(dict(backend=backend, merge="kernel", config=(32, 4, 2), min_blocks_per_part=1))
            out.append(
                dict(backend=backend, merge="kernel", num_parts=4 * sms, config=(32, 4, 2), min_blocks_per_part=1)
            )
    return out


def run_case(
    case: Case,
    tmp: Path,
    gen: torch.Generator,
    sms: int,
    mode: str,
    cache: str = "bf16",
) -> list[str]:
    module = module_for(case.spec, case.num_heads, tmp, cache)
    q, kv, table, lens, kv_scale = make_inputs(module, case.seqlens, case.seqlen_q, gen)
    batch = len(case.seqlens)
    nbytes, _ = bytes_and_flops(module, case.seqlens, case.seqlen_q)
    lines = []
    knobs_list = sweep_for(case, module, sms)
    if mode == "quick":  # each backend's default schedule with its combine launch, as a programmatic dependent or not
        knobs_list = [dict(backend=b, merge="kernel", pdl=pdl) for b in ("gluon", "triton") for pdl in (True, False)]
    elif mode == "parts":  # the Gluon kernel's runs: fewer, longer runs (fewer partial rows to merge) and more
        slots = [sms // 4, sms // 2, 3 * sms // 4, sms, 2 * sms]
        aligned = [k * batch for k in (4, 8, 12, 16, 24, 32) if k * batch <= 2 * sms]
        knobs_list = [
            dict(backend="gluon", merge="kernel", num_parts=n, min_blocks_per_part=1)
            for n in sorted(set(slots + aligned))
        ]
    elif mode == "partials":  # partial rows in float32 or in the output's dtype, whatever the policy says
        knobs_list = [dict(partials=form) for _ in range(2) for form in ("float32", "dtype")]
    elif mode == "configs":  # the portable kernel's default schedule, then tile configurations given
        knobs_list = [dict(backend="triton", merge="kernel")] + [
            dict(backend="triton", merge="kernel", config=(block_n, warps, stages))
            for block_n in (32, 64)
            for warps in (2, 4, 8)
            for stages in (1, 2)
        ]
        # runs of two 32-position blocks, pipelined (2 stages): as many runs as 64-position blocks of one
        knobs_list += [
            dict(backend="triton", merge="kernel", config=(32, warps, 2), min_blocks_per_part=2) for warps in (4, 8)
        ]
    elif mode == "merges":  # the Gluon kernel's default schedule with the combine launch or the fused merge
        knobs_list = [dict(backend="gluon", merge=merge) for _ in range(2) for merge in ("kernel", "fused")]
    elif mode == "minblocks":  # the Gluon kernel's default schedule with fewer or more cache blocks a run at least
        fewest = [m for _ in range(2) for m in (None, 10)] + [3, 8]
        knobs_list = [dict(backend="gluon", merge="kernel", min_blocks_per_part=m) for m in fewest]
    for knobs in knobs_list:
        knobs = dict(knobs)
        partials = knobs.pop("partials", None)
        chosen = {} if partials is None else {"decode_partials": partials}
        try:
            with use_options(**chosen):  # (the schedule records its partial rows' dtype when planned)
                schedule = module.get_decode_schedule(batch, case.seqlen_q, q.device, **knobs)
        except ValueError as error:
            lines.append(f"{case.name} {knobs}: {error}")
            continue
        out = torch.empty((batch, case.seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), dtype=q.dtype, device="cuda")
        lse = torch.empty((batch, module.NUM_HEADS, case.seqlen_q), dtype=torch.float32, device="cuda")

        def call(schedule=schedule, out=out, lse=lse):
            return module.mla_decode(
                q, kv, table, lens, kv_scale=kv_scale, schedule=schedule, out=out, lse=lse, return_lse=True
            )

        try:
            msg = checked_call(module, call, (q, kv, table, lens, kv_scale), max(case.seqlens), out, lse)
            graph, _ = capture_graph(call)
            graph_us = median_ms(lambda graph=graph: [graph.replay() for _ in range(20)], rep=60) * 1e3 / 20
            # the timed graph's own result, on poisoned outputs
            msg = msg or checked_call(
                module, graph.replay, (q, kv, table, lens, kv_scale), max(case.seqlens), out, lse, replayed=True
            )
            times = kernel_times(call)
        except Exception as error:  # noqa: BLE001 - a schedule that fails is reported, not fatal
            lines.append(f"{case.name} {knobs}: {type(error).__name__}: {str(error)[:200]}")
            continue
        cfg = (
            f"{schedule.backend} {schedule.merge} m{schedule.block_m} n{schedule.config[0]} w{schedule.config[1]} "
            f"s{schedule.config[2]} "
            f"p{schedule.num_parts} mb{schedule.min_blocks_per_part}{' pdl' if schedule.pdl else ''}"
            f"{' sequence-runs' if schedule.sequence_runs else ''}"
            f"{f' land-slots {schedule.land_slots}' if kv_scale is not None else ''} "
            f"tile {schedule.combine_tile}/{schedule.combine_runs}"
            f" partials {str(schedule.partial_dtype).removeprefix('torch.')}{' kept' if schedule.keep_partials else ''}"
        )
        kt = " ".join(f"{k}={v:.1f}" for k, v in times.items())
        line = (
            f"{case.name} | {cfg} | graph {graph_us:.1f} us ({nbytes / graph_us / 1e3:.0f} GB/s) | "
            f"kernels {sum(times.values()):.1f} us: {kt} | {'ok' if not msg else 'FAIL ' + msg}"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--quick", action="store_true", help="only each backend's default, PDL on and off")
    parser.add_argument("--parts", action="store_true", help="the Gluon kernel at several run counts instead")
    parser.add_argument("--partials", action="store_true", help="partial rows in float32 against the output's dtype")
    parser.add_argument(
        "--minblocks", action="store_true", help="the Gluon kernel with the plan's, 10, 3, 8 blocks a run at least"
    )
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="bf16", help="the latent cache's storage")
    parser.add_argument("--merges", action="store_true", help="the Gluon kernel's combine launch and fused merge")
    parser.add_argument("--configs", action="store_true", help="the portable kernel at every (block_n, warps, stages)")
    args = parser.parse_args()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        flush=True,
    )
    print(floor_us(), flush=True)
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.only and not any(part in case.name for part in args.only.split(",")):
                continue
            modes = ("parts", "quick", "partials", "minblocks", "merges", "configs")
            mode = next((name for name in modes if getattr(args, name)), "")
            lines += run_case(case, Path(tmp), gen, sms, mode, args.cache)
            torch.cuda.empty_cache()
    failed = [line for line in lines if "FAIL" in line or "Error" in line]
    print(f"\n{len(lines)} rows, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
