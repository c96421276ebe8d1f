#!/usr/bin/env bash
# One device call (H100, 2026-11-26, twelfth session): ncu SourceCounters and WarpStateStats of one
# Mistral-Small-4 (H32, Dc 256) B128 S8192 decode launch, bf16 and fp8, with the cache in L2 (every sequence on
# the first one's pages: what the warpgroups cost beside reading memory) and from memory, summarised per
# partition by sass_partitions.py (instructions, spills, stall reasons, most stalled instructions).
#   bash benchmarks/device_consumer_profile.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
ncu=/usr/local/cuda/bin/ncu
for cache in bf16 fp8; do
  for l2 in --l2-resident ""; do
    name=mistral_$cache${l2:+_l2}
    rep="/tmp/ncu_$name"
    timeout 120 "$ncu" --clock-control none --section SourceCounters --section WarpStateStats \
      --kernel-name regex:gluon --launch-skip 3 --launch-count 1 -f -o "$rep" \
      python3 benchmarks/profile_decode_once.py --spec mistral-small-4 --heads 32 --cache "$cache" $l2 \
      >> "$OUT/ncu.log" 2>&1
    "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/src_$name.csv" 2>> "$OUT/ncu.log"
    python3 benchmarks/sass_partitions.py "/tmp/src_$name.csv" --top 4 --stalled 14 | tee "$OUT/partitions_$name.md"
    "$ncu" -i "$rep.ncu-rep" --page details --section WarpStateStats 2>> "$OUT/ncu.log" | tail -30 \
      > "$OUT/warpstate_$name.txt"
  done
done
