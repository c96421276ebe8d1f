"""FlashMLA's Python decode API over mlagen's generated kernels: change one import, run any MLA geometry.

    import mlagen_compiler.flash_mla as flash_mla   # instead of `import flash_mla`

    sched_meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched_meta,
                                                causal=True)

Both generations of FlashMLA's API are here: the current one (``get_mla_metadata()`` returns an empty
``FlashMLASchedMeta`` that the first call fills and later calls are checked against) and the 2025 one
(``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)`` returns two tensors that
``flash_mla_with_kvcache`` takes), plus vLLM's dense fp8 variant (``flash_mla_with_kvcache_fp8``).

The geometry comes from the tensors: heads ``q.shape[2]``, latent width ``Dc = head_dim_v``, rope width
``q.shape[3] - head_dim_v``, page size ``k_cache.shape[1]``, dtype ``q.dtype``. The first call with a geometry
builds its spec and loads its module through the compile cache (``mlagen_compiler.load``); later calls reuse it.
FlashMLA's conventions hold: the default softmax scale is ``q.shape[-1] ** -0.5``, ``causal=False`` lets every
new token see the whole cache, and a query that sees no key gets a zero output and ``lse = +inf``.

What is not dense MLA decode raises NotImplementedError naming the argument: several KV heads, sparse
attention (``indices``, ``topk_length``, ``extra_*``), attention sinks, and FlashMLA's own fp8 cache layout
(``is_fp8_kvcache=True``: 656 bytes a token with per-128-value scales). mlagen's fp8 cache (one scale per
layer) is reached through ``flash_mla_with_kvcache_fp8``.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType

import torch

from .cache import load
from .spec import SpecError, spec_from_dict

__all__ = [
    "FlashMLASchedMeta",
    "flash_mla_with_kvcache",
    "flash_mla_with_kvcache_fp8",
    "get_mla_metadata",
    "get_mla_metadata_dense_fp8",
]

#: the width of one row of FlashMLA's 2025 tile-scheduler metadata (int32 words), kept for its tensor's shape
_TILE_SCHEDULER_METADATA_SIZE = 8
#: the value widths the generated decode is named for when the spec is built from shapes: decode reads only
#: the latent (Dc) and rope (Dr) widths; the per-head widths below matter to prefill, which is not built here
_PER_HEAD_WIDTH = 128
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The schedule of one batch shape (FlashMLA's class of the same name): empty from ``get_mla_metadata()``,
    filled by the first ``flash_mla_with_kvcache`` call that takes it, and checked against every later call.
    Share one across the layers of a step, as with FlashMLA; plan another when the batch shape changes."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None = None
        extra_page_block_size: int | None = None
        extra_topk: int | None = None

    have_initialized: bool = False
    config: Config | None = None
    #: FlashMLA's tensors; mlagen's schedule is `schedule`, so these stay None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    #: the generated module serving this schedule's calls and its DecodeSchedule (see get_decode_schedule)
    module: ModuleType | None = None
    schedule: object | None = None
    #: Config's first seven fields as a tuple: what every later call is checked against
    planned: tuple | None = dataclasses.field(default=None, repr=False)


def get_mla_metadata(*args, **kwargs):
    """``get_mla_metadata()``: ``(FlashMLASchedMeta(), None)``, filled by the first decode call (the current API).

    ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...)`` (the 2025 API): a pair of
    int32 tensors with FlashMLA's shapes, ``(tile_scheduler_metadata [num_sms, 8], num_splits [B + 1])``, for code
    that stores or copies them. Their contents are not FlashMLA's: mlagen plans its schedule from the batch shape
    at the first decode call of that shape (mla_decode's default schedule) and reads nothing from them.
    """
    if not args and not kwargs:
        return FlashMLASchedMeta(), None
    return _legacy_metadata(*args, **kwargs)


def get_mla_metadata_dense_fp8(cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
    """vLLM's metadata call for ``flash_mla_with_kvcache_fp8``: the 2025 ``get_mla_metadata`` pair."""
    return _legacy_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)


