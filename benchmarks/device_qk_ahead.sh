#!/usr/bin/env bash
# Device calls (H100, 2026-11-26, twelfth session): the softmax warpgroup's Q K^T issued a block ahead, and the query
# tile held in its registers. Both were measured, found no faster and reverted: these calls ran on a working tree
# with benchmarks/results/qk_ahead_2026-11-26.patch (a, s, c; a with its first form, AHEAD on/off) or
# query_regs_2026-11-26.patch (q) applied, whose variants (no_qk_ahead, qk_ahead1/2, no_query_regs) edit what
# those patches add; apply the patch (git apply, then mlagen compile --all) and add the variants to rerun one.
#   bash benchmarks/device_qk_ahead.sh a   GPU test of both forms (Dc 256 / 512, bf16 and fp8), then
#                                          Mistral-Small-4 bf16 and fp8 with and without (variants, and with the
#                                          cache in L2)
#   bash benchmarks/device_qk_ahead.sh s   Mistral-Small-4 with 3 / 4 stages, with and without (a: with 2 stages
#                                          the next block's stage is still loading when its Q K^T is issued)
#   bash benchmarks/device_qk_ahead.sh c   GPU test of the three forms; the Q K^T issued right after the P @ V
#                                          before (qk_ahead2): Mistral-Small-4 (also in L2), DeepSeek H128 and H16
#   bash benchmarks/device_qk_ahead.sh q   the query tile in the softmax warpgroup's registers: GPU test, then
#                                          Mistral-Small-4 (also in L2) and Dc 256 H64 against no_query_regs
# (after the .whl install line)
set -uo pipefail
export PYTHONUNBUFFERED=1
case "${1:-a}" in
a)
  timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "qk_ahead" 2>&1 | tail -15 \
    | tee "$OUT/pytest.log"
  timeout 150 python3 benchmarks/fp8_converter_variants.py --only "Mistral" --variants no_qk_ahead \
    --bf16-variants no_qk_ahead --out "$OUT/mistral" 2>&1 | tee "$OUT/mistral.log" | grep "^|"
  timeout 150 python3 benchmarks/fp8_converter_variants.py --only "Mistral" --variants no_qk_ahead \
    --bf16-variants no_qk_ahead --l2-resident --out "$OUT/mistral_l2" 2>&1 | tee "$OUT/mistral_l2.log" | grep "^|"
  ;;
s)
  for l2 in "" "--l2-resident"; do
    timeout 250 python3 benchmarks/fp8_converter_variants.py --only "Mistral" $l2 \
      --variants no_qk_ahead,ring_s3,ring_s3+no_qk_ahead --bf16-variants s3,s3+no_qk_ahead,s4,s4+no_qk_ahead \
      --out "$OUT/mistral${l2:+_l2}" 2>&1 | tee "$OUT/mistral${l2:+_l2}.log" | grep "^|"
  done
  ;;
c)
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "qk_ahead" 2>&1 | tail -15 \
    | tee "$OUT/pytest.log"
  for l2 in "" "--l2-resident"; do
    timeout 120 python3 benchmarks/fp8_converter_variants.py --only "Mistral" $l2 --variants qk_ahead2 \
      --bf16-variants qk_ahead2 --out "$OUT/mistral${l2:+_l2}" 2>&1 | tee "$OUT/mistral${l2:+_l2}.log" | grep "^|"
  done
  timeout 200 python3 benchmarks/fp8_converter_variants.py --only "H128,H16 B128" --variants qk_ahead2 \
    --bf16-variants qk_ahead2 --out "$OUT/deepseek" 2>&1 | tee "$OUT/deepseek.log" | grep "^|"
  ;;
q)
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode.py -k "query_in_registers" 2>&1 \
    | tail -15 | tee "$OUT/pytest.log"
  for l2 in "" "--l2-resident"; do
    timeout 150 python3 benchmarks/fp8_converter_variants.py --only "Mistral" $l2 --variants no_query_regs,pv168 \
      --bf16-variants no_query_regs --out "$OUT/mistral${l2:+_l2}" 2>&1 | tee "$OUT/mistral${l2:+_l2}.log" | grep "^|"
  done
  timeout 120 python3 benchmarks/fp8_converter_variants.py --only "Dc256 H64" --variants no_query_regs \
    --bf16-variants no_query_regs --out "$OUT/dc256" 2>&1 | tee "$OUT/dc256.log" | grep "^|"
  ;;
esac
