#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): the word converter as landed, against the whole-block one and
# with one bulk L2 prefetch of a block, one or two blocks ahead (fp8_converter_variants.py at H128; every variant checked
# against the reference first); then the GPU tests of the fp8 Gluon decode (the two-row-block test among them).
# conv_bulk1 became the shipped prefetch and conv_bulk2 the variant prefetch_next2 (device_word_prefetch.sh runs
# them now).
#   bash benchmarks/device_word_converter_final.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/fp8_converter_variants.py --only "H128" --variants whole_block,conv_bulk1,conv_bulk2 \
  --out "$OUT/variants" 2>&1 | tee "$OUT/variants.log" | grep "^|"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(gluon and float8) or fp8_landing or fp8_decode or two_row_blocks" 2>&1 | tail -15 | tee "$OUT/pytest.log"
