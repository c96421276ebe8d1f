"""mla_decode's causal= and empty_lse= arguments and the FlashMLA drop-in (mlagen_compiler.flash_mla) against
the reference. (Causal and non-causal decode are drawn by the shared decode property test: testing.decode_inputs.)

Interpreter-sized geometries; the GPU run of FlashMLA's own suite through the drop-in is
benchmarks/flash_mla_dropin.py. Outputs are poisoned (NaN) and unused cache slots hold NaN, as in FlashMLA's
suite, whose conventions are checked here: default scale q.shape[-1] ** -0.5, lse = +inf and a zero output
for a query that sees no key, block-table entries past a sequence set to a huge page number.
"""

import math

import pytest
import torch

import mlagen_compiler.flash_mla as flash_mla
from mlagen_compiler.verify import compare_with_lse, decode_reference, make_decode_inputs

#: FlashMLA's suite marks block-table entries past each sequence with this page number
PAST_THE_END_PAGE = 2147480000


def small_spec(**fields):
    spec = dict(name="noncausal", num_heads=3, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                v_head_dim=32, page_size=4, dtype="float16")  # fmt: skip
    spec.update(fields)
    return spec


def test_causal_and_empty_lse_are_checked(build_module, device):
    module = build_module(**small_spec())
    inputs = make_decode_inputs(module, [5], 2, torch.Generator().manual_seed(0), device)
    with pytest.raises(ValueError, match="causal: must be True or False, got 'no'"):
        module.mla_decode(**inputs, causal="no")
    with pytest.raises(ValueError, match="empty_lse: must be -math.inf or math.inf, got 0.0"):
        module.mla_decode(**inputs, empty_lse=0.0)


def test_empty_lse_sets_what_a_query_that_sees_no_key_gets(build_module, device):
    module = build_module(**small_spec())
    # sequence 1 is empty; sequence 2 (length 1, Sq 2): its first new token sees no key when causal
    inputs = make_decode_inputs(module, [6, 0, 1], 2, torch.Generator().manual_seed(1), device)
    _, lse_default = module.mla_decode(**inputs, return_lse=True)
    out, lse = module.mla_decode(**inputs, return_lse=True, empty_lse=math.inf)
    empty = torch.zeros_like(lse, dtype=torch.bool)
    empty[1] = True
    empty[2, :, 0] = True
    assert (lse_default[empty] == -math.inf).all() and (lse[empty] == math.inf).all()
    assert torch.equal(lse[~empty], lse_default[~empty]) and lse[~empty].isfinite().all()
    assert (out[1] == 0).all() and (out[2, 0] == 0).all()


# ---- the drop-in ------------------------------------------------------------------------------------------------


@pytest.fixture
def drop_in(tmp_path, monkeypatch):
    """mlagen_compiler.flash_mla with a fresh compile cache and no modules loaded yet."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(flash_mla, "_MODULES", {})
    return flash_mla


def flashmla_inputs(seqlens, seqlen_q, heads, dc, dr, page_size, dtype, seed, device):
    """Inputs the way FlashMLA's suite makes them: q and cache N(0, 1)/10 clamped to [-1, 1], shuffled pages,
    NaN in every unused page and page tail, block-table entries past each sequence a huge page number."""
    g = torch.Generator().manual_seed(seed)
    width = dc + dr
    pages_per_seq = max(1, -(-max(seqlens) // page_size))
    num_pages = len(seqlens) * pages_per_seq
    table = torch.randperm(num_pages, generator=g).to(torch.int32).view(len(seqlens), pages_per_seq)
    cache = (torch.randn(num_pages, page_size, 1, width, generator=g) / 10).clamp(-1, 1).to(dtype)
    q = (torch.randn(len(seqlens), seqlen_q, heads, width, generator=g) / 10).clamp(-1, 1).to(dtype)
    for b, length in enumerate(seqlens):
        used = -(-length // page_size)
        cache[table[b, used:].long()] = float("nan")
        if length % page_size:
            cache[table[b, used - 1].long(), length % page_size :] = float("nan")
        table[b, used:] = PAST_THE_END_PAGE
    lens = torch.tensor(seqlens, dtype=torch.int32)
    return q.to(device), cache.to(device), table.to(device), lens.to(device)


def flashmla_reference(q, cache, table, lens, dc, scale, causal):
    """The reference with FlashMLA's conventions: lse = +inf where a query sees no key."""
    # the reference gathers only the pages a sequence uses; entries past the end are never read
    safe_table = torch.where(table == PAST_THE_END_PAGE, 0, table)
    inputs = dict(q=q, kv_cache=cache, block_table=safe_table, cache_seqlens=lens)
    module = type("Geometry", (), dict(KV_LORA_RANK=dc, SOFTMAX_SCALE=scale))
    out, lse = decode_reference(module, inputs, causal=causal)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (3, 64): the portable kernel everywhere; (16, 128): the Gluon kernel on Hopper (48 query rows a sequence)
