#!/usr/bin/env bash
# On a GPU machine: run benchmarks/sanitize_cases.py once plainly (compiles every kernel into Triton's
# cache and checks results), then under each compute-sanitizer tool; prints one summary row per tool.
# Arguments go to sanitize_cases.py (e.g. --backends triton,gluon --specs san-page16 --kernels decode).
# Logs in ${OUT:-/tmp}/sanitize-*.log.
#
#   SANITIZE_TOOLS      tools to run (default: memcheck racecheck synccheck initcheck)
#   SANITIZE_TIMEOUT_S  limit per tool run (default 600), or per case with SANITIZE_PER_CASE=1
#   SANITIZE_PER_CASE=1 one process per case (sanitize_cases.py --list), SANITIZE_JOBS at a time (default 4),
#                       each under its own timeout, so a slow tool (racecheck) times out one case, not the
#                       rest; the plain run is split the same way. The per-case logs are joined into
#                       sanitize-<tool>.log, one "### case:" header each, and benchmarks/sanitize_summary.py
#                       prints one row per case and tool.
#   SANITIZE_KERNEL     instrument only kernels whose name contains this (e.g. _mla_decode_gluon_kernel):
#                       the reference's cuBLAS calls and other kernels then run uninstrumented
#   COMPUTE_SANITIZER   the binary (default: on PATH, else the newest /usr/local/cuda*/bin/compute-sanitizer)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export MLAGEN_VALIDATE=1 PYTHONUNBUFFERED=1
limit=${SANITIZE_TIMEOUT_S:-600}
tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}
[ -x "$cs" ] || { echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
filter=()
if [ -n "${SANITIZE_KERNEL:-}" ]; then
  help=$("$cs" --help 2>&1)  # (not piped into grep -q: under pipefail its early exit fails the pipe)
  if [[ $help == *--kernel-name* ]]; then
    filter=(--kernel-name "kns=$SANITIZE_KERNEL")
  else
    filter=(--filter "kns=$SANITIZE_KERNEL")
  fi
fi
common=(--error-exitcode 9 --target-processes all --print-limit 1000 "${filter[@]}")

if [ "${SANITIZE_PER_CASE:-0}" != 1 ]; then
  python3 benchmarks/sanitize_cases.py "$@" > "$out/sanitize-plain.log" 2>&1
  echo "plain run: exit $? ($(tail -1 "$out/sanitize-plain.log"))"
  status=0
  for tool in $tools; do
    timeout "$limit" "$cs" --tool "$tool" "${common[@]}" python3 benchmarks/sanitize_cases.py "$@" \
      > "$out/sanitize-$tool.log" 2>&1
    rc=$?
    summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out/sanitize-$tool.log" | tail -1)
    echo "$tool: exit $rc; ${summary:-no summary line}; $(grep -c '^san-.*PASS' "$out/sanitize-$tool.log") cases passed"
    [ $rc -eq 0 ] || status=1
  done
  exit $status
fi

# one process per case
work=$(mktemp -d)
python3 benchmarks/sanitize_cases.py --list "$@" > "$work/cases" || exit 2
echo "$(wc -l < "$work/cases") cases; $cs; ${filter[*]:-every kernel}"
run_case() {  # TOOL NUMBER ARGS...: one case, plainly (TOOL = plain) or under a tool, into its own log
  local tool=$1 n=$2
  shift 2
  local log="$work/$tool-$(printf %03d "$n").log"
  local start=$SECONDS
  if [ "$tool" = plain ]; then
    timeout "$limit" python3 benchmarks/sanitize_cases.py "$@" > "$log.body" 2>&1
  else
    timeout "$limit" "$cs" --tool "$tool" "${common[@]}" python3 benchmarks/sanitize_cases.py "$@" > "$log.body" 2>&1
  fi
  local rc=$?
  { echo "### case: $* | tool $tool | exit $rc | $((SECONDS - start)) s"; cat "$log.body"; } > "$log"
  rm -f "$log.body"
}
export -f run_case
export work limit cs
export common_str="${common[*]}"
status=0
for tool in plain $tools; do
  # (the function sees the arrays through a re-split string: the options hold no spaces)
  nl -ba -w1 -s' ' "$work/cases" | xargs -P "${SANITIZE_JOBS:-4}" -L 1 bash -c \
    'common=($common_str); run_case '"$tool"' "$@"' _
  cat "$work/$tool"-*.log > "$out/sanitize-$tool.log"
  failed=$(grep -c '^### case: .* exit [^0]' "$out/sanitize-$tool.log")
  echo "$tool: $(grep -c '^### case:' "$out/sanitize-$tool.log") cases, $failed with a non-zero exit"
  [ "$failed" -eq 0 ] || status=1
done
logs=("$out/sanitize-plain.log")
for tool in $tools; do logs+=("$out/sanitize-$tool.log"); done
python3 benchmarks/sanitize_summary.py "${logs[@]}" > "$out/sanitize-summary.md" 2>&1
cat "$out/sanitize-summary.md"
rm -rf "$work"
exit $status
