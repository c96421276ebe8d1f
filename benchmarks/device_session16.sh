#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, sixteenth session): the spread merge (launch_policy.spread_merge_runs: every run
# of a split sequence waits for all of them, then merges a share of its output tiles; one cooperative launch).
#   bash benchmarks/device_session16.sh a   GPU tests of the spread merge (both backends) and of the merges beside
#                                           it, then the latency cases: auto's merge against the spread merge
#   bash benchmarks/device_session16.sh b   after a (spread slower everywhere): the spread merge waiting on volatile
#                                           loads instead of atomics, cooperative and not, on B1 H16 and B8 H16
#   bash benchmarks/device_session16.sh c   the final code: B1 H16's portable configurations (with runs of two
#                                           32-position blocks in 2 stages), then bench_decode.py's target cases
#                                           (both caches) and its latency cases
# Modes a and b ran benchmarks/results/spread_merge_2026-11-26.patch (not kept; `git apply` it and regenerate
# the modules to rerun them).
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k \
    "spread or (triton and (fused_merge_trees or skewed or many_runs))" 2>&1 | tail -8 | tee "$OUT/pytest_spread.log"
  timeout 320 python3 benchmarks/latency_probe.py --spread \
    --only "B1 H16,B8 H16,skewed Sq1,skewed Sq4,B1 H128,B8 H128" 2>&1 | tee "$OUT/latency_spread.log" \
    | grep -v "^#" | cut -c1-260
  ;;
b)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k "spread" 2>&1 | tail -4 \
    | tee "$OUT/pytest_spread_volatile.log"
  timeout 200 python3 benchmarks/latency_probe.py --spread --only "B1 H16,B8 H16" 2>&1 \
    | tee "$OUT/latency_spread_volatile.log" | grep -v "^#" | grep -v "short\|S2048" | cut -c1-260
  ;;
c)
  timeout 120 python3 benchmarks/latency_probe.py --configs --only "B1 H16" 2>&1 | tee "$OUT/latency_configs.log" \
    | grep -v "^#" | cut -c1-230
  timeout 300 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B64 S32768,Mistral-S4 H32 B128 S8192,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  timeout 170 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B1 S8192 graph" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
esac
