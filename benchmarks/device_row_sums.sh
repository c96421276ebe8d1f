#!/usr/bin/env bash
# One device call (H100, 2026-11-26, eighth session): the narrow form's row sums kept per position and summed
# once a piece instead of every block. Correctness on the GPU first (the Gluon decode tests of the narrow form:
# page sizes 16 and 64 with both caches and Sq 1..4, the narrow-and-wide test, test_fp8.py), then fp8 and bf16
# H16 timings with the sum every block and once a piece in one process (fp8_converter_variants.py, variant
# "lsum_each"), then the narrow latency cases of the committed code (a worktree of HEAD) and of the working tree
# in turn, twice each (latency_probe.py --runs: the default schedule twice a run).
#   bash benchmarks/device_row_sums.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_fp8.py \
  -k "(gluon and every_page_size and (16- or 64-)) or narrow_and_wide or test_fp8" 2>&1 | tail -5 | tee "$OUT/pytest.log"
timeout 150 python3 benchmarks/fp8_converter_variants.py --only "H16" --variants lsum_each --bf16-variants lsum_each \
  --out "$OUT" 2>&1 | tee "$OUT/variants.log" | grep "^|"
git worktree add -q /tmp/base HEAD 2>/dev/null || git -c safe.directory='*' worktree add -q /tmp/base HEAD
for turn in 1 2; do
  for tree in /tmp/base .; do
    (cd "$tree" && timeout 100 python3 benchmarks/latency_probe.py --runs --only "B1 H16,B8 H16,skewed Sq1" 2>&1 \
      | grep "sequence-runs\|^[A-Za-z].* | " | grep -v "sequence-runs" | sed "s|^|$tree turn $turn: |") \
      | tee -a "$OUT/latency_row_sums.log"
  done
done
