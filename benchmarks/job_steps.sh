# Sourced by the one-call device jobs (h200_decode.sh, h200_prefill.sh): installs the carried wheels (.whl/: the
# GPU image lacks pydantic and platformdirs), sets PYTHONPATH, and defines `step`, which runs one part of a job
# under the job's time budget ($budget seconds, counted from the job's start).
export PYTHONUNBUFFERED=1
out=${OUT:-$PWD/out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# (and this tree's entry points, as an editable install has them: the pytest plugin, the vLLM plugin)
python3 scripts/editable_metadata.py /tmp/site >/dev/null || exit 1

# step NAME SECONDS COMMAND...: the command's output goes to $out/NAME.log; here, its exit status, its time and the
# lines that matter (STEP_LINES, an extended regular expression); the limit shrinks to what is left of the budget,
# and a step with less than 30 s left is not run.
step() {
  local name=$1 limit=$2 began=$SECONDS
  shift 2
  local left=$((budget - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "$name: NOT RUN (${left} s of the budget left)"
    return
  fi
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status after $((SECONDS - began)) s (limit $limit s)"
  grep -E "$STEP_LINES" "$out/$name.log" | cut -c1-400
  [ $status = 0 ] || tail -n 4 "$out/$name.log" | cut -c1-400
}
