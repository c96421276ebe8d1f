#!/usr/bin/env bash
# One device call (H100, 2026-11-26, twelfth session) on the final kernel code (the next block's L2 prefetch
# computed by one helper in both fp8 producers): the GPU tests of both producers that prefetch (the landing
# producer: ring, one block, landing apart; the row-loading converter: two row blocks), then fp8 against bf16 at
# H16 B128 (landing producer) and H128 B128 (row-loading converter), and Mistral-Small-4 with its blocks loaded
# row by row instead of landed in the ring (variant convert).
#   bash benchmarks/device_session12_final.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
  "landing_ring or fp8_landing or (narrow_and_wide and float8) or fp8_decode or two_row_blocks" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
timeout 150 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H128" --variants "" \
  --out "$OUT/deepseek" 2>&1 | tee "$OUT/deepseek.log" | grep "^|"
timeout 100 python3 benchmarks/fp8_converter_variants.py --only "Mistral" --variants convert \
  --out "$OUT/mistral" 2>&1 | tee "$OUT/mistral.log" | grep "^|"
