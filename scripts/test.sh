#!/usr/bin/env bash
# The test suite once per tested Triton (requirements/triton-*.txt), each in its own environment made by
# setup.sh, then the vLLM integration's tests (tests/test_integration_vllm.py) in .venv-vllm (setup.sh vllm:
# vLLM pins its own torch). Arguments go to pytest; the vLLM run takes them too, with its test file added
# unless they name test paths (then it runs only if they name that file). MLAGEN_TEST_VLLM=0 leaves it out.
# Exits non-zero if any run fails; every run happens regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
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

vllm_file=tests/test_integration_vllm.py
names_paths=0
names_vllm=0
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    names_paths=1
    [[ "$arg" == *test_integration_vllm* ]] && names_vllm=1
  fi
done
if [ "${MLAGEN_TEST_VLLM:-1}" = "0" ]; then
  echo "== vllm: left out (MLAGEN_TEST_VLLM=0) =="
elif [ $names_paths -eq 1 ] && [ $names_vllm -eq 0 ]; then
  echo "== vllm: left out (the arguments name no $vllm_file) =="
else
  echo "== vllm (.venv-vllm) =="
  if ! bash scripts/setup.sh vllm; then
    df -h . >&2  # the vLLM environment takes ~8 GB
    failed+=("vllm (setup)")
  else
    vllm_args=("$@")
    [ $names_paths -eq 1 ] || vllm_args+=("$vllm_file")
    .venv-vllm/bin/python -m pytest "${vllm_args[@]}"
    rc=$?
    [ $rc -eq 0 ] || failed+=("vllm (pytest exit $rc)")
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: failed under ${failed[*]}" >&2
  exit 1
fi