def _legacy_metadata(
    cache_seqlens, num_q_tokens_per_head_k=None, num_heads_k=1, num_heads_q=None, is_fp8_kvcache=False, topk=None
):
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.ndim != 1:
        raise ValueError(f"cache_seqlens: expected a 1-d int32 tensor [batch], got {_describe(cache_seqlens)}")
    _one_kv_head(num_heads_k, "num_heads_k")
    if topk is not None:
        raise NotImplementedError(f"topk={topk}: sparse attention is not supported by mlagen's dense MLA decode")
    device = cache_seqlens.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return (
        torch.zeros((sms, _TILE_SCHEDULER_METADATA_SIZE), dtype=torch.int32, device=device),
        torch.zeros((cache_seqlens.shape[0] + 1,), dtype=torch.int32, device=device),
    )


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta | torch.Tensor,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense MLA decode with FlashMLA's arguments and results (see the module's docstring).

    q [B, Sq, H, Dc + Dr], k_cache [num_pages, page_size, 1, Dc + Dr], block_table [B, max_pages] int32,
    cache_seqlens [B] int32, head_dim_v = Dc. tile_scheduler_metadata: a FlashMLASchedMeta (current API) or the
    2025 API's tensor (then num_splits is its second tensor). Returns out [B, Sq, H, Dc] in q's dtype and
    lse [B, H, Sq] float32 (natural log; +inf where a query sees no key).
    """
    if is_fp8_kvcache:
        raise NotImplementedError(
            "is_fp8_kvcache=True: FlashMLA's fp8 cache layout (656 bytes a token, a scale per 128 values) is not "
            "mlagen's; an fp8 cache with one scale per layer runs through flash_mla_with_kvcache_fp8(descale_k=...)"
        )
    _dense_only(
        indices=indices,
        attn_sink=attn_sink,
        extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache,
        topk_length=topk_length,
        extra_topk_length=extra_topk_length,
    )
    return _decode(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale,
        causal, None,
    )  # fmt: skip


def flash_mla_with_kvcache_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta | torch.Tensor,
    num_splits: torch.Tensor | None,
    softmax_scale: float | None = None,
    causal: bool = False,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dense fp8 FlashMLA call over mlagen's fp8 cache: k_cache float8_e4m3fn (or its uint8 view)
    holding latent / descale_k, so ``descale_k`` (float32, one element) is mlagen's ``kv_scale`` exactly.

    The query: FlashMLA multiplies fp8 q by ``descale_q`` inside its fp8 products; mlagen's decode takes a
    16-bit query, so an fp8 q is dequantised here, ``(q * descale_q)`` rounded once to bfloat16 (e4m3 values
    are exact in bfloat16; the product with the scale is what rounds). A 16-bit q is taken as it is (times
    descale_q when given). The output is bfloat16 for an fp8 q, else q's dtype; lse as flash_mla_with_kvcache.
    """
    if descale_k is None:
        raise ValueError("descale_k: an fp8 cache needs its float32 scale (latent = stored * descale_k), got None")
    if q.dtype == _FP8:
        scaled = q.to(torch.float32) if descale_q is None else q.to(torch.float32) * descale_q
        q = scaled.to(torch.bfloat16)
    elif descale_q is not None:
        q = (q.to(torch.float32) * descale_q).to(q.dtype)
    if k_cache.dtype == torch.uint8:
        k_cache = k_cache.view(_FP8)
    return _decode(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale,
        causal, descale_k,
    )  # fmt: skip


# ---- the shared path ------------------------------------------------------------------------------------------

#: generated modules by (heads, Dc, Dr, page size, dtype, cache dtype): one load through the compile cache each
_MODULES: dict[tuple, ModuleType] = {}


