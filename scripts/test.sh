#!/usr/bin/env bash
# The test suite once per tested Triton (requirements/triton-*.txt), each in its own environment made by
# setup.sh, then the vLLM integration's tests (tests/test_integration_vllm.py) in .venv-vllm (setup.sh vllm:
# vLLM pins its own torch). Arguments go to pytest. Arguments that name test paths choose the runs: the
# Triton environments run unless the vLLM file is the only path named, the vLLM one only if it is named (with
# no path named, it runs its file). MLAGEN_TEST_VLLM=0 leaves the vLLM run out.
# Exits non-zero if any run fails; every chosen run happens regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
vllm_file=tests/test_integration_vllm.py
names_vllm=0
names_other=0
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    if [[ "$arg" == *test_integration_vllm* ]]; then names_vllm=1; else names_other=1; fi
  fi
done

failed=()
if [ $names_vllm -eq 1 ] && [ $names_other -eq 0 ]; then
  echo "== triton environments: left out (the arguments name only $vllm_file) =="
else
  for pins in requirements/triton-*.txt; do
    version=${pins#requirements/triton-}
    version=${version%.txt}
    venv=.venv
    [ "$version" = "3.6" ] || venv=.venv-triton$version
    echo "== triton $version ($venv) =="
    if ! bash scripts/setup.sh "$version"; then
      df -h . >&2  # each environment takes ~2 GB: a full disk is the usual cause
      failed+=("triton $version (setup)")
      continue
    fi
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    # pytest's 5 = nothing collected: a selection that runs no test is not a pass
    [ $rc -eq 0 ] || failed+=("triton $version (pytest exit $rc)")
  done
fi

if [ "${MLAGEN_TEST_VLLM:-1}" = "0" ]; then
  echo "== vllm: left out (MLAGEN_TEST_VLLM=0) =="
elif [ $names_other -eq 1 ] && [ $names_vllm -eq 0 ]; then
  echo "== vllm: left out (the arguments name test paths, not $vllm_file) =="
else
  echo "== vllm (.venv-vllm) =="
  if ! bash scripts/setup.sh vllm; then
    df -h . >&2  # the vLLM environment takes ~8 GB
    failed+=("vllm (setup)")
  else
    vllm_args=("$@")
    [ $names_vllm -eq 1 ] || vllm_args+=("$vllm_file")
    .venv-vllm/bin/python -m pytest "${vllm_args[@]}"
    rc=$?
    [ $rc -eq 0 ] || failed+=("vllm (pytest exit $rc)")
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: failed under ${failed[*]}" >&2
  exit 1
fi
