#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): Mistral-Small-4's warpgroups, which bound its fp8 decode
# once the cache is in L2 (device_land_ring_probe.sh): the narrow form 32 rows wide (bf16 and fp8) and the P V
# warpgroup's registers, with the cache in L2 and from memory (fp8_converter_variants.py; every variant checked).
#   bash benchmarks/device_mistral_consumer.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
for mode in --l2-resident ""; do
  timeout 200 python3 benchmarks/fp8_converter_variants.py --only "Mistral" $mode --bf16-variants narrow32 \
    --variants narrow32,pv184,pv168,land2w --out "$OUT/run${mode:+_l2}" 2>&1 \
    | tee "$OUT/run${mode:+_l2}.log" | grep "^|"
done
