#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eleventh session) on the final code (the fp8 landing ring, 4 converting warps
# at Dc 256): GPU tests of the landing producer and the fp8 decode, the Gluon property test (ci profile), and the
# main bench_decode cases, bf16 and fp8.
#   bash benchmarks/device_session11_final.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
  "landing_ring or fp8_landing or (narrow_and_wide and float8) or fp8_decode or two_row_blocks" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
MLAGEN_HYPOTHESIS_PROFILE=ci timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
  -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
timeout 180 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
  --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
  2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