def _decode(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, kv_scale):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if type(meta) is FlashMLASchedMeta:
        if num_splits is not None:
            raise ValueError("num_splits: must be None with a FlashMLASchedMeta (the current API's placeholder)")
        key = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, False)
        if not meta.have_initialized:
            module = _module_for(q, k_cache, head_dim_v, block_table, cache_seqlens)
            meta.module = module
            meta.schedule = module.get_decode_schedule(q.shape[0], q.shape[1], q.device)
            meta.config = FlashMLASchedMeta.Config(*key)
            meta.planned = key
            meta.have_initialized = True
        elif key != meta.planned:
            raise ValueError(_config_mismatch(meta.planned, key))
        module, schedule = meta.module, meta.schedule
    elif isinstance(meta, torch.Tensor):  # the 2025 API: mla_decode plans the schedule of this batch shape once
        module, schedule = _module_for(q, k_cache, head_dim_v, block_table, cache_seqlens), None
    else:
        raise TypeError(
            "tile_scheduler_metadata: expected the FlashMLASchedMeta of get_mla_metadata() or the tensor of "
            f"get_mla_metadata(cache_seqlens, ...), got {type(meta).__name__}"
        )
    # FlashMLA's convention for a query that sees no key: lse = +inf, written so by the kernels
    return module.mla_decode(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        softmax_scale=softmax_scale,
        kv_scale=kv_scale,
        return_lse=True,
        schedule=schedule,
        causal=causal,
        empty_lse=math.inf,
    )


def _module_for(q, k_cache, head_dim_v, block_table, cache_seqlens) -> ModuleType:
    if not isinstance(q, torch.Tensor) or q.ndim != 4:
        raise ValueError(f"q: expected a 4-d tensor [batch, seqlen_q, num_heads, head_dim], got {_describe(q)}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.ndim != 4:
        raise ValueError(
            f"k_cache: expected a 4-d tensor [num_pages, page_size, num_heads_k, head_dim], got {_describe(k_cache)}"
        )
    if block_table is None or cache_seqlens is None:
        raise ValueError("block_table, cache_seqlens: dense decode needs both, got None")
    _one_kv_head(k_cache.shape[2], "k_cache")
    dtype = _DTYPES.get(q.dtype)
    if dtype is None:
        raise ValueError(f"q: dtype {q.dtype} is not allowed: must be torch.bfloat16 or torch.float16")
    if type(head_dim_v) is not int or not 0 < head_dim_v < q.shape[3]:
        raise ValueError(
            f"head_dim_v={head_dim_v!r} is not allowed: must be an int in 1..{q.shape[3] - 1} "
            f"(the latent width; q's last dimension {q.shape[3]} is latent + rope)"
        )
    cache_dtype = "float8_e4m3fn" if k_cache.dtype == _FP8 else dtype
    key = (q.shape[2], head_dim_v, q.shape[3] - head_dim_v, k_cache.shape[1], dtype, cache_dtype)
    module = _MODULES.get(key)
    if module is None:
        heads, dc, dr, page_size, _, _ = key
        fp8 = "-fp8" if cache_dtype == "float8_e4m3fn" else ""
        fields = dict(
            name=f"flashmla-h{heads}-dc{dc}-dr{dr}-p{page_size}-{dtype}{fp8}",
            num_heads=heads,
            kv_lora_rank=dc,
            qk_rope_head_dim=dr,
            qk_nope_head_dim=_PER_HEAD_WIDTH,
            v_head_dim=_PER_HEAD_WIDTH,
            dtype=dtype,
            cache_dtype=cache_dtype,
            page_size=page_size,
            kernels=["decode"],
        )
        try:
            spec = spec_from_dict(fields, "flash_mla")
        except SpecError as error:
            problems = "; ".join(line.removeprefix("flash_mla: ") for line in str(error).splitlines())
            raise ValueError(f"q, k_cache, head_dim_v: a geometry mlagen does not compile ({problems})") from None
        module = _MODULES[key] = load(spec)
    return module


def _one_kv_head(num_heads_k, name: str) -> None:
    if num_heads_k != 1:
        raise NotImplementedError(
            f"{name}: num_heads_k={num_heads_k} is not supported: MLA decode attends over one latent KV head"
        )


def _dense_only(**arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(
                f"{name}: not supported: mlagen runs dense MLA decode (no sparse attention, attention sinks or "
                "extra caches); pass None"
            )


def _config_mismatch(planned_key: tuple, key: tuple) -> str:
    names = ("b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache")
    for name, planned, given in zip(names, planned_key, key, strict=True):
        if planned != given:
            return (
                f"tile_scheduler_metadata: planned for {name}={planned!r}, called with {name}={given!r}: "
                "a FlashMLASchedMeta serves one batch shape; get another from get_mla_metadata()"
            )
    raise AssertionError("unreachable: the configurations differ")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
