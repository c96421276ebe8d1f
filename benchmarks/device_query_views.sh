#!/usr/bin/env bash
# One device call (H100, 2026-11-26, ninth session): the query tile's MMA descriptors kept in the block loop (rows
# as M), against hoisted ("hoisted": the form before) in one process, bf16 and fp8, at H128 (with converter register
# splits beside), H64 and Mistral-Small-4 (fp8_converter_variants.py); then the rows-as-M latency cases of the
# committed code (a worktree of HEAD) and of the working tree in turn (latency_probe.py --runs).
#   bash benchmarks/device_query_views.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/fp8_converter_variants.py --only "H128" --variants hoisted,conv112,conv120,pv160 \
  --bf16-variants hoisted --out "$OUT/h128" 2>&1 | tee "$OUT/variants_h128.log" | grep "^|"
timeout 160 python3 benchmarks/fp8_converter_variants.py --only "H64,Mistral" --variants hoisted \
  --bf16-variants hoisted --out "$OUT/h64" 2>&1 | tee "$OUT/variants_h64_mistral.log" | grep "^|"
git worktree add -q /tmp/base HEAD 2>/dev/null || git -c safe.directory='*' worktree add -q /tmp/base HEAD
for tree in /tmp/base .; do
  (cd "$tree" && timeout 80 python3 benchmarks/latency_probe.py --runs --only "B1 H128,B8 H128,skewed Sq4" 2>&1 \
    | grep "^[A-Za-z].* | " | grep -v "sequence-runs" | sed "s|^|$tree: |") | tee -a "$OUT/latency_query_views.log"
done
