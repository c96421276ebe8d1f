#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, tenth session) on the final code: the word converter with its bulk L2 prefetch
# and the landing issuer's bulk prefetch of the next block.
#   bash benchmarks/device_session10_final.sh a   GPU tests of the landing producer and the fp8 decode; the main
#                                                 bench_decode cases, bf16 and fp8; H64 with and without the
#                                                 issuer's prefetch (fp8_converter_variants.py)
#   bash benchmarks/device_session10_final.sh b   the Gluon property test (ci profile); the latency cases, and
#                                                 H16 B64 S32768 again (its bare host time in a was 185 us)
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "(every_page_size and gluon and float8 and (64- or 128- or 256-)) or fp8_landing or (narrow_and_wide and float8) or fp8_decode" \
    2>&1 | tail -15 | tee "$OUT/pytest.log"
  timeout 230 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  timeout 120 python3 benchmarks/fp8_converter_variants.py --only "H64" --variants issuer_no_prefetch \
    --out "$OUT/variants" 2>&1 | tee "$OUT/variants_h64.log" | grep "^|"
  ;;
b)
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 250 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B1 S8192 graph,H128 B8 S8192 graph,H16 B64 S32768" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
esac
