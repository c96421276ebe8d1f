#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, thirteenth session) on the Gluon block choice gathered into one launch-policy
# function (launch_policy.gluon_blocks; the schedules are the same as before for every bundled spec, checked on
# the CPU):
#   bash benchmarks/device_session13.sh a   the GPU tests of every block choice (long, short, landing ring,
#                                           landing apart, row loading) and the fp8 decode; the main bench_decode
#                                           cases, bf16 beside fp8
#   bash benchmarks/device_session13.sh b   issue 11's latency cases (graph replay, both caches); the short blocks'
#                                           fewest blocks a run: the plan's 5 against 10 (the cost rule's positions)
#   bash benchmarks/device_session13.sh c   the fp8 landing policy on or off in the latency regime (latency_probe.py
#                                           --cache fp8 --landing: the skewed Sq4 batch, Mistral-Small-4 B8)
#   bash benchmarks/device_session13.sh d   landing apart only beyond the small batches: its GPU test, the fp8
#                                           latency cases, 64 query rows at B16 / B32 / B128 (variant no_apart, a
#                                           variant removed with landing apart itself, after this call)
#   bash benchmarks/device_session13.sh e   landing apart dropped: the fp8 GPU tests, auto at 64 query rows, the
#                                           landing producer against rows loaded where it stays (variant convert)
#   bash benchmarks/device_session13.sh f   B8 H16's run counts (both caches), B1 H16's default sweep
#   bash benchmarks/device_session13.sh g   the Gluon decode tests (test_decode.py -k gluon, ci profile)
#   bash benchmarks/device_session13.sh h   the rest of g's tests (but those of a and e); test_fp8.py,
#                                           test_gluon_backend.py, test_prepared_launch.py
#   bash benchmarks/device_session13.sh i   short blocks forced on and off with an fp8 cache (latency cases)
#   bash benchmarks/device_session13.sh j   short blocks for fp8 caches whose rows are loaded: tests, latency cases
#   bash benchmarks/device_session13.sh k   the final template: the landing producer's tests, fp8 where it lands
#   bash benchmarks/device_session13.sh l   the row-loading converter's settings at H64 B128 fp8
#   bash benchmarks/device_session13.sh m   both merges where auto fuses, both caches
#   bash benchmarks/device_session13.sh n   the narrow form's var-length cases with both merges, twice
#   bash benchmarks/device_session13.sh o   its equal-length cases with both merges, twice
#   bash benchmarks/device_session13.sh p   auto keeps the combine launch for the narrow form: tests, main cases
#   bash benchmarks/device_session13.sh q   every page size with an fp8 cache on the final code
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "long_and_tuned or short_and_tuned or landing_apart or landing_ring or two_row_blocks or fp8_decode" \
    2>&1 | tail -15 | tee "$OUT/pytest.log"
  timeout 300 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  ;;
b)
  timeout 280 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B1 S8192 graph" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#"
  timeout 250 python3 benchmarks/latency_probe.py --minblocks --only "B1 H128,Sq4" 2>&1 \
    | tee "$OUT/minblocks.log" | grep -v "^#"
  ;;
