"""transformers 5.x models with Multi-head Latent Attention running on mlagen kernels.

    from mlagen_compiler.integrations.transformers import PagedMLACache, patch_model

    model = patch_model(AutoModelForCausalLM.from_pretrained(...))       # after the weights are loaded
    cache = PagedMLACache(model, max_batch_size=8, max_cache_len=4096)
    out = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), past_key_values=cache)

An fp8 latent cache (``patch_model(model, cache_dtype="float8_e4m3fn")``) stores each layer's rows as
latent / kv_scale in e4m3 (``PagedMLACache(..., kv_scale=...)``: one scale for every layer or one per layer,
default 1.0 as vLLM's; the kernels dequantise in registers), half the bytes of a 16-bit cache.

`patch_model` replaces the forward of every MLA attention module (DeepSeek-V2/V3 and models sharing their
code and config fields, e.g. Kimi-K2) in place. Per step, for every layer:

- rope is applied by the model's own function (DeepSeek-V3 interleaves, V2 uses complex rotations);
- the new tokens' latent rows [c_kv ; k_pe] go into the layer's paged cache (``mla_cache_write``);
- a prompt (nothing cached yet) runs through ``mla_prefill`` in MHA form, tokens appended to a cached
  prefix through ``mla_chunked_prefill``, steps of at most ``DECODE_MAX_NEW_TOKENS`` tokens per sequence
  through absorbed ``mla_decode`` (q~ = W_UK^T q_nope, o = W_UV o_lat);
- W_UK / W_UV are split out of ``kv_b_proj`` once, at patch time.

Padding: a 2-D ``attention_mask`` (1 = token, 0 = padding, as tokenizers and ``generate`` produce) decides
which tokens exist. Padding tokens are never written to the cache and never attended to; each sequence's
tokens sit at the positions they would have alone. New tokens of a step must be left-padded (zeros, then
ones); anything else is a ``ValueError``.

The kernels run as the generated module's ``torch.library`` custom ops (``module.ops``), so a patched
attention module compiles with ``torch.compile(fullgraph=True)``. ``planned_step`` fixes one model step's
plan so that a whole forward (every layer) can be captured in a CUDA graph or compiled as one graph.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType, ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import load
from ..cache_format import CACHE_FORMATS
from ..spec import MLASpec
from .hf_config import spec_from_config

__all__ = ["ATTN_IMPLEMENTATION", "DECODE_MAX_NEW_TOKENS", "PagedMLACache", "kv_scales_from", "patch_model",
           "planned_step", "spec_from_config"]  # fmt: skip

#: steps that add at most this many tokens to every sequence run through absorbed decode (the decode kernel
#: folds them into its head rows, as for MTP); longer steps after a prefix run through chunked prefill
DECODE_MAX_NEW_TOKENS = 4
_MLA_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "layer_idx")
#: the attention implementation a patched model's config names. The patched attention reads the 2-D padding
#: mask itself, so the model's own mask construction is wasted work (a 4-D mask per step for eager attention,
#: host-side checks for sdpa, neither capturable in a CUDA graph); transformers skips it for an
#: implementation its mask functions do not know.
ATTN_IMPLEMENTATION = "mlagen"


# ---- the plan of one model step, shared by all layers ----------------------------------------------------
@dataclass
class _Step:
    """What every layer of one forward needs: decided once on the host, tensors on the model's device."""

    mode: str  # "prefill" | "chunked" | "decode"
    batch: int
    num_new: int  # tokens per row of this step, padding included (the input's second dimension)
    cache: PagedMLACache | None  # None: a forward without a cache (nothing kept)
    position_ids: Tensor  # [B, S] positions each token has in its own sequence (0 for padding)
    slots: Tensor | None  # [B*S] int64 cache rows of the new tokens, -1 for padding
    tokens: Tensor | None  # [T] int64 flat indices of the real tokens (prefill / chunked)
    cu_seqlens: Tensor | None  # [B+1] int32 over the real tokens
    max_seqlen: int
    prefix_lens: Tensor | None  # [B] int32 tokens cached before this step
    cache_seqlens: Tensor | None  # [B] int32 tokens cached after this step
    block_table: Tensor | None  # [B, pages per sequence] int32
    lengths_before: list[int]
    lengths_after: list[int]


