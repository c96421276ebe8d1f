#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, fourteenth session) on the alternating form of the Gluon decode: two warpgroups
# on alternate cache blocks, each whole, merged at each piece's end (_gluon_alternate_partition). Tried and not
# kept: its code is benchmarks/results/alternate_blocks_v2_2026-11-26.patch (`git apply` it and regenerate the
# modules to rerun a mode; the form as measured in modes h-m: launch_policy.gluon_alternate, the merge through
# the query tile; k's variant early_qfree is in it too). Modes n and o ran it with
# alternate_blocks_v2_f16_exchange_2026-11-26.patch applied on top (the merge as two float16 halves; that patch
# also holds benchmarks/alternate_timeline_probe.py, which mode m ran on the first patch alone: its stamp at x_go
# anchors on that patch's comment). Modes a-c ran an earlier state (a merge buffer of its own, 2 fp8 stages),
# d-g the form switched on by a variant; their variants (alternate, alt_s2, alt_lean, alt_lean216: the form on,
# its stages, the producers at 56 / 24 registers) are not in the patch, whose no_alternate switches it off. The
# log of the session in docs/performance-log.md says which state each mode ran.
#   bash benchmarks/device_session14.sh a   Dc 256 cases (Mistral-Small-4 H32, H64, H128): shipped against the
#                                           alternating variants, bf16 and fp8, in one process, each checked first
#   bash benchmarks/device_session14.sh c   the same with the cache in L2 (--l2-resident): what the warpgroups cost
#   bash benchmarks/device_session14.sh d   the merge through the query tile and P (no buffer of its own), so the
#                                           ring is deeper: a and c's cases again, with and without the cache in L2
#   bash benchmarks/device_session14.sh e   Mistral fp8's wrong results in d: alternate_probe.py, then again
#   bash benchmarks/device_session14.sh f   the race e found mended: the probe, the cases, the GPU test
#   bash benchmarks/device_session14.sh g   the compute-bound cases (Sq 2 and 4, Dc 256 H128), alternating or not
#   bash benchmarks/device_session14.sh h   the form as a launch policy: its GPU tests, on / off at B128 and in the
#                                           latency regime
#   bash benchmarks/device_session14.sh i   h's latency loss: the merge through a swizzled view, on / off again
#   bash benchmarks/device_session14.sh j   shorter runs at larger batches, on / off
#   bash benchmarks/device_session14.sh k   the query tile freed before the merge (timing only): the short runs' loss?
#   bash benchmarks/device_session14.sh l   the ring's depth in both forms (shared in 3 stages, alternating in 2)
#   bash benchmarks/device_session14.sh m   per-program timelines of both forms (alternate_timeline_probe.py)
#   bash benchmarks/device_session14.sh n   the merge as two float16 halves sent at once: probe, timelines, cases
#   bash benchmarks/device_session14.sh o   the alternating warpgroups on 32-position blocks (variant alt_n32)
#   bash benchmarks/device_session14.sh b   the alternating form's GPU test (not run on its own: f and h ran it)
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 560 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral,Dc256 H64,Dc256 H128" \
    --variants alternate,alt_lean,alt_lean216 --bf16-variants alternate 2>&1 | tee "$OUT/alternate_variants.log" \
    | grep -v "^#"
  ;;
d)  # the merge through the query tile and P: deeper rings (bf16 4 stages, fp8 3 beside the landing ring)
  timeout 280 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt_l2" --only "Mistral,Dc256 H64" --l2-resident \
    --variants alternate,alt_s2,alt_lean216 --bf16-variants alternate,alt_s2 2>&1 \
    | tee "$OUT/alternate_deep_variants_l2.log" | grep "^|"
  timeout 280 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral,Dc256 H64" \
    --variants alternate,alt_s2,alt_lean216 --bf16-variants alternate,alt_s2 2>&1 \
    | tee "$OUT/alternate_deep_variants.log" | grep "^|"
  ;;
c)
  timeout 560 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt_l2" --only "Mistral,Dc256 H64" --l2-resident \
    --variants alternate,alt_lean216 --bf16-variants alternate 2>&1 | tee "$OUT/alternate_variants_l2.log" \
    | grep -v "^#" | grep "^|"
  ;;
e)  # Mistral fp8 went wrong in d (all NaN, H64 right): which sequences / heads, then Mistral again
  timeout 200 python3 benchmarks/alternate_probe.py --heads 32 --cache fp8 2>&1 | tee "$OUT/alternate_probe_h32.log"
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral" \
    --variants alternate,alt_lean216 2>&1 | tee "$OUT/alternate_mistral_fence.log" | grep "^|"
  ;;
f)  # warpgroup 1 stored into the query tile while warpgroup 0's Q K^T still read it: now after x_go
  for args in "--heads 32 --cache fp8" "--heads 64 --cache fp8" "--heads 32 --cache bf16"; do
    timeout 100 python3 benchmarks/alternate_probe.py $args 2>&1 | grep "alternate=True" | cut -c1-150
  done | tee "$OUT/alternate_probe.log"
  timeout 200 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral,Dc256 H64" \
    --variants alternate,alt_lean216 --bf16-variants alternate 2>&1 | tee "$OUT/alternate_go.log" | grep "^|"
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "alternating" 2>&1 | tail -15 \
    | tee "$OUT/pytest_alternating.log"
  ;;
