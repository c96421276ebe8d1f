#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): the word converter with its one bulk L2 prefetch of the next
# block (as landed), against it without (no_prefetch), two blocks ahead and the whole-block converter, in one
# process at H128 (fp8_converter_variants.py; every variant checked against the reference first); then the GPU
# tests of the fp8 Gluon decode (the two-row-block test among them).
#   bash benchmarks/device_word_prefetch.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/fp8_converter_variants.py --only "H128" \
  --variants no_prefetch,prefetch_next2,whole_block --out "$OUT/variants" 2>&1 \
  | tee "$OUT/variants.log" | grep "^|"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(gluon and float8) or fp8_landing or fp8_decode or two_row_blocks" 2>&1 | tail -15 | tee "$OUT/pytest.log"
