#!/usr/bin/env bash
# On a Hopper GPU: compute-sanitizer racecheck on the warp-specialised Gluon decode, with its controls.
#   1. benchmarks/racecheck_controls.py: each control kernel plainly (results checked), then under racecheck
#      (analysis report, and the per-hazard report naming threads) -> racecheck-controls.log
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
  for name in ws_entry handoff_ok handoff_once handoff_nowait; do
    echo "### control $name: racecheck (analysis report)"
    timeout "$limit" "$cs" --tool racecheck --print-limit 100 python3 benchmarks/racecheck_controls.py "$name"
    echo "### control $name: exit $?"
  done
  for name in handoff_once handoff_nowait; do
    echo "### control $name: racecheck --racecheck-report hazard (first 24 hazards)"
    timeout "$limit" "$cs" --tool racecheck --racecheck-report hazard --print-limit 24 \
      python3 benchmarks/racecheck_controls.py "$name"
    echo "### control $name: exit $?"
  done
} > "$out/racecheck-controls.log" 2>&1
grep "^### control\|^control \|RACECHECK SUMMARY" "$out/racecheck-controls.log"

SANITIZE_PER_CASE=1 SANITIZE_TOOLS=${SANITIZE_TOOLS:-racecheck} SANITIZE_TIMEOUT_S=$limit \
  SANITIZE_KERNEL=${SANITIZE_KERNEL-_mla_decode_gluon_kernel} \
  scripts/sanitize.sh --backends gluon --merges fused,kernel --kernels decode "$@"
