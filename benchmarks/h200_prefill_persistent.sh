#!/usr/bin/env bash
# The Gluon prefill's persistent variant on the H200 (issue 43; MLAGEN_PREFILL_PERSISTENT=1) in one device call of
# at most 9 minutes: its GPU tests first (the prefill property tests of both Gluon variants against the reference,
# the persistent kernel on 1-3 programs bit for bit against the tile-per-program kernel, causal and prefix), then
# prefill_lengths.py --persistent (each variant checked against the reference, then timed beside cuDNN, at a fixed
# token count and sequence lengths 1024-16384, H128 and H16).
#   command  bash benchmarks/h200_prefill_persistent.sh [all|tests|bench]   (default all)
#   carry    [".whl"]
# H200_BUDGET_S: seconds for the whole job (default 520). Back under $OUT: tests.log, lengths_h128.log,
# lengths_h16.log.
mode=${1:-all}
case $mode in all | tests | bench) ;; *) echo "h200_prefill_persistent.sh: unknown mode '$mode'" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-520}
source benchmarks/job_steps.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "budget $budget s"
STEP_LINES='^(# |B[0-9]+ S[0-9]+|FAILED|ERROR|Timeout|[0-9.]+s (call|setup) |.*(passed|failed) in )'
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci step tests 240 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short \
    --durations=8 -o faulthandler_timeout=100 -k "gluon" tests/test_prefill.py
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  step lengths_h128 150 python3 benchmarks/probes/prefill_lengths.py --persistent --no-triton --heads 128
  step lengths_h16 100 python3 benchmarks/probes/prefill_lengths.py --persistent --no-triton --heads 16 \
    --tokens 32768
fi
