#!/usr/bin/env bash
# cache_compute fp8 on the H200 (issue 44) in one device call of at most 8 minutes: the GPU tests of the fp8
# products (tests/test_fp8_compute.py: the float64 reference on the dequantised cache, within the bound chosen before
# any run; poisoned unused cache slots and outputs; and the routing: past the narrow form a cache_compute fp8 launch
# runs the exact path, bit for bit) and the exact Gluon decode's narrow / wide test beside them; the parts probe
# (benchmarks/probes/fp8_compute_parts.py: full, exact and slots4 checked, no-v timing only: no V read into the P V's
# A operand) on DeepSeek H16 B128 S8192; then bench_decode.py on DeepSeek H16 B128 S8192, H16 B64 S32768 (the narrow
# form: the products), H128 B128 S8192 and Mistral-Small-4 H32 B128 S8192 (routed to the exact path: the fp8mma row
# is the exact kernel's, its config column without " fp8mma") with the bf16 cache, the fp8 cache (exact) and the fp8
# cache with cache_compute fp8 (fp8mma), every row checked against the reference in the same run (the fp8mma rows
# against the fp8 products' bound).
# The device call (timeout_s 600):
#   command  MLAGEN_BENCH_COMMIT=<commit> bash benchmarks/h200_fp8_compute.sh [all|tests|probe|bench]   (default all)
#   carry    [".whl"]
# H200_BUDGET_S: seconds for the whole job (default 470); a step that would pass it is cut short, and one that
# starts with less than 30 s left is not run.
# Back under $OUT (6 files): tests.log, probe_deepseek.log, bench.log, decode/decode.json
# (rewritten row by row, so a cut run keeps its rows), decode/decode.png, results.jsonl (the rows for
# benchmarks/results/results.jsonl).
mode=${1:-all}
case $mode in all | tests | probe | bench) ;; *) echo "h200_fp8_compute.sh: unknown mode '$mode' (all, tests, probe or bench)" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-470}
source benchmarks/job_steps.sh
mkdir -p "$out/decode"
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit ${MLAGEN_BENCH_COMMIT:-?}; budget $budget s"
STEP_LINES='^(#|\||FAILED|PASSED|ERROR|SKIPPED|fp8 products|[0-9]+ (passed|failed)|=+ .*(passed|failed|error)| +(full|no-v|exact|slots4):)'

if [ "$mode" = all ] || [ "$mode" = tests ]; then
  step tests 170 python3 -m pytest -p no:cacheprovider -rfEs --tb=short -s \
    tests/test_fp8_compute.py tests/test_decode.py -k "within_its_bound or past_the_narrow_form or gluon_narrow_and_wide"
fi
if [ "$mode" = all ] || [ "$mode" = probe ]; then
  step probe_deepseek 90 python3 benchmarks/probes/fp8_compute_parts.py --variants full,no-v,exact,slots4
fi
# (=NAME: exactly that case; bench_decode.py's --only)
cases="=H16 B128 S8192 Sq1 fix,=H16 B64 S32768,=H128 B128 S8192 Sq1 fix,=Mistral-S4 H32 B128 S8192"
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  step bench 180 python3 benchmarks/bench_decode.py --out "$out/decode" --only "$cases" --backends auto \
    --caches bf16,fp8,fp8mma --flash-mla none --append "$out/results.jsonl"
fi
