#!/usr/bin/env bash
# Device calls of 2026-11-25 (H100). Run from the repo root after the .whl install line (device README):
#   bash benchmarks/device_2026-11-25.sh tests [ONLY [CACHES]]   the Gluon decode's GPU tests (every producer;
#                                      TESTS_K=... another -k), then bench_decode.py on the cases ONLY names, if given
#   bash benchmarks/device_2026-11-25.sh variants [ONLY [VARIANTS]]   fp8_converter_variants.py
#   bash benchmarks/device_2026-11-25.sh compare [ONLY]   GPU tests, then compare_modules.py .before/ vs generated/
#   bash benchmarks/device_2026-11-25.sh property   the Gluon decode's Hypothesis property test
#   bash benchmarks/device_2026-11-25.sh fp8 [ONLY [VARIANTS]]   fp8 landing-producer tests, then bf16 vs fp8 timings
#   bash benchmarks/device_2026-11-25.sh bench [ONLY [CACHES]]   bench_decode.py, both backends
#   bash benchmarks/device_2026-11-25.sh narrow   the narrow form (query rows as the MMAs' N): GPU tests, the
#                                      Gluon property test, fp8 and bf16 narrow against wide, compare_modules.py
#                                      (bf16, .before/ = the wide form) and the latency cases
#   bash benchmarks/device_2026-11-25.sh narrow16   the narrow form as shipped (16 rows): GPU tests, the Gluon
#                                      property test (ci profile), bench_decode.py (bf16 and fp8, Gluon) and the
#                                      latency cases (bf16, both backends)
#   bash benchmarks/device_2026-11-25.sh land4   the fp8 landing producer's GPU tests (4 converting warps with the
#                                      narrow form), the Gluon property test, bf16 against fp8 timings (Gluon)
#   bash benchmarks/device_2026-11-25.sh ring   the same for the landing ring of half blocks (3 slots below the
#                                      narrow form's 16 query rows, 2 below 32), H16 Sq2 (2 slots) timed too
#                                      (ran at c77cb32: correct and slower, reverted; the mode now times main)
#   bash benchmarks/device_2026-11-25.sh profile   where the narrow form's time goes: ncu of one fp8 and one bf16
#                                      H16 B128 S8192 launch (stalls per partition, shared-memory and throughput
#                                      sections), then latency_probe.py's sweep of the H16 latency cases
#   bash benchmarks/device_2026-11-25.sh group   landing pieces of plan.LAND_GROUP chunks: the fp8 landing
#                                      producer's GPU tests, narrow and wide, the Gluon property test, then the
#                                      group variants (1: a handshake per chunk as before, 4, 8) against the
#                                      shipped 2, bf16 beside them
#   bash benchmarks/device_2026-11-25.sh latency   latency_probe.py --parts (the Gluon kernel at several run counts)
#                                      on the H16 latency cases, then bench_decode.py's latency cases with both caches
#   bash benchmarks/device_2026-11-25.sh final   the Gluon property test (ci profile: 50 examples), then
#                                      bench_decode.py: the large cases (Gluon, both caches) and the latency cases
#                                      (run 17:49 UTC: the property test met its 170 s limit on a cold machine)
#   bash benchmarks/device_2026-11-25.sh confirm   the Gluon property test (ci profile, 330 s limit), then the
#                                      narrow latency cases with both caches (bench_decode.py)
#   bash benchmarks/device_2026-11-25.sh runs   runs of one sequence each for small batches (SEQUENCE_RUNS): GPU
#                                      tests (merges, skewed batches, the schedule), then latency_probe.py --runs
#                                      (runs of one sequence each against equal runs, in turn; ran 19:23 UTC with
#                                      the policy then: every small batch, both backends)
#   bash benchmarks/device_2026-11-25.sh steps   latency_probe.py --steps: the combine's runs a step x1, x2, x4
#   bash benchmarks/device_2026-11-25.sh threadsteps   at most 64 fp32 a thread a combine step for 2-warp programs in
#                                      crowded grids: GPU tests, latency_probe.py --thread-steps, the latency cases
#   (an "order" mode ran 00:03 UTC: the combine's programs by their sequence's runs, most first; correct and
#    slower, reverted: benchmarks/results/combine_runs_first_*)
#   (a "spread" mode ran 23:42-00:01 UTC: every run of a split sequence merging a share of it in the split launch,
#    a cooperative launch; correct and slower, reverted: benchmarks/results/spread_merge_*)
#   bash benchmarks/device_2026-11-25.sh latency_final   bench_decode.py's latency cases, both caches
#   bash benchmarks/device_2026-11-25.sh partials   partial rows in the output's dtype (fifth session): GPU tests
#                                      with the policy then (in dtype everywhere), latency_probe.py --partials on
#                                      every latency case, then --runs on the narrow form's cases (loop-free runs)
#   bash benchmarks/device_2026-11-25.sh keep   partial rows kept in L2 by cache hints: GPU tests, latency_probe.py
#                                      --keep on every latency case, the portable kernel's --partials on every
#                                      latency case, then bench_decode.py's latency cases (both caches)
#   bash benchmarks/device_2026-11-25.sh combine   where the combine launch's time goes: combine_timeline_probe.py on
#                                      the latency cases, then latency_probe.py --tiles on the Sq4 and B8 H128 cases
#   bash benchmarks/device_2026-11-25.sh retune   mlagen tune of the fp8 DeepSeek spec's Gluon bucket (registers,
#                                      stages; the narrow landing form since its last tuning) into $OUT/tune.json,
#                                      then bench_decode.py's large cases (Gluon, both caches)
#   bash benchmarks/device_2026-11-25.sh maxnreg   latency_probe.py --maxnreg: the combine kernel's registers capped
#                                      (ptxas' choice, 96, 80) on the skewed, B8 and B1 H16 cases
#                                      (ran 21:20 UTC on a tree with DECODE_COMBINE_MAXNREG: slower everywhere,
#                                      reverted with the probe's option)
#   bash benchmarks/device_2026-11-25.sh pipeline   the combine's loop software-pipelined: GPU tests of the combine
#                                      (many runs in steps, skewed batches), latency_probe.py --pipeline (ran 21:08
#                                      UTC on a tree with DECODE_COMBINE_STAGES: slower everywhere, reverted; the
#                                      mode's probe option is gone with it)
#   bash benchmarks/device_2026-11-25.sh confirm2   the Gluon property test (ci profile), then gluon_timeline_probe.py
#                                      on the skewed Sq4 batch
#   bash benchmarks/device_2026-11-25.sh tall   the same, runs of one sequence each for tall rows only: GPU tests,
#                                      latency_probe.py --runs, bench_decode.py's latency cases (both caches)
#   bash benchmarks/device_2026-11-25.sh short   32-position blocks in a ring of 3 for small batches with rows as
#                                      M (gluon_short_blocks): GPU tests (both block sizes, every page size 16-64,
#                                      merges, partial rows), latency_probe.py --blocks (short against tuned
#                                      blocks, in turn), bench_decode.py's latency cases (bf16), then the Gluon
#                                      property test
# (run 1 of the day, "tests" with the page-window A/B of fp8_converter_variants.py, ran the whole of the four
# decode test files and was stopped by its time limit after 17 tests: the property tests compile many kernels)
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='%h %s' | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
tests)
  # both producers of every kind (tma, gather, convert, land: page sizes 1-256, both caches), the off-word cache
  # view, the fp8 tests, the fused-merge trees and the raw launch; then, if given, a benchmark (below)
  timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    tests/test_prepared_launch.py \
    -k "${TESTS_K:-(every_page_size and gluon) or (off_word and gluon) or fp8_decode or raw_launch_gives or fused_merge_trees}" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  [ -n "${2:-}" ] && timeout 300 python3 benchmarks/bench_decode.py --out "$OUT" --caches "${3:-bf16}" --only "$2" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^#"
  ;;
