#!/usr/bin/env bash
# Prefill on the H200 (issue 43) in one device call of at most 9 minutes: the prefill property tests on the GPU for
# both backends (the portable kernel and the Gluon one), then bench_prefill.py (each backend checked against the
# reference on every case before it is timed, beside cuDNN, the other SDPA backends and FlexAttention).
#   command  MLAGEN_BENCH_COMMIT=<commit> bash benchmarks/h200_prefill.sh [all|tests|bench]   (default all)
#   carry    [".whl"]
# H200_BUDGET_S: seconds for the whole job (default 520). H200_BENCH_ARGS: more bench_prefill.py arguments.
# Back under $OUT: tests.log, bench.log, prefill/prefill.json, results.jsonl (rows for
# benchmarks/results/results.jsonl).
mode=${1:-all}
case $mode in all | tests | bench) ;; *) echo "h200_prefill.sh: unknown mode '$mode' (all, tests or bench)" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-520}
source benchmarks/job_steps.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit ${MLAGEN_BENCH_COMMIT:-?}; budget $budget s"
STEP_LINES='^(# |[A-Za-z_]+ [HB]=|chunked|FAILED|ERROR|Timeout|[0-9.]+s (call|setup) |.*(passed|failed) in )'
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  # (-v and the durations: which test a cut run was in, and where the time went; a test still running after
  # 100 s has its stack dumped)
  MLAGEN_HYPOTHESIS_PROFILE=ci step tests 200 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short \
    --durations=8 -o faulthandler_timeout=100 tests/test_prefill.py tests/test_gluon_prefill.py
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  # shellcheck disable=SC2086
  step bench 300 python3 benchmarks/bench_prefill.py --out "$out/prefill" --append "$out/results.jsonl" \
    ${H200_BENCH_ARGS:-}
fi
