#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session): the fp8 landing producer with several blocks landing at a
# time in a ring of its own (gluon_land_ring) against one block in the query tile's lower half (variant ring1, the
# form before), Mistral-Small-4 in one process (fp8_converter_variants.py; every variant checked against the
# reference first); then the GPU tests of the landing producer.
#   bash benchmarks/device_land_ring.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/fp8_converter_variants.py --only "Mistral" \
  --variants ring1,ring2,ring4,ring_s3,ring2+ring_s3 --out "$OUT/variants" 2>&1 \
  | tee "$OUT/variants.log" | grep "^|"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "landing_ring or fp8_landing or (narrow_and_wide and float8) or fp8_decode" 2>&1 | tail -15 \
  | tee "$OUT/pytest.log"