compare)
  # a kernel change against the modules before it (.before/, carried): GPU tests of the change, then
  # compare_modules.py (every case checked against the reference first, timings interleaved)
  timeout 250 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "${TESTS_K:-(every_page_size and gluon and (1- or 16- or 64- or 256-)) or (off_word and gluon)}" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 300 python3 benchmarks/compare_modules.py --before .before --after generated --out "$OUT" \
    --only "${2:-tp1 B128,tp1 B32,tp8 B128 S8192 Sq1,tp1 B1 ,tp8 B1 }" 2>&1 | tee "$OUT/compare.log"
  ;;
property)
  # the decode property test of the Gluon backend (Hypothesis: varlen batches, Sq, page sizes, empty
  # sequences, splits, both caches), MLAGEN_HYPOTHESIS_PROFILE as given (default dev: 12 examples)
  timeout 540 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  ;;
fp8)
  # the fp8 landing producer's GPU tests (pages of whole blocks, Sq * H <= 32), the graph replay, the Gluon
  # property test, then bf16 against fp8 (and the row-loading converter) in one process
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "(every_page_size and gluon and float8 and (64- or 128- or 256-)) or (off_word and gluon and float8) or fp8_decode_replays or (matches_reference and gluon)" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 200 python3 benchmarks/fp8_converter_variants.py --only "${2:-H16 B128,Mistral}" \
    --variants "${3:-convert}" --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
  ;;
