"""Property tests: generated mla_prefill, merge_attn_states and mla_chunked_prefill == the reference.

Runs in Triton's interpreter without a GPU and unchanged on one. Outputs are poisoned (NaN) before each
call and workspaces are NaN-filled (MLAGEN_POISON_WORKSPACE, conftest), so unwritten elements fail.
Lengths are drawn around the tile sizes the module uses on this device (block boundaries +-1).
"""

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from mlagen_compiler.reference import (
    MLAWeights,
    attention,
    causal_mask,
    chunked_prefill,
    dequantize_cache,
    mla_decompressed,
    prefill_varlen,
    project,
    random_weights,
)
from mlagen_compiler.verify import compare, compare_with_lse, cu_seqlens, paged_block_table, random_cache, random_mha

GEOMETRIES = [  # (H, Dn, Dr, Dv, Dc): DeepSeek, Mistral-Small-4, MiniCPM3-like, odd widths (padded)
    (2, 128, 64, 128, 512),
    (3, 64, 64, 128, 256),
    (4, 64, 32, 64, 256),
    (1, 48, 16, 80, 64),
    (5, 16, 16, 16, 64),
]
#: (block_m, block_n) pairs tried besides the module's own choice, so both loop shapes are covered
EXTRA_TILES = [(32, 16), (16, 32)]


def module_for(build_module, geometry, dtype, page_size=16, cache_dtype=None):
    heads, dn, dr, dv, dc = geometry
    return build_module(
        name="prefill-prop",
        num_heads=heads,
        kv_lora_rank=dc,
        qk_rope_head_dim=dr,
        qk_nope_head_dim=dn,
        v_head_dim=dv,
        page_size=page_size,
        dtype=dtype,
        cache_dtype=cache_dtype,
        kernels=["prefill"],
    )


def tile_lengths(block_m, block_n):
    edges = {1, 2, block_n - 1, block_n, block_n + 1, block_m - 1, block_m + 1, 2 * block_m + 1}
    return st.one_of(st.sampled_from(sorted(e for e in edges if e >= 1)), st.integers(1, 40))


def poisoned(module, num_tokens, device):
    out = torch.full((num_tokens, module.NUM_HEADS, module.V_HEAD_DIM), float("nan"), dtype=module.DTYPE, device=device)
    lse = torch.full((module.NUM_HEADS, num_tokens), float("nan"), device=device)
    return out, lse


def check(got, got_lse, want, want_lse, dtype):
    assert not got.isnan().any(), "unwritten or NaN output elements"
    _, _, message = compare_with_lse(got, got_lse, want, want_lse, dtype)
    assert not message, message


@st.composite
def prefill_problems(draw):
    geometry = draw(st.sampled_from(GEOMETRIES))
    dtype = draw(st.sampled_from(["bfloat16", "float16"]))
    tiles = draw(st.sampled_from([None, *EXTRA_TILES]))
    # key / value tiles through TMA descriptors or through pointer tiles: both load paths are checked
    tma = draw(st.booleans())
    return dict(geometry=geometry, dtype=dtype, tiles=tiles, tma=tma, seed=draw(st.integers(0, 2**32 - 1)))


@given(problem=prefill_problems(), data=st.data())
def test_prefill_matches_reference(build_module, device, problem, data):
    module = module_for(build_module, problem["geometry"], problem["dtype"])
    config = module.prefill_config(device)
    if problem["tiles"] is not None:
        config = (*problem["tiles"], *config[2:])
    lengths = data.draw(st.lists(tile_lengths(config[0], config[1]), min_size=1, max_size=4), label="lengths")
    note(f"{problem} config={config} lengths={lengths}")
    g = torch.Generator().manual_seed(problem["seed"])
    cu = cu_seqlens(lengths, device)
    q, k_nope, k_pe, v = random_mha(module, sum(lengths), g, device)
    out, lse = poisoned(module, sum(lengths), device)
    with patch.object(module, "PREFILL_USE_TMA", problem["tma"]):
        got, got_lse = module.mla_prefill(
            q, k_nope, k_pe, v, cu, max(lengths), return_lse=True, out=out, lse=lse, config=config
        )
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    want, want_lse = prefill_varlen(q.double(), k_nope.double(), k_pe.double(), v.double(), cu, module.SOFTMAX_SCALE)
    check(got, got_lse, want, want_lse, problem["dtype"])


