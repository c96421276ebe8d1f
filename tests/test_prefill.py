"""Property tests: generated mla_prefill, merge_attn_states and mla_chunked_prefill == the reference.

Runs in Triton's interpreter without a GPU and unchanged on one. Outputs are poisoned (NaN) before each
call and workspaces are NaN-filled (MLAGEN_POISON_WORKSPACE, conftest), so unwritten elements fail.
Lengths are drawn around the tile sizes the module uses on this device (block boundaries +-1), by the
strategies of mlagen_compiler.testing (which the pytest plugin runs on users' modules); these tests draw
the modules' geometries.
"""

import contextlib

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from mlagen_compiler.options import use_options
from mlagen_compiler.plan import lower_gluon_prefill
from mlagen_compiler.reference import (
    MLAWeights,
    attention,
    causal_mask,
    chunked_prefill,
    mla_decompressed,
    prefill_varlen,
    project,
    random_weights,
)
from mlagen_compiler.testing import (
    assert_chunked_prefill_matches_reference,
    assert_merge_matches_reference,
    assert_prefill_matches_reference,
    chunked_prefill_inputs,
    merge_inputs,
    prefill_inputs,
)
from mlagen_compiler.verify import compare, cu_seqlens, random_mha

GEOMETRIES = [  # (H, Dn, Dr, Dv, Dc): DeepSeek, Mistral-Small-4, MiniCPM3-like, odd widths (padded)
    (2, 128, 64, 128, 512),
    (3, 64, 64, 128, 256),
    (4, 64, 32, 64, 256),
    (1, 48, 16, 80, 64),
    (5, 16, 16, 16, 64),
]
DTYPES = ["bfloat16", "float16"]
#: the prefill backends: the portable kernel everywhere, the Gluon kernel on Hopper (skipped elsewhere with why),
#: "gluon-pingpong": the Gluon kernel with its warpgroups' MMAs in turns (MLAGEN_PREFILL_GLUON_PINGPONG=1)
BACKENDS = ["triton", "gluon", "gluon-pingpong"]
#: the geometries the Gluon prefill takes (the others always run the portable kernel)
GLUON_GEOMETRIES = [g for g in GEOMETRIES if lower_gluon_prefill(g[1], g[2], g[3]).eligible]


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


def backend_options(backend):
    """(the mla_prefill backend a BACKENDS entry names, the options it runs under)."""
    if backend == "gluon-pingpong":
        return "gluon", use_options(prefill_gluon_pingpong="1")
    return backend, contextlib.nullcontext()


def require_backend(build_module, device, backend):
    """Skip a Gluon case where the Gluon prefill cannot run (interpreter, not a 9.x GPU, Triton release), with why."""
    if not backend.startswith("gluon"):
        return
    module = module_for(build_module, GLUON_GEOMETRIES[0], "bfloat16")
    try:
        module.prefill_backend(device, "gluon")
    except ValueError as error:
        pytest.skip(f"Gluon prefill cannot run here: {error}")


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_prefill_matches_reference(build_module, device, backend, data):
    require_backend(build_module, device, backend)
    backend, chosen = backend_options(backend)
    geometries = GLUON_GEOMETRIES if backend == "gluon" else GEOMETRIES
    geometry = data.draw(st.sampled_from(geometries), label="geometry")
    module = module_for(build_module, geometry, data.draw(st.sampled_from(DTYPES), label="dtype"))
    # (the Gluon kernel's tiles are 128 rows and up to 128 keys: lengths past two of them)
    longer = {"max_length": 300} if backend == "gluon" else {}
    problem = data.draw(prefill_inputs(module, device=device, **longer), label="problem")
    note(problem.describe(module))
    with chosen:
        assert_prefill_matches_reference(module, problem, device=device, backend=backend)


@given(data=st.data())
def test_gluon_prefill_in_turns_equals_it_running_free(build_module, device, data):
    """The Gluon prefill with its warpgroups' MMAs in turns (pingpong=True) writes bit for bit what it writes
    without (the turns only order MMA issues), on every (block_n, stages) of DeepSeek's space: 64-key blocks too,
    where a causal program's warpgroups have different block counts and run free, and a non-causal one's take
    turns over ragged prefixes. The free-running kernel is checked against the reference by the tests above. (One
    geometry and dtype: each tile, launch kind and PINGPONG is a compile of its own.)"""
    require_backend(build_module, device, "gluon")
    heads, dn, dr, dv, dc = GLUON_GEOMETRIES[0]
    module = module_for(build_module, (heads, dn, dr, dv, dc), "bfloat16")
    config = data.draw(st.sampled_from(module.PREFILL_GLUON_SPACE), label="config")
    causal = data.draw(st.booleans(), label="causal")
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=3), label="lengths")
    keys = lengths if causal else data.draw(st.lists(st.integers(0, 400), min_size=len(lengths),
                                                     max_size=len(lengths)), label="key_lengths")  # fmt: skip
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(module.DTYPE).to(device)

    tokens, key_tokens = sum(lengths), sum(keys)
    q = randn(tokens, heads, dn + dr)
    k_nope, k_pe, v = randn(key_tokens, heads, dn), randn(key_tokens, dr), randn(key_tokens, heads, dv)
    cu_q = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    cu_k = torch.tensor([0, *keys], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    results = []
    for pingpong in (False, True):
        out = torch.full((tokens, heads, dv), float("nan"), dtype=module.DTYPE, device=device)
        lse = torch.full((heads, tokens), float("nan"), device=device)
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu_q, cu_k, max(lengths), out, lse, module.SOFTMAX_SCALE,
                                     causal, config=config, pingpong=pingpong)  # fmt: skip
        results.append((out, lse))
    (free, free_lse), (turns, turns_lse) = results
    note(f"lengths={lengths} keys={keys} causal={causal} config={config}")
    assert not free.isnan().any() and torch.equal(free, turns)
    assert torch.equal(free_lse.isnan(), turns_lse.isnan()) and torch.equal(
        free_lse.nan_to_num(), turns_lse.nan_to_num()
    )


