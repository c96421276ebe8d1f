#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): the fp8 landing ring's depth (1, 2, 3 slots) and 4
# converting warps instead of 2, Mistral-Small-4 in one process, twice (fp8_converter_variants.py; every variant
# checked against the reference first).
#   bash benchmarks/device_land_ring_warps.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
for run in 1 2; do
  timeout 200 python3 benchmarks/fp8_converter_variants.py --only "Mistral" \
    --variants ring1,ring2,ring3,ring2+land4w,ring3+land4w,ring1+land4w --out "$OUT/run$run" 2>&1 \
    | tee "$OUT/run$run.log" | grep "^|"
done
