#!/usr/bin/env bash
# One device call (H100, 2026-11-23, sixth session): the landing producer of the fp8 Gluon decode (fp8 blocks
# landed by TMA in the query tile's unused lower half). Correctness on the GPU first (the fp8 decode tests at
# page sizes 16 (row-loading converter), 64, 128, 256 with Sq 1..4, so both producers run (landing where
# Sq * H <= 32); the off-word cache view; test_fp8.py), then the timing against bf16 and against the
# row-loading converter in the same process (fp8_converter_variants.py, variant "convert"), then the Gluon
# property test with what time is left.
#   bash benchmarks/device_fp8_land.sh [VARIANTS] [ONLY]   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(every_page_size and gluon and float8 and (16- or 64- or 128- or 256-)) or (off_word and float8) or test_fp8" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
timeout 200 python3 benchmarks/fp8_converter_variants.py --only "${2:-H16,Mistral}" --variants "${1:-convert}" \
  --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
timeout 140 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
  2>&1 | tail -15 | tee "$OUT/pytest_property.log"
