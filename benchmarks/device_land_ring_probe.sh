#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): what bounds the fp8 landing producer's cases now that more
# blocks can land at a time: Mistral-Small-4 and H16 with every sequence reading the first sequence's pages (the
# cache stays in L2; fp8_converter_variants.py --l2-resident), bf16 and fp8, one and two landing slots, and the
# probe apart_noconv (the converter stores nothing: wrong output by design, timed anyway).
#   bash benchmarks/device_land_ring_probe.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/fp8_converter_variants.py --only "Mistral,H16 B128" --l2-resident \
  --variants ring1,ring2,ring2+apart_noconv --out "$OUT/l2" 2>&1 | tee "$OUT/l2.log" | grep "^|"
timeout 200 python3 benchmarks/fp8_converter_variants.py --only "Mistral,H16 B128" \
  --variants ring1,ring2,ring2+apart_noconv --out "$OUT/hbm" 2>&1 | tee "$OUT/hbm.log" | grep "^|"
