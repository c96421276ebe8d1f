"""Plain-PyTorch MLA from its maths (decompressed and absorbed forms): the ground truth for every kernel.

Everything computes in the dtype of its inputs; tests pass float64 (or float32) tensors. Two forms of
the same layer are given and must agree with each other:

* decompressed (MHA): expand k_nope / v per head from the latent c_kv, then ordinary causal attention;
* absorbed (MQA): fold W_UK into the query and W_UV into the output, attend over [c_kv ; k_pe] rows.

Plus absorbed decode over a paged cache with the contract of the generated `mla_decode`, and the
prefill contracts: varlen causal prefill (MHA form), chunked prefill over a cached latent prefix, and the
paged cache write. An fp8 cache (stored = fp8(latent / kv_scale)) is quantised by `quantize_latent` and read
through `dequantize_cache` (stored * kv_scale): the attention references take the dequantised cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_format import CACHE_FORMATS, cache_format

__all__ = [
    "MLAWeights",
    "absorb_query",
    "apply_rope",
    "attention",
    "cache_write",
    "causal_mask",
    "chunked_prefill",
    "decode_paged",
    "gather_pages",
    "decode_paged_batched",
    "dequantize_cache",
    "FP8_E4M3_MAX",
    "mla_absorbed",
    "mla_decompressed",
    "prefill_varlen",
    "project",
    "quantize_latent",
    "random_weights",
]


#: largest finite float8_e4m3fn value: quantisation saturates there (its cache format's max_abs)
FP8_E4M3_MAX = CACHE_FORMATS["float8_e4m3fn"].max_abs


def quantize_latent(latent: torch.Tensor, kv_scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """latent rows as a scaled cache of `dtype` stores them (the format's quantize: (latent / kv_scale) in
    float32, saturated at the format's largest finite value, rounded to nearest even by torch's conversion)."""
    return cache_format(str(dtype).removeprefix("torch.")).quantize(latent, kv_scale)


def dequantize_cache(
    kv_cache: torch.Tensor, kv_scale: float | torch.Tensor | None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The latent values a cache holds, in `dtype`: stored * kv_scale (kv_scale None: a 16-bit cache, as is)."""
    values = kv_cache.to(dtype)
    return values if kv_scale is None else values * float(kv_scale)