@pytest.mark.parametrize("heads, dc", [(3, 64), (16, 128)])
def test_drop_in_matches_the_reference_with_flashmla_conventions(drop_in, device, causal, dtype, heads, dc):
    dr, page_size, seqlen_q = 16, 8, 3
    # an empty sequence (lse +inf everywhere) and one shorter than Sq (its first causal rows see no key)
    seqlens = [19, 0, 2, 8]
    q, cache, table, lens = flashmla_inputs(seqlens, seqlen_q, heads, dc, dr, page_size, dtype, 7, device)
    meta, num_splits = drop_in.get_mla_metadata()
    assert num_splits is None and not meta.have_initialized
    for _ in range(2):  # the second call reuses the filled schedule
        out, lse = drop_in.flash_mla_with_kvcache(q, cache, table, lens, dc, meta, num_splits, causal=causal)
        assert meta.have_initialized and meta.config.b == len(seqlens) and meta.config.causal is causal
        want, want_lse = flashmla_reference(q.double(), cache, table, lens, dc, (dc + dr) ** -0.5, causal)
        assert out.shape == (len(seqlens), seqlen_q, heads, dc) and out.dtype == dtype
        assert lse.shape == (len(seqlens), heads, seqlen_q) and lse.dtype == torch.float32
        assert (lse[1] == float("inf")).all() and (out[1] == 0).all()
        assert bool((lse[2, :, 0] == float("inf")).all()) is causal  # position -1 sees nothing only when causal
        _, _, message = compare_with_lse(out, lse, want, want_lse, str(dtype).removeprefix("torch."))
        assert not message, message


def test_drop_in_2025_api_and_explicit_scale(drop_in, device):
    heads, dc, dr, page_size = 2, 64, 16, 16
    seqlens = [33, 5]
    q, cache, table, lens = flashmla_inputs(seqlens, 1, heads, dc, dr, page_size, torch.float16, 3, device)
    metadata, num_splits = drop_in.get_mla_metadata(lens, 1 * heads, 1)
    assert metadata.dtype == num_splits.dtype == torch.int32 and num_splits.shape == (len(seqlens) + 1,)
    out, lse = drop_in.flash_mla_with_kvcache(q, cache, table, lens, dc, metadata, num_splits, softmax_scale=0.3,
                                              causal=True)  # fmt: skip
    want, want_lse = flashmla_reference(q.double(), cache, table, lens, dc, 0.3, True)
    _, _, message = compare_with_lse(out, lse, want, want_lse, "float16")
    assert not message, message


def test_drop_in_fp8_cache_takes_descale_k_as_the_layer_scale(drop_in, device):
    heads, dc, dr, page_size = 2, 64, 16, 8
    seqlens = [21, 9]
    q, latent, table, lens = flashmla_inputs(seqlens, 2, heads, dc, dr, page_size, torch.bfloat16, 5, device)
    descale_k = torch.tensor([0.37], dtype=torch.float32, device=device)
    cache = (latent.float() / descale_k).to(torch.float8_e4m3fn)
    metadata, num_splits = drop_in.get_mla_metadata_dense_fp8(lens, 2 * heads, 1)
    out, lse = drop_in.flash_mla_with_kvcache_fp8(q, cache.view(torch.uint8), table, lens, dc, metadata, num_splits,
                                                  causal=True, descale_k=descale_k)  # fmt: skip
    dequantised = cache.to(torch.float64) * descale_k.double()  # what the cache holds, exactly
    want, want_lse = flashmla_reference(q.double(), dequantised, table, lens, dc, (dc + dr) ** -0.5, True)
    _, _, message = compare_with_lse(out, lse, want, want_lse, "bfloat16")
    assert not message, message


