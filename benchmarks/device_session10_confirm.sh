#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): the final code (the prefetch helper computing the block's
# address itself, the TMA producer's prefetch reverted): GPU tests of the landing producer and the row-loading
# converter, then fp8 against bf16 at H16 B128 and H128 B128 (fp8_converter_variants.py, every row checked).
#   bash benchmarks/device_session10_confirm.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
  "(every_page_size and gluon and float8 and (16- or 64- or 256-)) or fp8_landing or two_row_blocks or off_word" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
timeout 120 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H128" --variants "" --out "$OUT/variants" \
  2>&1 | tee "$OUT/variants.log" | grep "^|"
