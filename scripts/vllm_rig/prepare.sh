#!/usr/bin/env bash
# Prepare vLLM 0.26.0 for the GPU machine, which reaches no registry: run HERE (a machine with PyPI), from any folder.
#   bash scripts/vllm_rig/prepare.sh          -> .vllm-rig/vllm-rig.tar.xz.part0, .part1, MANIFEST (ignored by git)
# device.sh (beside this file) copies the parts on the GPU machine, joins, unpacks and installs them.
#
# What travels: one tar.xz of
#   site/   vllm 0.26.0's wheel unpacked, less what a dense MLA model on an H100/H200 never loads (below);
#   wheels/ the cp312 manylinux wheels (--no-deps) of the packages that `from vllm import LLM` and the offline
#           LLM(...).generate path import and that the GPU image lacks (KINDS.md's package list), plus mlagen's own
#           (pydantic, platformdirs).
# split into parts of at most PART_MIB (default 46) so that each `run` call carries one part beside the working
# tree (about 9.5 MiB) under the 64 MiB limit.
#
# Left out of the vLLM wheel (709 MB unpacked), and why:
#   vllm_flash_attn/_vllm_fa2_C.abi3.so   305 MB (84 MB as xz): FlashAttention 2. On SM90 vLLM picks FA3
#                                          (fa_utils.get_flash_attn_version); FA2 is only its fallback.
#   vllm-rs                                43 MB: the Rust API-server front end (`vllm serve`), not the offline LLM.
#   _moe_C_stable_libtorch.abi3.so         47 MB (40 MB as xz): fused-MoE kernels (routing, top-k, align). Loaded
#                                          under contextlib.suppress(ImportError) (platforms/cuda.py); the rig's
#                                          models are dense (first_k_dense_replace = layers), so no MoE op runs.
#                                          With it the archive needs a third part (a third call).
#   _qutlass_C.abi3.so                     1 MB: FP4 quantisation kernels, loaded under suppress(ImportError).
#   third_party/deep_gemm, fmha_sm100      65 MB: DeepGEMM (fp8 block GEMMs, MoE) and SM100 sparse FMHA (MiniMax-M3);
#                                          imported lazily by those features only.
# Kept on purpose: vllm_flash_attn/_vllm_fa3_C (153 MB, 8 MB as xz): the MLA PREFILL of every dense MLA backend
# (TRITON_MLA, FLASHMLA, and a CUSTOM one built on MLACommonImpl) goes through vLLM's MLA prefill registry, whose only
# SM90 entry is FLASH_ATTN (v1/attention/backends/mla/prefill/selector.py): without FA3 no MLA engine starts.
# _flashmla_C, _flashmla_extension_C and third_party/flashmla (FLASHMLA), _C_stable_libtorch (cache writes,
# RMSNorm, rotary, activations), the rest of third_party (small, imported lazily).
#
# Dependencies left out (the rest of the issue's list): not imported by the offline path with a token-id prompt
# (skip_tokenizer_init) and a dense bf16 model, checked by importing vllm.entrypoints.llm, the v1 engine core,
# scheduler, worker, GPU model runner, deepseek_v2, the MLA backends, the MLA prefill backend, the ngram proposer
# and the compilation modules in a CPU venv with only these wheels added: gguf, outlines-core, lm-format-enforcer,
# lark, compressed-tensors (quantised checkpoints), mistral-common (Mistral tokenizers), prometheus-fastapi-
# instrumentator, setproctitle (optional), ijson, watchfiles, python-json-logger, anthropic, mcp, uvicorn,
# opentelemetry-sdk/exporters, nvtx (profiling only), blake3 (multimodal hashing), jiter, and the kernel packages
# flashinfer, tilelang, quack, nvidia-cutlass-dsl (vLLM falls back when they are absent).
# Carried although only lazily needed: depyf (+ astor, dill): vllm/compilation/wrapper.py imports it to word an
# error when CUDA graphs meet a module that mutates buffers; typing-extensions: pydantic-core 2.41 needs >= 4.14.1.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/.vllm-rig
part_mib=${PART_MIB:-46}
scratch=${SCRATCH:-${TMPDIR:-/tmp}/vllm-rig-build}
vllm_version=0.26.0
wheels=(
  # the offline LLM path (import trial: see the header)
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.22.0 pybase64==1.5.1 cachetools==8.0.2 partial-json-parser==0.2.1.1.post7
  openai==2.54.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8
  fastapi==0.136.3 starlette==1.0.1 opentelemetry-api==1.45.2
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6
  depyf==0.20.0 astor==0.8.1 dill==0.4.1
  # mlagen's own needs that the image lacks (jinja2, pyyaml, typer, filelock are there)
  platformdirs==4.14.8
)
strip=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  vllm/vllm-rs
  vllm/_moe_C_stable_libtorch.abi3.so
  vllm/_qutlass_C.abi3.so
  vllm/third_party/deep_gemm
  vllm/third_party/fmha_sm100
)
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
  manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  platforms+=(--platform "$p")
done
download() {
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$@" 2>&1 | grep -v "^WARNING: Location" || true
}

mkdir -p "$scratch/dl" "$out"
wheel=$scratch/dl/vllm-$vllm_version-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f "$wheel" ] || download "$scratch/dl" "vllm==$vllm_version"
[ -f "$wheel" ] || { echo "prepare.sh: $wheel was not downloaded" >&2; exit 1; }

bundle=$scratch/bundle
rm -rf "$bundle" && mkdir -p "$bundle/site" "$bundle/wheels"
python3 -m zipfile -e "$wheel" "$bundle/site"
for path in "${strip[@]}"; do
  [ -e "$bundle/site/$path" ] || { echo "prepare.sh: $path is not in the vllm $vllm_version wheel" >&2; exit 1; }
  rm -rf "${bundle:?}/site/$path"
done
for kept in vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so vllm/_flashmla_C.abi3.so vllm/_C_stable_libtorch.abi3.so \
  vllm/third_party/flashmla/flash_mla_interface.py; do
  [ -e "$bundle/site/$kept" ] || { echo "prepare.sh: $kept missing from the wheel" >&2; exit 1; }
done
download "$bundle/wheels" "${wheels[@]}"
count=$(ls "$bundle/wheels"/*.whl | wc -l)
[ "$count" -eq "${#wheels[@]}" ] || { echo "prepare.sh: $count wheels for ${#wheels[@]} pins" >&2; exit 1; }

echo "prepare.sh: site $(du -sh "$bundle/site" | cut -f1), wheels $(du -sh "$bundle/wheels" | cut -f1); compressing"
archive=$scratch/vllm-rig.tar.xz
tar -C "$bundle" -cf - site wheels | xz -T0 -9 -c >"$archive"
size=$(stat -c %s "$archive")
parts=$(((size + part_mib * 1048576 - 1) / (part_mib * 1048576)))
part_bytes=$(((size + parts - 1) / parts))
rm -f "$out"/vllm-rig.tar.xz.part* "$out/MANIFEST"
split -b "$part_bytes" -d -a 1 "$archive" "$out/vllm-rig.tar.xz.part"
{
  echo "vllm $vllm_version archive $(sha256sum "$archive" | cut -d' ' -f1) $size"
  for f in "$out"/vllm-rig.tar.xz.part*; do echo "part $(basename "$f") $(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f")"; done
} >"$out/MANIFEST"
cat "$out/MANIFEST"
echo "prepare.sh: $parts parts in $out (carry one per call with .vllm-rig/MANIFEST: see device.sh)"
