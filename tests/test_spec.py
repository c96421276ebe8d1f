import json
import math
from pathlib import Path

import pytest
import yaml
from helpers import DEEPSEEK_V3_TP8_SPEC

from mlagen_compiler.plan import softmax_scale_of
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import SpecError, json_schema, load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
BASE = DEEPSEEK_V3_TP8_SPEC


def test_issue_example_loads(tmp_path):
    text = """
name: deepseek-v3-tp8
num_heads: 16          # heads per tensor-parallel rank
kv_lora_rank: 512
qk_rope_head_dim: 64
qk_nope_head_dim: 128
v_head_dim: 128
q_lora_rank: 1536      # or null
dtype: bfloat16        # bfloat16 | float16 (query, cache, output)
page_size: 64          # power of two, 1..256
"""
    path = tmp_path / "s.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert spec.num_heads == 16 and spec.q_lora_rank == 1536 and spec.kernels == ("decode",)
    assert math.isclose(softmax_scale_of(spec), 1 / math.sqrt(192))


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("num_heads", 0, "1..256"),
        ("num_heads", 257, "1..256"),
        ("kv_lora_rank", 100, "multiple of 16 in 64..1024"),
        ("kv_lora_rank", 48, "multiple of 16 in 64..1024"),
        ("kv_lora_rank", 1040, "multiple of 16 in 64..1024"),
        ("qk_rope_head_dim", 8, "multiple of 16 in 16..128"),
        ("qk_rope_head_dim", 144, "multiple of 16 in 16..128"),
        ("page_size", 48, "power of two in 1..256"),
        ("page_size", 512, "power of two in 1..256"),
        ("page_size", 0, "power of two in 1..256"),
        ("dtype", "float32", "bfloat16"),
        ("name", "Bad Name", "pattern"),
        ("kernels", ["decode", "decode"], "once"),
        ("cache_dtype", "float16", "the spec's dtype (bfloat16) or one of float8_e4m3fn"),
        ("cache_dtype", "fp8", "float8_e4m3fn"),
    ],
)
def test_invalid_field_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(SpecError) as info:
        spec_from_dict({**BASE, field: value}, "spec.yaml")
    message = str(info.value)
    assert message.startswith(f"spec.yaml: {field}")
    assert str(value if not isinstance(value, list) else value[0]) in message
    assert allowed in message


def test_unknown_and_missing_fields():
    with pytest.raises(SpecError, match=r"heads: unknown field \(allowed: .*num_heads"):
        spec_from_dict({**BASE, "heads": 3})
    incomplete = dict(BASE)
    del incomplete["kv_lora_rank"]
    with pytest.raises(SpecError, match="kv_lora_rank: required field is missing"):
        spec_from_dict(incomplete)
    allowed = r"tiles\.decode\.blockn: unknown field \(allowed: block_m, block_n, num_stages, num_warps\) \(got 64\)"
    with pytest.raises(SpecError, match=allowed):
        spec_from_dict({**BASE, "tiles": {"decode": {"blockn": 64}}})


def test_tile_overrides_validated():
    with pytest.raises(SpecError, match="block_n=48 is not allowed"):
        spec_from_dict({**BASE, "tiles": {"decode": {"block_n": 48}}})
    with pytest.raises(SpecError, match="num_warps=3 is not allowed"):
        spec_from_dict({**BASE, "tiles": {"decode": {"num_warps": 3}}})


def test_frozen():
    spec = spec_from_dict(BASE)
    with pytest.raises(Exception, match="frozen"):
        spec.num_heads = 3  # type: ignore[misc]


def test_yarn_mscale_scale():
    rope = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    spec = spec_from_dict({**BASE, "rope_scaling": rope})
    mscale = 0.1 * math.log(40) + 1.0
    assert math.isclose(softmax_scale_of(spec), mscale**2 / math.sqrt(192))
    # HF configs spell the key rope_type; mscale_all_dim 0 means no correction
    plain = spec_from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 40}})
    assert math.isclose(softmax_scale_of(plain), 1 / math.sqrt(192))
    explicit = spec_from_dict({**BASE, "softmax_scale": 0.5})
    assert softmax_scale_of(explicit) == 0.5
    with pytest.raises(SpecError, match="both"):
        spec_from_dict({**BASE, "softmax_scale": 0.5, "rope_scaling": rope})


def test_hash_ignores_key_order_comments_whitespace(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(BASE, sort_keys=True))
    b.write_text("# comment\n" + yaml.safe_dump(dict(reversed(list(BASE.items()))), sort_keys=False, indent=4))
    assert load_spec(a).content_hash() == load_spec(b).content_hash()
    assert spec_from_dict({**BASE, "page_size": 32}).content_hash() != load_spec(a).content_hash()


def test_cache_dtype_defaults_to_the_dtype():
    """An omitted (or null) cache_dtype is the spec's dtype, and writing it out does not change the hash."""
    plain = spec_from_dict(BASE)
    assert plain.cache_dtype == "bfloat16" and not plain.cache_format.scaled
    for explicit in ("bfloat16", None):
        assert spec_from_dict({**BASE, "cache_dtype": explicit}).content_hash() == plain.content_hash()
    assert spec_from_dict({**BASE, "dtype": "float16"}).cache_dtype == "float16"
    fp8 = spec_from_dict({**BASE, "cache_dtype": "float8_e4m3fn"})
    assert fp8.cache_format.scaled and fp8.dtype == "bfloat16" and fp8.content_hash() != plain.content_hash()
    assert spec_from_dict({**BASE, "dtype": "float16", "cache_dtype": "float8_e4m3fn"}).cache_format.scaled


def test_bundled_specs_cover_design_geometries():
    names = set(registered_specs())
    expected = {
        "deepseek-v2",
        "deepseek-v2-lite",
        "deepseek-v3-tp1",
        "deepseek-v3-tp8",
        "kimi-k2",
        "mistral-small-4",
    }
    assert expected <= names
    geometry = {
        "deepseek-v2": (128, 1536, 512, 64, 128, 128),
        "deepseek-v2-lite": (16, None, 512, 64, 128, 128),
        "deepseek-v3-tp1": (128, 1536, 512, 64, 128, 128),
        "deepseek-v3-tp8": (16, 1536, 512, 64, 128, 128),
        "deepseek-v3-tp4": (32, 1536, 512, 64, 128, 128),
        "deepseek-v3-tp2": (64, 1536, 512, 64, 128, 128),
        "kimi-k2": (64, 1536, 512, 64, 128, 128),
        "mistral-small-4": (32, 1024, 256, 64, 64, 128),
        "deepseek-v3-tp8-fp8": (16, 1536, 512, 64, 128, 128),
        "mistral-small-4-fp8": (32, 1024, 256, 64, 64, 128),
    }
    for name, want in geometry.items():
        s = resolve_spec(name)
        got = (
            s.num_heads,
            s.q_lora_rank,
            s.kv_lora_rank,
            s.qk_rope_head_dim,
            s.qk_nope_head_dim,
            s.v_head_dim,
        )
        assert got == want, name
        assert s.cache_dtype == ("float8_e4m3fn" if name.endswith("-fp8") else s.dtype), name
    # an fp8 spec is its 16-bit twin with the cache dtype changed, nothing else
    for name in ("deepseek-v3-tp8", "mistral-small-4"):
        twin = resolve_spec(f"{name}-fp8").to_flat_dict()
        assert {**twin, "name": name, "cache_dtype": "bfloat16"} == resolve_spec(name).to_flat_dict()


def test_published_schema_is_current():
    published = json.loads((ROOT / "specs" / "mlagen-spec.schema.json").read_text())
    assert published == json_schema()
