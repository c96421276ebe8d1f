"""How the latent cache stores its rows: one `CacheFormat` per value of the spec's `cache_dtype`.

A format says its storage dtype, whether the calls that read or write the cache take a scale (and of what
granularity), the largest value it stores, and how rows are quantised into it and dequantised out of it (the
PyTorch ground truth the kernels are checked against). The spec validates `cache_dtype` against `CACHE_FORMATS`,
the plan and the templates read the format (`cache_format.scaled` selects the scaled kernels' code), a generated
module holds its format as `CACHE_FORMAT`, and the runtime, verify, the tuner, the test strategies and the
integrations ask it rather than testing for fp8. A new format is one entry here plus its kernels (the template
blocks its flags select) and, where it changes a launch decision, the launch policy's measurements.

Standard library only at import (the spec imports it); torch is imported by the (de)quantisation methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CACHE_FORMATS", "SCALED_CACHE_DTYPES", "CacheFormat", "cache_format", "module_cache_format"]

#: granularities of a scale: one float32 per layer (latent = stored * kv_scale). Room for more (e.g. one per
#: group of values of a row) with their kernels.
SCALE_GRANULARITIES = ("layer",)


@dataclass(frozen=True)
class CacheFormat:
    #: the spec's cache_dtype value naming this format
    name: str
    #: torch dtype name of a stored element
    storage: str
    #: bytes of a stored element
    element_bytes: int
    #: None: rows are stored as they are, in the model's dtype (the spec's dtype must be `storage`); else the
    #: scale's granularity (SCALE_GRANULARITIES): every call that reads or writes the cache takes kv_scale
    scale: str | None = None
    #: the largest finite stored magnitude: quantisation saturates there (None: no quantisation)
    max_abs: float | None = None
    #: appended to the names of specs derived for this format (integrations: "deepseek-v3-tp8-fp8")
    name_suffix: str = ""
    #: the module docstring's note on what the cache holds ('' for a plain one)
    stored_note: str = ""

    def __post_init__(self):
        if self.scale is not None and self.scale not in SCALE_GRANULARITIES:
            raise ValueError(f"scale: expected None or one of {', '.join(SCALE_GRANULARITIES)}, got {self.scale!r}")

    @property
    def scaled(self) -> bool:
        """The cache stores latent / kv_scale: every call that reads or writes it takes kv_scale."""
        return self.scale is not None

    @property
    def follows_model_dtype(self) -> bool:
        """A plain (unscaled) format stores the model's own dtype: only a spec of that dtype may use it."""
        return self.scale is None

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.storage)

    def quantize(self, latent: Any, kv_scale: float | Any | None = None) -> Any:
        """latent rows as this format stores them. Scaled: (latent / kv_scale) in float32, saturated at max_abs
        and rounded to nearest even by torch's own conversion (the clamp makes the saturation explicit: older
        torch releases turn out-of-range values into NaN); plain: the rows converted to the storage dtype."""
        import torch

        if not self.scaled:
            if kv_scale is not None:
                raise ValueError(f"kv_scale: a {self.name} cache stores the latent itself and takes no kv_scale")
            return latent.to(self.torch_dtype())
        if kv_scale is None:
            raise ValueError(f"kv_scale: a {self.name} cache stores latent / kv_scale: give the layer's scale")
        # float32 division by the float32 scale, as the kernel's (torch casts a Python number to float32 here)
        scaled = latent.to(torch.float32) / float(kv_scale)
        return scaled.clamp(-self.max_abs, self.max_abs).to(self.torch_dtype())

    def dequantize(self, stored: Any, kv_scale: float | Any | None, dtype: Any) -> Any:
        """The latent values stored rows hold, in `dtype`: stored * kv_scale (plain: as they are)."""
        values = stored.to(dtype)
        return values if kv_scale is None else values * float(kv_scale)

    def scale_for(self, largest: float, margin: float = 1.0) -> float | None:
        """A per-layer scale that stores values up to |largest| * margin unsaturated (None for a plain format;
        1.0 where the layer holds only zeros)."""
        if not self.scaled:
            return None
        return largest * margin / self.max_abs if largest > 0 else 1.0


#: every format, by the spec's cache_dtype value
CACHE_FORMATS: dict[str, CacheFormat] = {
    fmt.name: fmt
    for fmt in (
        CacheFormat("bfloat16", storage="bfloat16", element_bytes=2),
        CacheFormat("float16", storage="float16", element_bytes=2),
        CacheFormat(
            "float8_e4m3fn",
            storage="float8_e4m3fn",
            element_bytes=1,
            scale="layer",
            max_abs=448.0,
            name_suffix="-fp8",
            stored_note="stored = fp8(latent / kv_scale), kv_scale given at each call",
        ),
    )
}

#: the cache_dtype values whose cache stores latent / kv_scale (any spec dtype may use them)
SCALED_CACHE_DTYPES = tuple(name for name, fmt in CACHE_FORMATS.items() if fmt.scaled)


def cache_format(name: str) -> CacheFormat:
    """The format of cache_dtype `name` (a KeyError naming the formats for any other)."""
    try:
        return CACHE_FORMATS[name]
    except KeyError:
        raise KeyError(f"cache format {name!r}: expected one of {', '.join(CACHE_FORMATS)}") from None


def module_cache_format(module: Any) -> CacheFormat:
    """A generated module's format: its CACHE_FORMAT, or for a module of an earlier mlagen (which held only
    CACHE_DTYPE; the benchmarks load such modules side by side) the format of its cache dtype."""
    held = getattr(module, "CACHE_FORMAT", None)
    if held is not None:
        return held
    return cache_format(str(getattr(module, "CACHE_DTYPE", module.DTYPE)).removeprefix("torch."))
