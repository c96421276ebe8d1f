"""vLLM attention backend serving MLA layers on mlagen's generated kernels (optional extra ``mlagen[vllm]``).

    vllm serve MODEL --attention-backend CUSTOM
    LLM(MODEL, attention_backend="CUSTOM")

The package's entry point in the ``vllm.general_plugins`` group (``mlagen``, see pyproject.toml) calls
`register` in every vLLM process, which registers `MlagenBackend` as vLLM's ``CUSTOM`` attention backend and
`MlagenPrefillBackend` as its ``CUSTOM`` MLA prefill backend. Per layer:

- decode (``forward_mqa``): ``mla_decode`` on vLLM's paged cache ``[num_blocks, block_size, Dc+Dr]`` (viewed
  with a head dimension of 1), uniform multi-token steps (speculative / MTP) as ``[B, Sq, H, Dc+Dr]``, the
  schedule planned on the host by the metadata builder (``get_decode_schedule``, no device synchronisation:
  capturable in CUDA graphs, ``UNIFORM_BATCH``);
- prefill (``forward_mha``, where mlagen prefills: see below): ``mla_prefill``, or ``mla_chunked_prefill`` when
  the new tokens follow a cached context (chunked prefill, prefix caching), in MHA form with W_UK / W_UV taken
  from ``kv_b_proj``;
- cache writes (``do_kv_cache_update``): ``mla_cache_write`` on vLLM's slot mapping (-1: padding, skipped).

The spec of a layer comes from what vLLM gives its attention: heads per tensor-parallel rank, the MLA
widths, the model dtype, the softmax scale vLLM computed, the kernel block size (the page size) and
``kv_cache_dtype`` ("auto" / "bfloat16" / "float16": a 16-bit cache; "fp8" / "fp8_e4m3": an e4m3 cache
whose per-layer scale is vLLM's ``k_scale``: vLLM stores latent / k_scale, as mlagen's cache does).
Modules are loaded through the compile cache (``mlagen_compiler.load``: one build per node, under a file
lock) once per distinct spec.

Prefill: vLLM gives every MLA layer a prefill backend object, named by ``attention_config.mla_prefill_backend``
or chosen by vLLM. With none named, the layer keeps vLLM's choice where one runs its geometry (FlashAttention-3
on Hopper runs DeepSeek's, GLM's and Mistral-Small-4's): measured inside vLLM on the H200, its prefill kernels
took 0.6x the GPU time of mlagen's on the same batches (docs/performance-log.md, "vLLM backend"), so
``forward_mha`` is then vLLM's own and decode and cache writes stay mlagen's. Where none runs (other
geometries, no FlashAttention library), and where ``"CUSTOM"`` is named, the stand-in `MlagenPrefillBackend`
is chosen, which passes vLLM's prefill selection for any geometry and which ``forward_mha`` never calls:
prefill runs on mlagen's kernels.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise
from types import ModuleType
from typing import Any, ClassVar

import torch

from ..cache import load
from ..cache_format import cache_format
from ..spec import MLASpec, spec_from_dict

#: vLLM releases this backend was tested with (the extra pins them: pyproject.toml)
VLLM_TESTED_VERSIONS = ("0.26.0",)

try:
    import vllm
    from vllm.config import get_current_vllm_config
    from vllm.logger import init_logger
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonBackend,
        MLACommonDecodeMetadata,
        MLACommonImpl,
        MLACommonMetadata,
        MLACommonMetadataBuilder,
        QueryLenSupport,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
except ImportError as error:  # the extra is not installed, or a vLLM whose internals moved
    raise ImportError(
        f"mlagen_compiler.integrations.vllm: needs vllm {' or '.join(VLLM_TESTED_VERSIONS)} "
        f"(pip install 'mlagen[vllm]'): {error}"
    ) from None

# under vLLM's root logger, so the lines land in vLLM's log with its format and level (a logger outside "vllm"
# propagates to Python's root logger, which drops INFO: the warm-up lines never showed in vLLM's output)
logger = init_logger(f"vllm.{__name__}")

__all__ = [
    "BACKEND_NAME",
    "EAGER_SCHEDULES_KEPT",
    "KERNEL_BLOCK_SIZES",
    "PREFERRED_BLOCK_SIZE",
    "UNTESTED_ENV",
    "VLLM_TESTED_VERSIONS",
    "MlagenBackend",
    "MlagenImpl",
    "MlagenMetadata",
    "MlagenMetadataBuilder",
    "MlagenPrefillBackend",
    "PrefillGroup",
    "check_vllm_version",
    "register",
    "spec_for_layer",
]

#: the name vLLM logs for this backend (it is selected as attention backend "CUSTOM")
BACKEND_NAME = "MLAGEN"
#: set to 1 to run with a vLLM release outside VLLM_TESTED_VERSIONS (at your own risk)
UNTESTED_ENV = "MLAGEN_VLLM_ALLOW_UNTESTED"
#: kernel block sizes (cache pages) the spec allows: powers of two in 1..256
KERNEL_BLOCK_SIZES = tuple(1 << i for i in range(9))
#: the block size the backend asks vLLM for when none is given (--block-size): pages of whole 64-token cache
#: blocks are fetched by TMA, and the shipped tuned configurations are for 64-token pages
PREFERRED_BLOCK_SIZE = 64
#: vLLM's kv_cache_dtype names -> the spec's cache_dtype (None: the model's 16-bit dtype)
_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "float16": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}
_MODEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: decode schedules (each owns a split-KV workspace) kept for batch shapes outside captured CUDA graphs, newest
#: first; the schedules of captured shapes are kept for good (their graphs write into those workspaces)
EAGER_SCHEDULES_KEPT = 8


def check_vllm_version(version: str | None = None) -> str | None:
    """Why this backend refuses the installed vLLM (None: a tested release, or UNTESTED_ENV=1)."""
    version = vllm.__version__ if version is None else version
    if version in VLLM_TESTED_VERSIONS or os.environ.get(UNTESTED_ENV) == "1":
        return None
    return (
        f"vllm {version} is outside the releases mlagen's backend is tested with "
        f"({', '.join(VLLM_TESTED_VERSIONS)}); install one (pip install 'mlagen[vllm]') or set {UNTESTED_ENV}=1"
    )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make MlagenBackend vLLM's CUSTOM attention backend and
    MlagenPrefillBackend its CUSTOM MLA prefill backend (idempotent: vLLM may call it more than once)."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.{MlagenBackend.__qualname__}")
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, f"{__name__}.{MlagenPrefillBackend.__qualname__}")


def spec_for_layer(
    *,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None,
    softmax_scale: float,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    block_size: int,
) -> MLASpec:
    """The spec of one vLLM MLA layer: geometry per tensor-parallel rank, vLLM's softmax scale, the model
    dtype, vLLM's kv_cache_dtype name and the kernel block size (the page size). Errors are one line."""
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"dtype={dtype}: mlagen's vLLM backend runs bfloat16 or float16 models (--dtype)")
    if kv_cache_dtype not in _CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not served by mlagen's vLLM backend: one of "
            f"{', '.join(_CACHE_DTYPES)}"
        )
    cache_dtype = _CACHE_DTYPES[kv_cache_dtype]
    name = f"vllm-h{num_heads}-c{kv_lora_rank}-r{qk_rope_head_dim}-n{qk_nope_head_dim}-v{v_head_dim}-p{block_size}" + (
        cache_format(cache_dtype).name_suffix if cache_dtype is not None else ""
    )
    fields: dict[str, Any] = {
        "name": name,
        "num_heads": num_heads,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim,
        "q_lora_rank": q_lora_rank,
        "dtype": _MODEL_DTYPES[dtype],
        "cache_dtype": cache_dtype,
        "page_size": block_size,
        "softmax_scale": float(softmax_scale),
        "kernels": ["decode", "prefill"],
    }
    return spec_from_dict(fields, "mlagen vLLM backend: the layer's spec")


