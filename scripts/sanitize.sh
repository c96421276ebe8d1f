#!/usr/bin/env bash
# On a GPU machine: run benchmarks/sanitize_cases.py once plainly (compiles every kernel into Triton's
# cache and checks results), then under each compute-sanitizer tool; prints one summary row per tool.
# Arguments go to sanitize_cases.py (e.g. --backends triton,gluon). Logs in ${OUT:-/tmp}/sanitize-*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export MLAGEN_VALIDATE=1 PYTHONUNBUFFERED=1
limit=${SANITIZE_TIMEOUT_S:-600}  # per tool
python3 benchmarks/sanitize_cases.py "$@" > "$out/sanitize-plain.log" 2>&1
echo "plain run: exit $? ($(tail -1 "$out/sanitize-plain.log"))"
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
  timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
    python3 benchmarks/sanitize_cases.py "$@" > "$out/sanitize-$tool.log" 2>&1
  rc=$?
  summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out/sanitize-$tool.log" | tail -1)
  echo "$tool: exit $rc; ${summary:-no summary line}; $(grep -c '^san-.*PASS' "$out/sanitize-$tool.log") cases passed"
  [ $rc -eq 0 ] || status=1
done
exit $status