variants)
  timeout 250 python3 benchmarks/fp8_converter_variants.py --only "${2:-H16 B128,Mistral}" \
    --variants "${3:-land72}" --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
  ;;
bench)
  timeout 560 python3 benchmarks/bench_decode.py --out "$OUT" --caches "${3:-bf16,fp8}" \
    --only "${2:-S8192 Sq1 fix,S8192 Sq2 fix,H128 B32,H16 B64 S32768,Kimi,Mistral,graph}" 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^#"
  ;;
narrow)
  timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    -k "(every_page_size and gluon and (16- or 64- or 256-)) or (off_word and gluon) or fp8_decode" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 150 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H16 B64,Mistral" --variants wide \
    --bf16-variants wide --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
  timeout 70 python3 benchmarks/compare_modules.py --before .before --after generated --out "$OUT" \
    --only "tp8 B128 S8192 Sq2" 2>&1 | tee "$OUT/compare.log"
  timeout 110 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4 Sq1" 2>&1 | tee "$OUT/bench.log" | grep -v "^#"
  ;;
narrow16)
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    -k "(every_page_size and gluon and 64-) or fp8_decode_replays" 2>&1 | tail -25 | tee "$OUT/pytest.log"
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  timeout 110 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4" 2>&1 | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
land4)
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "(every_page_size and gluon and float8 and (64- or 128- or 256-)) or (off_word and gluon and float8) or fp8_decode_replays" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 150 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B64 S32768,Mistral" 2>&1 | tee "$OUT/bench.log" | grep -v "^#"
  ;;
ring)
  timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "(every_page_size and gluon and float8 and (64- or 128- or 256-)) or (off_word and gluon and float8) or fp8_decode_replays" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 170 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral" 2>&1 | tee "$OUT/bench.log" \
    | grep -v "^#"
  ;;
group)
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "(every_page_size and gluon and float8 and (64- or 128- or 256-)) or (off_word and gluon and float8) or fp8_decode_replays or narrow_and_wide" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 200 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H16 B64,Mistral" \
    --variants group1,group4 --out "$OUT/variants" 2>&1 | tee "$OUT/variants.log" | grep -v "^#"
  timeout 90 python3 benchmarks/fp8_converter_variants.py --only "H16 B128" \
    --variants group1,group8 --out "$OUT/variants8" 2>&1 | tee "$OUT/variants8.log" | grep -v "^#"
  ;;
latency)
  timeout 240 python3 benchmarks/latency_probe.py --parts --only "B1 H16,skewed,B8 H16" 2>&1 \
    | tee "$OUT/latency_parts.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4" 2>&1 | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
