#!/usr/bin/env bash
# Create a virtual environment and install mlagen (editable) with the CPU test stack and one tested Triton.
#   bash scripts/setup.sh          -> .venv               (triton 3.6, the GPU machine's)
#   bash scripts/setup.sh 3.9      -> .venv-triton3.9     (any requirements/triton-<version>.txt)
#   bash scripts/setup.sh vllm     -> .venv-vllm          (requirements/vllm.txt: vLLM with the torch it pins)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.6}
if [ "$version" = "vllm" ]; then
  venv=.venv-vllm
  requirements=(-r requirements/vllm.txt)
  versions=", '| vllm', __import__('vllm').__version__"
else
  pins=requirements/triton-$version.txt
  if [ ! -f "$pins" ]; then
    echo "setup.sh: no $pins; tested Triton versions: $(ls requirements/triton-*.txt | sed 's/.*triton-//; s/\.txt$//' | xargs), or vllm" >&2
    exit 2
  fi
  venv=.venv
  [ "$version" = "3.6" ] || venv=.venv-triton$version
  requirements=(-r requirements/ci.txt -r "$pins")
  versions=""
fi
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${requirements[@]}" -e . 2>&1 \
  | grep -v "^WARNING: Location" || true
"$venv/bin/python" -c "import torch, triton, numpy, mlagen_compiler; print('$venv: mlagen', mlagen_compiler.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| numpy', numpy.__version__$versions)" 2>&1 \
  | grep -v "Failed to import from vllm._C"
