"""A generated module's kernels as ``torch.library`` custom ops, so ``torch.compile`` traces through them.

``kernel_ops(module)`` registers (once per module) and returns the ops of one generated module:

    ops.decode(q, kv_cache, block_table, cache_seqlens, softmax_scale) -> o_lat [B, Sq, H, Dc]
    ops.prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale) -> out [T, H, Dv]
    ops.chunked_prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens,
                        w_uk, w_uv, softmax_scale, num_prefix_tokens) -> out [T, H, Dv]
                        (num_prefix_tokens = sum(prefix_lens), a host int: no host synchronisation)
    ops.cache_write(c_kv, k_pe, kv_cache, slot_mapping) -> None   (mutates kv_cache)

(decode / prefill ops exist only where the spec emits those kernels). Each module gets its own namespace,
``mlagen_<module name>_<hash>``, so modules of different specs (or of one spec built by different mlagen or
Triton versions) loaded in one process never collide. Fake implementations give the output shapes, so
FakeTensor tracing (torch.compile, torch.export) needs no kernel launch. Plain calls of the module's
Python functions keep working unchanged.
"""

from __future__ import annotations

import hashlib
import re
import threading
from types import ModuleType, SimpleNamespace

import torch
from torch import Tensor

__all__ = ["kernel_ops", "op_namespace"]

_LOCK = threading.Lock()
_REGISTERED: dict[str, SimpleNamespace] = {}


def op_namespace(module: ModuleType) -> str:
    """A torch.library namespace unique to this generated module (its import name is unique per file)."""
    digest = hashlib.sha256(module.__name__.encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9]", "_", str(module.SPEC["name"]).lower())[:24]
    return f"mlagen_{stem}_{digest}"


def kernel_ops(module: ModuleType) -> SimpleNamespace:
    """Register `module`'s kernels as custom ops (first call) and return them as attributes of a namespace."""
    namespace = op_namespace(module)
    with _LOCK:
        if namespace not in _REGISTERED:
            _REGISTERED[namespace] = _register(module, namespace)
        return _REGISTERED[namespace]


def _register(module: ModuleType, ns: str) -> SimpleNamespace:
    heads, dc, dv = module.NUM_HEADS, module.KV_LORA_RANK, module.V_HEAD_DIM
    ops = SimpleNamespace(namespace=ns)

    @torch.library.custom_op(f"{ns}::cache_write", mutates_args=("kv_cache",))
    def cache_write(c_kv: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        module.mla_cache_write(c_kv, k_pe, kv_cache, slot_mapping)

    @cache_write.register_fake
    def _(c_kv: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        return None

    ops.cache_write = cache_write

    if hasattr(module, "mla_decode"):

        @torch.library.custom_op(f"{ns}::decode", mutates_args=())
        def decode(
            q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, softmax_scale: float
        ) -> Tensor:
            return module.mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale)

        @decode.register_fake
        def _(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, softmax_scale: float) -> Tensor:
            return q.new_empty((q.shape[0], q.shape[1], heads, dc))

        ops.decode = decode

    if hasattr(module, "mla_prefill"):

        @torch.library.custom_op(f"{ns}::prefill", mutates_args=())
        def prefill(
            q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
        ) -> Tensor:
            return module.mla_prefill(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale=scale)

        @prefill.register_fake
        def _(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, scale):
            return q.new_empty((q.shape[0], heads, dv))

        @torch.library.custom_op(f"{ns}::chunked_prefill", mutates_args=())
        def chunked_prefill(
            q: Tensor,
            k_nope: Tensor,
            k_pe: Tensor,
            v: Tensor,
            cu_seqlens: Tensor,
            max_seqlen: int,
            kv_cache: Tensor,
            block_table: Tensor,
            prefix_lens: Tensor,
            w_uk: Tensor,
            w_uv: Tensor,
            softmax_scale: float,
            num_prefix_tokens: int,
        ) -> Tensor:
            return module.mla_chunked_prefill(
                q, k_nope, k_pe, v, cu_seqlens, max_seqlen, kv_cache, block_table, prefix_lens, w_uk, w_uv,
                softmax_scale=softmax_scale, num_prefix_tokens=num_prefix_tokens,
            )  # fmt: skip

        @chunked_prefill.register_fake
        def _(
            q,
            k_nope,
            k_pe,
            v,
            cu_seqlens,
            max_seqlen,
            kv_cache,
            block_table,
            prefix_lens,
            w_uk,
            w_uv,
            scale,
            num_prefix,
        ):
            return q.new_empty((q.shape[0], heads, dv))

        ops.prefill = prefill
        ops.chunked_prefill = chunked_prefill
    return ops
