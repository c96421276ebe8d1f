#!/usr/bin/env bash
# The FlashMLA drop-in on the GPU machine: FlashMLA's dense-decoding suite through mlagen_compiler.flash_mla (bf16,
# fp16), the cases FlashMLA cannot run, the GPU tests of causal / non-causal decode and the drop-in, then, alone on
# the GPU, the latency cases with float32 and 16-bit partial rows and the drop-in's host time.
#
# Here, once: `echo /.whl/ >> .git/info/exclude; echo /.flashmla/ >> .git/info/exclude`, the wheels of pydantic
# 2.12.5, pydantic-core 2.41.5, annotated-types, typing-inspection and platformdirs (cp312 manylinux) in .whl/,
# and FlashMLA's tests in .flashmla/: `git -C FLASHMLA_REPO archive HEAD tests | tar -x -C .flashmla`.
# Then the device call: carry [".whl", ".flashmla"], command `bash benchmarks/flash_mla_dropin.sh`.
#   bash benchmarks/flash_mla_dropin.sh rerun   only the cases listed in .flashmla/rerun/{suite_bf16,suite_fp16,
#                                               extra_bf16}.json (an earlier run's failures, its JSONs' "failures"),
#                                               the GPU tests, no timings
mode=${1:-all}
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
run() {  # name, time limit, command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"/tmp/logs/$name.log" 2>&1
  echo "$name: exit $?" >>/tmp/logs/status.log
}
mkdir -p /tmp/logs
# FlashMLA's suite in 5 slices a dtype and the extra cases in 3, side by side (compiling is what takes the time)
select=()
if [ "$mode" = rerun ]; then select=(--cases); fi
for job in suite_bf16 suite_fp16 extra_bf16; do
  slices=5
  [ "$job" = extra_bf16 ] && slices=3
  for k in $(seq 0 $((slices - 1))); do
    run "${job}_$k" 300 python3 benchmarks/flash_mla_dropin.py "${job%_*}" --flashmla .flashmla --dtype "${job#*_}" \
      --shard "$k/$slices" --json "/tmp/logs/${job}_$k.json" ${select[@]+"${select[@]}" ".flashmla/rerun/$job.json"} &
  done
done
run pytest_gpu 300 python3 -m pytest -q -p no:cacheprovider tests/test_flash_mla.py tests/test_ops.py \
  tests/test_decode.py -k "flash_mla or causal or matches_reference or default_call or graph or partial" &
wait
sort /tmp/logs/status.log
tail -3 /tmp/logs/pytest_gpu.log
python3 - <<'PY'
import collections, glob, json
totals = collections.defaultdict(collections.Counter)
for path in sorted(glob.glob("/tmp/logs/*.json")):
    result = json.load(open(path))
    totals[f"{result['job']} {result['dtype']}{' (stopped early)' if result.get('partial') else ''}"].update(
        result["counts"])
    for failure in result["failures"]:
        print("FAILED", failure["case"], failure["error"][:300])
for name, counts in totals.items():
    print(name, dict(counts))
PY
grep -h "^NOT APPLICABLE" /tmp/logs/*.log | head -5
tar -czf "$OUT/logs_$mode.tar.gz" -C /tmp logs  # (at most 8 files come back: the logs and counts travel as one)
[ "$mode" = rerun ] && exit 0
# alone on the GPU from here: timings
timeout 100 python3 benchmarks/probes/latency_probe.py --partials --only "B1 H16" 2>&1 | tee "$OUT/latency_partials.log" \
  | grep -v "^#" | cut -c1-240
timeout 60 python3 benchmarks/flash_mla_dropin.py host --json "$OUT/host.json" 2>&1 | tail -22
