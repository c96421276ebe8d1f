"""The reference's two forms of MLA agree; paged decode agrees with the absorbed form."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from mlagen_compiler import reference as ref
from mlagen_compiler.verify import paged_block_table


def _weights(g, hidden, heads, dims, q_lora=None):
    """ref.random_weights in float64 for dims = (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)."""
    dc, dr, dn, dv = dims
    return ref.random_weights(
        hidden=hidden,
        num_heads=heads,
        kv_lora_rank=dc,
        qk_rope_head_dim=dr,
        qk_nope_head_dim=dn,
        v_head_dim=dv,
        q_lora_rank=q_lora,
        generator=g,
    )


@given(
    seed=st.integers(0, 2**32 - 1),
    heads=st.sampled_from([1, 3, 16]),
    dims=st.sampled_from([(64, 16, 32, 32), (128, 32, 64, 48), (96, 16, 16, 64)]),
    q_lora=st.sampled_from([None, 24]),
    tokens=st.integers(1, 9),
)
def test_decompressed_equals_absorbed(seed, heads, dims, q_lora, tokens):
    dc, dr, dn, dv = dims
    g = torch.Generator().manual_seed(seed)
    w = _weights(g, 40, heads, dims, q_lora=q_lora)
    hidden = torch.randn(tokens, 40, generator=g, dtype=torch.float64)
    positions = torch.arange(tokens) + int(torch.randint(0, 100, (1,), generator=g))
    parts = ref.project(w, hidden, positions)
    scale = (dn + dr) ** -0.5
    out_mha, lse_mha = ref.mla_decompressed(w, *parts, scale)
    out_mqa, lse_mqa = ref.mla_absorbed(w, *parts, scale)
    assert out_mha.shape == (tokens, heads, dv) and lse_mha.shape == (heads, tokens)
    torch.testing.assert_close(out_mqa, out_mha, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(lse_mqa, lse_mha, atol=1e-10, rtol=1e-9)


def test_causality_and_rope_are_real():
    """A sanity check that the reference is not trivially symmetric: later tokens change earlier rows
    only if causality is broken, and rope makes scores depend on position."""
    g = torch.Generator().manual_seed(1)
    w = _weights(g, 32, 2, (64, 16, 16, 16))
    hidden = torch.randn(6, 32, generator=g, dtype=torch.float64)
    out, _ = ref.mla_absorbed(w, *ref.project(w, hidden, torch.arange(6)), 0.25)
    out4, _ = ref.mla_absorbed(w, *ref.project(w, hidden[:4], torch.arange(4)), 0.25)
    torch.testing.assert_close(out[:4], out4)
    shifted, _ = ref.mla_absorbed(w, *ref.project(w, hidden, torch.arange(6) * 7), 0.25)
    assert not torch.allclose(shifted, out)


@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 4, 16]), seqlen_q=st.integers(1, 3))
def test_paged_decode_equals_absorbed_attention(seed, page_size, seqlen_q):
    """decode_paged over a shuffled page table == mla_absorbed's latent attention on the same rows."""
    g = torch.Generator().manual_seed(seed)
    heads, dc, dr, dn, dv = 4, 64, 16, 32, 32
    w = _weights(g, 24, heads, (dc, dr, dn, dv))
    seqlen = int(torch.randint(seqlen_q, 40, (1,), generator=g))
    hidden = torch.randn(seqlen, 24, generator=g, dtype=torch.float64)
    q_nope, q_pe, c_kv, k_pe = ref.project(w, hidden, torch.arange(seqlen))
    scale = (dn + dr) ** -0.5
    want, want_lse = ref.mla_absorbed(w, q_nope[-seqlen_q:], q_pe[-seqlen_q:], c_kv, k_pe, scale)
    # the absorbed form's queries must see the whole prefix: attention over all rows, causal at the end
    table, n_pages = paged_block_table([seqlen], page_size, g, spare_pages=2)
    cache = torch.randn(n_pages, page_size, 1, dc + dr, generator=g, dtype=torch.float64)
    rows = torch.cat([c_kv, k_pe], dim=-1)
    for t in range(seqlen):
        cache[table[0, t // page_size], t % page_size, 0] = rows[t]
    q_abs = ref.absorb_query(w, q_nope[-seqlen_q:], q_pe[-seqlen_q:])[None]
    o_lat, lse = ref.decode_paged(q_abs, cache, table, torch.tensor([seqlen], dtype=torch.int32), dc, scale)
    got = torch.einsum("thc,hvc->thv", o_lat[0], w.w_uv)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse[0], want_lse)


@given(seed=st.integers(0, 2**32 - 1), seqlen_q=st.integers(1, 3), page_size=st.sampled_from([1, 4, 8]))
def test_batched_decode_equals_looped(seed, seqlen_q, page_size):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 30, (4,), generator=g, dtype=torch.int32)
    table, n_pages = paged_block_table([30] * 4, page_size, g, spare_pages=1)  # room for max_seqlen=30
    cache = torch.randn(n_pages, page_size, 1, 80, generator=g, dtype=torch.float64)
    q = torch.randn(4, seqlen_q, 3, 80, generator=g, dtype=torch.float64)
    want = ref.decode_paged(q, cache, table, lens, 64, 0.3)
    got = ref.decode_paged_batched(q, cache, table, lens, 64, 0.3, max_seqlen=30)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
