#!/usr/bin/env bash
# The test suite once per tested Triton (requirements/triton-*.txt), each in its own environment made by
# setup.sh. Arguments go to pytest. Exits non-zero if any run fails; every version runs regardless.
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
    failed+=("$version (setup)")
    continue
  fi
  "$venv/bin/python" -m pytest "$@"
  rc=$?
  # pytest's 5 = nothing collected: a selection that runs no test is not a pass
  [ $rc -eq 0 ] || failed+=("$version (pytest exit $rc)")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: failed under triton ${failed[*]}" >&2
  exit 1
fi
