"""Spec dicts the tests build on (one home each); inputs and comparisons live in `mlagen_compiler.verify`,
which the library's verify command and tuner use too.

Use as `{**SMALL_SPEC, "name": ..., <the fields a test is about>}`.
"""

import importlib.util
from pathlib import Path

#: DeepSeek-V3 at tensor parallel 8: the geometry the product is for (spec and plan tests)
DEEPSEEK_V3_TP8_SPEC = {
    "name": "deepseek-like",
    "num_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 1536,
    "dtype": "bfloat16",
    "page_size": 64,
}

#: a small geometry that compiles and runs quickly in Triton's interpreter (cache, render, tuning tests)
SMALL_SPEC = {
    "name": "small",
    "num_heads": 16,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "page_size": 16,
    "dtype": "float16",
}


def import_source(source: str, directory: Path, name: str):
    """Import generated source from a file (Triton's JIT reads the kernels' source from it)."""
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
