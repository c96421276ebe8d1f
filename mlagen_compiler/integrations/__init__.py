"""Integrations of generated MLA modules with model code.

- :mod:`mlagen_compiler.integrations.hf_config`: MLA spec from a Hugging Face config (a config object or a
  config.json), without importing transformers (used by ``mlagen spec-from-hf``).
- :mod:`mlagen_compiler.integrations.transformers`: ``patch_model``, ``PagedMLACache`` and ``planned_step``
  for transformers 5.x DeepSeek-V2/V3-style models (needs the optional extra ``mlagen[hf]``); the kernels run
  as the generated module's own ``torch.library`` custom ops (``module.ops``).
- :mod:`mlagen_compiler.integrations.vllm`: a vLLM attention backend for MLA layers (``CUSTOM``, registered by
  the ``vllm.general_plugins`` entry point ``mlagen``; needs the optional extra ``mlagen[vllm]``).
"""