g)  # the compute-bound cases: Sq 2 and 4 (64 / 128 query rows), Dc 256 H128
  timeout 560 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Sq2,Sq4,Dc256 H128" \
    --variants alternate,alt_lean216 --bf16-variants alternate 2>&1 | tee "$OUT/alternate_compute.log" | grep "^|"
  ;;
h)  # the alternating form landed where gluon_alternate takes it (fp8 beside the landing ring, rows as M)
  timeout 250 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py tests/test_launch_policy.py \
    -k "alternat or landing_ring or fp8_query_filling or gluon_blocks" 2>&1 | tail -5 | tee "$OUT/pytest_alternate.log"
  timeout 150 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral-S4 H32 B128 S8192,Dc256 H64" \
    --variants no_alternate 2>&1 | tee "$OUT/alternate_landed.log" | grep "^|"
  timeout 120 python3 benchmarks/latency_probe.py --cache fp8 --alternate --only Mistral 2>&1 \
    | tee "$OUT/latency_alternate.log" | grep -v "^#"
  ;;
i)  # the merge's float32 half through a 128-byte swizzled view (row-major: bank conflicts), on / off again
  timeout 120 python3 benchmarks/latency_probe.py --cache fp8 --alternate --only Mistral 2>&1 \
    | tee "$OUT/latency_alternate_swizzled.log" | grep -v "^#"
  timeout 200 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" --only "Mistral-S4 H32 B128 S8192,Dc256 H64" \
    --variants no_alternate 2>&1 | tee "$OUT/alternate_swizzled.log" | grep "^|"
  ;;
j)  # shorter runs (the latency cases lost): B128 at S1024 / S4096, B64 / B32 / B16 at S8192, on / off
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" \
    --only "B128 S1024,B128 S4096,H32 B64 S8192,H32 B32 S8192,H32 B16 S8192" --variants no_alternate 2>&1 \
    | tee "$OUT/alternate_short_runs.log" | grep "^|"
  ;;
k)  # (with the patch and the timing-only variant early_qfree) does the merge holding the query tile cost the short runs?
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" \
    --only "Mistral-S4 H32 B128 S8192,H32 B16 S8192,B128 S1024" --variants no_alternate,early_qfree 2>&1 \
    | tee "$OUT/alternate_early_qfree.log" | grep "^|"
  ;;
l)  # (with the patch) the ring's depth in both forms: the shared form in 3 stages, the alternating one in 2
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" \
    --only "Mistral-S4 H32 B128 S8192,H32 B16 S8192,B128 S1024" --variants no_alternate,no_alternate+s3,s2 2>&1 \
    | tee "$OUT/alternate_stages.log" | grep "^|"
  ;;
m)  # (with the patch) per-program timelines of both forms: B16, B128 S1024 (short runs), B128 S8192, B8
  timeout 400 python3 benchmarks/alternate_timeline_probe.py --out "$OUT/tl" 2>&1 | tee "$OUT/alternate_timeline.log"
  ;;
n)  # (with the patch) the merge as two float16 halves sent at once: right? the timelines, the short runs
  for args in "--heads 32 --cache fp8" "--heads 64 --cache fp8"; do
    timeout 100 python3 benchmarks/alternate_probe.py $args 2>&1 | grep "alternate=True" | cut -c1-150
  done | tee "$OUT/alternate_probe_f16.log"
  timeout 150 python3 benchmarks/alternate_timeline_probe.py --out "$OUT/tl" --only "B16,B8" 2>&1 \
    | tee "$OUT/alternate_timeline_f16.log"
  timeout 200 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" \
    --only "H32 B128 S8192,H32 B16 S8192,B128 S1024" --variants no_alternate 2>&1 \
    | tee "$OUT/alternate_f16.log" | grep "^|"
  ;;
o)  # (with both patches and the variant alt_n32) the alternating warpgroups on 32-position blocks (fewer registers);
    # alt_n32 is one edit of the module, of gluon_blocks' ring branch:
    #   '(block_n, sizes["alternate_regs"], sizes["alternate_stages"]) if alternate else ring_config'
    #   -> '(32, sizes["alternate_regs"], 4) if alternate else ring_config'
  timeout 300 python3 benchmarks/fp8_converter_variants.py --out "$OUT/alt" \
    --only "Mistral-S4 H32 B128 S8192,H32 B16 S8192,B128 S1024" --variants no_alternate,alt_n32 2>&1 \
    | tee "$OUT/alternate_n32.log" | grep "^|"
  ;;
b)
  timeout 560 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "alternating" 2>&1 | tail -15 \
    | tee "$OUT/pytest_alternating.log"
  ;;
esac
