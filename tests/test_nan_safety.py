"""Never a NaN where the reference is finite: uninitialised (NaN) cache rows past each sequence's end and
unused pages full of NaN, queries of magnitude 1e4, rows whose every position is masked. Kernels must not
let what they are not meant to read reach the output (0 * NaN is NaN in a P.V product)."""

import pytest
import torch

from mlagen_compiler.options import use_options
from mlagen_compiler.verify import compare, compare_with_lse, decode_reference, make_decode_inputs, poison_unused_cache


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize(
    ("seqlens", "seqlen_q", "q_scale"),
    [
        ((5, 17, 0, 33), 1, 1.0),
        ((3, 18, 1), 3, 1.0),  # Sq 3 over a 1-token sequence: two rows see no position at all
        ((9, 40), 2, 1e4),  # |q| of 1e4: the softmax is one-hot
    ],
)
def test_decode_ignores_what_it_must_not_read(build_module, device, page_size, dtype, tma, seqlens, seqlen_q, q_scale):
    module = build_module(
        name="nan-safety", num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=page_size, dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    inputs = make_decode_inputs(module, list(seqlens), seqlen_q, g, device)
    inputs["q"] = (inputs["q"].float() * q_scale).to(module.DTYPE)
    poison_unused_cache(inputs)
    schedule = module.get_decode_schedule(len(seqlens), seqlen_q, device, num_parts=5, min_blocks_per_part=1)
    with use_options(decode_tma=tma):
        got, lse = module.mla_decode(**inputs, return_lse=True, schedule=schedule)
    want, want_lse = decode_reference(module, inputs)
    assert want.isfinite().all()
    assert not got.isnan().any(), "a NaN from an unread cache row reached the output"
    _, _, message = compare_with_lse(got, lse, want, want_lse, dtype)
    assert not message, message


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_ignores_unread_cache_rows(build_module, device, page_size):
    from mlagen_compiler.reference import chunked_prefill

    module = build_module(
        name="nan-safety-prefill", num_heads=2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=page_size, dtype="bfloat16", kernels=["prefill"],
    )  # fmt: skip
    g = torch.Generator().manual_seed(12)
    lengths, prefix = [4, 9], [5, 0]
    total = sum(lengths)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(module.DTYPE).to(device)

    q, k_nope, k_pe, v = rnd(total, 2, 32, scale=1e4), rnd(total, 2, 16), rnd(total, 16), rnd(total, 2, 16)
    cu = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    pages = -(-max(prefix) // page_size)
    table = torch.tensor([[1 + p for p in range(pages)], [0] * pages], dtype=torch.int32, device=device)
    cache = rnd(1 + pages + 2, page_size, 1, 80)
    cache[0] = float("nan")  # a page no prefix reads
    cache[1 + prefix[0] // page_size :, prefix[0] % page_size :] = float("nan")  # past the prefix
    w_uk, w_uv = rnd(2, 16, 64, scale=0.125), rnd(2, 16, 64, scale=0.125)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=device)
    got = module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 9, cache, table, prefix_lens, w_uk, w_uv)
    want, _ = chunked_prefill(
        q.double(), k_nope.double(), k_pe.double(), v.double(), [0, 4, 13], cache.double(), table, prefix,
        w_uk.double(), w_uv.double(), module.SOFTMAX_SCALE, expanded_dtype=module.DTYPE,
    )  # fmt: skip
    assert want.isfinite().all() and not got.isnan().any()
    assert not compare(got, want, "bfloat16")[2]
