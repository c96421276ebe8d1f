#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, eleventh session) on the final code. Both run the GPU tests of the landing
# producer and the fp8 decode and the Gluon property test (ci profile), then:
#   bash benchmarks/device_session11_final.sh a   the main bench_decode cases, bf16 and fp8 (the landing ring where
#                                                 the query takes the tile's upper half, 4 converting warps at
#                                                 Dc 256)
#   bash benchmarks/device_session11_final.sh b   (the ring for the query filling the tile too) Mistral-Small-4
#                                                 in bench_decode, Dc 256 H64 against landing apart in short
#                                                 blocks (fp8_converter_variants.py, variant apart_short)
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 220 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
  "landing_ring or fp8_landing or (narrow_and_wide and float8) or fp8_decode or two_row_blocks" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
MLAGEN_HYPOTHESIS_PROFILE=ci timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
  -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
case "${1:-a}" in
a)
  timeout 180 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  ;;
b)
  timeout 100 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "Mistral" 2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  timeout 120 python3 benchmarks/fp8_converter_variants.py --only "Dc256 H64" --variants apart_short \
    --out "$OUT/variants" 2>&1 | tee "$OUT/variants.log" | grep "^|"
  ;;
esac
