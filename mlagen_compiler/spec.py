"""Stage 1 of the pipeline: the user's YAML spec of one MLA layer, validated and frozen.

Nothing here derives kernel constants; that is :mod:`mlagen_compiler.plan`'s job. This module only says
what a user may write, checks it, and gives every error the field, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import reprlib
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .cache_format import CACHE_FORMATS, SCALED_CACHE_DTYPES, CacheFormat

__all__ = [
    "RESERVED_MODULE_NAMES",
    "SCALED_CACHE_DTYPES",
    "SOFTMAX_SCALE_CALL_MAX",
    "SOFTMAX_SCALE_MAX",
    "SOFTMAX_SCALE_MIN",
    "CacheCompute",
    "CacheDType",
    "DecodeTiles",
    "MLASpec",
    "PrefillTiles",
    "RopeScaling",
    "SpecError",
    "Tiles",
    "brief_repr",
    "load_spec",
    "safe_load_yaml",
    "spec_from_dict",
    "unique_json_keys",
]

KernelName = Literal["decode", "prefill"]
DType = Literal["bfloat16", "float16"]
#: what the latent cache may hold: the spec's dtype, or fp8 e4m3 (one scale per layer, given at the call); each
#: value is a format of cache_format.CACHE_FORMATS (SCALED_CACHE_DTYPES: those that store latent / kv_scale)
CacheDType = Literal["bfloat16", "float16", "float8_e4m3fn"]
#: how the decode computes with a scaled (fp8) cache: "exact" widens the cache to 16 bits and multiplies as the
#: 16-bit cache does; "fp8" multiplies e4m3 operands on the tensor cores (the Gluon decode on 9.x only)
CacheCompute = Literal["exact", "fp8"]
assert set(get_args(CacheDType)) == set(CACHE_FORMATS), "CacheDType names every cache format"


#: an int field takes an int only: YAML's true, "16" or 16.0 are errors, not 1 or 16 (pydantic's lax mode
#: would convert them silently)
StrictInt = Annotated[int, Strict()]
#: a float field takes an int or a float, never a bool or a string
StrictFloat = Annotated[float, Strict()]

#: the largest softmax scale a spec may set (explicitly or through rope_scaling): every call without a scale of
#: its own uses it, whatever its data. The kernels work with qk_scale = scale * log2(e) in float32, and the
#: fp8 cache's decode multiplies that by up to 2**113 (a bfloat16 query's largest exponent, 127, brought down
#: to 14: see _fp8_cache_query), so |scale| * log2(e) * 2**113 must stay below float32's 2**128:
#: |scale| < 2**15 / log2(e) ~ 22713.
SOFTMAX_SCALE_MAX = 2.0**14
#: ... and the smallest a spec may set: qk_scale * 2**-100 (the fp8 decode's smallest factor) stays a normal
#: float32 (>= 2**-126); a call may give any magnitude down to 0 (a zero scale only makes uniform weights)
SOFTMAX_SCALE_MIN = 2.0**-24
#: the largest |softmax_scale| a call may give (the module's SOFTMAX_SCALE_MAX): scale * log2(e) is a finite
#: float32 with room for every score |q.k| below 2**63. Wider than a spec's bound: a call's own scale comes with
#: its own data (tiny queries with a large scale, say), where the fp8 decode's factor follows the query's size.
SOFTMAX_SCALE_CALL_MAX = 2.0**64

#: module names a spec may not take: its module `<name>.py` written into a script's folder would be imported
#: instead of the standard library's or a package's of that name (`import torch` in a script run from there)
RESERVED_MODULE_NAMES = frozenset(sys.stdlib_module_names) | {
    "mlagen_compiler", "torch", "triton", "numpy", "yaml", "pydantic", "pydantic_core", "jinja2", "typer", "click",
    "filelock", "platformdirs", "rich", "transformers", "tokenizers", "safetensors", "huggingface_hub",
    "accelerate", "vllm", "sglang", "flashinfer", "flash_attn", "flash_mla", "xformers", "setuptools", "pip",
    "pkg_resources", "pytest", "typing_extensions", "packaging", "scipy", "pandas", "einops",
}  # fmt: skip

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 2, 60, 60, 40
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_BRIEF, _attr, 4)


def brief_repr(value: Any) -> str:
    """repr(value) cut short (nested containers, long strings and numbers): an error message that shows a
    user's value stays one short line, and writing it out never walks a huge structure (YAML aliases can
    make a kilobyte file hold a billion elements)."""
    return _BRIEF.repr(value)


class SpecError(ValueError):
    """A spec that cannot be loaded: one line per problem, each naming field, value and what is allowed."""


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_multiple_in_range(field: str, value: int, multiple: int, lo: int, hi: int) -> int:
    if value % multiple or not lo <= value <= hi:
        raise ValueError(f"{field}={value} is not allowed: must be a multiple of {multiple} in {lo}..{hi}")
    return value


#: the head dimensions' allowed values: field: (multiple, lo, hi)
_DIM_RANGES = {
    "kv_lora_rank": (16, 64, 1024),
    "qk_rope_head_dim": (16, 16, 128),
    "qk_nope_head_dim": (16, 16, 256),
    "v_head_dim": (16, 16, 256),
}


class _Frozen(BaseModel):
    # inf / NaN would compile into a module that cannot even be imported: every float must be finite
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)


class RopeScaling(_Frozen):
    """The `rope_scaling` block of a HF config; only what changes the softmax scale is used.

    DeepSeek-V3 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 where
    mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1.
    """

    type: Literal["yarn"] = Field(default="yarn", alias="rope_type")
    # bounded so that the derived scale stays inside [SOFTMAX_SCALE_MIN, SOFTMAX_SCALE_MAX]: mscale is at most
    # 0.1 * 10 * ln(65536) + 1 ~ 12.1, its square ~ 147; at least 1 (mscale_all_dim >= 0)
    factor: StrictFloat = Field(gt=0, le=65536, description="context extension factor, in (0, 65536]")
    mscale: StrictFloat = Field(default=1.0, ge=0, le=10)
    mscale_all_dim: StrictFloat = Field(default=0.0, ge=0, le=10, description="YaRN mscale of the softmax, 0..10")
    original_max_position_embeddings: StrictInt | None = Field(default=None, gt=0)
    beta_fast: StrictFloat | None = None
    beta_slow: StrictFloat | None = None


_BLOCK_CHOICES = "a power of two in 16..256"


class DecodeTiles(_Frozen):
    """Optional overrides of the decode autotune space; each given value pins that knob."""

    block_n: StrictInt | None = Field(default=None, description="cache tokens per inner iteration")
    block_m: StrictInt | None = Field(default=None, description="query rows (heads x Sq) per program")
    num_warps: StrictInt | None = Field(default=None, description="warps per program: 1, 2, 4, 8 or 16")
    num_stages: StrictInt | None = Field(default=None, ge=1, le=6, description="software-pipelining depth")

    @field_validator("block_n", "block_m")
    @classmethod
    def _block(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not (_is_pow2(value) and 16 <= value <= 256):
            raise ValueError(f"{info.field_name}={value} is not allowed: must be {_BLOCK_CHOICES}")
        return value

    @field_validator("num_warps")
    @classmethod
    def _warps(cls, value: int | None) -> int | None:
        if value is not None and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={value} is not allowed: must be one of 1, 2, 4, 8, 16")
        return value


class PrefillTiles(DecodeTiles):
    """Optional overrides of the prefill autotune space (block_m: query tokens, block_n: key tokens)."""


class Tiles(_Frozen):
    decode: DecodeTiles = DecodeTiles()
    prefill: PrefillTiles = PrefillTiles()


class MLASpec(_Frozen):
    """One MLA layer as seen by one tensor-parallel rank.

    Field names follow the HF config names of DeepSeek-V2/V3 so a user can copy them across.
    """

    name: str = Field(
        pattern=r"^[a-z][a-z0-9_-]*$",
        max_length=64,
        description="lower-case identifier; the generated module is named after it with '-' as '_'",
    )
    num_heads: StrictInt = Field(description="attention heads per tensor-parallel rank, 1..256")
    kv_lora_rank: StrictInt = Field(description="Dc, latent width of the cache, multiple of 16 in 64..1024")
    qk_rope_head_dim: StrictInt = Field(description="Dr, rope part of q/k, multiple of 16 in 16..128")
    qk_nope_head_dim: StrictInt = Field(description="Dn, non-rope part of q/k per head, multiple of 16 in 16..256")
    v_head_dim: StrictInt = Field(description="Dv, value width per head, multiple of 16 in 16..256")
    q_lora_rank: StrictInt | None = Field(default=None, description="Lq, or null when q = W_q h directly")
    dtype: DType = Field(default="bfloat16", description="dtype of query and output (and of the cache by default)")
    # None (omitted) is replaced by `dtype` before validation (see _default_cache_dtype): never None after it
    cache_dtype: CacheDType | None = Field(
        default=None,
        description="dtype of the latent cache: null or the spec's dtype (the default), or float8_e4m3fn, stored "
        "as fp8(latent / kv_scale) with one float32 scale per layer passed at every call",
    )
    cache_compute: CacheCompute = Field(
        default="exact",
        description="how the decode multiplies with an fp8 cache: exact (the default: the cache widened to 16 bits, "
        "16-bit products) or fp8 (e4m3 tensor-core products: the query quantised to e4m3 with a scale per row, P "
        "to e4m3; less exact), fp8 only with cache_dtype float8_e4m3fn and used only by the Gluon decode on compute "
        "capability 9.x (the portable Triton kernel, the interpreter included, keeps the exact path)",
    )
    page_size: StrictInt = Field(default=64, description="tokens per cache page, a power of two in 1..256")
    softmax_scale: StrictFloat | None = Field(
        default=None,
        description="explicit softmax scale in [2**-24, 2**14]; default 1/sqrt(Dn+Dr) with rope mscale",
        json_schema_extra={"minimum": SOFTMAX_SCALE_MIN, "maximum": SOFTMAX_SCALE_MAX},
    )
    rope_scaling: RopeScaling | None = None
    kernels: tuple[KernelName, ...] = Field(default=("decode",), description="which kernels to emit")
    tiles: Tiles = Tiles()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        module = value.replace("-", "_")
        if module in RESERVED_MODULE_NAMES:
            raise ValueError(
                f"name={value!r} is not allowed: its module {module}.py would shadow Python's or a package's "
                f"module '{module}' for scripts run beside it; choose another name"
            )
        return value

    @field_validator("softmax_scale")
    @classmethod
    def _scale(cls, value: float | None) -> float | None:
        if value is not None and not SOFTMAX_SCALE_MIN <= value <= SOFTMAX_SCALE_MAX:
            raise ValueError(
                f"softmax_scale={value!r} is not allowed: must be in [2**-24, 2**14] (the kernels' float32 "
                "scales stay finite and normal)"
            )
        return value

    @field_validator("num_heads")
    @classmethod
    def _heads(cls, value: int) -> int:
        if not 1 <= value <= 256:
            raise ValueError(f"num_heads={value} is not allowed: must be in 1..256")
        return value

    @field_validator(*_DIM_RANGES)
    @classmethod
    def _dims(cls, value: int, info: ValidationInfo) -> int:
        return _check_multiple_in_range(info.field_name, value, *_DIM_RANGES[info.field_name])

    @field_validator("q_lora_rank")
    @classmethod
    def _lq(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 65536:
            raise ValueError(f"q_lora_rank={value} is not allowed: must be null or in 1..65536")
        return value

    @field_validator("page_size")
    @classmethod
    def _page(cls, value: int) -> int:
        if not (_is_pow2(value) and value <= 256):
            raise ValueError(f"page_size={value} is not allowed: must be a power of two in 1..256")
        return value

    @field_validator("cache_dtype")
    @classmethod
    def _cache_dtype(cls, value: str | None, info: Any) -> str | None:
        dtype = info.data.get("dtype")  # validated before (declared first); absent when it was invalid
        if dtype is not None and value != dtype and CACHE_FORMATS[value].follows_model_dtype:
            raise ValueError(
                f"cache_dtype={value} is not allowed with dtype={dtype}: must be the spec's dtype ({dtype}) or "
                f"one of {', '.join(SCALED_CACHE_DTYPES)}"
            )
        return value

    @field_validator("cache_compute")
    @classmethod
    def _cache_compute(cls, value: str, info: Any) -> str:
        cache_dtype = info.data.get("cache_dtype")  # validated before (declared first); absent when it was invalid
        if value != "exact" and cache_dtype is not None and not CACHE_FORMATS[cache_dtype].scaled:
            raise ValueError(
                f"cache_compute={value} is not allowed with cache_dtype={cache_dtype}: must be exact, or give "
                f"cache_dtype one of {', '.join(SCALED_CACHE_DTYPES)}"
            )
        return value

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("kernels=[] is not allowed: name at least one of decode, prefill")
        if len(set(value)) != len(value):
            raise ValueError(f"kernels={list(value)} is not allowed: each kernel may be named once")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_cache_dtype(cls, data: Any) -> Any:
        # an omitted (or null) cache_dtype is the spec's dtype, filled in here so that the canonical JSON, and
        # so the hash, of a spec that writes it out equals that of one that leaves it to the default
        if isinstance(data, dict) and data.get("cache_dtype") is None:
            dtype = data.get("dtype", cls.model_fields["dtype"].default)
            if dtype in get_args(DType):  # else the dtype's own error says what is wrong, once
                data = {**data, "cache_dtype": dtype}
        return data

    @property
    def cache_format(self) -> CacheFormat:
        """How the latent cache stores rows (its storage dtype, whether calls take kv_scale, quantisation)."""
        return CACHE_FORMATS[self.cache_dtype]

    @model_validator(mode="after")
    def _scale_source(self) -> MLASpec:
        if self.softmax_scale is not None and self.rope_scaling is not None:
            raise ValueError(
                "softmax_scale and rope_scaling are both set: give an explicit softmax_scale or let "
                "rope_scaling derive it, not both"
            )
        scale = self.derived_softmax_scale()
        # the field bounds keep it inside; this states the contract the generated module relies on
        if not (math.isfinite(scale) and SOFTMAX_SCALE_MIN <= scale <= SOFTMAX_SCALE_MAX):
            raise ValueError(
                f"rope_scaling gives a softmax scale of {scale!r}: it must be in [2**-24, 2**14] (kernels keep "
                "float32 scales finite)"
            )
        return self

    def derived_softmax_scale(self) -> float:
        """The softmax scale the kernels use: softmax_scale, else 1/sqrt(Dn+Dr) times DeepSeek-V3's YaRN
        mscale^2 when rope_scaling asks for it (mscale(s, m) = 0.1 m ln(s) + 1 for s > 1)."""
        if self.softmax_scale is not None:
            return float(self.softmax_scale)
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope_scaling
        if rope is not None and rope.mscale_all_dim and rope.factor > 1:
            mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= mscale * mscale
        return scale

    # ---- identity -------------------------------------------------------------------------------
    def to_flat_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-able data with the YAML's keys (what generated modules expose as SPEC).
        cache_compute is left out where it is its default, exact: a spec's hash (and its module) is the one it
        had before the field existed."""
        data = self.model_dump(mode="json", by_alias=False)
        if data["cache_compute"] == "exact":
            del data["cache_compute"]
        return data

    def canonical_json(self) -> str:
        """Key order, comments and whitespace of the YAML do not change this string; values do."""
        return json.dumps(self.to_flat_dict(), sort_keys=True, separators=(",", ":"))

    def content_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def module_name(self) -> str:
        return self.name.replace("-", "_")


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<spec>"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(item["loc"]))
            message = f"unknown field (allowed: {allowed})"
        elif item["type"] == "missing":
            message = "required field is missing"
        value = item.get("input")
        # (a scalar already written in the message is not shown twice; a container is never stringified whole)
        written = isinstance(value, (bool, int, float, str)) and len(str(value)) <= 100 and str(value) in message
        shown = "" if item["type"] == "missing" or written else f" (got {brief_repr(value)})"
        lines.append(f"{source}: {field}: {message}{shown}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = MLASpec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        nested = [a for a in candidates if issubclass(a, BaseModel)]
        if not nested:
            break
        model = nested[0]
    return sorted(model.model_fields)


def spec_from_dict(data: dict[str, Any], source: str = "<spec>") -> MLASpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec must be a mapping of fields, got {type(data).__name__}")
    try:
        return MLASpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(format_validation_error(error, source)) from None


class _SpecLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a merge key (<<) may be overridden by the keys beside it; other keys: PyYAML's errors
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {brief_repr(key)} is given twice (lines {seen[key]} and {line}): give each key once",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads an exponent without a dot (1e-3, 2E5) as a string; YAML 1.2 and JSON as a number,
# which is what a user writing one means (a float field takes no string)
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def unique_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook for a user's file: a key given twice is a ValueError (json keeps the last)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {brief_repr(key)} is given twice in one object: give each key once")
        data[key] = value
    return data


def safe_load_yaml(text: str) -> Any:
    """yaml.safe_load, except that a mapping with a key given twice is an error (yaml.YAMLError)."""
    return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a SafeLoader)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What is wrong and where (PyYAML's first line is often only the context: 'while parsing a mapping')."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(error).splitlines()[0]


def load_spec(path: str | Path) -> MLASpec:
    """Load and validate one YAML spec file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecError(f"{path}: cannot read spec file ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise SpecError(f"{path}: not a YAML text file (byte {error.start} is not UTF-8)") from None
    try:
        data = safe_load_yaml(text)
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: not valid YAML: {_yaml_problem(error)}") from None
    except ValueError as error:  # a scalar Python cannot convert (an int of more than 4300 digits)
        raise SpecError(f"{path}: not valid YAML: {brief_repr(str(error))}") from None
    return spec_from_dict(data, str(path))


def json_schema() -> dict[str, Any]:
    schema = MLASpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mlagen MLA layer spec"
    return schema
