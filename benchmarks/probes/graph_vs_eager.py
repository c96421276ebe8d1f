"""Is a decode call slower replayed from a CUDA graph than launched eagerly, or slower whenever the GPU runs it back to
back (dev tool, issue 44, item 4)? One case, checked against the fp32 reference (outputs NaN-poisoned first), then
timed per call by CUDA events in four modes, in rounds that alternate the modes:

- eager, back to back: calls issued without waiting, an event pair around each;
- graph, back to back: replays of a graph of one call, the same way;
- eager, idle gap: each call alone, then the host waits --gap-ms with the GPU idle;
- graph, idle gap: the same for replays.

`nvidia-smi` samples the SM clock and the power draw every 20 ms while each mode runs, so a slower mode can be told
apart as launch-bound (graph against eager at equal clocks) or clock-bound (back to back against idle gap).

    python benchmarks/probes/graph_vs_eager.py --spec deepseek-v3-tp1 --batch 128 --seqlen 8192 [--seqlen-q 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd  # noqa: E402
import harness  # noqa: E402

MODES = ("eager, back to back", "graph, back to back", "eager, idle gap", "graph, idle gap")


def per_call_us(fn, calls: int, gap_s: float) -> list[float]:
    """GPU time of each of `calls` calls of fn (µs), by an event pair around each; gap_s > 0: wait for each call
    to end and then that long before the next."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    torch.cuda.synchronize()
    for start, end in pairs:
        start.record()
        fn()
        end.record()
        if gap_s:
            end.synchronize()
            time.sleep(gap_s)
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in pairs]


class ClockSampler:
    """nvidia-smi's SM clock (MHz) and power draw (W) every 20 ms while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate()
        samples = []
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            samples.append((clock, power))
        # (the first sample was taken before the block's work began)
        samples = samples[1:] or samples
        self.clock = statistics.median(c for c, _ in samples) if samples else float("nan")
        self.power = statistics.median(p for _, p in samples) if samples else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bd.add_fixed_case_arguments(parser, spec="deepseek-v3-tp1")
    parser.add_argument("--calls", type=int, default=1000, help="calls a mode a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    args = parser.parse_args()
    for name in ("calls", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if not args.gap_ms > 0:
        parser.error(f"--gap-ms: must be positive, got {args.gap_ms}")

    module, _, (q, kv, table, seqlens, kv_scale) = bd.fixed_case(args, Path(tempfile.mkdtemp()))
    sched = module.get_decode_schedule(args.batch, args.seqlen_q, q.device)
    out = torch.empty(*q.shape[:3], module.KV_LORA_RANK, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], module.NUM_HEADS, q.shape[1], dtype=torch.float32, device=q.device)
    scaled = {} if kv_scale is None else {"kv_scale": kv_scale}
    call = functools.partial(
        module.mla_decode, q, kv, table, seqlens, schedule=sched, out=out, lse=lse, return_lse=True, **scaled
    )
    wrong = bd.checked_call(module, call, (q, kv, table, seqlens, kv_scale), args.seqlen, out, lse)
    graph, _ = harness.capture_graph(call)
    replay_wrong = bd.checked_call(
        module, graph.replay, (q, kv, table, seqlens, kv_scale), args.seqlen, out, lse, replayed=True
    )
    described = ", ".join(f"{k} {getattr(sched, k)}" for k in ("backend", "config", "num_parts", "narrow", "merge"))
    print(
        f"# {args.spec} H{module.NUM_HEADS} B{args.batch} S{args.seqlen} Sq{args.seqlen_q} {args.cache}; {described};"
        f" eager {wrong or 'checked'}; {replay_wrong or 'replay checked'}"
    )
    fns = {"eager": call, "graph": graph.replay}
    results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            kind, _, how = mode.partition(", ")
            gap_s = args.gap_ms / 1e3 if how == "idle gap" else 0.0
            per_call_us(fns[kind], 10, gap_s)  # warm-up
            with ClockSampler() as clocks:
                times = per_call_us(fns[kind], args.calls, gap_s)
            results[mode].append((statistics.median(times), clocks.clock, clocks.power))
    for mode in MODES:
        times, clocks, powers = zip(*results[mode], strict=True)
        print(
            f"{mode:>22}: median {' / '.join(f'{t:8.2f}' for t in times)} us a call;"
            f" SM clock {' / '.join(f'{c:.0f}' for c in clocks)} MHz; power {' / '.join(f'{p:.0f}' for p in powers)} W"
        )


if __name__ == "__main__":
    main()