def test_schedule_reuse_is_checked_like_flashmla(drop_in, device):
    q, cache, table, lens = flashmla_inputs([9, 4], 2, 2, 64, 16, 4, torch.float16, 1, device)
    meta, _ = drop_in.get_mla_metadata()
    drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, meta, causal=True)
    with pytest.raises(ValueError, match=r"planned for causal=True, called with causal=False"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, meta, causal=False)
    with pytest.raises(ValueError, match=r"planned for b=2, called with b=1"):
        drop_in.flash_mla_with_kvcache(q[:1], cache, table[:1], lens[:1], 64, meta, causal=True)
    with pytest.raises(ValueError, match=r"planned for s_q=2, called with s_q=1"):
        drop_in.flash_mla_with_kvcache(q[:, :1], cache, table, lens, 64, meta, causal=True)
    with pytest.raises(ValueError, match="num_splits: must be None"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, meta, lens, causal=True)
    with pytest.raises(TypeError, match="tile_scheduler_metadata: expected the FlashMLASchedMeta"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, "meta")


@pytest.mark.parametrize(
    "argument",
    ["indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"],
)
def test_what_is_not_dense_mla_raises_not_implemented_naming_the_argument(drop_in, device, argument):
    q, cache, table, lens = flashmla_inputs([9], 1, 2, 64, 16, 4, torch.float16, 1, device)
    meta, _ = drop_in.get_mla_metadata()
    with pytest.raises(NotImplementedError, match=f"^{argument}: not supported"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, meta, **{argument: lens})


def test_several_kv_heads_and_flashmla_fp8_layout_raise_not_implemented(drop_in, device):
    q, cache, table, lens = flashmla_inputs([9], 1, 2, 64, 16, 4, torch.float16, 1, device)
    meta, _ = drop_in.get_mla_metadata()
    with pytest.raises(NotImplementedError, match="k_cache: num_heads_k=2 is not supported"):
        drop_in.flash_mla_with_kvcache(q, cache.expand(-1, -1, 2, -1), table, lens, 64, meta)
    with pytest.raises(NotImplementedError, match="is_fp8_kvcache=True: FlashMLA's fp8 cache layout"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 64, meta, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="num_heads_k=4 is not supported"):
        drop_in.get_mla_metadata(lens, 2, 4)
    with pytest.raises(NotImplementedError, match="topk=128: sparse attention"):
        drop_in.get_mla_metadata(lens, 2, 1, 2, True, 128)


def test_bad_geometry_and_values_are_one_line_errors(drop_in, device):
    q, cache, table, lens = flashmla_inputs([9], 1, 2, 64, 16, 4, torch.float16, 1, device)
    meta, _ = drop_in.get_mla_metadata()
    with pytest.raises(ValueError, match=r"head_dim_v=80 is not allowed: must be an int in 1\.\.79"):
        drop_in.flash_mla_with_kvcache(q, cache, table, lens, 80, meta)
    with pytest.raises(
        ValueError, match=r"a geometry mlagen does not compile \(kv_lora_rank: kv_lora_rank=50 is not allowed"
    ):
        drop_in.flash_mla_with_kvcache(q[..., :66], cache[..., :66], table, lens, 50, meta)
    with pytest.raises(ValueError, match="q: dtype torch.float32 is not allowed"):
        drop_in.flash_mla_with_kvcache(q.float(), cache, table, lens, 64, meta)
    with pytest.raises(ValueError, match="block_table, cache_seqlens: dense decode needs both"):
        drop_in.flash_mla_with_kvcache(q, cache, None, lens, 64, meta)
    with pytest.raises(ValueError, match="descale_k: an fp8 cache needs its float32 scale"):
        drop_in.flash_mla_with_kvcache_fp8(q, cache, table, lens, 64, meta, None)
    # the generated decode's own checks: a page index past the cache
    bad_table = table.clone()
    bad_table[0, 0] = cache.shape[0] + 5
    with pytest.raises(ValueError, match="block_table"):
        drop_in.flash_mla_with_kvcache(q, cache, bad_table, lens, 64, meta)
