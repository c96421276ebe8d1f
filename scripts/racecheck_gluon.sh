#!/usr/bin/env bash
# On a Hopper GPU: compute-sanitizer racecheck on the warp-specialised Gluon decode, with its controls.
#   1. benchmarks/racecheck_controls.py: each control kernel plainly (results checked), then under racecheck
#      (analysis report, and the per-hazard report naming threads) -> racecheck-controls.log
#      and the per-hazard report of one decode case -> racecheck-decode-hazards.log
#   2. every Gluon decode case of benchmarks/sanitize_cases.py (both merges), one process per case under
#      racecheck, only the Gluon kernel instrumented -> sanitize-{plain,racecheck}.log, sanitize-summary.md
# Logs in ${OUT:-/tmp}. Environment: as scripts/sanitize.sh (SANITIZE_TIMEOUT_S, SANITIZE_JOBS, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}
export COMPUTE_SANITIZER=$cs
limit=${SANITIZE_TIMEOUT_S:-240}
{
  echo "### $("$cs" --version | tail -1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  timeout "$limit" python3 benchmarks/racecheck_controls.py
  echo "### plain run: exit $?"
  controls=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import racecheck_controls as c; print(*c.CONTROLS)")
  for name in $controls ws_entry handoff_once handoff_ok; do  # (the first three twice: are reports repeatable?)
    echo "### control $name: racecheck (analysis report)"
    timeout "$limit" "$cs" --tool racecheck --print-limit 100 python3 benchmarks/racecheck_controls.py "$name"
    echo "### control $name: exit $?"
  done
  for name in handoff_once handoff_nosync; do
    echo "### control $name: racecheck --racecheck-report hazard (first 24 hazards)"
    timeout "$limit" "$cs" --tool racecheck --racecheck-report hazard --print-limit 24 --show-backtrace no \
      python3 benchmarks/racecheck_controls.py "$name"
    echo "### control $name: exit $?"
  done
  for name in handoff_once handoff_ok; do
    echo "### control $name: racecheck --racecheck-trace-sync yes (the synchronisation racecheck sees; 400 lines)"
    timeout "$limit" "$cs" --tool racecheck --racecheck-trace-sync yes --show-backtrace no \
      python3 benchmarks/racecheck_controls.py "$name" 2>&1 | head -400
  done
} > "$out/racecheck-controls.log" 2>&1
grep "^### control\|^control \|RACECHECK SUMMARY" "$out/racecheck-controls.log"

# one decode case per hazard, naming the threads (RAW or WAR, writer and reader)
echo "### decode san-page16 Sq3 fused: racecheck --racecheck-report hazard (first 16)" > "$out/racecheck-decode-hazards.log"
timeout "$limit" "$cs" --tool racecheck --racecheck-report hazard --print-limit 16 --show-backtrace no \
  --kernel-name "kns=${SANITIZE_KERNEL-_mla_decode_gluon_kernel}" python3 benchmarks/sanitize_cases.py \
  --specs san-page16 --kernels decode --cases 1 --backends gluon --merges fused >> "$out/racecheck-decode-hazards.log" 2>&1 &
hazards=$!

SANITIZE_PER_CASE=1 SANITIZE_TOOLS=${SANITIZE_TOOLS:-racecheck} SANITIZE_TIMEOUT_S=$limit \
  SANITIZE_KERNEL=${SANITIZE_KERNEL-_mla_decode_gluon_kernel} \
  scripts/sanitize.sh --backends gluon --merges fused,kernel --kernels decode "$@"
status=$?
wait $hazards
exit $status
