"""The cache formats (mlagen_compiler.cache_format): one object per cache_dtype says its storage, its scale and
how rows are quantised; the spec, the plan, the templates and the modules read it."""

from __future__ import annotations

import types
from typing import get_args

import pytest
import torch

from mlagen_compiler.cache_format import (
    CACHE_FORMATS,
    SCALED_CACHE_DTYPES,
    CacheFormat,
    cache_format,
    module_cache_format,
)
from mlagen_compiler.plan import CACHE_BYTES, lower
from mlagen_compiler.reference import FP8_E4M3_MAX, quantize_latent
from mlagen_compiler.render import render_context
from mlagen_compiler.spec import CacheDType, SpecError, spec_from_dict

BASE = dict(
    name="formats", num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    page_size=16, dtype="bfloat16",
)  # fmt: skip


def test_every_cache_dtype_the_spec_takes_is_one_format():
    assert set(get_args(CacheDType)) == set(CACHE_FORMATS)
    assert SCALED_CACHE_DTYPES == ("float8_e4m3fn",)
    for name, fmt in CACHE_FORMATS.items():
        assert fmt.name == name and fmt.torch_dtype().itemsize == fmt.element_bytes == CACHE_BYTES[name]
    plain, fp8 = cache_format("bfloat16"), cache_format("float8_e4m3fn")
    assert not plain.scaled and plain.follows_model_dtype and plain.max_abs is None and plain.name_suffix == ""
    assert fp8.scaled and fp8.scale == "layer" and fp8.max_abs == FP8_E4M3_MAX == 448.0 and fp8.name_suffix == "-fp8"
    with pytest.raises(KeyError, match="cache format 'int4': expected one of bfloat16, float16, float8_e4m3fn"):
        cache_format("int4")
    with pytest.raises(ValueError, match="^scale: expected None or one of layer, got 'row'$"):
        CacheFormat("x", storage="float8_e4m3fn", element_bytes=1, scale="row", max_abs=448.0)


def test_the_spec_plan_and_render_context_carry_the_format():
    plain = spec_from_dict(BASE)
    fp8 = spec_from_dict({**BASE, "cache_dtype": "float8_e4m3fn"})
    assert plain.cache_format is CACHE_FORMATS["bfloat16"] and fp8.cache_format is CACHE_FORMATS["float8_e4m3fn"]
    for spec in (plain, fp8):
        plan = lower(spec)
        assert plan.cache_format is spec.cache_format and plan.cache_dtype == spec.cache_format.name
        assert render_context(plan)["cache_format"] is spec.cache_format
    # a plain format must be the model's own dtype; a scaled one takes any spec dtype
    with pytest.raises(SpecError, match="cache_dtype=float16 is not allowed with dtype=bfloat16"):
        spec_from_dict({**BASE, "cache_dtype": "float16"})
    assert spec_from_dict({**BASE, "dtype": "float16", "cache_dtype": "float8_e4m3fn"}).cache_format.scaled


def test_quantisation_is_the_scaled_division_saturated_and_dequantisation_its_inverse():
    fp8 = cache_format("float8_e4m3fn")
    g = torch.Generator().manual_seed(3)
    latent = (torch.randn(64, 80, generator=g) * 40).to(torch.bfloat16)
    scale = torch.tensor([0.05])
    stored = fp8.quantize(latent, scale)
    want = (latent.float() / 0.05).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn and torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(quantize_latent(latent, scale, torch.float8_e4m3fn).view(torch.uint8), want.view(torch.uint8))
    assert float(stored.float().abs().max()) == 448.0  # saturated, not NaN
    back = fp8.dequantize(stored, scale, torch.float64)
    assert torch.equal(back, want.to(torch.float64) * float(scale))
    with pytest.raises(ValueError, match="^kv_scale: a float8_e4m3fn cache stores latent / kv_scale"):
        fp8.quantize(latent)
    plain = cache_format("bfloat16")
    assert (
        torch.equal(plain.quantize(latent.float()), latent)
        and plain.dequantize(latent, None, torch.bfloat16) is not None
    )
    with pytest.raises(ValueError, match="^kv_scale: a bfloat16 cache stores the latent itself and takes no kv_scale$"):
        plain.quantize(latent, scale)
    assert fp8.scale_for(896.0) == 2.0 and fp8.scale_for(448.0, margin=1.5) == 1.5 and fp8.scale_for(0.0) == 1.0
    assert plain.scale_for(10.0) is None


def test_a_module_holds_its_format(build_module):
    module = build_module(**{**BASE, "name": "formats-fp8", "cache_dtype": "float8_e4m3fn"})
    assert module.CACHE_FORMAT is CACHE_FORMATS["float8_e4m3fn"]
    assert module.CACHE_DTYPE is torch.float8_e4m3fn
    assert module_cache_format(module) is module.CACHE_FORMAT
    earlier = types.SimpleNamespace(DTYPE=torch.bfloat16, CACHE_DTYPE=torch.float8_e4m3fn)  # (no CACHE_FORMAT)
    assert module_cache_format(earlier) is CACHE_FORMATS["float8_e4m3fn"]
    assert module_cache_format(types.SimpleNamespace(DTYPE=torch.float16)) is CACHE_FORMATS["float16"]
