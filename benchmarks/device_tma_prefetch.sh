#!/usr/bin/env bash
# One device call (H100, 2026-11-26, tenth session): the 16-bit TMA producer's bulk L2 prefetch of the next block,
# against it without (tma_no_prefetch) in one process at H16 B128 and H128 B128 (fp8_converter_variants.py
# --bf16-variants; fp8 as shipped beside), then the bf16 Gluon latency cases of the code before (6dc81c8, in base_tree/)
# and of the working tree in turn (bench_decode.py, graph replay), every row checked.
# The prefetch was slower everywhere and was reverted (benchmarks/results/tma_prefetch_2026-11-26.patch, the template
# of 88da619; the variant tma_no_prefetch is in that commit's fp8_converter_variants.py): check out 88da619 and
# restore base_tree/ to run this again.
#   bash benchmarks/device_tma_prefetch.sh   (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/fp8_converter_variants.py --only "H16 B128,H128" --variants "" \
  --bf16-variants tma_no_prefetch --out "$OUT/variants" 2>&1 | tee "$OUT/variants.log" | grep "^|"
# base_tree: the code before the TMA prefetch (git archive 6dc81c8, carried as an untracked folder, not committed)
for tree in base_tree . base_tree .; do
  (cd "$tree" && timeout 90 python3 benchmarks/bench_decode.py --out "$OUT/latency_$(basename "$tree")" --caches bf16 \
    --backends gluon --only "H16 B1 S8192 graph,H16 B8 S8192 graph,skewed4,H128 B8 S8192 graph" 2>&1 \
    | grep "^| H" | sed "s|^|$tree: |") | tee -a "$OUT/latency.log"
done
