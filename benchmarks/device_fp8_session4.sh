#!/usr/bin/env bash
# One device call (H100, 2026-11-23, fourth session): fp8 converter variants (checked, timed), the GPU tests
# of the launch paths, then ncu's per-instruction counters (SourceCounters) of the H128 launch, fp8 and bf16.
# Each step has its own time limit and writes under $OUT as it goes, so a cut-off run still returns what
# finished; at most 7 files come back (the device returns 8).
#   bash benchmarks/device_fp8_session4.sh   (after the .whl install line of the device README)
set -uo pipefail
export PYTHONUNBUFFERED=1
ncu=/usr/local/cuda/bin/ncu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/variants.log"
timeout 210 python3 benchmarks/fp8_converter_variants.py --variants evict_first,regs88 --out "$OUT" 2>&1 \
  | tee -a "$OUT/variants.log"
rm -rf "$OUT/modules"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_prepared_launch.py tests/test_gluon_backend.py 2>&1 \
  | tee "$OUT/pytest.log" | tail -15
for cache in fp8 bf16; do
  rep="$OUT/ncu_$cache"
  timeout 60 "$ncu" --clock-control none --section SourceCounters --kernel-name regex:gluon --launch-skip 3 \
    --launch-count 1 -f -o "$rep" python3 benchmarks/profile_decode_once.py --heads 128 --cache $cache \
    >> "$OUT/ncu.log" 2>&1
  if "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$cache.csv" 2>> "$OUT/ncu.log"
  then
    rm -f "$rep.ncu-rep"
  fi
  ls -la "$OUT" | tee -a "$OUT/ncu.log"
done
