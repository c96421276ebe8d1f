#!/usr/bin/env bash
# vLLM 0.26.0 on the GPU machine (H100/H200, python3.12, torch 2.11.0+cu130, triton 3.6; no registry there).
# Run from the repo root by `run`; modes run in the order given:
#   part0 | part1 ...  copy that part of the archive (carried under .vllm-rig/) to /tmp/vllm-rig/parts, checked
#                      against .vllm-rig/MANIFEST (a carried path is removed by the next call that does not carry it)
#   install            join the parts, unpack vLLM into /tmp/vllm-rig/site, install the wheels there (--no-deps),
#                      make mlagen importable from this tree with its entry points (as `pip install -e .` would),
#                      then a smoke test: import vllm and its kernels, `from vllm import LLM`, load the plugins
#   e2e                scripts/vllm_rig/e2e.py: mlagen's CUSTOM backend against TRITON_MLA and FLASHMLA (< 9 min;
#                      E2E_BUDGET: seconds after which engines are not started, default 450; E2E_ONLY: models;
#                      E2E_CASES: parts of engine labels, with their references)
#   throughput         scripts/vllm_rig/throughput.py (< 9 min; THROUGHPUT_ARGS: its options, THROUGHPUT_TIMEOUT: seconds,
#                      default 560)
#   tp                 scripts/vllm_rig/tp.py: tensor parallelism on two GPUs (nvidia-h200-x2; TP_ARGS, TP_TIMEOUT)
#   profile            scripts/vllm_rig/engine_profile.py: where the time goes, mlagen beside FLASHMLA (torch.profiler;
#                      PROFILE_ARGS: its options, PROFILE_TIMEOUT: seconds, default 560)
# Everything lives under /tmp, which lasts while the machine stays warm (30 s after a call): chain the calls.
#
# The calls, in order (prepare.sh first, here; then copy .vllm-rig/ into the checkout that `run` sends):
#   1. command: bash scripts/vllm_rig/device.sh part0          (timeout_s 600; another job may follow in the command)
#      carry:   [".vllm-rig/vllm-rig.tar.xz.part0", ".vllm-rig/MANIFEST"]   41.4 MiB + the tree (9.3 MiB); ~10 s
#   2. command: bash scripts/vllm_rig/device.sh part1 install e2e           (timeout_s 600)
#      carry:   [".vllm-rig/vllm-rig.tar.xz.part1", ".vllm-rig/MANIFEST"]   41.4 MiB + the tree; install ~40 s,
#               e2e at most 530 s (its own budget: 450 s, then NOT RUN rows)
#   3. command: bash scripts/vllm_rig/device.sh throughput                  (timeout_s 600)
#      carry:   []                                                           at most 560 s (engines start until 470 s)
# .vllm-rig/ must be git-ignored in that checkout (this branch's .gitignore does it): untracked, it would travel
# whole (83 MiB) and the call would be refused.
# A call that finds /tmp/vllm-rig gone (the machine went back) says so; start again at call 1.
# Files back under $OUT: install.log, e2e.log, e2e.json, throughput.log, throughput.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
rig=/tmp/vllm-rig
out=${OUT:-$repo/out}
mkdir -p "$out" "$rig/parts"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# the sampler's FlashInfer top-k / top-p kernels: flashinfer is not carried (seen on the H200: every engine stopped
# at Sampler() with "No module named 'flashinfer'"); vLLM's native sampler needs nothing more
export VLLM_USE_FLASHINFER_SAMPLER=0
# NVLink multicast stays off (the GPU machine's rule: it can take the host's shared GPUs out of service), also in
# the worker processes vLLM starts for tensor parallelism, which inherit this environment
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$rig/site:$repo${PYTHONPATH:+:$PYTHONPATH}

manifest_sha() { # manifest_sha NAME -> the sha256 MANIFEST gives for part NAME
  awk -v n="$1" '$1 == "part" && $2 == n { print $3 }' "$rig/MANIFEST"
}