runs)
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    tests/test_prepared_launch.py \
    -k "(every_page_size and gluon and (16- or 64-)) or (off_word and gluon) or fused_merge_trees or many_runs_in_steps or skewed_small_batch or as_short_as_fit or fp8_decode_replays or raw_launch_gives" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 320 python3 benchmarks/latency_probe.py --runs --only "${2:-skewed,B8 H16}" 2>&1 | tee "$OUT/latency_runs.log"
  ;;
tall)
  # runs of one sequence each for the Gluon kernel's tall rows only (decode_sequence_runs): GPU tests with the
  # Gluon property test, latency_probe.py --runs (forced either way), then bench_decode.py's latency cases
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    -k "(every_page_size and gluon and 64-) or fused_merge_trees or many_runs_in_steps or skewed_small_batch or fit_the_runs or fp8_decode_replays or (matches_reference and gluon)" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 150 python3 benchmarks/latency_probe.py --runs --only "${2:-skewed Sq4,B8 H128}" 2>&1 \
    | tee "$OUT/latency_runs.log"
  timeout 220 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4" 2>&1 | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
final)
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B128 S8192 Sq2 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/latency" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B1 S8192 graph,H128 B8 S8192 graph" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
confirm)
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 150 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4 Sq1" 2>&1 | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
steps)
  # the combine's runs a step as planned and 2 and 4 times as many (latency_probe.py --steps)
  timeout 330 python3 benchmarks/latency_probe.py --steps --only "${2:-B1 H16,skewed,B8 H16,B8 H128}" 2>&1 \
    | tee "$OUT/latency_steps.log"
  ;;
partials)
  timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    -k "(every_page_size and gluon and 64-) or fused_merge_trees or many_runs_in_steps or skewed_small_batch or fp8_decode_replays" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 300 python3 benchmarks/latency_probe.py --partials 2>&1 | tee "$OUT/latency_partials.log"
  timeout 110 python3 benchmarks/latency_probe.py --runs --only "skewed Sq1,B8 H16" 2>&1 \
    | tee "$OUT/latency_runs_narrow.log"
  ;;
keep)
  timeout 130 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
    -k "(every_page_size and 64-) or fused_merge_trees or many_runs_in_steps or skewed_small_batch or fp8_decode_replays" \
    2>&1 | tail -25 | tee "$OUT/pytest.log"
  timeout 170 python3 benchmarks/latency_probe.py --keep 2>&1 | tee "$OUT/latency_keep.log"
  MLAGEN_DECODE_BACKEND=triton timeout 120 python3 benchmarks/latency_probe.py --partials 2>&1 \
    | tee "$OUT/latency_partials_portable.log"
  timeout 150 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B1 S8192 graph" 2>&1 | tee "$OUT/bench_latency.log" \
    | grep -v "^#"
  ;;
combine)
  timeout 200 python3 benchmarks/combine_timeline_probe.py --out "$OUT" 2>&1 | tee "$OUT/combine_timeline.log"
  timeout 200 python3 benchmarks/latency_probe.py --tiles --only "skewed Sq4,B8 H128" 2>&1 \
    | tee "$OUT/latency_tiles.log"
  ;;
pipeline)
  timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "many_runs_in_steps or skewed_small_batch or partial_rows" 2>&1 | tail -5 | tee "$OUT/pytest.log"
  timeout 420 python3 benchmarks/latency_probe.py --pipeline 2>&1 | tee "$OUT/latency_pipeline.log"
  ;;
retune)
  timeout 260 python3 -m mlagen_compiler.cli tune deepseek-v3-tp8-fp8 --buckets gluon --cases b128-s8k,b32-s32k \
    --db "$OUT/tune.json" 2>&1 | tail -40 | tee "$OUT/tune.log"
  timeout 260 python3 benchmarks/bench_decode.py --out "$OUT/main" --caches bf16,fp8 --backends gluon \
    --only "H16 B128 S8192 Sq1 fix,H16 B64 S32768,Mistral,H128 B128 S8192 Sq1 fix,H128 B32" \
    2>&1 | tee "$OUT/bench_main.log" | grep -v "^#"
  ;;