@dataclass(frozen=True)
class MLAWeights:
    """Raw projection weights of one MLA layer (nn.Linear convention: y = x @ W.T).

    w_dq [Lq, hidden] and w_uq [H*(Dn+Dr), Lq] when q_lora_rank is set, else w_q [H*(Dn+Dr), hidden];
    w_dkv [Dc, hidden], w_kr [Dr, hidden], w_uk [H, Dn, Dc], w_uv [H, Dv, Dc].
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    w_dkv: torch.Tensor
    w_kr: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    w_q: torch.Tensor | None = None
    w_dq: torch.Tensor | None = None
    w_uq: torch.Tensor | None = None


def random_weights(
    *,
    hidden: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> MLAWeights:
    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype) / shape[-1] ** 0.5

    q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
    q_weights = (
        {"w_dq": mat(q_lora_rank, hidden), "w_uq": mat(q_out, q_lora_rank)}
        if q_lora_rank
        else {"w_q": mat(q_out, hidden)}
    )
    return MLAWeights(
        num_heads=num_heads,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        kv_lora_rank=kv_lora_rank,
        w_dkv=mat(kv_lora_rank, hidden),
        w_kr=mat(qk_rope_head_dim, hidden),
        w_uk=mat(num_heads, qk_nope_head_dim, kv_lora_rank),
        w_uv=mat(num_heads, v_head_dim, kv_lora_rank),
        **q_weights,
    )


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding over the last dimension (pairs (i, i + d/2)); x [..., T, (heads,) d]."""
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim)
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles).repeat(1, 2), torch.sin(angles).repeat(1, 2)
    if x.dim() == 3:  # [T, H, d]
        cos, sin = cos[:, None, :], sin[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def project(weights: MLAWeights, hidden: torch.Tensor, positions: torch.Tensor):
    """Hidden states [T, hidden] -> (q_nope [T,H,Dn], q_pe [T,H,Dr], c_kv [T,Dc], k_pe [T,Dr])."""
    w = weights
    if w.w_q is not None:
        q = hidden @ w.w_q.T
    else:
        assert w.w_dq is not None and w.w_uq is not None
        q = _rms_norm(hidden @ w.w_dq.T) @ w.w_uq.T
    q = q.view(hidden.shape[0], w.num_heads, w.qk_nope_head_dim + w.qk_rope_head_dim)
    q_nope, q_pe = q[..., : w.qk_nope_head_dim], apply_rope(q[..., w.qk_nope_head_dim :], positions)
    c_kv = _rms_norm(hidden @ w.w_dkv.T)
    k_pe = apply_rope(hidden @ w.w_kr.T, positions)
    return q_nope, q_pe, c_kv, k_pe


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention. q [T, H, Dq], k [S, H, Dq], v [S, H, Dv], visible [T, S] bool.

    Returns out [T, H, Dv] and lse [H, T] (natural log; -inf and zero output for a row that sees nothing).
    """
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hts,shd->thd", probs, v)
    return out, lse


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """Query i (the last num_queries positions of num_keys) sees keys 0..num_keys-num_queries+i."""
    q_pos = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
    return torch.arange(num_keys, device=device)[None, :] <= q_pos


def mla_decompressed(weights: MLAWeights, q_nope, q_pe, c_kv, k_pe, scale: float):
    """MHA form: k_i = [W_UK_i c_kv ; k_pe], v_i = W_UV_i c_kv. Causal; queries are the last T keys."""
    k_nope = torch.einsum("sc,hnc->shn", c_kv, weights.w_uk)
    v = torch.einsum("sc,hvc->shv", c_kv, weights.w_uv)
    num_heads = weights.num_heads
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return attention(q, k, v, scale, causal_mask(q.shape[0], k.shape[0], q.device))


def absorb_query(weights: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """q~_i = [W_UK_i^T q_nope_i ; q_pe_i]: [T, H, Dc + Dr]."""
    return torch.cat([torch.einsum("thn,hnc->thc", q_nope, weights.w_uk), q_pe], dim=-1)


def mla_absorbed(weights: MLAWeights, q_nope, q_pe, c_kv, k_pe, scale: float):
    """MQA form: every head attends over the shared rows [c_kv ; k_pe]; o_i = W_UV_i o_lat_i."""
    q_abs = absorb_query(weights, q_nope, q_pe)
    rows = torch.cat([c_kv, k_pe], dim=-1)[:, None, :]
    visible = causal_mask(q_abs.shape[0], rows.shape[0], q_abs.device)
    o_lat, lse = attention(q_abs, rows, c_kv[:, None, :], scale, visible)
    return torch.einsum("thc,hvc->thv", o_lat, weights.w_uv), lse


def gather_pages(kv_cache: torch.Tensor, pages: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The first `seqlen` rows of one sequence from a paged cache [num_pages, page_size, 1, D]."""
    page_size = kv_cache.shape[1]
    n_pages = -(-seqlen // page_size)
    rows = kv_cache[pages[:n_pages].long()].reshape(n_pages * page_size, kv_cache.shape[-1])
    return rows[:seqlen]


def decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode, the contract of the generated `mla_decode`, computed in q's dtype.

    q [B, Sq, H, Dc+Dr]; query j of row b is at position cache_seqlens[b] - Sq + j and sees cache
    positions <= its own (causal=False: every query sees the whole sequence). Returns out [B, Sq, H, Dc]
    and lse [B, H, Sq].
    """
    batch, seqlen_q, num_heads, _ = q.shape
    out = q.new_zeros(batch, seqlen_q, num_heads, kv_lora_rank)
    lse = q.new_full((batch, num_heads, seqlen_q), float("-inf"))
    for b in range(batch):
        seqlen = int(cache_seqlens[b])
        if seqlen == 0:
            continue
        rows = gather_pages(kv_cache, block_table[b], seqlen).to(q.dtype)
        q_pos = seqlen - seqlen_q + torch.arange(seqlen_q, device=q.device)
        if not causal:
            q_pos = torch.full_like(q_pos, seqlen - 1)
        visible = torch.arange(seqlen, device=q.device)[None, :] <= q_pos[:, None]
        o_b, lse_b = attention(q[b], rows[:, None, :], rows[:, None, :kv_lora_rank], scale, visible)
        out[b], lse[b] = o_b, lse_b
    return out, lse


def decode_paged_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    max_seqlen: int | None = None,
    kv_scale: torch.Tensor | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `decode_paged` in whole-batch tensor ops (no Python loop over sequences, no host sync
    when `max_seqlen` is given): PyTorch eager absorbed decode, the baseline the benchmarks compare to.
    Computes in q's dtype; scores and softmax in float32 at least. kv_scale: an fp8 cache's scale (a tensor
    on the cache's device, or a number): the gathered rows are dequantised, rows * kv_scale. causal: as in
    `decode_paged`.
    """
    batch, seqlen_q, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    if max_seqlen is None:
        max_seqlen = int(cache_seqlens.max())
    n_pages = -(-max_seqlen // page_size)
    rows = kv_cache[block_table[:, :n_pages].long()]  # [B, n_pages, page_size, 1, D]
    rows = rows.reshape(batch, n_pages * page_size, kv_cache.shape[-1])
    # an fp8 cache: dequantised in float32, then computed with in q's dtype like a 16-bit cache
    rows = rows.to(q.dtype) if kv_scale is None else (rows.to(torch.float32) * kv_scale).to(q.dtype)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bshd,bnd->bhsn", q, rows).to(acc) * scale
    key_pos = torch.arange(n_pages * page_size, device=q.device)
    q_pos = cache_seqlens[:, None].long() - seqlen_q + torch.arange(seqlen_q, device=q.device)[None, :]
    if not causal:
        q_pos = (cache_seqlens[:, None].long() - 1).expand(-1, seqlen_q)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Sq, N]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None]).to(q.dtype)
    out = torch.einsum("bhsn,bnc->bshc", probs, rows[..., :kv_lora_rank])
    return out, lse