stage_part() {
  local name=vllm-rig.tar.xz.$1
  [ -f .vllm-rig/MANIFEST ] || { echo "device.sh: .vllm-rig/MANIFEST was not carried" >&2; return 1; }
  [ -f ".vllm-rig/$name" ] || { echo "device.sh: .vllm-rig/$name was not carried" >&2; return 1; }
  if [ -f "$rig/MANIFEST" ] && ! cmp -s .vllm-rig/MANIFEST "$rig/MANIFEST"; then
    echo "device.sh: a different archive's parts are in $rig/parts; dropping them"
    rm -f "$rig"/parts/*
  fi
  cp .vllm-rig/MANIFEST "$rig/MANIFEST"
  cp ".vllm-rig/$name" "$rig/parts/$name"
  local want have
  want=$(manifest_sha "$name")
  have=$(sha256sum "$rig/parts/$name" | cut -d' ' -f1)
  [ "$want" = "$have" ] || { echo "device.sh: $name sha256 $have, MANIFEST says $want" >&2; return 1; }
  echo "device.sh: staged $name ($(stat -c %s "$rig/parts/$name") bytes) in $rig/parts"
}

install_rig() {
  [ -f "$rig/MANIFEST" ] || { echo "device.sh: no $rig/MANIFEST: this machine has no staged part (start at call 1)" >&2; return 1; }
  local name want
  for name in $(awk '$1 == "part" { print $2 }' "$rig/MANIFEST"); do
    [ -f "$rig/parts/$name" ] || { echo "device.sh: $name is not staged: the machine went back since; start again at call 1" >&2; return 1; }
  done
  want=$(awk '$1 == "vllm" { print $4 }' "$rig/MANIFEST")
  rm -rf "$rig/site" "$rig/wheels"
  cat $(awk '$1 == "part" { print "'"$rig"'/parts/" $2 }' "$rig/MANIFEST") >"$rig/archive.tar.xz"
  [ "$(sha256sum "$rig/archive.tar.xz" | cut -d' ' -f1)" = "$want" ] || { echo "device.sh: joined archive sha256 differs from MANIFEST" >&2; return 1; }
  xz -dc "$rig/archive.tar.xz" | tar -x -C "$rig" || return 1
  rm -f "$rig/archive.tar.xz"
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$rig/site" "$rig"/wheels/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
  # mlagen from this tree, with the entry points pyproject.toml declares (an editable install's metadata)
  python3 scripts/editable_metadata.py "$rig/site" || return 1
  python3 - <<'EOF'
import importlib.metadata as md, time
t = time.time()
import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__, "| GPU", torch.cuda.get_device_name(0))
import vllm, vllm._C_stable_libtorch, vllm._flashmla_C  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA2_AVAILABLE
from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported
print("vllm", vllm.__version__, "| FA3", FA3_AVAILABLE, "| FA2", FA2_AVAILABLE, "| FlashMLA dense", is_flashmla_dense_supported())
plugins = [f"{e.name} = {e.value}" for e in md.entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins:", plugins or "none")
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
load_general_plugins()
try:
    print("CUSTOM ->", AttentionBackendEnum.CUSTOM.get_path())
except ValueError as error:
    print("CUSTOM not registered:", error)
print(f"imports {time.time() - t:.1f} s")
EOF
}

status=0
for mode in "$@"; do
  case $mode in
  part[0-9]) stage_part "$mode" || status=1 ;;
  install) install_rig 2>&1 | tee "$out/install.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  e2e) timeout 530 python3 scripts/vllm_rig/e2e.py --out "$out/e2e.json" --budget "${E2E_BUDGET:-450}" ${E2E_ONLY:+--only "$E2E_ONLY"} ${E2E_CASES:+--cases "$E2E_CASES"} 2>&1 | tee "$out/e2e.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  throughput) timeout "${THROUGHPUT_TIMEOUT:-560}" python3 scripts/vllm_rig/throughput.py --out "$out/throughput.json" \
    ${THROUGHPUT_ARGS:-} 2>&1 \
    | tee "$out/throughput.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  tp) timeout "${TP_TIMEOUT:-560}" python3 scripts/vllm_rig/tp.py --out "$out/tp.json" ${TP_ARGS:-} 2>&1 \
    | grep -v "^INFO\|^WARNING\|^(EngineCore\|^(Worker" | tee "$out/tp.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  profile) timeout "${PROFILE_TIMEOUT:-560}" python3 scripts/vllm_rig/engine_profile.py --out-dir "$out" ${PROFILE_ARGS:-} 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" \
    | tee "$out/profile.log"; [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
  *) echo "device.sh: unknown mode '$mode' (allowed: part0..part9, install, e2e, throughput, profile, tp)" >&2; exit 2 ;;
  esac
  [ $status = 0 ] || { echo "device.sh: mode $mode failed; stopping" >&2; exit 1; }
done
