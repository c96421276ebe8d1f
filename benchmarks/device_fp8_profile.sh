#!/usr/bin/env bash
# One device call (H100, 2026-11-23): ncu SourceCounters and WarpStateStats of one H16 B128 S8192 decode launch
# per module given (default: the fp8 module as shipped, and the bf16 one), summarised on the device by
# sass_partitions.py (per partition: instructions, spills, stall reasons, most stalled instructions); the
# CSVs stay there. An fp8 entry may name fp8_converter_variants edits: fp8:pv160+regs88. HEADS=128 in the environment
# profiles that head count instead (B128 S8192).
#   [HEADS=128] bash benchmarks/device_fp8_profile.sh [fp8 bf16 fp8:VARIANT ...]   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
ncu=/usr/local/cuda/bin/ncu
for entry in "${@:-fp8 bf16}"; do
  for item in $entry; do
    cache=${item%%:*}
    variant=${item#"$cache"}
    variant=${variant#:}
    name=h${HEADS:-16}_$cache${variant:+_$variant}
    rep="/tmp/ncu_$name"
    timeout 90 "$ncu" --clock-control none --section SourceCounters --section WarpStateStats \
      --kernel-name regex:gluon --launch-skip 3 --launch-count 1 -f -o "$rep" \
      python3 benchmarks/profile_decode_once.py --heads "${HEADS:-16}" --cache "$cache" ${variant:+--variant $variant} \
      >> "$OUT/ncu.log" 2>&1
    "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/src_$name.csv" 2>> "$OUT/ncu.log"
    python3 benchmarks/sass_partitions.py "/tmp/src_$name.csv" --top 4 --stalled 14 | tee "$OUT/partitions_$name.md"
  done
done