def prefill_varlen(
    q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, cu_seqlens, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal MHA-form prefill over packed sequences, the contract of the generated `mla_prefill`.

    q [T, H, Dn+Dr], k_nope [T, H, Dn], k_pe [T, Dr] (shared by all heads), v [T, H, Dv],
    cu_seqlens [B+1]. Returns out [T, H, Dv] and lse [H, T].
    """
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros(num_tokens, num_heads, v.shape[-1])
    lse = q.new_full((num_heads, num_tokens), float("-inf"))
    bounds = [int(x) for x in cu_seqlens]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=False):
        if hi == lo:
            continue
        k = torch.cat([k_nope[lo:hi], k_pe[lo:hi, None, :].expand(-1, num_heads, -1)], dim=-1)
        out[lo:hi], lse[:, lo:hi] = attention(q[lo:hi], k, v[lo:hi], scale, causal_mask(hi - lo, hi - lo, q.device))
    return out, lse


def chunked_prefill(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    expanded_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention over cached prefix + new tokens, the contract of `mla_chunked_prefill`.

    New tokens of sequence b (tokens cu_seqlens[b]..cu_seqlens[b+1]-1) sit at positions prefix_lens[b]..;
    the prefix keys are expanded from the latent cache rows: k = [W_UK c_kv ; k_pe], v = W_UV c_kv.
    expanded_dtype: round the prefix rows and the expanded prefix k_nope / v to this dtype, as the MHA form
    materializes them in the kernel's dtype (None: keep them exact; rows of a 16-bit cache are already
    exact in it, dequantised fp8 rows are not). Computed in q's dtype. Returns out [T, H, Dv], lse [H, T].
    kv_cache: the latent values (an fp8 cache through `dequantize_cache`).
    """
    num_tokens, num_heads, _ = q.shape
    kv_lora_rank = w_uk.shape[-1]
    out = q.new_zeros(num_tokens, num_heads, v.shape[-1])
    lse = q.new_full((num_heads, num_tokens), float("-inf"))
    bounds = [int(x) for x in cu_seqlens]
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=False)):
        if hi == lo:
            continue
        prefix = int(prefix_lens[b])
        rows = gather_pages(kv_cache, block_table[b], prefix).to(q.dtype)
        if expanded_dtype is not None:
            rows = rows.to(expanded_dtype).to(q.dtype)
        c_kv, pre_k_pe = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
        pre_k_nope = torch.einsum("sc,hnc->shn", c_kv, w_uk.to(q.dtype))
        pre_v = torch.einsum("sc,hvc->shv", c_kv, w_uv.to(q.dtype))
        if expanded_dtype is not None:
            pre_k_nope, pre_v = pre_k_nope.to(expanded_dtype).to(q.dtype), pre_v.to(expanded_dtype).to(q.dtype)
        keys_nope = torch.cat([pre_k_nope, k_nope[lo:hi]])
        keys_pe = torch.cat([pre_k_pe, k_pe[lo:hi]])
        values = torch.cat([pre_v, v[lo:hi]])
        k = torch.cat([keys_nope, keys_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
        visible = causal_mask(hi - lo, prefix + hi - lo, q.device)
        out[lo:hi], lse[:, lo:hi] = attention(q[lo:hi], k, values, scale, visible)
    return out, lse


def cache_write(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of kv_cache [num_pages, page_size, 1, Dc+Dr] with row [c_kv[t] ; k_pe[t]] at slot_mapping[t]
    (page slot // page_size, row slot % page_size); negative slots are skipped. kv_scale: a scaled (fp8)
    cache stores `quantize_latent(row, kv_scale)`."""
    result = kv_cache.clone()
    page_size = kv_cache.shape[1]
    rows = torch.cat([c_kv, k_pe], dim=-1)
    rows = rows.to(kv_cache.dtype) if kv_scale is None else quantize_latent(rows, kv_scale, kv_cache.dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            result[slot // page_size, slot % page_size, 0] = rows[t]
    return result