esac
# d: landing apart only beyond the small batches (gluon_land_apart): its GPU test; the latency cases with an fp8
# cache; 64 query rows at B16 / B32 / B128 landing apart against rows loaded (variant no_apart)
if [ "${1:-a}" = d ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "landing_apart" 2>&1 | tail -5 \
    | tee "$OUT/pytest_apart.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 --backends gluon \
    --only "skewed4,H128 B1 S8192 graph" 2>&1 | tee "$OUT/bench_latency.log" | grep "^|"
  timeout 180 python3 benchmarks/fp8_converter_variants.py --only "H64" --variants no_apart --out "$OUT/apart" 2>&1 \
    | tee "$OUT/apart.log" | grep "^|"
fi
# e: the 32-position blocks landing apart dropped (gluon_blocks): the GPU tests of every fp8 producer; auto on
# 64 query rows at Dc 512 (H64 B128, the skewed Sq4 batch); the landing producer against rows loaded (variant
# convert) where it stays: 16 and 32 query rows at Dc 512, 64 (the ring) and 32 at Dc 256
if [ "${1:-a}" = e ]; then
  timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "query_filling or landing_ring or two_row_blocks or fp8_decode or (narrow_and_wide and float8)" 2>&1 | tail -5 \
    | tee "$OUT/pytest_fp8.log"
  timeout 150 python3 benchmarks/bench_decode.py --out "$OUT/auto" --caches bf16,fp8 --backends gluon \
    --only "H64 B128 S8192 Sq1 fix,skewed4 Sq4" 2>&1 | tee "$OUT/bench_auto.log" | grep "^|"
  timeout 170 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H32 B128,Dc256 H64,Mistral" \
    --variants convert --out "$OUT/convert" 2>&1 | tee "$OUT/convert.log" | grep "^|"
fi
# f: the two latency cases still missed (B8 H16, B1 H16; bf16): the Gluon kernel's run counts at B8 H16 (both
# caches), and the default sweep of both backends at B1 H16
if [ "${1:-a}" = f ]; then
  for cache in bf16 fp8; do
    timeout 150 python3 benchmarks/latency_probe.py --parts --only "B8 H16" --cache $cache 2>&1 \
      | tee "$OUT/parts_b8h16_$cache.log" | grep -v "^#"
  done
  timeout 200 python3 benchmarks/latency_probe.py --only "B1 H16" 2>&1 | tee "$OUT/sweep_b1h16.log" | grep -v "^#"
fi
# g, h: the GPU tests on the final code: g the Gluon decode tests (the property test in the ci profile), h the fp8,
# Gluon-backend and prepared-launch tests
if [ "${1:-a}" = g ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 570 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k gluon \
    2>&1 | tail -15 | tee "$OUT/pytest_decode_gluon.log"
fi
if [ "${1:-a}" = h ]; then
  # (g ran 42 of its 83 tests in its 570 s, every one passed: the rest but those run in a and e)
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k \
    "gluon and (partial_rows or skewed_small_batch or fused_merge_trees or off_word or combine_merges)" 2>&1 \
    | tail -15 | tee "$OUT/pytest_decode_gluon_rest.log"
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 340 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py \
    tests/test_gluon_backend.py tests/test_prepared_launch.py 2>&1 | tail -15 | tee "$OUT/pytest_fp8_backend.log"
fi
# i: short blocks (32 positions, a ring of 3) with an fp8 cache, whose rows the converter loads (the launch
# policy keeps them for 16-bit caches): forced on and off at B1 H128, B8 H128 and the skewed Sq4 batch
if [ "${1:-a}" = i ]; then
  timeout 250 python3 benchmarks/latency_probe.py --cache fp8 --blocks --only "B1 H128,B8 H128,Sq4" 2>&1 \
    | tee "$OUT/fp8_short_blocks.log" | grep -v "^#"
fi
# j: short blocks with an fp8 cache whose rows are loaded (gluon_blocks): their GPU tests and test_fp8.py; the fp8
# latency cases they take
if [ "${1:-a}" = j ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py \
    tests/test_fp8.py -k "query_filling or short_and_tuned or test_fp8" 2>&1 | tail -5 | tee "$OUT/pytest_short_fp8.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 --backends gluon \
    --only "H128 B1 S8192 graph,skewed4 Sq4" 2>&1 | tee "$OUT/bench_latency.log" | grep "^|"
fi
# k: the landing issuer deriving its OWN (the final template): the landing producer's GPU tests; fp8 beside bf16
# where it lands (H16 B128, Mistral-Small-4)
if [ "${1:-a}" = k ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py \
    tests/test_fp8.py -k "landing_ring or (narrow_and_wide and float8) or (every_page_size and gluon and float8)" \
    2>&1 | tail -5 | tee "$OUT/pytest_landing.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,Mistral-S4 H32 B128 S8192" 2>&1 | tee "$OUT/bench_main.log" | grep "^|"
fi
# l: the row-loading converter's settings where 64 query rows now take it (H64 B128, Dc 512): 8 converting warps,
# its registers, the P V warpgroup's
if [ "${1:-a}" = l ]; then
  timeout 300 python3 benchmarks/fp8_converter_variants.py --only "H64 B128" --variants conv8w,conv80,conv128,pv160 \
    --out "$OUT/h64" 2>&1 | tee "$OUT/h64_converter.log" | grep "^|"
fi
# m: decode_merge's rule (fused where sequences average at most about five runs, measured 2026-11-22) on today's
# kernels: both merges where auto fuses, both caches
if [ "${1:-a}" = m ]; then
  timeout 400 python3 benchmarks/bench_decode.py --out "$OUT/merges" --caches bf16,fp8 --backends gluon \
    --merges fused,kernel --only "H128 B32,H16 B64 S32768,H16 B128 S8192 Sq1 var,H64 B128 S8192 Sq1 var" 2>&1 \
    | tee "$OUT/merges.log" | grep "^|"
fi
# n: the narrow form (16 query rows) with both merges, twice, where call m had the combine launch ahead
if [ "${1:-a}" = n ]; then
  for run in 1 2; do
    timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/narrow_merges_$run" --caches bf16,fp8 --backends gluon \
      --merges fused,kernel --only "H16 B128 S8192 Sq1 var,H16 B128 S4096 Sq1 var" 2>&1 \
      | tee "$OUT/narrow_merges_$run.log" | grep "^|"
  done
fi
# o: the narrow form's equal-length cases with both merges, twice (no sequence split at H16 B128 S8192)
if [ "${1:-a}" = o ]; then
  for run in 1 2; do
    timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/narrow_fix_$run" --caches bf16,fp8 --backends gluon \
      --merges fused,kernel --only "H16 B128 S8192 Sq1 fix,H16 B64 S32768" 2>&1 \
      | tee "$OUT/narrow_fix_$run.log" | grep "^|"
  done
fi
# p: auto keeps the combine launch for the narrow form (decode_merge): its GPU tests; the narrow main cases by auto
if [ "${1:-a}" = p ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py \
    tests/test_fp8.py tests/test_gluon_backend.py -k "narrow_and_wide or test_fp8 or merge or gluon_backend" 2>&1 \
    | tail -5 | tee "$OUT/pytest_merge.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/auto" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq1 var,H16 B64 S32768" 2>&1 | tee "$OUT/bench_auto.log" | grep "^|"
fi
# q: every page size with an fp8 cache on the final code (Sq 3 takes the short blocks with rows loaded)
if [ "${1:-a}" = q ]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k "every_page_size and gluon and float8" \
    2>&1 | tail -5 | tee "$OUT/pytest_pages_fp8.log"
fi
# c: the fp8 landing policy in the latency regime (a zone apart for the skewed Sq4 batch, the ring for
# Mistral-Small-4 B8) against the tuned blocks, graph-replayed
if [ "${1:-a}" = c ]; then
  timeout 280 python3 benchmarks/latency_probe.py --cache fp8 --landing --only "Sq4,Mistral" 2>&1 \
    | tee "$OUT/landing_latency.log" | grep -v "^#"
fi