@given(data=st.data())
def test_merge_attn_states_equals_attention_over_the_union(build_module, device, data):
    """Attention over keys A and over keys B, merged, == attention over A + B (either part may be empty)."""
    geometry = data.draw(st.sampled_from(GEOMETRIES), label="geometry")
    module = module_for(build_module, geometry, data.draw(st.sampled_from(DTYPES), label="dtype"))
    problem = data.draw(merge_inputs(module), label="problem")
    note(problem.describe(module))
    assert_merge_matches_reference(module, problem, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_chunked_prefill_equals_full_attention(build_module, device, backend, data):
    require_backend(build_module, device, backend)
    backend, chosen = backend_options(backend)
    geometry = data.draw(st.sampled_from(GLUON_GEOMETRIES if backend == "gluon" else GEOMETRIES), label="geometry")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    page_size = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    # the prefix in a 16-bit or an fp8 cache (dequantised before it is expanded)
    cache_dtype = data.draw(st.sampled_from([None, "float8_e4m3fn"]), label="cache_dtype")
    module = module_for(build_module, geometry, dtype, page_size, cache_dtype)
    longer = {"max_length": 300, "max_prefix": 400} if backend == "gluon" else {}
    problem = data.draw(chunked_prefill_inputs(module, device=device, **longer), label="problem")
    note(problem.describe(module))
    with chosen:
        assert_chunked_prefill_matches_reference(module, problem, device=device, backend=backend)


@given(data=st.data())
def test_expanded_prefix_rows_are_the_cached_rows(build_module, device, data):
    """expand_latent_prefix's gather: packed row t is its sequence's cached row (dequantised once for an fp8 cache),
    bit for bit, for prefixes of any length (empty ones too) in shuffled pages; every cache row no prefix holds,
    and the page the block table's unused entries name, is NaN, so a row read from the wrong place shows."""
    heads, dn, dr, dv, dc = data.draw(st.sampled_from(GEOMETRIES), label="geometry")
    page_size = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    cache_dtype = data.draw(st.sampled_from([None, "float8_e4m3fn"]), label="cache_dtype")
    module = module_for(build_module, (heads, dn, dr, dv, dc), "bfloat16", page_size, cache_dtype)
    lengths = data.draw(st.lists(st.integers(0, 3 * page_size + 1), min_size=1, max_size=5), label="prefix_lens")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    pages = [-(-length // page_size) for length in lengths]
    poisoned_page = sum(pages)  # (the last page: named by every unused block-table entry)
    order = torch.randperm(sum(pages), generator=g)
    table = torch.full((len(lengths), max(1, *pages)), poisoned_page, dtype=torch.int32)
    for b, start in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        table[b, : pages[b]] = order[start : start + pages[b]]
    cache = torch.full((sum(pages) + 1, page_size, 1, dc + dr), float("nan"))
    want = []
    for b, length in enumerate(lengths):
        for pos in range(length):
            cache[table[b, pos // page_size], pos % page_size, 0] = torch.randn(dc + dr, generator=g)
            want.append((table[b, pos // page_size].item(), pos % page_size))
    cu_prefix = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    w_uk = torch.randn(heads, dn, dc, generator=g).to(torch.bfloat16)
    w_uv = torch.randn(heads, dv, dc, generator=g).to(torch.bfloat16)
    if cache_dtype:
        stored = cache.to(torch.float8_e4m3fn).to(device)
        # (a scale of many mantissa bits, so the dequantised rows need rounding to bfloat16)
        kv_scale = torch.tensor([data.draw(st.floats(1e-3, 4.0), label="kv_scale")], device=device)
        rows = (stored.float() * kv_scale).to(torch.bfloat16)
    else:
        stored = cache.to(torch.bfloat16).to(device)
        kv_scale, rows = None, stored
    table, cu_prefix, w_uk, w_uv = (t.to(device) for t in (table, cu_prefix, w_uk, w_uv))
    total = sum(lengths)
    k_nope, k_pe, v = module.expand_latent_prefix(stored, table, cu_prefix, total, w_uk, w_uv, kv_scale)
    packed = torch.stack([rows[page, slot, 0] for page, slot in want]) if want else rows.new_empty(0, dc + dr)
    assert not packed.isnan().any()
    torch.testing.assert_close(k_pe, packed[:, dc:], rtol=0, atol=0)
    c_kv = packed[:, :dc]
    torch.testing.assert_close(k_nope, (c_kv @ w_uk.reshape(-1, dc).t()).view(total, heads, dn), rtol=0, atol=0)
    torch.testing.assert_close(v, (c_kv @ w_uv.reshape(-1, dc).t()).view(total, heads, dv), rtol=0, atol=0)


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
