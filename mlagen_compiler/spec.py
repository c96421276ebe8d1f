"""Stage 1 of the pipeline: the user's YAML spec of one MLA layer, validated and frozen.

Nothing here derives kernel constants; that is :mod:`mlagen_compiler.plan`'s job. This module only says
what a user may write, checks it, and gives every error the field, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "SCALED_CACHE_DTYPES",
    "CacheDType",
    "DecodeTiles",
    "MLASpec",
    "PrefillTiles",
    "RopeScaling",
    "SpecError",
    "Tiles",
    "load_spec",
    "spec_from_dict",
]

KernelName = Literal["decode", "prefill"]
DType = Literal["bfloat16", "float16"]
#: what the latent cache may hold: the spec's dtype, or fp8 e4m3 (one scale per layer, given at the call)
CacheDType = Literal["bfloat16", "float16", "float8_e4m3fn"]
#: cache dtypes that store latent / kv_scale and need the scale at every call
SCALED_CACHE_DTYPES = ("float8_e4m3fn",)


class SpecError(ValueError):
    """A spec that cannot be loaded: one line per problem, each naming field, value and what is allowed."""


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_multiple_in_range(field: str, value: int, multiple: int, lo: int, hi: int) -> int:
    if value % multiple or not lo <= value <= hi:
        raise ValueError(f"{field}={value} is not allowed: must be a multiple of {multiple} in {lo}..{hi}")
    return value


class _Frozen(BaseModel):
    # inf / NaN would compile into a module that cannot even be imported: every float must be finite
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)


class RopeScaling(_Frozen):
    """The `rope_scaling` block of a HF config; only what changes the softmax scale is used.

    DeepSeek-V3 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 where
    mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1.
    """

    type: Literal["yarn"] = Field(default="yarn", alias="rope_type")
    factor: float = Field(gt=0)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    beta_fast: float | None = None
    beta_slow: float | None = None


_BLOCK_CHOICES = "a power of two in 16..256"


class DecodeTiles(_Frozen):
    """Optional overrides of the decode autotune space; each given value pins that knob."""

    block_n: int | None = Field(default=None, description="cache tokens per inner iteration")
    block_m: int | None = Field(default=None, description="query rows (heads x Sq) per program")
    num_warps: int | None = Field(default=None, description="warps per program: 1, 2, 4, 8 or 16")
    num_stages: int | None = Field(default=None, ge=1, le=6, description="software-pipelining depth")

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
    num_heads: int = Field(description="attention heads per tensor-parallel rank, 1..256")
    kv_lora_rank: int = Field(description="Dc, latent width of the cache, multiple of 16 in 64..1024")
    qk_rope_head_dim: int = Field(description="Dr, rope part of q/k, multiple of 16 in 16..128")
    qk_nope_head_dim: int = Field(description="Dn, non-rope part of q/k per head, multiple of 16 in 16..256")
    v_head_dim: int = Field(description="Dv, value width per head, multiple of 16 in 16..256")
    q_lora_rank: int | None = Field(default=None, description="Lq, or null when q = W_q h directly")
    dtype: DType = Field(default="bfloat16", description="dtype of query and output (and of the cache by default)")
    # None (omitted) is replaced by `dtype` before validation (see _default_cache_dtype): never None after it
    cache_dtype: CacheDType | None = Field(
        default=None,
        description="dtype of the latent cache: null or the spec's dtype (the default), or float8_e4m3fn, stored "
        "as fp8(latent / kv_scale) with one float32 scale per layer passed at every call",
    )
    page_size: int = Field(default=64, description="tokens per cache page, a power of two in 1..256")
    softmax_scale: float | None = Field(
        default=None, gt=0, description="explicit softmax scale; default 1/sqrt(Dn+Dr) with rope mscale"
    )
    rope_scaling: RopeScaling | None = None
    kernels: tuple[KernelName, ...] = Field(default=("decode",), description="which kernels to emit")
    tiles: Tiles = Tiles()

    @field_validator("num_heads")
    @classmethod
    def _heads(cls, value: int) -> int:
        if not 1 <= value <= 256:
            raise ValueError(f"num_heads={value} is not allowed: must be in 1..256")
        return value

    @field_validator("kv_lora_rank")
    @classmethod
    def _dc(cls, value: int) -> int:
        return _check_multiple_in_range("kv_lora_rank", value, 16, 64, 1024)

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _dr(cls, value: int) -> int:
        return _check_multiple_in_range("qk_rope_head_dim", value, 16, 16, 128)

    @field_validator("qk_nope_head_dim")
    @classmethod
    def _dn(cls, value: int) -> int:
        return _check_multiple_in_range("qk_nope_head_dim", value, 16, 16, 256)

    @field_validator("v_head_dim")
    @classmethod
    def _dv(cls, value: int) -> int:
        return _check_multiple_in_range("v_head_dim", value, 16, 16, 256)

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
        if dtype is not None and value != dtype and value not in SCALED_CACHE_DTYPES:
            raise ValueError(
                f"cache_dtype={value} is not allowed with dtype={dtype}: must be the spec's dtype ({dtype}) or "
                f"one of {', '.join(SCALED_CACHE_DTYPES)}"
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
    def cache_scaled(self) -> bool:
        """True when the cache stores latent / kv_scale (fp8): every call that reads or writes it takes kv_scale."""
        return self.cache_dtype in SCALED_CACHE_DTYPES

    @model_validator(mode="after")
    def _scale_source(self) -> MLASpec:
        if self.softmax_scale is not None and self.rope_scaling is not None:
            raise ValueError(
                "softmax_scale and rope_scaling are both set: give an explicit softmax_scale or let "
                "rope_scaling derive it, not both"
            )
        return self

    # ---- identity -------------------------------------------------------------------------------
    def to_flat_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-able data with the YAML's keys (what generated modules expose as SPEC)."""
        return self.model_dump(mode="json", by_alias=False)

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
        shown = "" if item["type"] == "missing" or str(value) in message else f" (got {value!r})"
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
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
    return spec_from_dict(data, str(path))


def json_schema() -> dict[str, Any]:
    schema = MLASpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mlagen MLA layer spec"
    return schema
