"""Patch a transformers DeepSeek-V3-style model onto mlagen kernels and generate.

    python examples/hf_generate.py                      # a small random DeepSeek-V3 (no download)
    python examples/hf_generate.py --config path/to/config.json --new-tokens 32

Needs `pip install "mlagen[hf]"` (transformers 5.x) and a CUDA GPU; on a CPU-only machine set
TRITON_INTERPRET=1 (slow: keep the model tiny).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config

import mlagen_compiler
from mlagen_compiler.integrations.transformers import PagedMLACache, patch_model, spec_from_config


def small_config() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=4, num_mtp_layers=0, max_position_embeddings=4096,
        pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a config.json or a model directory (default: a small random DeepSeek-V3)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--cache-dtype", help="the latent cache's storage: float8_e4m3fn (kv_scale 1; default: the kernels' bfloat16)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(args.config) if args.config else small_config()

    # 1. the spec of one attention layer, derived from the config (YaRN scale included), compiled once
    spec = spec_from_config(config, dtype="bfloat16", cache_dtype=args.cache_dtype)
    print(f"spec {spec.name}: {spec.num_heads} heads, Dc {spec.kv_lora_rank}, Dr {spec.qk_rope_head_dim}, "
          f"cache {spec.cache_dtype}")  # fmt: skip
    mlagen_compiler.load(spec)  # patch_model loads the same module from the compile cache

    # 2. a model with random weights (from_pretrained works the same way); patch a copy in place
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model = patch_model(copy.deepcopy(reference), page_size=64, dtype=torch.bfloat16, cache_dtype=args.cache_dtype)

    # 3. a left-padded batch of prompts of different lengths, as a tokenizer gives them
    lengths = [12, 5]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, config.vocab_size, (n,), device=device)
        mask[row, -n:] = 1

    cache = PagedMLACache(model, max_batch_size=len(lengths), max_cache_len=max(lengths) + args.new_tokens)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=args.new_tokens,
                             do_sample=False)  # fmt: skip
        patched_s = time.perf_counter() - start
        start = time.perf_counter()
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
        reference_s = time.perf_counter() - start
    new = out[:, ids.shape[1] :]
    print("mlagen tokens:    ", new.tolist())
    print("transformers:     ", expected[:, ids.shape[1] :].tolist())
    print(f"generate: mlagen {patched_s:.2f} s, transformers {reference_s:.2f} s ({device})")


if __name__ == "__main__":
    main()