def _vllm_prefill_runs(config: Any) -> bool:
    """Whether vLLM's own choice of MLA prefill backend (none configured) runs this model here."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill.selector import get_mla_prefill_backend

    if current_platform.get_device_capability() is None:  # vLLM would name FlashAttention unchecked
        return False
    try:
        get_mla_prefill_backend(config)
    except ValueError:
        return False
    return True


_MODULES: dict[str, ModuleType] = {}
#: (module, shapes) pairs MlagenImpl.warm_up has compiled in this process
_WARMED: set[tuple[Any, ...]] = set()


def _module_for(spec: MLASpec) -> ModuleType:
    """The generated module of a spec, loaded once per process (the compile cache builds it once per node)."""
    key = spec.canonical_json()
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = load(spec)
    return module


class MlagenBackend(MLACommonBackend):
    """vLLM attention backend for MLA layers on mlagen kernels (selected as "CUSTOM", see `register`)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MlagenImpl]:
        return MlagenImpl

    @staticmethod
    def get_builder_cls() -> type[MlagenMetadataBuilder]:
        return MlagenMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PREFERRED_BLOCK_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any Dc + Dr the spec allows (checked per layer by spec_for_layer)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability.major >= 8  # bf16 tensor-core dots; Hopper adds the Gluon decode

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> str | None:
        if not use_mla:
            return "mlagen serves Multi-head Latent Attention only (DeepSeek-V2/V3-style models); this model has none"
        return check_vllm_version()


