#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): the other fp8 landing forms at Dc 256, which the landing
# ring and the 4 converting warps (rows as M) also reach: 16 query rows (the narrow form: one landing block
# against the ring) and 64 (landing apart: 2 converting warps against 4); fp8_converter_variants.py, every
# variant checked against the reference.
#   bash benchmarks/device_dc256_forms.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 250 python3 benchmarks/fp8_converter_variants.py --only "Dc256" --variants ring1,land2w \
  --out "$OUT/run" 2>&1 | tee "$OUT/run.log" | grep "^|"
