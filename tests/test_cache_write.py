"""Property tests: generated mla_cache_write == reference.cache_write, bit for bit.

New tokens' [c_kv ; k_pe] rows land in the paged cache at their slot (pages in any order); negative
slots (padding) are skipped and every row nobody wrote keeps its old value.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from mlagen_compiler.reference import cache_write

GEOMETRIES = [(512, 64), (256, 64), (256, 32), (64, 16), (96, 48)]  # (Dc, Dr)


@given(
    geometry=st.sampled_from(GEOMETRIES),
    page_size=st.sampled_from([1, 2, 16, 64]),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    num_tokens=st.one_of(st.integers(0, 40), st.sampled_from([15, 16, 17, 33])),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    padding=st.floats(0.0, 0.5),
    # every module emits the cache write, whichever kernels the spec asks for
    kernels=st.sampled_from([["decode"], ["prefill"], ["decode", "prefill"]]),
    seed=st.integers(0, 2**32 - 1),
)
def test_cache_write_matches_reference(
    build_module, device, geometry, page_size, dtype, num_tokens, slot_dtype, padding, kernels, seed
):
    dc, dr = geometry
    module = build_module(
        name="cache-write",
        num_heads=2,
        kv_lora_rank=dc,
        qk_rope_head_dim=dr,
        qk_nope_head_dim=32,
        v_head_dim=32,
        page_size=page_size,
        dtype=dtype,
        kernels=kernels,
    )
    note(f"dc={dc} dr={dr} page_size={page_size} tokens={num_tokens} padding={padding} {kernels} seed={seed}")
    g = torch.Generator().manual_seed(seed)
    num_pages = -(-(num_tokens + 3) // page_size) + 2
    cache = torch.randn(num_pages, page_size, 1, dc + dr, generator=g).to(module.DTYPE)
    # distinct slots scattered over shuffled pages; some tokens are padding (slot -1)
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < padding] = -1
    c_kv = torch.randn(num_tokens, dc, generator=g).to(module.DTYPE)
    k_pe = torch.randn(num_tokens, dr, generator=g).to(module.DTYPE)
    want = cache_write(cache, c_kv, k_pe, slots)
    got = cache.to(device)
    returned = module.mla_cache_write(c_kv.to(device), k_pe.to(device), got, slots.to(slot_dtype).to(device))
    assert returned.data_ptr() == got.data_ptr()
    assert torch.equal(got.cpu(), want)


def test_cache_write_reads_strided_rows(build_module, device):
    """c_kv and k_pe may be column slices of one [T, Dc+Dr] projection output."""
    module = build_module(
        name="cache-write-strided", num_heads=1, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=4, dtype="bfloat16", kernels=["prefill"],
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 80, generator=g).to(torch.bfloat16)
    cache = torch.randn(3, 4, 1, 80, generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, 0, 11, -1, 3, 8])
    want = cache_write(cache, rows[:, :64], rows[:, 64:], slots)
    got = cache.to(device)
    module.mla_cache_write(rows[:, :64].to(device), rows.to(device)[:, 64:], got, slots.to(device))
    assert torch.equal(got.cpu(), want)


def test_cache_write_bad_arguments(build_module, device):
    module = build_module(
        name="cache-write-args", num_heads=1, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=4, dtype="bfloat16", kernels=["prefill"],
    )  # fmt: skip
    c_kv = torch.randn(3, 64).to(torch.bfloat16).to(device)
    k_pe = torch.randn(3, 16).to(torch.bfloat16).to(device)
    cache = torch.zeros(2, 4, 1, 80, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="slot_mapping: expected an int32 or int64"):
        module.mla_cache_write(c_kv, k_pe, cache, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="slot_mapping: expected 3 slots"):
        module.mla_cache_write(c_kv, k_pe, cache, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="kv_cache: expected \\[num_pages, 4"):
        module.mla_cache_write(c_kv, k_pe, cache[:, :2], torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="k_pe: expected last dimension"):
        module.mla_cache_write(c_kv, k_pe[:, :8], cache, torch.zeros(3, dtype=torch.int32, device=device))
