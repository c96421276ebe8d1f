#!/usr/bin/env bash
# cache_compute fp8 on the H200 (issue 44, item 1) in one device call of at most 9 minutes: the GPU tests of the
# fp8 products (tests/test_fp8_compute.py: the float64 reference on the dequantised cache, within the bound chosen
# before any run; poisoned unused cache slots and outputs) and the exact Gluon decode's narrow / wide test beside
# them, then bench_decode.py on DeepSeek H16 B128 S8192, H16 B64 S32768, H128 B128 S8192 and Mistral-Small-4 H32
# B128 S8192 with the bf16 cache, the fp8 cache (exact), the fp8 cache with cache_compute fp8 (fp8mma: the plan's
# two-term e4m3 query) and the same with a one-term query (fp8mma1: half the Q K^T products), every row checked
# against the reference in the same run (the fp8mma rows against the fp8 products' bound). An emulation of the
# kernel's rounding (plan.FP8_QUERY_TERMS) expects fp8mma1 outside that bound at DeepSeek's geometry: its rows then
# say NO and the bench exits 1 after printing the whole table.
# The device call (timeout_s 600):
#   command  MLAGEN_BENCH_COMMIT=<commit> bash benchmarks/h200_fp8_compute.sh [all|tests|bench]   (default all)
#   carry    [".whl"]
# H200_BUDGET_S: seconds for the whole job (default 520); a step that would pass it is cut short, and one that
# starts with less than 30 s left is not run.
# Back under $OUT: tests.log, bench.log, decode/decode.json (rewritten row by row, so a cut run keeps its rows),
# decode/decode.png, results.jsonl (the rows for benchmarks/results/results.jsonl).
mode=${1:-all}
case $mode in all | tests | bench) ;; *) echo "h200_fp8_compute.sh: unknown mode '$mode' (all, tests or bench)" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-520}
source benchmarks/job_steps.sh
mkdir -p "$out/decode"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit ${MLAGEN_BENCH_COMMIT:-?}; budget $budget s"
STEP_LINES='^(#|\||FAILED|PASSED|ERROR|SKIPPED|fp8 products|[0-9]+ (passed|failed)|=+ .*(passed|failed|error))'

if [ "$mode" = all ] || [ "$mode" = tests ]; then
  step tests 200 python3 -m pytest -p no:cacheprovider -rfEs --tb=short -s \
    tests/test_fp8_compute.py tests/test_decode.py -k "within_its_bound or gluon_narrow_and_wide"
fi
# (=NAME: exactly that case; bench_decode.py's --only)
cases="=H16 B128 S8192 Sq1 fix,=H16 B64 S32768,=H128 B128 S8192 Sq1 fix,=Mistral-S4 H32 B128 S8192"
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  step bench 300 python3 benchmarks/bench_decode.py --out "$out/decode" --only "$cases" --backends auto \
    --caches bf16,fp8,fp8mma,fp8mma1 --flash-mla none --append "$out/results.jsonl"
fi
