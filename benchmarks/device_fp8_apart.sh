#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eighth session): the fp8 Gluon decode's landing producer where the query
# fills one row block (Sq * H in 33..64: H64, H16 with Sq 3-4), its landing zone a buffer of its own beside
# 32-position stages (launch_policy.gluon_land_apart). Correctness on the GPU first (the fp8 decode tests at every
# page size with Sq 1..4; the off-word view; the narrow-and-wide and landing-apart tests; test_fp8.py), then the
# timing against bf16 and against the row-loading converter with 64-position blocks in the same process
# (fp8_converter_variants.py, variant "no_apart"), then the Gluon property test.
#   bash benchmarks/device_fp8_apart.sh [VARIANTS] [ONLY]   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(every_page_size and gluon and float8) or (off_word and float8) or (narrow_and_wide and float8) or landing_apart or test_fp8" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
timeout 200 python3 benchmarks/fp8_converter_variants.py --only "${2:-H64,H128}" --variants "${1:-no_apart}" \
  --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
  2>&1 | tail -15 | tee "$OUT/pytest_property.log"
