#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): landing apart at Dc 256 (64 query rows: the query fills
# the tile) in 64-position blocks with a landing ring of its own (variants apart_ring2 / apart_ring3) against the
# 32-position blocks of landing apart; fp8_converter_variants.py, every variant checked against the reference.
#   bash benchmarks/device_dc256_apart_ring.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 250 python3 benchmarks/fp8_converter_variants.py --only "Dc256 H64" --variants apart_ring2,apart_ring3 \
  --out "$OUT/run" 2>&1 | tee "$OUT/run.log" | grep "^|"
