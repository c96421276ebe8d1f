#!/usr/bin/env bash
# One device call (H100, 2026-11-26, twelfth session): 128-position cache blocks for two or more row blocks with a
# 16-bit cache (launch_policy.gluon_long_blocks). The GPU test of long and tuned blocks (pages 64 and 128, H128 Sq1
# and H32 Sq4 at Dc 256, both merges, the gathering producer too), the Gluon property test (ci profile), then
# block_n_probe.py: the module's own choice (auto) against the tuned 64-position blocks given, pages of 64 (two
# TMA boxes a long block) and 128, H128 Sq1 and H32 Sq4; and Mistral-Small-4 / DeepSeek in bench_decode (one row
# block, or Dc 512: unchanged).
#   bash benchmarks/device_long_blocks.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "long_and_tuned or short_and_tuned" \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
MLAGEN_HYPOTHESIS_PROFILE=ci timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py \
  -k "matches_reference and gluon" 2>&1 | tail -15 | tee "$OUT/pytest_property.log"
for page in 64 128; do
  timeout 100 python3 benchmarks/block_n_probe.py --page $page --heads 128 --no-l2 --configs auto,64:200:2,auto,64:200:2 \
    --out "$OUT/h128_p$page" 2>&1 | grep "^|" | tee -a "$OUT/probe.log"
done
timeout 100 python3 benchmarks/block_n_probe.py --page 64 --heads 32 --sq 4 --no-l2 --configs auto,64:200:2,auto,64:200:2 \
  --out "$OUT/h32sq4" 2>&1 | grep "^|" | tee -a "$OUT/probe.log"
timeout 150 python3 benchmarks/bench_decode.py --out "$OUT/bench" --caches bf16 --backends gluon \
  --only "Mistral,H128 B128 S8192 Sq1 fix" 2>&1 | tee "$OUT/bench.log" | grep -v "^#" | tail -12