maxnreg)
  timeout 300 python3 benchmarks/latency_probe.py --maxnreg --only "skewed,B8,B1 H16" 2>&1 | tee "$OUT/latency_maxnreg.log"
  ;;
short)
  timeout 190 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k \
    "short_and_tuned or (every_page_size and gluon and None and (16- or 32- or 64-)) or fused_merge_trees or partial_rows_in_either or skewed_small_batch" \
    2>&1 | tail -15 | tee "$OUT/pytest.log"
  timeout 110 python3 benchmarks/latency_probe.py --blocks --only "skewed Sq4,B1 H128,B8 H128" 2>&1 \
    | tee "$OUT/latency_blocks.log"
  timeout 160 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16 \
    --only "H16 B1 S8192 graph,H128 B1 S8192 graph,H16 B8 S8192 graph,H128 B8 S8192 graph,skewed4" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#"
  timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "matches_reference and gluon" \
    2>&1 | tail -8 | tee "$OUT/pytest_property.log"
  ;;
threadsteps)
  # at most 64 fp32 a thread a combine step for 2-warp programs in crowded grids (combine_step_runs_for_warps):
  # GPU tests of the combine, latency_probe.py --thread-steps (the rule on and off, in turn, twice), then
  # bench_decode.py's latency cases (bf16)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k \
    "skewed_small_batch or many_runs_in_steps or (every_page_size and gluon and None and (32- or 64-))" 2>&1 \
    | tail -4 | tee "$OUT/pytest.log"
  timeout 200 python3 benchmarks/latency_probe.py --thread-steps 2>&1 | grep -v Warn | tee "$OUT/latency_thread_steps.log"
  timeout 160 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16 \
    --only "H16 B1 S8192 graph,H128 B1 S8192 graph,H16 B8 S8192 graph,H128 B8 S8192 graph,skewed4" 2>&1 \
    | tee "$OUT/bench_latency.log" | grep -v "^#" | grep "^|"
  ;;
latency_final)
  timeout 250 python3 benchmarks/bench_decode.py --out "$OUT" --caches bf16,fp8 \
    --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4" 2>&1 | tee "$OUT/bench_latency.log" | grep -v "^#"
  ;;
confirm2)
  # the final code: the Gluon property test (ci profile) and the timeline of the skewed Sq4 batch
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
    -k "matches_reference and gluon" 2>&1 | tail -25 | tee "$OUT/pytest_property.log"
  timeout 120 python3 benchmarks/gluon_timeline_probe.py --out "$OUT" --only "skewed H16 Sq4" 2>&1 \
    | tee "$OUT/timeline.log"
  ;;
profile)
  ncu=/usr/local/cuda/bin/ncu
  for cache in fp8 bf16; do
    rep="/tmp/ncu_$cache"
    timeout 100 "$ncu" --clock-control none --section SourceCounters --section WarpStateStats \
      --kernel-name regex:gluon --launch-skip 3 --launch-count 1 -f -o "$rep" \
      python3 benchmarks/profile_decode_once.py --heads 16 --cache "$cache" >> "$OUT/ncu.log" 2>&1
    "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/src_$cache.csv" 2>> "$OUT/ncu.log"
    python3 benchmarks/sass_partitions.py "/tmp/src_$cache.csv" --top 4 --stalled 14 | tee "$OUT/partitions_$cache.md"
    timeout 100 "$ncu" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,sm__cycles_elapsed.avg \
      --kernel-name regex:gluon --launch-skip 3 --launch-count 1 -f -o "${rep}_mem" \
      python3 benchmarks/profile_decode_once.py --heads 16 --cache "$cache" >> "$OUT/ncu.log" 2>&1
    "$ncu" -i "${rep}_mem.ncu-rep" --page details > "$OUT/details_$cache.txt" 2>> "$OUT/ncu.log"
    grep -iE "duration|throughput|shared|bank|pipe|wavefront|cycles|busy" "$OUT/details_$cache.txt" | head -60
  done
  timeout 240 python3 benchmarks/latency_probe.py --only "B1 H16,skewed,B8 H16" 2>&1 | tee "$OUT/latency_probe.log"
  ;;
esac
