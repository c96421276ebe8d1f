#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, fifteenth session): the Gluon kernel's fused merge loading every member of a
# merge step at once (_gluon_merge_group, launch_policy.gluon_merge_step), against the combine launch; and the
# fp8 landing producers after land_apart / LAND_APART became land_slots / FULL_QUERY (PTX equal offline).
#   bash benchmarks/device_session15.sh a   GPU tests (fused merge trees, fp8 landing and row loading, skewed
#                                           batches, short blocks), then the latency cases' merges in turn
#   bash benchmarks/device_session15.sh b   the fused merge's step size (8192 fp32 values in a, now the plan's
#                                           16384, and 32768) on the latency cases, then its GPU tests again
#   bash benchmarks/device_session15.sh c   the step sizes and the combine launch at B128 with varied lengths
#   bash benchmarks/device_session15.sh d   c's cases after the revert: the shipped fused merge and the combine
#   bash benchmarks/device_session15.sh e   bench_hf.py with the bf16 cache, then an fp8 one (kv_scale 1), one after
#                                           the other on one machine (the transformers integration's fp8 cache)
#   bash benchmarks/device_session15.sh f   e's fp8 graph step was slower: bench_hf's decode lengths, bf16 and fp8
#   bash benchmarks/device_session15.sh g   fp8 small batches: the sweep (fewest blocks a run 1-3 beside the plan's
#                                           5) at bench_hf's lengths, S2048 and S8192
#   bash benchmarks/device_session15.sh h   after gluon_small_batch_schedule gives fp8 small batches one-block runs:
#                                           the latency cases (fp8, then bf16), bench_hf.py fp8, the fp8 GPU tests
#   bash benchmarks/device_session15.sh i   the final code's GPU tests: the Gluon property test (ci profile), the
#                                           Gluon backend, prepared launches, the integration's CUDA-graph test
#   bash benchmarks/device_session15.sh j   B1 H16 (the portable kernel's case): every (block_n, warps, stages), bf16
#                                           and fp8 (the "w" column is the Gluon kernel's registers for gluon rows)
#   bash benchmarks/device_session15.sh k   bench_hf.py fp8 with kv_scale 1, then with kv_scales_from (margin 1.5)
# Modes a-c ran benchmarks/results/merge_steps_all_members_2026-11-26.patch (not kept; `git apply` it and
# regenerate the modules to rerun them; mode b's --merge-steps is merge_steps_latency_probe_2026-11-26.patch, on
# latency_probe.py as this session left it; variants merge8k / merge32k of c were text edits of its
# DECODE_MERGE_STEP_ELEMENTS = 16384, dropped with it).
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k \
    "gluon and (fused_merge_trees or skewed)" 2>&1 | tail -8 | tee "$OUT/pytest_merge_steps.log"
  timeout 200 python3 benchmarks/latency_probe.py --merges --only "B8 H16,B1 H16,skewed Sq1" 2>&1 \
    | tee "$OUT/latency_merges.log" | grep -v "^#" | cut -c1-230
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "gluon and (fp8 or short_and_tuned or narrow)" 2>&1 | tail -8 | tee "$OUT/pytest_fp8_landing.log"
  ;;
b)  # the fused merge's step size (fp32 values loaded at once) on the latency cases, against the combine launch
  timeout 330 python3 benchmarks/latency_probe.py --merges --merge-steps 8192,16384,32768 \
    --only "B8 H16,skewed Sq1,B1 H128,B8 H128" 2>&1 | tee "$OUT/latency_merge_steps.log" | grep -v "^#" | cut -c1-230
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py -k \
    "gluon and (fused_merge_trees or skewed or many_runs)" 2>&1 | tail -4 | tee "$OUT/pytest_merge_steps16k.log"
  ;;
c)  # the same at B128 with varied lengths (rows as M: the policy fuses), bf16 and fp8, in one process
  timeout 560 python3 benchmarks/fp8_converter_variants.py --out "$OUT/merges" --only "H64 B128 S8192 var,H128 B32" \
    --variants merge8k,combine --bf16-variants merge8k,merge32k,combine 2>&1 | tee "$OUT/merge_steps_b128.log" \
    | grep "^|\|Error"
  ;;
d)  # after the all-members merge was reverted: the shipped fused merge against the combine launch, as in c
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/merges" --only "H64 B128 S8192 var,H128 B32" \
    --variants combine --bf16-variants combine 2>&1 | tee "$OUT/merges_b128_shipped.log" | grep "^|\|Error"
  ;;
e)
  timeout 280 python3 benchmarks/bench_hf.py --out "$OUT/bench_hf_bf16.json" 2>&1 | tee "$OUT/bench_hf_bf16.log" \
    | grep "ok (\|teacher\|generate_mlagen\|cuda_graph\|FAIL\|Error"
  timeout 280 python3 benchmarks/bench_hf.py --cache-dtype float8_e4m3fn --out "$OUT/bench_hf_fp8.json" 2>&1 \
    | tee "$OUT/bench_hf_fp8.log" | grep "ok (\|teacher\|generate_mlagen\|cuda_graph\|FAIL\|Error"
  ;;
f)
  for cache in bf16 fp8; do
    timeout 200 python3 benchmarks/latency_probe.py --quick --only "B8 H16 short" --cache $cache 2>&1 \
      | tee "$OUT/latency_short_$cache.log" | grep -v "^#\|Warn\|warn" | cut -c1-230
  done
  ;;
g)
  timeout 540 python3 benchmarks/latency_probe.py --only "B8 H16 short,B8 H16 S2048,B8 H16" --cache fp8 2>&1 \
    | tee "$OUT/latency_fp8_small_sweep.log" | grep "gluon" | cut -c1-200
  ;;
h)
  for cache in fp8 bf16; do
    timeout 120 python3 benchmarks/latency_probe.py --quick --only "B8 H16,skewed Sq1" --cache $cache 2>&1 \
      | tee "$OUT/latency_small_runs_$cache.log" | grep "gluon kernel" | cut -c1-200
  done
  timeout 150 python3 benchmarks/bench_hf.py --cache-dtype float8_e4m3fn --out "$OUT/bench_hf_fp8_short_runs.json" \
    2>&1 | tee "$OUT/bench_hf_fp8_short_runs.log" | grep "teacher_forced | mlagen_decode\|cuda_graph | graph\|FAIL"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_fp8.py -k \
    "gluon and (fp8 or skewed or narrow)" 2>&1 | tail -4 | tee "$OUT/pytest_fp8_short_runs.log"
  ;;
i)
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_decode.py::test_decode_matches_reference[gluon]" 2>&1 | tail -4 | tee "$OUT/pytest_property_gluon.log"
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_backend.py \
    tests/test_prepared_launch.py tests/test_integration_transformers.py 2>&1 | tail -4 \
    | tee "$OUT/pytest_backend_launch_hf.log"
  ;;
j)
  for cache in bf16 fp8; do
    timeout 250 python3 benchmarks/latency_probe.py --configs --only "B1 H16" --cache $cache 2>&1 \
      | tee "$OUT/latency_b1_configs_$cache.log" | grep "B1 H16" | cut -c1-200
  done
  ;;
k)
  for args in "" "--calibrate 1.5"; do
    timeout 200 python3 benchmarks/bench_hf.py --cache-dtype float8_e4m3fn $args \
      --out "$OUT/bench_hf_fp8${args:+_calibrated}.json" 2>&1 | tee "$OUT/bench_hf_fp8${args:+_calibrated}.log" \
      | grep "kv_scale\|teacher_forced | mlagen\|cuda_graph | graph_step\|FAIL"
  done
  ;;
esac