@dataclass
class MlagenDecodeMetadata(MLACommonDecodeMetadata):
    """Decode metadata plus mlagen's decode schedule for this batch shape (planned on the host)."""

    schedule: Any


@dataclass
class PrefillGroup:
    """Consecutive prefill requests whose cached contexts one mla_chunked_prefill call expands: requests
    first..last-1 of the prefill part, tokens first_token..last_token-1 of it."""

    first: int
    last: int
    first_token: int
    last_token: int
    max_seqlen: int  # the group's longest query (host)
    cu_seqlens: torch.Tensor  # [last - first + 1] int32 on the device
    prefix_lens: torch.Tensor  # [last - first] int32 on the device: cached context per request
    num_prefix_tokens: int  # their total (host)


@dataclass
class MlagenMetadata(MLACommonMetadata[MlagenDecodeMetadata]):
    """vLLM's MLA metadata plus what mlagen's kernels take: the module, and where prefill requests follow a
    cached context, the groups they run in (None: no context, one mla_prefill call)."""

    module: ModuleType | None = None
    prefill_groups: list[PrefillGroup] | None = None

    def __post_init__(self) -> None:
        # vLLM's check allows the head sizes of its own kernels (320, 576); the layer's spec decides here
        pass


class MlagenMetadataBuilder(MLACommonMetadataBuilder[MlagenMetadata]):
    """Builds MlagenMetadata: vLLM's common MLA metadata, the layer group's module, the decode schedule of
    each (batch, query length) planned once and reused (its workspace too), and prefill context lengths."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    # decode requests have one new token, or 1 + the speculative tokens (vLLM raises the threshold to that)
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, MlagenMetadata)
        layers = vllm_config.compilation_config.static_forward_context
        impls = [layers[name].impl for name in layer_names]
        for name, impl in zip(layer_names, impls, strict=True):
            if not isinstance(impl, MlagenImpl):
                raise ValueError(f"{name}: its attention runs {type(impl).__name__}, not mlagen's MlagenImpl")
        modules = {id(module): module for module in (impl.module_for(self.page_size) for impl in impls)}
        if len(modules) != 1:
            raise ValueError(f"layers {layer_names[0]}..{layer_names[-1]} of one cache group differ in geometry")
        self.module = modules.popitem()[1]
        self.mlagen_prefill = all(impl.mlagen_prefill for impl in impls)
        if self.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            speculative = vllm_config.speculative_config
            extra = speculative.num_speculative_tokens if speculative is not None else 0
            impls[0].warm_up(
                self.module,
                self.device,
                max_batch=vllm_config.scheduler_config.max_num_seqs,
                seqlens_q=(1, 1 + extra) if extra else (1,),
                block_table_width=-(-vllm_config.model_config.max_model_len // self.page_size),
            )
        self._graph_schedules: dict[tuple[int, int], Any] = {}
        self._eager_schedules: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._capturing = False
        # the most cached-context tokens one chunked-prefill call expands (whole requests; one longer context
        # is expanded alone): vLLM's own bound on its MLA prefill workspace, which its memory profile covers
        self.prefix_tokens_per_call = self.chunked_prefill_workspace_size

    def _schedule(self, batch: int, seqlen_q: int) -> Any:
        """The decode schedule of a batch shape: planned once, reused with its workspace (see
        EAGER_SCHEDULES_KEPT)."""
        key = (batch, seqlen_q)
        schedule = self._graph_schedules.get(key)
        if schedule is not None:
            return schedule
        schedule = self._eager_schedules.pop(key, None)
        if schedule is None:
            schedule = self.module.get_decode_schedule(batch, seqlen_q, self.device)
        if self._capturing:
            self._graph_schedules[key] = schedule
        else:
            self._eager_schedules[key] = schedule
            if len(self._eager_schedules) > EAGER_SCHEDULES_KEPT:
                self._eager_schedules.popitem(last=False)
        return schedule

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> MlagenMetadata:
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False
        # the most cached-context tokens one chunked-prefill call expands (whole requests; one longer context
        # is expanded alone): vLLM's own bound on its MLA prefill workspace, which its memory profile covers
        self.prefix_tokens_per_call = self.chunked_prefill_workspace_size

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> MlagenDecodeMetadata:
        batch = query_start_loc_cpu.shape[0] - 1
        if num_decode_tokens % batch:
            raise ValueError(f"decode batch: {num_decode_tokens} tokens over {batch} requests is not uniform")
        return MlagenDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            schedule=self._schedule(batch, num_decode_tokens // batch),
        )

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> MlagenMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.module = self.module
        if metadata.prefill is not None and self.mlagen_prefill:
            metadata.prefill_groups = self._prefill_groups(metadata.num_decodes, common_attn_metadata)
        return metadata

    def _prefill_groups(self, num_decodes: int, common: Any) -> list[PrefillGroup] | None:
        """The prefill requests in groups of at most prefix_tokens_per_call cached-context tokens, from host
        values (no device synchronisation; vLLM's upper bound on sequence lengths is exact for prefill rows).
        None where no prefill request has a cached context."""
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[num_decodes : num_reqs + 1].long()
        starts = starts - starts[0]
        query_lens = starts[1:] - starts[:-1]
        context = common.seq_lens_cpu_upper_bound[num_decodes:num_reqs].long() - query_lens
        if int(context.max()) <= 0:
            return None
        bounds, total = [0], 0
        for index, length in enumerate(context.tolist()):
            if total and total + length > self.prefix_tokens_per_call:
                bounds.append(index)
                total = 0
            total += length
        bounds.append(len(query_lens))
        # every group's cu_seqlens and context lengths in one host-to-device copy
        pieces = []
        for first, last in pairwise(bounds):
            pieces += [starts[first : last + 1] - starts[first], context[first:last]]
        device_values = torch.cat(pieces).to(torch.int32).to(self.device, non_blocking=True)
        groups, offset = [], 0
        for first, last in pairwise(bounds):
            count = last - first
            groups.append(
                PrefillGroup(
                    first=first,
                    last=last,
                    first_token=int(starts[first]),
                    last_token=int(starts[last]),
                    max_seqlen=int(query_lens[first:last].max()),
                    cu_seqlens=device_values[offset : offset + count + 1],
                    prefix_lens=device_values[offset + count + 1 : offset + 2 * count + 1],
                    num_prefix_tokens=int(context[first:last].sum()),
                )
            )
            offset += 2 * count + 1
        return groups


class MlagenImpl(MLACommonImpl[MlagenMetadata]):
    """One MLA layer's attention on mlagen kernels: decode, prefill and cache writes (see the module doc)."""

    can_return_lse_for_decode: bool = True
    supports_pcp: bool = False
    supports_dcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args: Any,
    ) -> None:
        refusal = check_vllm_version()
        if refusal is not None:
            raise RuntimeError(f"mlagen vLLM backend: {refusal}")
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        for name, value in unsupported.items():
            if value:
                raise NotImplementedError(f"{name}={value!r}: mlagen's MLA kernels have no {name}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"attn_type={attn_type!r}: mlagen serves decoder self-attention only")
        # the decode query stays in the model dtype (the kernels dequantise an fp8 cache themselves)
        self.supports_quant_query_input = False
        config = get_current_vllm_config()
        parallel = config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name) > 1:
                raise NotImplementedError(f"{name}={getattr(parallel, name)}: mlagen's vLLM backend runs without it")
        self.model_dtype = config.model_config.dtype if config.model_config is not None else torch.get_default_dtype()
        #: how the cache stores rows: the format vLLM's kv_cache_dtype names, else the model's 16-bit dtype's
        self.cache_format = cache_format(
            _CACHE_DTYPES.get(kv_cache_dtype) or _MODEL_DTYPES.get(self.model_dtype, "bfloat16")
        )
        self._cache_storage = self.cache_format.torch_dtype()
        self._w_uk_uv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._modules: dict[int, ModuleType] = {}
        block_size = config.cache_config.block_size
        # a geometry, dtype or block size the spec refuses is an error now, at engine start
        self.spec_for(block_size if block_size in KERNEL_BLOCK_SIZES else KERNEL_BLOCK_SIZES[-1])
        # vLLM picks the layer's MLA prefill backend right after this (see the module doc)
        from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

        if config.attention_config.mla_prefill_backend is None and not _vllm_prefill_runs(config):
            config.attention_config.mla_prefill_backend = MLAPrefillBackendEnum.CUSTOM
        self.mlagen_prefill = config.attention_config.mla_prefill_backend == MLAPrefillBackendEnum.CUSTOM

    def spec_for(self, block_size: int) -> MLASpec:
        """This layer's spec with pages of `block_size` tokens (vLLM's kernel block size)."""
        return spec_for_layer(
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            softmax_scale=self.scale,
            dtype=self.model_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=block_size,
        )

    def module_for(self, block_size: int) -> ModuleType:
        """The generated module of this layer's spec with pages of `block_size` tokens (memoised per layer)."""
        module = self._modules.get(block_size)
        if module is None:
            module = self._modules[block_size] = _module_for(self.spec_for(block_size))
        return module

    def _paged(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's [num_blocks, block_size, Dc+Dr] cache as mlagen's [num_pages, page_size, 1, Dc+Dr]
        (an fp8 cache, allocated as uint8, viewed as e4m3)."""
        if self.cache_format.scaled and kv_cache.dtype != self._cache_storage:
            kv_cache = kv_cache.view(self._cache_storage)
        return kv_cache.unsqueeze(2)

    def _kv_scale(self, k_scale: torch.Tensor) -> torch.Tensor | None:
        return k_scale if self.cache_format.scaled else None

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        if kv_cache.numel() == 0 or slot_mapping is None:  # the profiling run has no cache yet
            return
        slot_mapping = slot_mapping.flatten()
        num_tokens = slot_mapping.shape[0]  # inputs may be padded past the slots (as concat_and_cache_mla reads)
        self.module_for(kv_cache.shape[1]).mla_cache_write(
            kv_c_normed[:num_tokens],
            k_pe.reshape(k_pe.shape[0], -1)[:num_tokens],
            self._paged(kv_cache),
            slot_mapping,
            kv_scale=self._kv_scale(k_scale),
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MlagenMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = attn_metadata.decode
        module = attn_metadata.module
        assert decode is not None and module is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_tokens, num_heads, width = q.shape
        batch = attn_metadata.num_decodes
        seqlen_q = num_tokens // batch
        want_lse = self.need_to_return_lse_for_decode  # (else the kernels store it in the schedule's scratch)
        result = module.mla_decode(
            q.reshape(batch, seqlen_q, num_heads, width),
            self._paged(kv_c_and_k_pe_cache),
            decode.block_table,
            decode.seq_lens,
            kv_scale=self._kv_scale(layer._k_scale),
            return_lse=want_lse,
            schedule=decode.schedule,
        )
        out, lse = result if want_lse else (result, None)
        out = out.view(num_tokens, num_heads, self.kv_lora_rank)
        if lse is None:
            return out, None
        return out, lse.transpose(1, 2).reshape(num_tokens, num_heads)  # [tokens, H], as vLLM's backends return

    def _mha_keys(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The MHA-form keys and values of new tokens: k_nope [T, H, Dn] and v [T, H, Dv] (views of kv_b_proj's
        output), k_pe [T, Dr]."""
        kv_nope = self.kv_b_proj(kv_c_normed)[0].view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return k_nope, k_pe.reshape(kv_c_normed.shape[0], self.qk_rope_head_dim), v

    def warm_up(
        self,
        module: ModuleType,
        device: torch.device,
        *,
        max_batch: int,
        seqlens_q: tuple[int, ...],
        block_table_width: int,
    ) -> None:
        """Compile (or load from Triton's cache) the kernels this layer's calls take, at engine start instead of
        inside the first requests: decode for every batch size up to max_batch and each query length (the
        schedule, and so the kernel variant, depends on both), prefill, chunked prefill and cache writes, on
        small random inputs laid out as vLLM lays out its own (the layout decides Triton's specialisation).
        Once per module and shape set in a process."""
        key = (id(module), max_batch, seqlens_q, block_table_width, self.mlagen_prefill)
        if key in _WARMED:
            return
        start = time.perf_counter()
        generator = torch.Generator(device=device).manual_seed(0)
        heads, dc, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        page = module.PAGE_SIZE
        cache_dtype = module.CACHE_DTYPE

        def randn(*shape: int, dtype: torch.dtype = self.model_dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

        num_pages = max(4, -(-32 // page))  # room for 17 distinct cache-write slots
        cache = randn(num_pages, page, dc + dr).clamp(-4, 4).to(cache_dtype)
        kv_scale = torch.full((1,), 0.5, device=device) if self.cache_format.scaled else None
        table = torch.arange(max_batch * block_table_width, device=device, dtype=torch.int32)
        table = (table % num_pages).view(max_batch, block_table_width)
        lengths = torch.randint(1, 4 * page + 1, (max_batch,), generator=generator, device=device)
        lengths = lengths.to(torch.int32)
        paged = self._paged(cache)
        calls = 0
        with torch.inference_mode():
            for seqlen_q in seqlens_q:
                for batch in range(1, max_batch + 1):
                    schedule = module.get_decode_schedule(batch, seqlen_q, device)
                    q = randn(batch * seqlen_q, heads, dc + dr).view(batch, seqlen_q, heads, dc + dr)
                    module.mla_decode(q, paged, table[:batch], lengths[:batch], kv_scale=kv_scale, schedule=schedule)
                    calls += 1
            for num_tokens in (1, 16, 17):  # Triton specialises integers on 1 and multiples of 16
                rows = randn(num_tokens, dc + dr)
                slots = torch.randperm(num_pages * page, generator=generator, device=device)[:num_tokens]
                module.mla_cache_write(rows[:, :dc], rows[:, dc:], paged, slots, kv_scale=kv_scale)
                calls += 1
            if self.mlagen_prefill:
                calls += self._warm_up_prefill(module, randn, paged, table, kv_scale, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        _WARMED.add(key)
        logger.info(
            "mlagen: %s warmed up in %.1f s (%d calls: decode at batch 1..%d, query lengths %s, prefill, cache "
            "writes)", module.SPEC["name"], time.perf_counter() - start, calls, max_batch, list(seqlens_q),
        )  # fmt: skip

    def _warm_up_prefill(self, module: ModuleType, randn: Any, paged: torch.Tensor, table: torch.Tensor,
                         kv_scale: torch.Tensor | None, device: torch.device) -> int:  # fmt: skip
        """warm_up's prefill and chunked prefill: two new sequences, with and without a cached prefix, once with
        host integers (longest sequence, token and prefix-token counts) that are multiples of 16 and once with
        ones that are not: Triton specialises a kernel on that, and a serving run meets both."""
        heads, dc, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        w_uk, w_uv = self._up_projections()
        page = module.PAGE_SIZE
        calls = 0
        for lengths, prefix_lens in (([5, 12], [page + 3, 7]), ([16, 32], [2 * page, 2 * page])):
            num_tokens, num_prefix_tokens = sum(lengths), sum(prefix_lens)
            q = randn(num_tokens, heads, self.qk_nope_head_dim + dr)
            latent = randn(num_tokens, dc + dr)  # vLLM's k_pe is a view of the latent projection's rows
            k_nope, k_pe, v = self._mha_keys(latent[:, :dc], latent[:, dc:].unsqueeze(1))
            cu_seqlens = torch.tensor([0, lengths[0], num_tokens], device=device, dtype=torch.int32)
            out = torch.empty(num_tokens, heads, self.v_head_dim, device=device, dtype=self.model_dtype)
            module.mla_prefill(q, k_nope, k_pe, v, cu_seqlens, max(lengths), out=out)
            module.mla_chunked_prefill(
                q, k_nope, k_pe, v, cu_seqlens, max(lengths), paged, table[:2],
                torch.tensor(prefix_lens, device=device, dtype=torch.int32), w_uk, w_uv,
                kv_scale=kv_scale, out=out, num_prefix_tokens=num_prefix_tokens,
            )  # fmt: skip
            calls += 2
        return calls

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, Dc] and W_UV [H, Dv, Dc] of this layer in the model dtype (from kv_b_proj, once)."""
        if self._w_uk_uv is None:
            weight = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=self.model_dtype)
            weight = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            w_uk, w_uv = weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
            self._w_uk_uv = (w_uk.contiguous(), w_uv.contiguous())
        return self._w_uk_uv

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MlagenMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        if not self.mlagen_prefill:  # the prefill backend configured in attention_config.mla_prefill_backend
            super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, output_scale)
            return
        prefill = attn_metadata.prefill
        module = attn_metadata.module
        assert prefill is not None and module is not None
        if output_scale is not None:
            raise NotImplementedError("output_scale: mlagen's prefill writes the model dtype (no fused quantisation)")
        num_tokens = q.shape[0]
        k_nope, k_pe, v = self._mha_keys(kv_c_normed, k_pe)
        out = output.view(num_tokens, self.num_heads, self.v_head_dim)
        if attn_metadata.prefill_groups is None:
            module.mla_prefill(q, k_nope, k_pe, v, prefill.query_start_loc, prefill.max_query_len, out=out)
            return
        w_uk, w_uv = self._up_projections()
        cache = self._paged(kv_c_and_k_pe_cache)
        for group in attn_metadata.prefill_groups:
            tokens = slice(group.first_token, group.last_token)
            if group.num_prefix_tokens == 0:  # new prompts only
                module.mla_prefill(
                    q[tokens], k_nope[tokens], k_pe[tokens], v[tokens], group.cu_seqlens, group.max_seqlen,
                    out=out[tokens],
                )  # fmt: skip
                continue
            module.mla_chunked_prefill(
                q[tokens],
                k_nope[tokens],
                k_pe[tokens],
                v[tokens],
                group.cu_seqlens,
                group.max_seqlen,
                cache,
                prefill.block_table[group.first : group.last],
                group.prefix_lens,
                w_uk,
                w_uv,
                kv_scale=self._kv_scale(k_scale),
                out=out[tokens],
                num_prefix_tokens=group.num_prefix_tokens,
            )


class MlagenPrefillBackend(MLAPrefillBackend):
    """vLLM's CUSTOM MLA prefill backend: a stand-in that passes vLLM's prefill selection for any geometry
    under MlagenBackend, whose forward_mha runs mlagen's prefill kernels and never calls this object."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        backend = get_current_vllm_config().attention_config.backend
        if backend is None or backend.name != "CUSTOM" or not backend.get_path().endswith(MlagenBackend.__qualname__):
            return [f"the {BACKEND_NAME} prefill backend serves only mlagen's attention backend (backend CUSTOM)"]
        return super().validate_configuration(device_capability, selector_config)

    def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool, out: Any = None,
                               output_scale: Any = None) -> Any:  # fmt: skip
        raise NotImplementedError(f"the {BACKEND_NAME} prefill backend runs inside MlagenImpl.forward_mha only")

    def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        raise NotImplementedError(f"the {BACKEND_NAME} prefill backend runs inside MlagenImpl.forward_mha only")
