#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): fp8 blocks landed by TMA in the upper half of their own
# float16 stage and widened there (the producer "land_stage", where the query fills the tile: H128), against the
# row-loading converters (convert_tall: the word converter; +whole_block: the one before this session) and with
# the issuer's L2 prefetches, in one process (fp8_converter_variants.py; every variant checked against the
# reference first); then the GPU tests of the fp8 Gluon decode.
# The producer and the variant convert_tall were reverted (slower: 684.3 against 612.0 us); apply
# benchmarks/results/land_stage_2026-11-26.patch to run this again.
#   bash benchmarks/device_land_stage.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/fp8_converter_variants.py --only "H128" \
  --variants convert_tall,convert_tall+whole_block,prefetch1,prefetch2 --out "$OUT/variants" 2>&1 \
  | tee "$OUT/variants.log" | grep "^|"
timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(gluon and float8) or fp8_landing or fp8_decode or in_their_stages" 2>&1 | tail -15 | tee "$OUT/pytest.log"
