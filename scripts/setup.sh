#!/usr/bin/env bash
# Create .venv and install mlagen (editable) with the CPU test stack pinned to the GPU machine's Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-ci.txt -e . 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, triton, mlagen_compiler; print('mlagen', mlagen_compiler.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
