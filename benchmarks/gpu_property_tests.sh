#!/usr/bin/env bash
# One device call: the property tests that now draw and check through mlagen_compiler.testing, on the
# GPU (both decode backends, and the GPU-only decode tests, whose problems go through the same check); the
# plugin's own tests (pytester: a user's spec passes, an edited module fails with its shrunk case); then the
# plugin on bundled specs with the GPU's longer shapes: DeepSeek-V3 TP8 with a 16-bit and an fp8 cache (the
# Gluon decode too) and Mistral-Small-4 (Dc 256). The first command runs on 8 workers (pytest-xdist is on the GPU
# image; test_decode.py with test_gluon_backend.py took 239 s so) with -v, so a run cut at its limit still names
# each test that failed (xdist prints the summary only at the end).
#   bash benchmarks/gpu_property_tests.sh   (carry [".whl"])
# `suites` instead runs every GPU test file whole under one longer limit (GPU_SUITES_S, default 540 s: the files
# above with the Gluon backends' and the tuner's, which do not fit one call beside the plugin):
#   bash benchmarks/gpu_property_tests.sh suites
set -uo pipefail
source benchmarks/job_steps.sh  # (the wheels, PYTHONPATH and the plugin's entry point)
if [ "${1:-}" = suites ]; then
  MLAGEN_HYPOTHESIS_PROFILE=ci timeout "${GPU_SUITES_S:-540}" python3 -m pytest -v -n 8 -p no:cacheprovider --tb=short \
    tests/test_decode.py tests/test_prefill.py tests/test_cache_write.py tests/test_prefill_prepared.py \
    tests/test_gluon_backend.py tests/test_gluon_prefill.py tests/test_tuning.py >"$out/suites.log" 2>&1
  status=$?
  echo "suites: exit $status (124: cut at the limit)"
  grep -E "FAILED|ERROR|(passed|failed).* in " "$out/suites.log" | tail -30
  grep -cE " PASSED" "$out/suites.log" | sed 's/^/PASSED lines: /'
  exit $status
fi
MLAGEN_HYPOTHESIS_PROFILE=ci timeout 300 python3 -m pytest -v -n 8 -p no:cacheprovider --tb=short tests/test_decode.py \
  tests/test_prefill.py tests/test_cache_write.py >"$out/tests.log" 2>&1
grep -E "FAILED|ERROR|(passed|failed).* in " "$out/tests.log" | tail -30
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_pytest_plugin.py 2>&1 | tail -8 | tee "$out/plugin_tests.log"
timeout 150 python3 -m pytest -v -p no:cacheprovider --mlagen-spec deepseek-v3-tp8 --mlagen-spec deepseek-v3-tp8-fp8 \
  --mlagen-spec mistral-small-4 --mlagen-examples 20 --hypothesis-show-statistics 2>&1 | tail -90 | tee "$out/plugin_gpu.log"
