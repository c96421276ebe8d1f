"""Property tests: generated mla_cache_write == reference.cache_write, bit for bit.

New tokens' [c_kv ; k_pe] rows land in the paged cache at their slot (pages in any order); negative
slots (padding) are skipped and every row nobody wrote keeps its old value. An fp8 cache stores
fp8(row / kv_scale): the bits must be torch's own conversion of the float32 quotient, saturated at +-448.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from mlagen_compiler.reference import FP8_E4M3_MAX, cache_write
from mlagen_compiler.testing import assert_cache_write_matches_reference, cache_write_inputs
from mlagen_compiler.verify import same_bits

GEOMETRIES = [(512, 64), (256, 64), (256, 32), (64, 16), (96, 48)]  # (Dc, Dr)


@given(
    geometry=st.sampled_from(GEOMETRIES),
    page_size=st.sampled_from([1, 2, 16, 64]),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    cache_dtype=st.sampled_from([None, "float8_e4m3fn"]),
    # every module emits the cache write, whichever kernels the spec asks for
    kernels=st.sampled_from([["decode"], ["prefill"], ["decode", "prefill"]]),
    data=st.data(),
)
def test_cache_write_matches_reference(build_module, device, geometry, page_size, dtype, cache_dtype, kernels, data):
    """Tokens (some padding) into shuffled pages; an fp8 cache's scale the calibrated one times a factor
    (below 1 the largest values saturate), as a number, a 0-d or a one-element tensor."""
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
        cache_dtype=cache_dtype,
        kernels=kernels,
    )
    problem = data.draw(cache_write_inputs(module), label="problem")
    note(problem.describe(module))
    assert_cache_write_matches_reference(module, problem, device=device)


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


def e4m3_test_values() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours (a tie: rounds to the even one) and the bf16
    values just above and below each midpoint, values past the largest (saturated: 464 is the midpoint to
    the first value past it, 480), +-inf, subnormals and signed zeros; all exact in bf16."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()]
    positive = finite[finite >= 0].unique()  # sorted
    mids = ((positive[1:] + positive[:-1]) / 2).to(torch.bfloat16)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    past = torch.tensor([449.0, 463.0, 464.0, 465.0, 480.0, 1e4, 3e38, float("inf")], dtype=torch.bfloat16)
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12, 2.0**-20, 0.0], dtype=torch.bfloat16)
    half = torch.cat([positive.to(torch.bfloat16), mids, below, above, past, tiny])
    return torch.cat([half, -half])


@pytest.mark.parametrize("kv_scale", [1.0, 0.3712])
def test_fp8_cache_write_rounds_like_torch(build_module, device, kv_scale):
    """mla_cache_write's bits == torch's (row.float() / kv_scale).clamp(-448, 448).to(float8_e4m3fn) on every
    rounding case of the format (kv_scale 1: the values themselves; 0.3712: the float32 quotients near them),
    and finite rows never become NaN."""
    module = build_module(
        name="cache-write-fp8", num_heads=1, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=4, dtype="bfloat16", cache_dtype="float8_e4m3fn", kernels=["decode"],
    )  # fmt: skip
    values = e4m3_test_values() * torch.tensor(kv_scale, dtype=torch.bfloat16)
    rows = torch.cat([values, values[: -len(values) % 80]]).view(-1, 80)  # [T, Dc + Dr]
    num_tokens = rows.shape[0]
    num_pages = -(-num_tokens // 4) + 1
    cache = torch.zeros(num_pages, 4, 1, 80, dtype=torch.float8_e4m3fn)
    slots = torch.randperm(num_pages * 4, generator=torch.Generator().manual_seed(5))[:num_tokens]
    want = cache_write(cache, rows[:, :64], rows[:, 64:], slots, kv_scale)
    expected = (rows.float() / kv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    assert same_bits(want[slots // 4, slots % 4, 0], expected)  # the reference is torch's conversion
    got = cache.to(device)
    module.mla_cache_write(rows[:, :64].to(device), rows[:, 64:].to(device), got, slots.to(device), kv_scale=kv_scale)
    assert same_bits(got, want)
    finite = rows.isfinite()
    assert not got.cpu()[slots // 4, slots % 4, 0].float()[finite].isnan().any()
