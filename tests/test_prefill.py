"""Property tests: generated mla_prefill, merge_attn_states and mla_chunked_prefill == the reference.

Runs in Triton's interpreter without a GPU and unchanged on one. Outputs are poisoned (NaN) before each
call and workspaces are NaN-filled (MLAGEN_POISON_WORKSPACE, conftest), so unwritten elements fail.
Lengths are drawn around the tile sizes the module uses on this device (block boundaries +-1), by the
strategies of mlagen_compiler.testing (which the pytest plugin runs on users' modules); these tests draw
the modules' geometries.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

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
from mlagen_compiler.verify import compare, compare_with_lse, cu_seqlens, random_mha

GEOMETRIES = [  # (H, Dn, Dr, Dv, Dc): DeepSeek, Mistral-Small-4, MiniCPM3-like, odd widths (padded)
    (2, 128, 64, 128, 512),
    (3, 64, 64, 128, 256),
    (4, 64, 32, 64, 256),
    (1, 48, 16, 80, 64),
    (5, 16, 16, 16, 64),
]
DTYPES = ["bfloat16", "float16"]
#: the prefill backends: the portable kernel everywhere, the Gluon kernel on Hopper (skipped elsewhere with why),
#: tile per program or persistent (the prefill_persistent option: testing.PREFILL_CHECK_BACKENDS)
BACKENDS = ["triton", "gluon", "gluon-persistent"]
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
    geometries = GLUON_GEOMETRIES if backend != "triton" else GEOMETRIES
    geometry = data.draw(st.sampled_from(geometries), label="geometry")
    module = module_for(build_module, geometry, data.draw(st.sampled_from(DTYPES), label="dtype"))
    # (the Gluon kernel's tiles are 128 rows and up to 128 keys: lengths past two of them)
    longer = {"max_length": 300} if backend != "triton" else {}
    problem = data.draw(prefill_inputs(module, device=device, **longer), label="problem")
    note(problem.describe(module))
    assert_prefill_matches_reference(module, problem, device=device, backend=backend)


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
    geometry = data.draw(st.sampled_from(GLUON_GEOMETRIES if backend != "triton" else GEOMETRIES), label="geometry")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    page_size = data.draw(st.sampled_from([1, 4, 16]), label="page_size")
    # the prefix in a 16-bit or an fp8 cache (dequantised before it is expanded)
    cache_dtype = data.draw(st.sampled_from([None, "float8_e4m3fn"]), label="cache_dtype")
    module = module_for(build_module, geometry, dtype, page_size, cache_dtype)
    longer = {"max_length": 300, "max_prefix": 400} if backend != "triton" else {}
    problem = data.draw(chunked_prefill_inputs(module, device=device, **longer), label="problem")
    note(problem.describe(module))
    assert_chunked_prefill_matches_reference(module, problem, device=device, backend=backend)


#: the chunked persistent kernel's GPU cases (a fixed few: each variant compiles once): (query lengths, key lengths:
#: None for causal, else the prefix's), with row blocks past a sequence's end, a one-token sequence, a sequence
#: without queries and one with an empty prefix
CHUNK_CASES = {
    "causal": ((300, 129, 1, 520, 128), None),
    "prefix": ((200, 0, 77, 129, 257), (333, 64, 0, 700, 1)),
}


@pytest.mark.parametrize("chunk", [0, 1, 2, 3])
@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunked_persistent_gluon_prefill_is_the_tile_per_program_kernel(build_module, device, case, chunk):
    """The persistent Gluon prefill with contiguous chunks (chunk > 0: a program per `chunk` consecutive tiles, the
    ring's phases and the query tile's q_ready / q_free carried from tile to tile within a chunk, tiles past a
    sequence's end skipped inside one) writes what the tile-per-program kernel writes, bit for bit, outputs and
    LSEs, and both match the float64 reference within the bfloat16 tolerances; chunk 0 is the stride, here on 3
    programs. Causal, and the non-causal prefix attention of chunked prefill (float32 outputs); outputs poisoned
    (NaN) first. A fixed parametrisation: one module, two compiles of each kernel."""
    require_backend(build_module, device, "gluon")
    module = module_for(build_module, GLUON_GEOMETRIES[0], "bfloat16")
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    lengths, prefix = CHUNK_CASES[case]
    causal = prefix is None
    key_lengths = lengths if causal else prefix
    g = torch.Generator().manual_seed(1000 * chunk + list(CHUNK_CASES).index(case))

    def drawn(*shape):
        return torch.randn(*shape, generator=g).to(module.DTYPE).to(device)

    tokens, keys = sum(lengths), sum(key_lengths)
    q, k_nope, k_pe, v = drawn(tokens, heads, dn + dr), drawn(keys, heads, dn), drawn(keys, dr), drawn(keys, heads, dv)

    def cumulative(counts):
        return torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    cu_q, cu_k = cumulative(lengths), cumulative(key_lengths)
    out_dtype = module.DTYPE if causal else torch.float32
    results = []
    for persistent in (False, True):
        out = torch.full((tokens, heads, dv), float("nan"), dtype=out_dtype, device=device)
        lse = torch.full((heads, tokens), float("nan"), device=device)
        schedule = dict(chunk=chunk, programs=None if chunk else 3) if persistent else dict(chunk=0)
        module._launch_prefill_gluon(
            q, k_nope, k_pe, v, cu_q, cu_k, max(lengths), out, lse, module.SOFTMAX_SCALE, causal,
            config=module.PREFILL_GLUON_DEFAULT, persistent=persistent, **schedule,
        )  # fmt: skip
        results.append((out, lse))
    (want, want_lse), (got, got_lse) = results
    assert not want.isnan().any() and not want_lse.isnan().any()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    # the reference: each sequence's queries against its keys (causal: the same tokens), in float64 on the CPU
    ref = torch.zeros(tokens, heads, dv, dtype=torch.float64)
    ref_lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float64)
    q64, k64 = q.double().cpu(), torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1).double().cpu()
    v64 = v.double().cpu()
    for seq, (rows, cols) in enumerate(zip(lengths, key_lengths, strict=True)):
        q0, k0 = int(cu_q[seq]), int(cu_k[seq])
        if rows == 0:
            continue
        visible = causal_mask(rows, cols) if causal else torch.ones(rows, cols, dtype=torch.bool)
        ref[q0 : q0 + rows], ref_lse[:, q0 : q0 + rows] = attention(
            q64[q0 : q0 + rows], k64[k0 : k0 + cols], v64[k0 : k0 + cols], module.SOFTMAX_SCALE, visible
        )
    assert not compare_with_lse(got, got_lse, ref, ref_lse, "bfloat16")[2]


@given(data=st.data())
def test_persistent_gluon_prefill_on_few_programs_is_the_tile_per_program_kernel(build_module, device, data):
    """The persistent Gluon prefill with 1-3 programs (each loops over many tiles: the ring's mbarrier phases and
    the query tile's q_ready / q_free carried from tile to tile, tiles of other sequences and heads, rows past a
    sequence's end, empty prefixes) writes what the tile-per-program kernel writes, bit for bit (the same products
    and softmax in the same order), causal and the non-causal prefix attention of chunked prefill; outputs
    poisoned (NaN) first."""
    require_backend(build_module, device, "gluon")
    geometry = data.draw(st.sampled_from(GLUON_GEOMETRIES), label="geometry")
    module = module_for(build_module, geometry, data.draw(st.sampled_from(DTYPES), label="dtype"))
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    causal = data.draw(st.booleans(), label="causal")
    lengths = data.draw(st.lists(st.integers(0, 400), min_size=1, max_size=4), label="lengths")
    if causal:
        key_lengths = lengths
    else:
        key_lengths = data.draw(
            st.lists(st.integers(0, 500), min_size=len(lengths), max_size=len(lengths)), label="key_lengths"
        )
    programs = data.draw(st.integers(1, 3), label="programs")
    config = data.draw(st.sampled_from(module.PREFILL_GLUON_SPACE), label="config")
    store_lse = data.draw(st.booleans(), label="store_lse")
    out_dtype = data.draw(st.sampled_from([module.DTYPE, torch.float32]), label="out dtype")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    tokens, keys = sum(lengths), sum(key_lengths)
    if max(lengths) == 0 or keys == 0:
        return  # (no launch, or the portable kernel's zeros: nothing of the Gluon kernels runs)

    def drawn(*shape):
        return torch.randn(*shape, generator=g).to(module.DTYPE).to(device)

    q, k_nope, k_pe, v = drawn(tokens, heads, dn + dr), drawn(keys, heads, dn), drawn(keys, dr), drawn(keys, heads, dv)

    def cumulative(counts):
        return torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    cu_q, cu_k = cumulative(lengths), cumulative(key_lengths)
    results = []
    for persistent in (False, True):
        out = torch.full((tokens, heads, dv), float("nan"), dtype=out_dtype, device=device)
        lse = torch.full((heads, tokens), float("nan"), device=device) if store_lse else None
        module._launch_prefill_gluon(
            q, k_nope, k_pe, v, cu_q, cu_k, max(lengths), out, lse, module.SOFTMAX_SCALE, causal, config=config,
            persistent=persistent, programs=programs if persistent else None,
        )  # fmt: skip
        results.append((out, lse))
    (want, want_lse), (got, got_lse) = results
    assert not want.isnan().any()
    assert torch.equal(got, want)
    if store_lse:
        assert torch.equal(got_lse, want_lse)


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
