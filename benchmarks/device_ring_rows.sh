#!/usr/bin/env bash
# One device call (H100, 2026-11-26, twelfth session): the fp8 landing ring for two row blocks of query rows at
# Dc 256 (variant ring_rows) against the row-loading converter the launch policy gives them, bf16 (long blocks)
# in the same run; every row checked against the reference.
#   bash benchmarks/device_ring_rows.sh   (after the .whl install line; the first call ran only the first command)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 250 python3 benchmarks/fp8_converter_variants.py --only "Dc256 H128" --variants ring_rows,ring_rows+ring_s3 \
  --out "$OUT/ring_rows" 2>&1 | tee "$OUT/ring_rows.log" | grep "^|"
# (second call) the long blocks with an fp8 cache: the row-loading converter filling 128-position stages, with the
# registers moved between the warpgroups and the converter
timeout 300 python3 benchmarks/fp8_converter_variants.py --only "Dc256 H128" \
  --variants long_fp8,long_fp8+pv168,long_fp8+conv120,long_fp8+pv168+conv120 \
  --out "$OUT/long_fp8" 2>&1 | tee "$OUT/long_fp8.log" | grep "^|"