def _new_token_mask(attention_mask: Tensor | None, batch: int, num_new: int, past_columns: int) -> Tensor | None:
    """The [B, S] part of a 2-D mask that covers the new tokens (None: every token is real)."""
    if attention_mask is None:
        return None
    expected = (batch, past_columns + num_new)
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != expected:
        raise ValueError(
            f"attention_mask: expected a 2-D mask of shape {list(expected)} (batch, cached columns + new tokens), "
            f"got shape {list(attention_mask.shape)}"
        )
    return attention_mask[:, past_columns:].to(torch.bool)


def _check_cache_fits(cache: PagedMLACache, patch: _Patch) -> None:
    """A PagedMLACache made for this patched model: one layer per attention layer, the kernels' spec, its device."""
    layers = len(cache.layers)
    if layers != patch.num_layers:
        raise ValueError(
            f"cache (past_key_values): a PagedMLACache of {layers} layer(s), the patched model has "
            f"{patch.num_layers} attention layers: make it with PagedMLACache(model, ...) of this model"
        )
    if cache.spec is not patch.spec and cache.spec != patch.spec:
        raise ValueError(
            f"cache (past_key_values): a PagedMLACache for spec '{cache.spec.name}', the model is patched with "
            f"'{patch.spec.name}': make it with PagedMLACache(model, ...) of this model"
        )
    device = cache.kv_cache(0).device
    if device != patch.device:
        raise ValueError(f"cache (past_key_values): a PagedMLACache on {device}, the model is on {patch.device}")


