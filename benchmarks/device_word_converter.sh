#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): the row-loading fp8 converter that keeps the next block's rows
# in flight as 32-bit words, against the whole-block converter before it ("whole_block") and register splits, in
# one process at H128 and H64 (fp8_converter_variants.py; every variant checked against the reference first); then
# the GPU tests of the fp8 Gluon decode (every page size, rows off 4-byte words, landing apart / row loading).
#   bash benchmarks/device_word_converter.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 260 python3 benchmarks/fp8_converter_variants.py --only "H128,H64" --variants whole_block,conv112,conv120 \
  --out "$OUT/variants" 2>&1 | tee "$OUT/variants.log" | grep "^|"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(gluon and float8) or fp8_landing or fp8_decode" 2>&1 | tail -15 | tee "$OUT/pytest.log"
