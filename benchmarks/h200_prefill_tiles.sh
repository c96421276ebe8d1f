#!/usr/bin/env bash
# The Gluon prefill's persistent kernel with contiguous chunks on the H200 (issue 43; MLAGEN_PREFILL_TILE_CHUNK=N:
# ceil(tiles / N) programs of N consecutive tiles each) in one device call of at most ~400 s, separating what the
# persistent code costs (chunk 1: its code on the tile kernel's grid) from what its static schedule costs (the
# stride over a program per SM) and what the overlap gains with the hardware still balancing programs (chunk 2, 4).
# First its GPU tests (test_prefill.py's fixed chunked cases: chunk 1-3 and the stride on 3 programs, bit for bit
# against the tile-per-program kernel and against the reference, causal and prefix), then prefill_lengths.py with
# the variants gluon, gluon-persistent, gluon-chunk1, gluon-chunk2 and gluon-chunk4 (each checked against the
# reference, then timed beside cuDNN at a fixed token count), H128 and H16.
#   command  bash benchmarks/h200_prefill_tiles.sh [all|tests|bench]   (default all)
#   carry    [".whl"]
# H200_BUDGET_S: seconds for the whole job (default 400). Back under $OUT: tests.log, lengths_h128.log,
# lengths_h16.log.
mode=${1:-all}
case $mode in all | tests | bench) ;; *) echo "h200_prefill_tiles.sh: unknown mode '$mode'" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-400}
source benchmarks/job_steps.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "budget $budget s"
STEP_LINES='^(# |B[0-9]+ S[0-9]+|FAILED|ERROR|Timeout|[0-9.]+s (call|setup) |.*(passed|failed|skipped) in )'
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  step tests 150 python3 -m pytest -v -p no:cacheprovider -rfEs --tb=short --durations=8 \
    -o faulthandler_timeout=100 -k "chunked_persistent" tests/test_prefill.py
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  step lengths_h128 150 python3 benchmarks/probes/prefill_lengths.py --persistent --chunks 1,2,4 --no-triton \
    --heads 128 --tokens 16384 --lengths 1024,2048,4096,16384
  step lengths_h16 100 python3 benchmarks/probes/prefill_lengths.py --persistent --chunks 1,2,4 --no-triton \
    --heads 16 --tokens 32768 --lengths 1024,4096,16384
fi