def _plan_step(
    cache: PagedMLACache | None, attention_mask: Tensor | None, batch: int, num_new: int, device: torch.device
) -> _Step:
    past_columns = cache.columns if cache is not None else 0
    new_mask = _new_token_mask(attention_mask, batch, num_new, past_columns)
    prefix = cache.lengths[:batch] if cache is not None else [0] * batch
    if cache is not None:
        cache._check_batch(batch)
    if new_mask is None:
        counts = [num_new] * batch
    else:
        host = attention_mask.detach().to("cpu", torch.bool)  # host decisions below need it (one small copy)
        counts = host[:, past_columns:].sum(1).tolist()
        for row in range(batch):
            if not bool(host[row, past_columns + num_new - counts[row] :].all()):
                raise ValueError(
                    f"attention_mask row {row}: the new tokens' mask {host[row, past_columns:].int().tolist()} is "
                    "not left-padded: padding (0) must come before every token (1)"
                )
            if cache is not None and int(host[row, :past_columns].sum()) != prefix[row]:
                raise ValueError(
                    f"attention_mask row {row}: {int(host[row, :past_columns].sum())} ones before the new tokens, "
                    f"but the cache holds {prefix[row]} tokens of sequence {row}: pass the mask of every token fed"
                )
    after = [p + n for p, n in zip(prefix, counts, strict=True)]
    if cache is not None and max(after) > cache.max_cache_len:
        row = max(range(batch), key=lambda r: after[r])
        raise ValueError(
            f"PagedMLACache: sequence {row} would hold {after[row]} tokens, more than max_cache_len="
            f"{cache.max_cache_len}: make a cache with a larger max_cache_len"
        )
    if all(p == 0 for p in prefix):
        mode = "prefill"
    elif num_new <= DECODE_MAX_NEW_TOKENS and all(n == num_new for n in counts):
        mode = "decode"
    else:
        mode = "chunked"

    real = torch.ones(batch, num_new, dtype=torch.bool, device=device) if new_mask is None else new_mask.to(device)
    prefix_dev = torch.tensor(prefix, dtype=torch.int64, device=device)
    position = prefix_dev[:, None] + real.long().cumsum(1) - 1
    position_ids = torch.where(real, position, 0)
    slots = prefix_lens = cache_seqlens = block_table = None
    if cache is not None:
        block_table = cache.block_table[:batch]
        page = block_table.long().gather(1, position_ids // cache.page_size)
        slots = torch.where(real, page * cache.page_size + position_ids % cache.page_size, -1).flatten()
        prefix_lens = prefix_dev.to(torch.int32)
        cache_seqlens = torch.tensor(after, dtype=torch.int32, device=device)
    tokens = cu_seqlens = None
    if mode != "decode":
        flat = [row * num_new + j for row in range(batch) for j in range(num_new - counts[row], num_new)]
        tokens = torch.tensor(flat, dtype=torch.int64, device=device)
        cu = [0]
        for count in counts:
            cu.append(cu[-1] + count)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    return _Step(
        mode, batch, num_new, cache, position_ids, slots, tokens, cu_seqlens, max(counts), prefix_lens,
        cache_seqlens, block_table, list(prefix), after,
    )  # fmt: skip


# ---- the cache ----------------------------------------------------------------------------------------------
class _PagedLatentLayer(CacheLayerMixin):
    """One layer's paged latent cache [num_pages, page_size, 1, Dc+Dr]; the block tables live in the Cache."""

    is_compileable = False  # generate must keep passing the 2-D mask, which decides the padding
    is_sliding = False

    def __init__(self, owner: PagedMLACache, kv: Tensor, kv_scale: Tensor | None) -> None:
        super().__init__()
        self.owner = owner
        self.kv = kv
        #: (fp8 cache) the layer's float32 [1] scale: stored rows are latent / kv_scale; None for a 16-bit cache
        self.kv_scale = kv_scale
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(
            "PagedMLACache holds latents for attention patched by mlagen: call patch_model(model) first"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.columns

    def get_max_length(self) -> int:
        return self.owner.max_cache_len

    def reset(self) -> None:
        pass  # rows past a sequence's length are never read; the owner resets the lengths

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass  # the owner moves pages of every layer at once

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class PagedMLACache(Cache):
    """A transformers ``Cache`` holding MLA's latent rows in paged caches, one per attention layer.

    Each layer keeps [num_pages, page_size, 1, Dc+Dr] rows ([c_kv ; k_pe], the spec dtype) where
    num_pages = max_batch_size * ceil(max_cache_len / page_size); sequence b owns the pages of row b of
    ``block_table`` (pages of different sequences interleave, so tables are never trivially contiguous).
    ``lengths[b]`` counts the tokens of sequence b (padding excluded); ``get_seq_length()`` counts the
    columns fed so far (padding included), as transformers' own caches do.

    With a model patched for an fp8 cache (``cache_dtype="float8_e4m3fn"``) the rows are stored as
    latent / kv_scale in e4m3: kv_scale is one positive float for every layer or a sequence of one per layer
    (default 1.0, vLLM's default; max |latent| / 448 of a calibration run keeps the largest values in range).
    Values beyond 448 * kv_scale saturate. A 16-bit cache takes no kv_scale.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int,
        max_cache_len: int,
        page_size: int | None = None,
        kv_scale: float | Sequence[float] | None = None,
    ):
        patch = _patch_of(model)
        if patch is None:
            raise ValueError("model: not patched by mlagen: call patch_model(model) before PagedMLACache(model, ...)")
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: must be an int >= 1")
        if page_size is not None and page_size != patch.spec.page_size:
            raise ValueError(
                f"page_size={page_size!r} is not allowed: the model was patched with page_size="
                f"{patch.spec.page_size} (the kernels are compiled for it); pass that or None"
            )
        self.spec: MLASpec = patch.spec
        self.page_size = patch.spec.page_size
        # read-only properties below: transformers < 5.23's Cache defines both as properties without setters
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len
        self.pages_per_sequence = math.ceil(max_cache_len / self.page_size)
        device = patch.device
        num_pages = max_batch_size * self.pages_per_sequence
        width = patch.spec.kv_lora_rank + patch.spec.qk_rope_head_dim
        dtype = getattr(torch, patch.spec.cache_dtype)
        scales = _layer_scales(kv_scale, patch)
        layers = [
            _PagedLatentLayer(self, torch.empty(num_pages, self.page_size, 1, width, dtype=dtype, device=device), scale)
            for scale in scales
        ]
        super().__init__(layers=layers)
        # page j of sequence b is page j * max_batch_size + b
        pages = torch.arange(self.pages_per_sequence, dtype=torch.int32, device=device) * max_batch_size
        self.block_table = pages[None, :] + torch.arange(max_batch_size, dtype=torch.int32, device=device)[:, None]
        self.lengths: list[int] = [0] * max_batch_size
        self.columns = 0
        self.active_batch = 0

    @property
    def max_batch_size(self) -> int:
        """Sequences the cache has room for."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        """Tokens (padding excluded) each sequence has room for."""
        return self._max_cache_len

    def kv_cache(self, layer_idx: int) -> Tensor:
        """Layer `layer_idx`'s paged latent cache [num_pages, page_size, 1, Dc+Dr]."""
        return self.layers[layer_idx].kv

    def kv_scale(self, layer_idx: int) -> Tensor | None:
        """(fp8 cache) layer `layer_idx`'s float32 [1] scale (stored = latent / kv_scale); None for 16 bits."""
        return self.layers[layer_idx].kv_scale

    def _check_batch(self, batch: int) -> None:
        if batch > self.max_batch_size:
            raise ValueError(
                f"batch of {batch} sequences: the PagedMLACache was made for max_batch_size={self.max_batch_size}"
            )
        if self.columns and batch != self.active_batch:
            raise ValueError(
                f"batch of {batch} sequences: the PagedMLACache holds {self.active_batch}; call reset() to start over"
            )

    def _commit(self, step: _Step) -> None:
        self.lengths[: step.batch] = step.lengths_after
        self.columns += step.num_new
        self.active_batch = step.batch

    # transformers' Cache API ------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.lengths = [0] * self.max_batch_size
        self.columns = 0
        self.active_batch = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Sequence i takes the contents of sequence beam_idx[i] (beam search), in every layer."""
        self._gather_sequences(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._gather_sequences(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._gather_sequences(torch.arange(self.active_batch).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PagedMLACache.crop: rolling back tokens (assisted decoding) is not supported")

    def _gather_sequences(self, index: Tensor) -> None:
        index = index.to(torch.int64).cpu()
        if index.numel() > self.max_batch_size:
            raise ValueError(
                f"{index.numel()} sequences: the PagedMLACache was made for max_batch_size={self.max_batch_size}"
            )
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= max(self.active_batch, 1)):
            raise ValueError(f"sequence index {index.tolist()} out of range: the cache holds {self.active_batch}")
        device = self.block_table.device
        source = self.block_table[index.to(device)].flatten().long()
        target = self.block_table[: index.numel()].flatten().long()
        for layer in self.layers:
            # (one-byte caches as bytes: not every indexing kernel takes float8 on every device)
            rows = layer.kv.view(torch.uint8) if layer.kv.element_size() == 1 else layer.kv
            rows[target] = rows[source].clone()
        self.lengths = [self.lengths[i] for i in index.tolist()] + [0] * (self.max_batch_size - index.numel())
        self.active_batch = index.numel()


# ---- the patch -------------------------------------------------------------------------------------------------
@dataclass
class _Patch:
    spec: MLASpec
    module: ModuleType  # the generated module
    ops: SimpleNamespace  # its kernels as custom ops (module.ops)
    device: torch.device
    num_layers: int
    step: _Step | None = None
    #: a step fixed by planned_step: every forward runs it, none plans or commits one
    planned: _Step | None = None
    #: whether a forward ran the planned step (a bool, not a count: torch.compile guards a module's ints by
    #: value, so a counter recompiled a compiled step on every call; a flag compiles twice at most)
    planned_ran: bool = False
    #: (kv_scales_from) per layer, the largest |value| of the latent rows [c_kv ; k_pe] the forwards computed
    #: for real tokens, in the kernels' dtype; None: not recording
    latent_max: list[float] | None = None


def _patch_of(model: nn.Module) -> _Patch | None:
    return getattr(model, "_mlagen_patch", None)


def _layer_scales(kv_scale: float | Sequence[float] | None, patch: _Patch) -> list[Tensor | None]:
    """Each layer's kv_scale as a float32 [1] tensor on the model's device (an fp8 cache), or None (16 bits)."""
    spec = patch.spec
    if not spec.cache_format.scaled:
        if kv_scale is not None:
            raise ValueError(
                f"kv_scale={kv_scale!r} is not allowed: the model was patched for a {spec.cache_dtype} cache, which "
                f"stores the latent itself; patch_model(model, cache_dtype='float8_e4m3fn') stores it scaled"
            )
        return [None] * patch.num_layers
    scales = [1.0] * patch.num_layers if kv_scale is None else kv_scale
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        scales = [scales] * patch.num_layers
    if not isinstance(scales, Sequence) or isinstance(scales, str) or len(scales) != patch.num_layers:
        raise ValueError(
            f"kv_scale={kv_scale!r} is not allowed: give one positive float for every layer or a sequence of "
            f"{patch.num_layers} (one per attention layer)"
        )
    for layer, value in enumerate(scales):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"kv_scale={kv_scale!r} is not allowed: layer {layer}'s scale {value!r} must be a finite float > 0"
            )
    return [torch.tensor([float(value)], dtype=torch.float32, device=patch.device) for value in scales]


def _rope_function(attn: nn.Module) -> Any:
    """The model's own rope: DeepSeek-V3 (interleaved or not, cos/sin) or DeepSeek-V2 (complex freqs_cis)."""
    code = sys.modules[type(attn).__module__]
    if hasattr(code, "apply_rotary_pos_emb_interleave") and getattr(attn.config, "rope_interleave", False):
        return code.apply_rotary_pos_emb_interleave
    for name in ("apply_rotary_pos_emb", "apply_rotary_emb"):
        if hasattr(code, name):
            return getattr(code, name)
    raise ValueError(f"model: {type(attn).__name__}'s module {code.__name__} has no rope function mlagen knows")


def _mla_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_embeddings: Any = None,
    attention_mask: Tensor | None = None,
    past_key_values: Cache | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """MLA on mlagen kernels; what to run was decided for the whole model step (``_Step``)."""
    patch: _Patch = self._mlagen_patch
    step = patch.step
    if step is None:
        raise RuntimeError(
            "mlagen-patched attention called outside a model forward: call the model (or its base model), "
            "which plans the step from attention_mask and the PagedMLACache"
        )
    ops, spec = patch.ops, patch.spec
    kdtype = self.mlagen_w_uk_kernel.dtype
    batch, seqlen = hidden_states.shape[:2]
    heads, dn, dr, dc = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_nope, q_pe = q.view(batch, seqlen, heads, dn + dr).split([dn, dr], dim=-1)
    c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([dc, dr], dim=-1)
    c_kv = self.kv_a_layernorm(c_kv)
    # the model's rope on [B, H, S, Dr] queries and a one-head [B, 1, S, Dr] key, as its own forward does
    rope_args = position_embeddings if isinstance(position_embeddings, tuple) else (position_embeddings,)
    q_pe, k_pe = self.mlagen_rope(q_pe.transpose(1, 2), k_pe.view(batch, 1, seqlen, dr), *rope_args)
    q_pe = q_pe.transpose(1, 2)  # [B, S, H, Dr]
    k_pe = k_pe.reshape(batch * seqlen, dr)
    c_kv = c_kv.reshape(batch * seqlen, dc)
    if patch.latent_max is not None:  # (kv_scales_from: the rows as a cache write would take them)
        real = slice(None) if step.tokens is None else step.tokens
        rows = torch.cat([c_kv[real].to(kdtype), k_pe[real].to(kdtype)], dim=-1)
        if rows.numel():
            patch.latent_max[self.layer_idx] = max(patch.latent_max[self.layer_idx], rows.abs().max().item())

    kv_cache = kv_scale = None
    if step.cache is not None:
        kv_cache, kv_scale = step.cache.kv_cache(self.layer_idx), step.cache.kv_scale(self.layer_idx)
        ops.cache_write(c_kv.to(kdtype), k_pe.to(kdtype), kv_cache, step.slots, kv_scale)

    if step.mode == "decode":
        q_abs = torch.einsum("bshn,hnc->bshc", q_nope, self.mlagen_w_uk)  # absorbed: W_UK^T q_nope
        q_full = torch.cat([q_abs, q_pe], dim=-1).to(kdtype)
        # (softmax scale None: the spec's, which is the model's)
        o_lat, _ = ops.decode(q_full, kv_cache, step.block_table, step.cache_seqlens, None, kv_scale)
        out = torch.einsum("bshc,hvc->bshv", o_lat.to(hidden_states.dtype), self.mlagen_w_uv)
        out = out.reshape(batch, seqlen, heads * spec.v_head_dim)
    else:
        tokens = step.tokens
        q_mha = torch.cat([q_nope, q_pe], dim=-1).reshape(batch * seqlen, heads, dn + dr)[tokens].to(kdtype)
        c_new = c_kv[tokens]
        k_nope = torch.einsum("tc,hnc->thn", c_new, self.mlagen_w_uk).to(kdtype)
        value = torch.einsum("tc,hvc->thv", c_new, self.mlagen_w_uv).to(kdtype)
        k_rope = k_pe[tokens].to(kdtype)
        if step.mode == "prefill":
            attn, _ = ops.prefill(q_mha, k_nope, k_rope, value, step.cu_seqlens, step.max_seqlen)
        else:
            attn, _ = ops.chunked_prefill(
                q_mha, k_nope, k_rope, value, step.cu_seqlens, step.max_seqlen, kv_cache, step.block_table,
                step.prefix_lens, self.mlagen_w_uk_kernel, self.mlagen_w_uv_kernel, sum(step.lengths_before),
                None, kv_scale,
            )  # fmt: skip
        # padding rows get zeros: nothing attends to them and their outputs are not results
        out = hidden_states.new_zeros(batch * seqlen, heads * spec.v_head_dim)
        out = out.index_copy(0, tokens, attn.reshape(-1, heads * spec.v_head_dim).to(hidden_states.dtype))
        out = out.view(batch, seqlen, -1)
    return self.o_proj(out), None


def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", model)
    return base if isinstance(base, nn.Module) else model


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plan the step (which kernels, slots, positions) once for all layers, from the mask and the cache."""
    patch: _Patch = module._mlagen_patch
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name still accepted by the
    # model, renamed inside its forward); a hook sees whichever name the caller used
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and not isinstance(cache, PagedMLACache):
        raise TypeError(
            f"cache (past_key_values): a mlagen-patched model needs a PagedMLACache, got {type(cache).__name__}: "
            "pass PagedMLACache(model, max_batch_size=..., max_cache_len=...)"
        )
    if cache is not None:
        _check_cache_fits(cache, patch)
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    if inputs is None:
        raise ValueError("input_ids / inputs_embeds: one of them is required")
    batch, num_new = inputs.shape[:2]
    step = patch.planned
    if step is not None:
        if cache is not step.cache or (batch, num_new) != (step.batch, step.num_new):
            raise ValueError(
                f"input of {batch} sequences x {num_new} tokens with {type(cache).__name__}: inside planned_step the "
                f"forward must feed the planned step ({step.batch} x {step.num_new} tokens, its PagedMLACache)"
            )
        patch.planned_ran = True
    else:
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.ndim != 2:
            raise ValueError(
                f"attention_mask: a mlagen-patched model takes the 2-D padding mask (1 = token, 0 = padding), got "
                f"a {mask.ndim}-D mask"
            )
        step = _plan_step(cache, mask, batch, num_new, patch.device)
    patch.step = step
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = step.position_ids  # each token at its position in its own sequence
    if cache is None:
        kwargs["use_cache"] = False  # no DynamicCache behind the patched attention's back
    return args, kwargs


def _after_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    patch: _Patch = module._mlagen_patch
    step, patch.step = patch.step, None
    if step is not None and step.cache is not None and patch.planned is None:
        step.cache._commit(step)
    return output


@contextmanager
def planned_step(
    model: nn.Module,
    cache: PagedMLACache,
    *,
    batch_size: int,
    num_new_tokens: int = 1,
    attention_mask: Tensor | None = None,
) -> Iterator[None]:
    """Plan the next step of a patched model once; every forward inside the block runs exactly that step.

    For capturing a whole model step in a CUDA graph, or compiling it with torch.compile: planning a step
    reads the mask and the cache's lengths on the host and copies small tensors to the device, which a
    graph capture cannot contain and a compiler would have to break the graph for. Inside the block a
    forward does no host work of mlagen's: it reuses the plan's device tensors (positions, cache slots,
    lengths, block table). Each forward inside writes the same cache rows and reads the same lengths, so
    it may run any number of times (warm-up, capture, replays) with the same result. Leaving the block
    without an error, after at least one forward, counts the step's tokens in the cache once.

    Forwards inside must feed `batch_size` sequences of `num_new_tokens` tokens with `cache` as
    past_key_values; `attention_mask` is the 2-D mask of the whole step (as for a plain forward) and
    decides the plan, the mask given to the forwards does not. Pass `position_ids=None` to the forwards:
    the plan's positions are used.
    """
    patch = _patch_of(model)
    if patch is None:
        raise ValueError("model: not patched by mlagen: call patch_model(model) before planned_step(model, ...)")
    if not isinstance(cache, PagedMLACache):
        raise TypeError(f"cache: expected a PagedMLACache, got {type(cache).__name__}")
    _check_cache_fits(cache, patch)
    for name, value in (("batch_size", batch_size), ("num_new_tokens", num_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: must be an int >= 1")
    if patch.planned is not None:
        raise RuntimeError("planned_step: a step is already planned for this model (blocks do not nest)")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"attention_mask: expected the 2-D padding mask, got a {attention_mask.ndim}-D mask")
    step = _plan_step(cache, attention_mask, batch_size, num_new_tokens, patch.device)
    patch.planned, patch.planned_ran = step, False
    try:
        yield
    finally:
        patch.planned = None
    if patch.planned_ran:  # the step's rows are in the cache
        cache._commit(step)


#: the fp8 format kv_scales_from calibrates for (e4m3, one scale per layer)
_FP8 = CACHE_FORMATS["float8_e4m3fn"]


def kv_scales_from(
    model: nn.Module, input_ids: Tensor, *, attention_mask: Tensor | None = None, margin: float = 1.0
) -> list[float]:
    """Per-layer kv_scale for an fp8 PagedMLACache, calibrated on `input_ids` (one forward, no cache): each
    layer's largest |value| of the latent rows [c_kv ; k_pe] of the real tokens (as the cache write would take
    them) times `margin`, over 448 (e4m3's largest), so that those rows are stored without saturating; 1.0
    for a layer whose rows are all 0. As vLLM's calculate_kv_scales, from one batch: later tokens beyond
    448 * kv_scale saturate, which margin > 1 leaves room for. Any patched model (the cache dtype does not
    matter here); pass the result to PagedMLACache(model, ..., kv_scale=...).
    """
    patch = _patch_of(model)
    if patch is None:
        raise ValueError("model: not patched by mlagen: call patch_model(model) before kv_scales_from(model, ...)")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"margin={margin!r} is not allowed: must be a finite float > 0")
    patch.latent_max = [0.0] * patch.num_layers
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask, use_cache=False)
        largest = patch.latent_max
    finally:
        patch.latent_max = None
    return [_FP8.scale_for(value, margin) for value in largest]


def _mla_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if all(hasattr(m, part) for part in _MLA_PARTS)]


def patch_model(
    model: nn.Module,
    *,
    page_size: int = 64,
    dtype: torch.dtype | str | None = None,
    cache_dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Run every MLA attention of a transformers model through mlagen kernels (in place; returns `model`).

    page_size: tokens per page of the PagedMLACache. dtype: the kernels' dtype (query, latent cache, output):
    bfloat16 or float16; default the model's when it is one of those, else bfloat16 (projections, rope and
    the absorption products stay in the model's dtype). cache_dtype: the PagedMLACache's storage, dtype
    (default) or float8_e4m3fn (latent / kv_scale, see PagedMLACache). Patch after loading the weights:
    W_UK / W_UV are taken from ``kv_b_proj`` now. Calling it again with the same arguments does nothing.
    """
    attns = _mla_modules(model)
    if not attns:
        raise ValueError(
            f"model: no MLA attention found in {type(model).__name__} (modules with {', '.join(_MLA_PARTS)})"
        )
    param = next(model.parameters())
    if dtype is None:
        dtype = param.dtype if param.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    spec = spec_from_config(attns[0].config, page_size=page_size, dtype=dtype, cache_dtype=cache_dtype)
    existing = _patch_of(model)
    if existing is not None:
        if existing.spec != spec:
            raise ValueError(f"model: already patched with spec {existing.spec.name} ({existing.spec.dtype}, cache "
                             f"{existing.spec.cache_dtype}, page size {existing.spec.page_size}); patch a fresh model "
                             f"for page_size={page_size}, dtype={dtype}, cache_dtype={cache_dtype}")  # fmt: skip
        return model
    module = load(spec)
    patch = _Patch(spec, module, module.ops, param.device, max(a.layer_idx for a in attns) + 1)
    kernel_dtype = getattr(torch, spec.dtype)
    for attn in attns:
        if attn.num_heads != spec.num_heads:
            raise ValueError(f"model: layer {attn.layer_idx} has {attn.num_heads} heads, the config {spec.num_heads}")
        if not math.isclose(float(attn.scaling), module.SOFTMAX_SCALE, rel_tol=1e-9):
            raise ValueError(
                f"model: layer {attn.layer_idx} scales scores by {attn.scaling}, the spec derived from its config by "
                f"{module.SOFTMAX_SCALE}: this config's rope scaling is not one mlagen reads"
            )
        weight = attn.kv_b_proj.weight.detach()
        w_kv = weight.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        w_uk, w_uv = w_kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)
        # non-persistent buffers: they follow model.to(...) and stay out of the state dict
        attn.register_buffer("mlagen_w_uk", w_uk.contiguous(), persistent=False)  # [H, Dn, Dc]
        attn.register_buffer("mlagen_w_uv", w_uv.contiguous(), persistent=False)  # [H, Dv, Dc]
        attn.register_buffer("mlagen_w_uk_kernel", w_uk.to(kernel_dtype).contiguous(), persistent=False)
        attn.register_buffer("mlagen_w_uv_kernel", w_uv.to(kernel_dtype).contiguous(), persistent=False)
        attn.mlagen_rope = _rope_function(attn)
        attn._mlagen_patch = patch
        attn.forward = MethodType(_mla_attention_forward, attn)
    for config in {id(c): c for c in [model.config, *(attn.config for attn in attns)]}.values():
        config._attn_implementation = ATTN_IMPLEMENTATION
    base = _base_model(model)
    for holder in {id(model): model, id(base): base}.values():
        holder._mlagen_patch = patch
    base.register_forward_pre_hook(_before_forward, with_kwargs=True)
    base.register_forward_hook(_after_forward, with_kwargs=True)
    return model
