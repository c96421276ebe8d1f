#!/usr/bin/env bash
# Decode on the H200 (issue 44) in one device call of at most 9 minutes: bench_decode.py on the issue's cases with
# FlashMLA in the same process (each row checked against the same fp32 reference, then timed the same way), then
# `mlagen tune` of the decode kernels of deepseek-v3-tp1 and -tp8, recorded under the device's own name.
#
# FlashMLA comes from the first of:
#   /tmp/vllm-rig/site   vLLM's build (vllm._flashmla_C through vllm.v1.attention.ops.flashmla): chain this call
#                        after scripts/vllm_rig/device.sh's `part0` and `part1 install` calls, the machine still warm;
#   $FLASH_MLA, else .flashmla-build/   a folder holding the user's built flash_mla package (git-ignored: carry it);
# else the bench says FlashMLA is absent and goes on.
# Here, once: the .whl/ folder of flash_mla_dropin.sh's header. The device call (timeout_s 600):
#   command  MLAGEN_BENCH_COMMIT=<commit> bash benchmarks/h200_decode.sh [all|bench|tune]   (default all)
#   carry    [".whl"] (and ".flashmla-build" for a FlashMLA build)
# H200_FLASH_MLA: bench_decode's --flash-mla, instead of the choice above (vllm, a PATH, auto or none).
# H200_BUDGET_S: seconds for the whole job (default 520); a step that would pass it is cut short, and one that
# starts with less than 30 s left is not run. H200_CACHES: bench_decode's --caches (default bf16: FlashMLA's).
# Back under $OUT: bench.log, decode/decode.json (rewritten row by row, so a cut run keeps its rows), results.jsonl
# (the rows for benchmarks/results/results.jsonl), tune_*.log, h200.json: the H200's tuning database; ship it as
# tuning/h200.json beside tuning/h100.json, then `mlagen compile --all -o generated --tuning shipped`.
mode=${1:-all}
case $mode in all | bench | tune) ;; *) echo "h200_decode.sh: unknown mode '$mode' (all, bench or tune)" >&2; exit 2 ;; esac
set -uo pipefail
budget=${H200_BUDGET_S:-520}
source benchmarks/job_steps.sh
mkdir -p "$out/decode"
flash=${H200_FLASH_MLA:-}
if [ -z "$flash" ]; then
  flash=auto
  if [ -d /tmp/vllm-rig/site/vllm ]; then
    flash=vllm
  elif [ -d "${FLASH_MLA:-.flashmla-build}" ]; then
    flash=${FLASH_MLA:-.flashmla-build}
  fi
fi
if [ "$flash" = vllm ]; then
  export PYTHONPATH=/tmp/vllm-rig/site:$PYTHONPATH VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader
echo "commit ${MLAGEN_BENCH_COMMIT:-?}; FlashMLA: --flash-mla $flash; budget $budget s"
STEP_LINES='^(#|\||\[flash-mla\]|FAILED|FlashMLA failed|tuning |tuned once|wrote |WRONG|NOT PICKED|NO WORKING|spec |deepseek)'

# the issue's cases (names as bench_decode.py's --only matches them: substrings)
cases="H16 B128 S8192 Sq1 fix,H64 B128 S8192 Sq1 fix,H128 B128 S8192 Sq1 fix,H128 B128 S8192 Sq2 fix"
cases+=",H16 B1 S8192 graph,H128 B1 S8192 graph,H16 B8 S8192 graph,H128 B32 S8192,H16 B64 S32768"
cases+=",H16 skewed4 Sq4 graph,Mistral-S4 H32 B128 S8192"
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  step bench 270 python3 benchmarks/bench_decode.py --out "$out/decode" --only "$cases" --backends auto \
    --caches "${H200_CACHES:-bf16}" --flash-mla "$flash" --append "$out/results.jsonl"
fi
if [ "$mode" = all ] || [ "$mode" = tune ]; then
  tune=(python3 -m mlagen_compiler.cli tune --db "$out/h200.json")
  # B1 H16 (the portable kernel's latency bucket), then the Gluon kernel's serving batches (measured with H128, as
  # the H100's entry was), then the portable kernel's serving buckets (used on Hopper only where Gluon is not)
  step tune_latency 120 "${tune[@]}" deepseek-v3-tp8 --buckets m16-small --cases b1-s8k
  step tune_gluon 240 "${tune[@]}" deepseek-v3-tp1 deepseek-v3-tp8 --buckets gluon --cases b128-s8k,b32-s32k
  step tune_portable 240 "${tune[@]}" deepseek-v3-tp1 deepseek-v3-tp8 --buckets m16,m32,m64 --cases b128-s8k
  python3 - "$out/h200.json" <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
for e in json.loads(path.read_text())["entries"] if path.exists() else []:
    print(f"{e['gpu']} {e['geometry']} {e['bucket']}: {e['config']} {e['time_us']} us "
          f"(default {e['default_config']} {e['default_time_us']} us; {e['measured_with'][0]['spec']})")
PY
fi
