"""An MLA spec from a Hugging Face model config (DeepSeek-V2/V3 field names), without importing transformers.

Works on a `transformers` config object (``model.config``) or on the plain dict of a ``config.json``, so
``mlagen spec-from-hf`` needs no transformers install and reads configs transformers does not know
(Kimi-K2's ``model_type: kimi_k2`` uses DeepSeek-V3's fields and code).

The softmax scale is computed the way transformers' DeepSeek-V2/V3 attention computes ``self.scaling``:
(Dn + Dr) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when the rope parameters are not "default"
and set ``mscale_all_dim`` (mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..cache_format import CACHE_FORMATS
from ..plan import softmax_scale_of
from ..spec import MLASpec, SpecError, brief_repr, spec_from_dict, unique_json_keys

__all__ = ["hf_softmax_scale", "read_hf_config", "spec_from_config", "spec_yaml"]

#: config fields every MLA config has (DeepSeek-V2/V3 names); q_lora_rank may be null
_REQUIRED = ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_HALF_DTYPES = ("bfloat16", "float16")


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _int_field(config: Any, name: str) -> int | None:
    """An integer field of the config (None when absent or null): a bool, a float (128.7, or 128.0) or a
    string is an error naming it, never truncated to an int."""
    value = _field(config, name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise SpecError(f"config: {name}={brief_repr(value)} is not allowed: must be an integer")


def _number(rope: Mapping[str, Any], name: str, default: float | None = None) -> float:
    """A number of the rope block (an int or a finite float; not a bool, a string or null), as a float."""
    value = rope.get(name, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise SpecError(f"config: rope_scaling.{name}={brief_repr(value)} is not allowed: must be a finite number")


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The rope block: transformers 5 names it rope_parameters, older config.json files rope_scaling."""
    rope = _field(config, "rope_parameters") or _field(config, "rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise SpecError(f"config: rope_parameters must be a mapping, got {type(rope).__name__}")
    rope = dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if not isinstance(rope["rope_type"], str):
        shown = brief_repr(rope["rope_type"])
        raise SpecError(f"config: rope_scaling.rope_type={shown} is not allowed: must be a string")
    return rope


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_softmax_scale(config: Any) -> float:
    """The softmax scale transformers' DeepSeek-V2/V3 attention uses for this config (YaRN mscale^2 included)."""
    dims = [_int_field(config, name) or 0 for name in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if sum(dims) <= 0:
        raise SpecError(f"config: qk_nope_head_dim + qk_rope_head_dim must be > 0, got {dims}")
    scale = sum(dims) ** -0.5
    rope = _rope_parameters(config)
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim") is not None:
        mscale_all_dim = _number(rope, "mscale_all_dim")
        if mscale_all_dim:
            mscale = _yarn_mscale(_number(rope, "factor"), mscale_all_dim)
            scale *= mscale * mscale
    return scale


def _config_dtype(config: Any) -> str:
    value = _field(config, "dtype") or _field(config, "torch_dtype")
    name = str(value).removeprefix("torch.") if value is not None else ""
    return name if name in _HALF_DTYPES else "bfloat16"


def spec_from_config(
    config: Any,
    *,
    name: str | None = None,
    page_size: int = 64,
    tp_size: int = 1,
    dtype: str | Any | None = None,
    cache_dtype: str | Any | None = None,
) -> MLASpec:
    """The MLA spec of one attention layer of `config` as seen by one of `tp_size` tensor-parallel ranks.

    config: a transformers config (DeepseekV2Config, DeepseekV3Config, ...) or a config.json dict with the same
    MLA fields. name: default ``<model_type>-tp<tp_size>`` (``deepseek-v3-tp8``). dtype: "bfloat16" /
    "float16" or a torch dtype; default the config's own when it is one of those, else bfloat16. cache_dtype:
    the latent cache's storage, "float8_e4m3fn" or a torch dtype (the spec's field; default: dtype).
    The spec emits decode and prefill kernels; its softmax scale equals the model's (checked here).
    """
    missing = [field for field in _REQUIRED if _field(config, field) is None]
    if missing:
        raise SpecError(
            f"config: not an MLA config: missing {', '.join(missing)} (DeepSeek-V2/V3 fields are required: "
            f"{', '.join(_REQUIRED)}, q_lora_rank)"
        )
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise SpecError(f"tp_size={tp_size!r} is not allowed: must be an int >= 1")
    heads = _int_field(config, "num_attention_heads")
    if heads < 1:
        raise SpecError(f"config: num_attention_heads={heads} is not allowed: must be >= 1")
    if heads % tp_size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise SpecError(
            f"tp_size={tp_size} does not divide num_attention_heads={heads}: choose one of "
            f"{', '.join(map(str, divisors))}"
        )
    if dtype is None:
        dtype_name = _config_dtype(config)
    else:
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in _HALF_DTYPES:
            raise SpecError(f"dtype={dtype!r} is not allowed: must be bfloat16 or float16")
    # (a name the spec does not allow is its validator's error, naming the field and what is allowed)
    cache_name = None if cache_dtype is None else str(cache_dtype).removeprefix("torch.")
    if name is None:
        model_type = str(_field(config, "model_type") or "mla").lower().replace("_", "-")
        suffix = CACHE_FORMATS[cache_name].name_suffix if cache_name in CACHE_FORMATS else ""
        name = f"{model_type}-tp{tp_size}" + suffix
    fields: dict[str, Any] = {
        "name": name,
        "num_heads": heads // tp_size,
        **{field: _int_field(config, field) for field in _REQUIRED[1:]},
        "q_lora_rank": _int_field(config, "q_lora_rank"),
        "dtype": dtype_name,
        "cache_dtype": cache_name,
        "page_size": page_size,
        "kernels": ["decode", "prefill"],
    }
    scale = hf_softmax_scale(config)
    rope = _rope_parameters(config)
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):  # (checked a number by hf_softmax_scale)
        # the readable form, as in the bundled specs; the check below proves it gives the model's scale
        keys = ("factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast", "beta_slow")
        fields["rope_scaling"] = {"type": "yarn", **{k: rope[k] for k in keys if rope.get(k) is not None}}
    elif not math.isclose(scale, (fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]) ** -0.5, rel_tol=1e-15):
        fields["softmax_scale"] = scale
    spec = spec_from_dict(fields, f"spec from {name}")
    if not math.isclose(softmax_scale_of(spec), scale, rel_tol=1e-12):  # a rope block the spec reads differently
        spec = spec_from_dict({**fields, "rope_scaling": None, "softmax_scale": scale}, f"spec from {name}")
    return spec


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The dict of a config.json, given the file or a directory holding one (errors name the path)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no config.json" if path.is_dir() else f"{file}: no such file"
        raise SpecError(f"{where}: give a config.json or a directory holding one")
    try:
        data = json.loads(file.read_bytes(), object_pairs_hook=unique_json_keys)  # bytes: json detects the encoding
    except OSError as error:
        raise SpecError(f"{file}: cannot read ({error.strerror})") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise SpecError(f"{file}: not valid JSON: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{file}: a config must be a JSON object, got {type(data).__name__}")
    return data


def spec_yaml(spec: MLASpec, source: str = "") -> str:
    """The spec as YAML in the bundled specs' style (defaults left out; the schema comment on top)."""
    data = spec.model_dump(mode="json", exclude_defaults=True)
    for key in ("name", "dtype", "page_size", "kernels", "q_lora_rank"):  # always written, even when default
        data.setdefault(key, getattr(spec, key) if key != "kernels" else list(spec.kernels))
    if spec.rope_scaling is not None:  # name the rope type even though yarn is the default
        data["rope_scaling"] = {"type": spec.rope_scaling.type, **data["rope_scaling"]}
    order = [*MLASpec.model_fields]
    data = {key: data[key] for key in order if key in data}
    header = "# yaml-language-server: $schema=mlagen-spec.schema.json\n"
    if source:
        header += f"# Derived by `mlagen spec-from-hf` from {source}.\n"
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