@given(
    geometry=st.sampled_from(GEOMETRIES),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    split=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_attn_states_equals_attention_over_the_union(build_module, device, geometry, dtype, split, seed):
    """Attention over keys A and over keys B, merged, == attention over A + B (either part may be empty)."""
    module = module_for(build_module, geometry, dtype)
    num_tokens = split.draw(st.integers(1, 20), label="tokens")
    keys_a = split.draw(st.integers(0, 24), label="keys_a")
    keys_b = split.draw(st.integers(0 if keys_a else 1, 24), label="keys_b")
    parts_fp32 = split.draw(st.booleans(), label="fp32 partials")
    g = torch.Generator().manual_seed(seed)
    heads, dv = module.NUM_HEADS, module.V_HEAD_DIM
    q = torch.randn(num_tokens, heads, 32, generator=g, dtype=torch.float64)
    k = torch.randn(keys_a + keys_b, heads, 32, generator=g, dtype=torch.float64)
    v = torch.randn(keys_a + keys_b, heads, dv, generator=g, dtype=torch.float64)
    # a random visibility pattern where each query sees a key of the union, except drawn blind rows
    visible = torch.rand(num_tokens, keys_a + keys_b, generator=g) < 0.7
    visible[torch.arange(num_tokens), torch.randint(0, keys_a + keys_b, (num_tokens,), generator=g)] = True
    if split.draw(st.booleans(), label="blind rows"):  # lse -inf and zero output for these
        visible[torch.rand(num_tokens, generator=g) < 0.3] = False
    o_a, l_a = attention(q, k[:keys_a], v[:keys_a], 0.2, visible[:, :keys_a])
    o_b, l_b = attention(q, k[keys_a:], v[keys_a:], 0.2, visible[:, keys_a:])
    want, want_lse = attention(q, k, v, 0.2, visible)
    part_dtype = torch.float32 if parts_fp32 else module.DTYPE
    out, lse = poisoned(module, num_tokens, device)
    got, got_lse = module.merge_attn_states(
        o_a.to(part_dtype).to(device),
        l_a.float().to(device),
        o_b.to(part_dtype).to(device),
        l_b.float().to(device),
        out=out,
        out_lse=lse,
        return_lse=True,
    )
    check(got, got_lse, want, want_lse, dtype)


def paged_cache(module, prefix_lens, generator, device):
    """Random latent cache holding the prefixes in shuffled pages (see verify.paged_block_table), its table
    and its kv_scale (None for a 16-bit cache, see verify.random_cache)."""
    table, num_pages = paged_block_table(prefix_lens, module.PAGE_SIZE, generator, spare_pages=2)
    cache, kv_scale = random_cache(module, num_pages, generator, device)
    return cache, table.to(device), kv_scale


@given(problem=prefill_problems(), data=st.data())
def test_chunked_prefill_equals_full_attention(build_module, device, problem, data):
    page_size = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    # the prefix in a 16-bit or an fp8 cache (dequantised before it is expanded)
    cache_dtype = data.draw(st.sampled_from([None, "float8_e4m3fn"]), label="cache_dtype")
    module = module_for(build_module, problem["geometry"], problem["dtype"], page_size, cache_dtype)
    config = module.prefill_config(device)
    if problem["tiles"] is not None:
        config = (*problem["tiles"], *config[2:])
    batch = data.draw(st.integers(1, 3), label="batch")
    lengths = data.draw(st.lists(tile_lengths(config[0], config[1]), min_size=batch, max_size=batch), label="new")
    prefix_length = st.one_of(st.just(0), tile_lengths(config[1], page_size), st.integers(0, 50))
    prefix_lens = data.draw(st.lists(prefix_length, min_size=batch, max_size=batch), label="prefix")
    note(f"{problem} config={config} new={lengths} prefix={prefix_lens} page_size={page_size}")
    g = torch.Generator().manual_seed(problem["seed"])
    cu = cu_seqlens(lengths, device)
    q, k_nope, k_pe, v = random_mha(module, sum(lengths), g, device)
    cache, table, kv_scale = paged_cache(module, prefix_lens, g, device)
    heads, dn, dv, dc = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK
    w_uk = (torch.randn(heads, dn, dc, generator=g) / dc**0.5).to(module.DTYPE).to(device)
    w_uv = (torch.randn(heads, dv, dc, generator=g) / dc**0.5).to(module.DTYPE).to(device)
    plen = torch.tensor(prefix_lens, dtype=torch.int32, device=device)
    out, lse = poisoned(module, sum(lengths), device)
    # the prefix total as a host int (no synchronisation, graph-capturable) or read from prefix_lens
    total = data.draw(st.sampled_from([None, sum(prefix_lens)]), label="num_prefix_tokens")
    got, got_lse = module.mla_chunked_prefill(
        q, k_nope, k_pe, v, cu, max(lengths), cache, table, plen, w_uk, w_uv, kv_scale=kv_scale,
        return_lse=True, out=out, lse=lse, config=config, num_prefix_tokens=total,
    )  # fmt: skip
    want, want_lse = chunked_prefill(
        q.double(), k_nope.double(), k_pe.double(), v.double(), cu, dequantize_cache(cache, kv_scale), table, plen,
        w_uk.double(), w_uv.double(), module.SOFTMAX_SCALE, expanded_dtype=module.DTYPE,
    )  # fmt: skip
    check(got, got_lse, want, want_lse, problem["dtype"])


def test_reference_chunked_prefill_is_the_mla_layer():
    """The chunked reference over [prefix ; new] == the decompressed MLA layer over the whole sequence."""
    g = torch.Generator().manual_seed(3)
    heads, dn, dr, dv, dc, page = 3, 32, 16, 24, 48, 4
    weights: MLAWeights = random_weights(
        hidden=40, num_heads=heads, kv_lora_rank=dc, qk_rope_head_dim=dr, qk_nope_head_dim=dn,
        v_head_dim=dv, q_lora_rank=None, generator=g,
    )  # fmt: skip
    prefix, new = 9, 7
    hidden = torch.randn(prefix + new, 40, generator=g, dtype=torch.float64)
    q_nope, q_pe, c_kv, k_pe = project(weights, hidden, torch.arange(prefix + new))
    want, want_lse = mla_decompressed(weights, q_nope[prefix:], q_pe[prefix:], c_kv, k_pe, 0.3)
    cache = torch.zeros(4, page, 1, dc + dr, dtype=torch.float64)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    for pos in range(prefix):
        cache[table[0, pos // page], pos % page, 0] = torch.cat([c_kv[pos], k_pe[pos]])
    k_nope = torch.einsum("sc,hnc->shn", c_kv[prefix:], weights.w_uk)
    v = torch.einsum("sc,hvc->shv", c_kv[prefix:], weights.w_uv)
    q = torch.cat([q_nope[prefix:], q_pe[prefix:]], dim=-1)
    got, got_lse = chunked_prefill(
        q, k_nope, k_pe[prefix:], v, [0, new], cache, table, [prefix], weights.w_uk, weights.w_uv, 0.3
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)
    # and prefill_varlen is the same layer with an empty prefix
    got, got_lse = prefill_varlen(q, k_nope, k_pe[prefix:], v, [0, new], 0.3)
    want, want_lse = attention(
        q, torch.cat([k_nope, k_pe[prefix:, None].expand(-1, heads, -1)], -1), v, 0.3, causal_mask(new, new)
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)


def args_module(build_module):
    return module_for(build_module, (4, 32, 16, 48, 64), "bfloat16", page_size=4)


def prefill_args(module, device):
    q, k_nope, k_pe, v = random_mha(module, 9, torch.Generator().manual_seed(0), device)
    return dict(q=q, k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens=cu_seqlens([4, 5], device), max_seqlen=5)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
        (lambda a: a.update(q=a["q"][..., :-1]), "q: expected last dimension"),
        (lambda a: a.update(q=a["q"][:, :3]), "q: expected 4 heads"),
        (lambda a: a.update(k_pe=a["k_pe"][:, None]), "k_pe: expected 2 dimensions"),
        (lambda a: a.update(k_nope=a["k_nope"][:-1]), "k_nope: expected shape"),
        (lambda a: a.update(v=a["v"][..., :16]), "v: expected shape"),
        (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens: expected dtype"),
        (lambda a: a.update(max_seqlen=-1), "max_seqlen: must be an int"),
    ],
)
def test_prefill_bad_arguments_name_the_argument(build_module, device, mutate, match):
    module = args_module(build_module)
    args = prefill_args(module, device)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        module.mla_prefill(**args)


def test_default_call_and_softmax_scale(build_module, device):
    module = args_module(build_module)
    args = prefill_args(module, device)
    out = module.mla_prefill(**args)
    assert out.shape == (9, 4, 48) and out.dtype == torch.bfloat16
    for scale in (None, 0.05):
        got = module.mla_prefill(**args, softmax_scale=scale)
        want, _ = prefill_varlen(
            *(args[k].double() for k in ("q", "k_nope", "k_pe", "v")),
            args["cu_seqlens"],
            module.SOFTMAX_SCALE if scale is None else scale,
        )
        assert not compare(got, want, "bfloat16")[2]
