"""Bad index values and scales given to the generated wrappers: with validation on (the CPU default,
MLAGEN_VALIDATE=1 in the tests) each becomes a ValueError naming the argument, the position and the value,
never a foreign memory access, unwritten output or a silent wrong answer."""

import re

import pytest
import torch
from helpers import SMALL_SPEC

from mlagen_compiler import runtime
from mlagen_compiler.options import Options, use_options
from mlagen_compiler.reference import prefill_varlen
from mlagen_compiler.verify import compare_with_lse, paged_block_table

FIELDS = {
    **SMALL_SPEC, "name": "bad-values", "num_heads": 2, "qk_nope_head_dim": 16, "v_head_dim": 16, "page_size": 4,
    "kernels": ["decode", "prefill"],
}  # fmt: skip


DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # as in conftest


def on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.fixture
def module(build_module):
    return build_module(**FIELDS)


def mha(module, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    h, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(module.DTYPE)

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    return on_device(rnd(total, h, dn + dr), rnd(total, h, dn), rnd(total, dr), rnd(total, h, dv), cu)


@pytest.mark.parametrize(
    ("cu", "max_seqlen", "message"),
    [
        ([0, 3, 9], 6, "cu_seqlens: must end at the number of tokens (8), got cu_seqlens[-1] = 9"),
        ([0, 3, 7], 4, "cu_seqlens: must end at the number of tokens (8), got cu_seqlens[-1] = 7"),
        ([-2, 3, 8], 5, "cu_seqlens: must start at 0, got cu_seqlens[0] = -2"),
        ([1, 3, 8], 5, "cu_seqlens: must start at 0, got cu_seqlens[0] = 1"),
        ([0, 6, 5, 8], 6, "cu_seqlens: must not decrease, got cu_seqlens[1] = 6 > cu_seqlens[2] = 5"),
        ([0, 3, 8], 4, "max_seqlen: 4 is less than the longest sequence (5 tokens)"),
        ([0, 3, 8], 0, "max_seqlen: 0 is less than the longest sequence (5 tokens)"),
        ([0, 3, 8], True, "max_seqlen: must be an int >= 0, got True"),
        ([0, 3, 8], 5.0, "max_seqlen: must be an int >= 0, got 5.0"),
    ],
)
@pytest.mark.parametrize("kernel", ["prefill", "chunked"])
def test_prefill_token_bounds(module, cu, max_seqlen, message, kernel):
    q, k_nope, k_pe, v, _ = mha(module, [3, 5])
    cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        if kernel == "prefill":
            module.mla_prefill(q, k_nope, k_pe, v, cu, max_seqlen)
        else:
            cache, table, prefix, w_uk, w_uv = chunked_extras(module, len(cu) - 1)
            module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, max_seqlen, cache, table, prefix, w_uk, w_uv)


def chunked_extras(module, batch, prefix_len=5, num_pages=6):
    g = torch.Generator().manual_seed(1)
    h, dn, dv, dc, dr = (module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK,
                         module.QK_ROPE_HEAD_DIM)  # fmt: skip
    # two distinct pages per row whatever prefix_len (room for 8 tokens), the rest of the pool spare
    two_pages = [2 * module.PAGE_SIZE] * batch
    table, _ = paged_block_table(two_pages, module.PAGE_SIZE, g, spare_pages=num_pages - 2 * batch)
    cache = torch.randn(num_pages, module.PAGE_SIZE, 1, dc + dr, generator=g).to(module.DTYPE)
    prefix = torch.full((batch,), prefix_len, dtype=torch.int32)
    w_uk = (torch.randn(h, dn, dc, generator=g) / dc**0.5).to(module.DTYPE)
    w_uv = (torch.randn(h, dv, dc, generator=g) / dc**0.5).to(module.DTYPE)
    return on_device(cache, table, prefix, w_uk, w_uv)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t, p: t.__setitem__((1, 0), -1),
            "block_table[1, 0] = -1: a page used by its sequence must be in [0, 5]",
        ),
        (lambda t, p: t.__setitem__((0, 1), 6), "block_table[0, 1] = 6: a page used by its sequence must be in [0, 5]"),
        (
            lambda t, p: p.__setitem__(1, 9),
            "prefix_lens[1] = 9: a length (block_table rows hold 8 tokens) must be in [0, 8]",
        ),
        (
            lambda t, p: p.__setitem__(0, -1),
            "prefix_lens[0] = -1: a length (block_table rows hold 8 tokens) must be in [0, 8]",
        ),
    ],
)
def test_chunked_prefill_prefix_pages(module, mutate, message):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    cache, table, prefix, w_uk, w_uv = chunked_extras(module, 2)
    mutate(table, prefix)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, cache, table, prefix, w_uk, w_uv)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(cu_prefix=lambda cu: cu.long()), "cu_prefix: expected dtype torch.int32, got torch.int64"),
        (dict(table=lambda t: torch.cat([t, t[:1]])), "block_table: batch size 3 disagrees with 2"),
        (dict(total=lambda n: -1), "num_prefix_tokens: must be an int >= 0, got -1"),
        (dict(total=lambda n: n - 1), "cu_prefix: must end at num_prefix_tokens (9), got cu_prefix[-1] = 10"),
        (
            dict(cu_prefix=lambda cu: _int32([0, 6, 5]), total=lambda n: 5),
            "cu_prefix: must not decrease, got cu_prefix[1] = 6 > cu_prefix[2] = 5",
        ),
        (
            dict(cu_prefix=lambda cu: _int32([0, 9, 14]), total=lambda n: 14),
            "cu_prefix's lengths[0] = 9: a length (block_table rows hold 8 tokens) must be in [0, 8]",
        ),
        (
            dict(table=lambda t: t.index_fill(1, torch.tensor([1], device=t.device), 6)),
            "block_table[0, 1] = 6: a page used by its sequence must be in [0, 5]",
        ),
        (dict(w_uv=lambda w: w[:, :8]), "w_uv: expected shape [2, 16, 64], got (2, 8, 64)"),
        (dict(kv_scale=lambda s: 0.5), "kv_scale: this module's cache is torch.float16, not scaled"),
    ],
)
def test_expand_latent_prefix_refuses_bad_arguments_by_name(module, change, message):
    """The module's expand_latent_prefix reads the cache through a kernel: every argument is checked first (the
    values too when validating), so a wrong one is a one-line error, never a read outside the cache."""
    cache, table, prefix, w_uk, w_uv = chunked_extras(module, 2)
    arguments = dict(cache=cache, table=table, cu_prefix=_int32([0, 5, 10]), total=10, w_uk=w_uk, w_uv=w_uv)
    arguments["kv_scale"] = None
    arguments.update({name: mutate(arguments[name]) for name, mutate in change.items()})
    a = arguments
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        module.expand_latent_prefix(
            a["cache"], a["table"], a["cu_prefix"], a["total"], a["w_uk"], a["w_uv"], a["kv_scale"], validate=True
        )


def test_expand_latent_prefix_of_an_fp8_cache_needs_its_scale(build_module):
    """Without the scale the stored fp8 values would be expanded as they are: a wrong answer, so an error."""
    module = build_module(**{**FIELDS, "name": "bad-values-fp8", "cache_dtype": "float8_e4m3fn"})
    cache, table, prefix, w_uk, w_uv = chunked_extras(module, 2)
    stored = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^kv_scale: required: this module's cache is torch.float8_e4m3fn"):
        module.expand_latent_prefix(stored, table, _int32([0, 5, 10]), 10, w_uk, w_uv)


@pytest.mark.parametrize(
    ("total", "message"),
    [(9, "num_prefix_tokens: 9 is not the sum of prefix_lens (10)"), (-1, "num_prefix_tokens: must be an int >= 0")],
)
def test_chunked_prefill_prefix_total(module, total, message):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    cache, table, prefix, w_uk, w_uv = chunked_extras(module, 2)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, cache, table, prefix, w_uk, w_uv, num_prefix_tokens=total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device synchronisation is only observable on a GPU")
def test_chunked_prefill_with_a_host_total_never_synchronises(build_module):
    module = build_module(**FIELDS)
    q, k_nope, k_pe, v, cu = (t.cuda() for t in mha(module, [3, 5]))
    cache, table, prefix, w_uk, w_uv = (t.cuda() for t in chunked_extras(module, 2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        module.mla_chunked_prefill(
            q, k_nope, k_pe, v, cu, 5, cache, table, prefix, w_uk, w_uv, num_prefix_tokens=10, validate=False
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_unused_block_table_entries_are_not_checked(module):
    """Entries past a sequence's pages are never read, so padding them with -1 (as engines do) is fine."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    cache, table, prefix, w_uk, w_uv = chunked_extras(module, 2, prefix_len=3)
    table[:, 1] = -1
    out = module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, cache, table, prefix, w_uk, w_uv)
    assert not out.isnan().any()


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([0, 24, -1], "slot_mapping[1] = 24: a slot (-1: skip the token) must be in [-1, 23]"),
        ([0, 2**40, -1], "slot_mapping[1] = 1099511627776: a slot (-1: skip the token) must be in [-1, 23]"),
        ([0, -2, 5], "slot_mapping[1] = -2: a slot (-1: skip the token) must be in [-1, 23]"),
        ([7, 3, 7], "slot_mapping: slot 7 is written by more than one token"),
    ],
)
def test_cache_write_slots(module, slots, message):
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(6, module.PAGE_SIZE, 1, 80, generator=g).to(module.DTYPE).to(DEVICE)
    before = cache.clone()
    c_kv, k_pe = on_device(
        torch.randn(3, 64, generator=g).to(module.DTYPE), torch.randn(3, 16, generator=g).to(module.DTYPE)
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        module.mla_cache_write(c_kv, k_pe, cache, torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)  # nothing written


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), True, "0.1"])
def test_scales_must_be_finite_numbers(module, scale):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    with pytest.raises(ValueError, match=r"^softmax_scale: must be a finite number, got "):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, softmax_scale=scale)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4, module.PAGE_SIZE, 1, 80, generator=g).to(module.DTYPE)
    dq = torch.randn(1, 1, module.NUM_HEADS, 80, generator=g).to(module.DTYPE)
    args = on_device(dq, kv, torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^softmax_scale: must be a finite number, got "):
        module.mla_decode(*args, softmax_scale=scale)


@pytest.mark.parametrize("scale", [-1.0, -0.05, 1e-6, 3.0])
def test_prefill_is_right_for_any_finite_scale(module, scale):
    """The row max is taken after scaling: a negative scale turns the largest score into the smallest."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 70], seed=5)
    got, lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 70, softmax_scale=scale, return_lse=True)
    want, want_lse = prefill_varlen(q.double(), k_nope.double(), k_pe.double(), v.double(), cu, scale)
    _, _, message = compare_with_lse(got, lse, want, want_lse, "float16")
    assert not message, message


def test_validate_false_is_the_callers_contract(module):
    """validate=False skips the checks (as on the GPU by default): a short max_seqlen is not caught then."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    with pytest.raises(ValueError, match="max_seqlen"):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 3, validate=True)
    module.mla_prefill(q, k_nope, k_pe, v, cu, 3, validate=False)  # no check, no error (tokens 3, 4 unwritten)


def decode_args(module, lengths, seed=4):
    g = torch.Generator().manual_seed(seed)
    # every row holds max(lengths) tokens' pages; one spare page
    table, num_pages = paged_block_table([max(lengths)] * len(lengths), module.PAGE_SIZE, g, spare_pages=1)
    kv = torch.randn(num_pages, module.PAGE_SIZE, 1, 80, generator=g).to(module.DTYPE)
    q = torch.randn(len(lengths), 1, module.NUM_HEADS, 80, generator=g).to(module.DTYPE)
    return on_device(q, kv, table, torch.tensor(lengths, dtype=torch.int32))


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (("table", (1, 2)), 13, "block_table[1, 2] = 13: a page used by its sequence must be in [0, 12]"),
        (("table", (0, 0)), -1, "block_table[0, 0] = -1: a page used by its sequence must be in [0, 12]"),
        (("lengths", 1), 13, "cache_seqlens[1] = 13: a length (block_table rows hold 12 tokens) must be in [0, 12]"),
        (("lengths", 0), 2**31 - 1, "cache_seqlens[0] = 2147483647: a length (block_table rows hold 12 tokens)"),
        (("lengths", 0), -5, "cache_seqlens[0] = -5: a length (block_table rows hold 12 tokens) must be in [0, 12]"),
    ],
)
def test_decode_pages_and_lengths(module, where, value, message):
    q, kv, table, lengths = decode_args(module, [9, 11, 3, 12])
    tensor, position = where
    (table if tensor == "table" else lengths)[position] = value
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        module.mla_decode(q, kv, table, lengths)


def test_a_negative_length_cannot_disturb_the_other_sequences(module):
    """Unvalidated (the GPU default), a negative length counts as empty: the other sequences stay right."""
    q, kv, table, lengths = decode_args(module, [9, 11, 3, 12])
    schedule = module.get_decode_schedule(4, 1, num_parts=3, min_blocks_per_part=1)
    want, want_lse = module.mla_decode(q, kv, table, lengths, schedule=schedule, return_lse=True)
    lengths[2] = -(2**30)
    got, lse = module.mla_decode(q, kv, table, lengths, schedule=schedule, return_lse=True, validate=False)
    keep = [0, 1, 3]
    torch.testing.assert_close(got[keep], want[keep], atol=0, rtol=0)
    assert not got[2].any() and (lse[2] == float("-inf")).all()


def test_a_schedule_is_immutable_and_only_its_own_module_takes_it(module, build_module):
    schedule = module.get_decode_schedule(2, 1, DEVICE)
    with pytest.raises(AttributeError, match="DecodeSchedule is immutable"):
        schedule.num_parts = 10**8
    other = build_module(**{**FIELDS, "name": "bad-values-other", "num_heads": 4})
    q, kv, table, lengths = on_device(*decode_args(other, [9, 11])[:3], torch.tensor([9, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^schedule: planned by another module \(spec [0-9a-f]{12}\), not this one"):
        other.mla_decode(q, kv, table, lengths, schedule=schedule)
    other.mla_decode(q, kv, table, lengths, schedule=other.get_decode_schedule(2, 1, DEVICE))


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(num_parts=10**8), r"^num_parts: must be an int in 1\.\.65535, got 100000000$"),
        (dict(config=(48, 8, 2)), r"^config: expected \(block_n: a power of two in 16\.\.256"),
        (dict(tuned=(48, 8, 2)), r"^tuned: expected \(block_n: a power of two in 16\.\.256"),
        (dict(min_blocks_per_part=0), r"^min_blocks_per_part: must be an int >= 1, got 0$"),
    ],
)
def test_schedule_knobs_are_checked_when_planned(module, knobs, message):
    with pytest.raises(ValueError, match=message):
        module.get_decode_schedule(2, 1, DEVICE, **knobs)


# ---- scales, token bounds, tile configurations, overlapping outputs, devices, flags ------------------------
BAD_CONFIGS = [(0, 16, 4, 1), (48, 16, 4, 1), ("16", 16, 4, 1), (16, 16, 3, 1), (16, 16, 4, 0), (True, 16, 4, 1),
               (16, 512, 4, 1), (16, 16, 4), "16,16,4,1"]  # fmt: skip


@pytest.mark.parametrize("scale", [1e300, -1e300, 2.0**64 * 1.001, -(2.0**65)])
def test_finite_scales_that_overflow_float32_in_the_kernels_are_refused(module, scale):
    """|scale| * log2(e) must stay a finite float32, with room for the scores: past 2**64 a call is refused
    (1e300 would make prefill's outputs all NaN and crash decode)."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    message = r"^softmax_scale: must be within \[-2\*\*64, 2\*\*64\] \(the kernels' float32 scales stay finite\), got "
    with pytest.raises(ValueError, match=message):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, softmax_scale=scale)
    dq, kv, table, lengths = decode_args(module, [9, 11])
    with pytest.raises(ValueError, match=message):
        module.mla_decode(dq, kv, table, lengths, softmax_scale=scale)


@pytest.mark.parametrize("scale", [2.0**64, -(2.0**64)])
def test_the_largest_scale_allowed_gives_finite_outputs(module, scale):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    out, lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 5, softmax_scale=scale, return_lse=True)
    assert out.isfinite().all() and lse.isfinite().all()
    dq, kv, table, lengths = decode_args(module, [9, 11])
    out, lse = module.mla_decode(dq, kv, table, lengths, softmax_scale=scale, return_lse=True)
    assert out.isfinite().all() and lse.isfinite().all()


@pytest.mark.parametrize("validate", [None, False])
@pytest.mark.parametrize("kernel", ["prefill", "chunked"])
def test_max_seqlen_past_the_tokens_is_refused(module, kernel, validate):
    """max_seqlen launches programs for that many tokens of every sequence: 200000 for 8 tokens would launch
    them all (minutes in the interpreter). A host check, so also without validation."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    message = "max_seqlen: 200000 is more than the number of tokens (8): must be in [longest sequence, 8]"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        if kernel == "prefill":
            module.mla_prefill(q, k_nope, k_pe, v, cu, 200000, validate=validate)
        else:
            module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 200000, *chunked_extras(module, 2), validate=validate)


@pytest.mark.parametrize("config", BAD_CONFIGS)
@pytest.mark.parametrize("kernel", ["prefill", "chunked"])
def test_prefill_config_is_checked_whole(module, kernel, config):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    message = r"^config: expected \(block_m, block_n: powers of two in 16\.\.256, num_warps: 1, 2, 4, 8 or 16, "
    with pytest.raises(ValueError, match=message):
        if kernel == "prefill":
            module.mla_prefill(q, k_nope, k_pe, v, cu, 5, config=config)
        else:
            module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, *chunked_extras(module, 2), config=config)


def test_a_cache_of_no_pages_is_refused(module):
    """A cache of zero pages (every sequence empty) would reach Triton's TensorDescriptor (AssertionError)."""
    g = torch.Generator().manual_seed(6)
    empty = torch.empty(0, module.PAGE_SIZE, 1, 80, dtype=module.DTYPE, device=DEVICE)
    message = rf"^kv_cache: expected at least one page, got shape \(0, {module.PAGE_SIZE}, 1, 80\)$"
    dq = torch.randn(2, 1, module.NUM_HEADS, 80, generator=g).to(module.DTYPE).to(DEVICE)
    zeros = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        module.mla_decode(dq, empty, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), zeros)
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    _, _, _, w_uk, w_uv = chunked_extras(module, 2)
    with pytest.raises(ValueError, match=message):
        module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, empty, torch.zeros(2, 1, dtype=torch.int32,
                                   device=DEVICE), zeros, w_uk, w_uv)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        module.mla_cache_write(torch.randn(3, 64).to(module.DTYPE).to(DEVICE), torch.randn(3, 16).to(module.DTYPE)
                               .to(DEVICE), empty, torch.full((3,), -1, device=DEVICE))  # fmt: skip


def test_meta_tensors_are_refused_by_name(module):
    message = r": a meta tensor holds no data: the kernels need CUDA tensors"
    meta = torch.device("meta")
    dq, kv, table, lengths = (t.to(meta) for t in decode_args(module, [9, 11]))
    with pytest.raises(ValueError, match="^q" + message):
        module.mla_decode(dq, kv, table, lengths)
    with pytest.raises(ValueError, match="^device" + message):
        module.get_decode_schedule(2, 1, meta)
    q, k_nope, k_pe, v, cu = (t.to(meta) for t in mha(module, [3, 5]))
    with pytest.raises(ValueError, match="^q" + message):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5)
    with pytest.raises(ValueError, match="^c_kv" + message):
        rows = torch.empty(3, 80, dtype=module.DTYPE, device=meta)
        module.mla_cache_write(rows[:, :64], rows[:, 64:], kv, torch.zeros(3, dtype=torch.int64, device=meta))
    o = torch.empty(8, module.NUM_HEADS, module.V_HEAD_DIM, device=meta)
    lse = torch.empty(module.NUM_HEADS, 8, device=meta)
    with pytest.raises(ValueError, match="^prefix_output" + message):
        module.merge_attn_states(o, lse, o, lse)


def test_host_tensors_are_refused_by_name_where_the_kernels_are_compiled(module, monkeypatch):
    """Outside the interpreter the kernels are compiled for the GPU and cannot read host memory: a CPU tensor is a
    one-line error naming the argument, not Triton's launcher error (the interpreter is switched off for the check
    only; nothing is launched)."""
    message = r": a cpu tensor: the compiled kernels read CUDA tensors \(CPU tensors run only under TRITON_INTERPRET=1"
    cpu = torch.device("cpu")
    dq, kv, table, lengths = (t.to(cpu) for t in decode_args(module, [9, 11]))
    q, k_nope, k_pe, v, cu = (t.to(cpu) for t in mha(module, [3, 5]))
    rows = torch.randn(3, 80).to(module.DTYPE)
    o = torch.randn(8, module.NUM_HEADS, module.V_HEAD_DIM)
    lse = torch.randn(module.NUM_HEADS, 8)
    monkeypatch.setattr(runtime, "_INTERPRET", False)
    with pytest.raises(ValueError, match="^q" + message):
        module.mla_decode(dq, kv, table, lengths)
    with pytest.raises(ValueError, match="^q" + message):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5)
    with pytest.raises(ValueError, match="^c_kv" + message):
        module.mla_cache_write(rows[:, :64], rows[:, 64:], kv, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="^prefix_output" + message):
        module.merge_attn_states(o, lse, o, lse)
    module.get_decode_schedule(2, 1, cpu)  # (a schedule reads no tensor)


def test_prefill_outputs_that_overlap_each_other_or_an_input_are_refused(module):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    h, dv = module.NUM_HEADS, module.V_HEAD_DIM
    buffer = torch.empty(8 * h * dv * 2 + 64, dtype=torch.uint8, device=DEVICE)
    out = buffer[: 8 * h * dv * 2].view(module.DTYPE).view(8, h, dv)
    lse_over_out = buffer[64 : 64 + 8 * h * 4].view(torch.float32).view(h, 8)
    with pytest.raises(ValueError, match=r"^out: overlaps lse in memory: give out memory of its own$"):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, out=out, lse=lse_over_out)
    with pytest.raises(ValueError, match=r"^out: overlaps v in memory"):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, out=v[:, :, :dv])
    with pytest.raises(ValueError, match=r"^lse: overlaps q in memory"):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, lse=q.view(torch.float32).reshape(-1)[: h * 8].view(h, 8))
    # disjoint parts of one buffer are fine, and the results are those of fresh outputs
    apart = torch.empty(8 * h * dv * 2 + 8 * h * 4, dtype=torch.uint8, device=DEVICE)
    out = apart[: 8 * h * dv * 2].view(module.DTYPE).view(8, h, dv).fill_(float("nan"))
    lse = apart[8 * h * dv * 2 :].view(torch.float32).view(h, 8).fill_(float("nan"))
    module.mla_prefill(q, k_nope, k_pe, v, cu, 5, out=out, lse=lse)
    want, want_lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 5, return_lse=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


def test_chunked_prefill_and_merge_outputs_that_overlap_are_refused(module):
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    extras = chunked_extras(module, 2)
    with pytest.raises(ValueError, match=r"^out: overlaps v in memory"):
        module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, *extras, out=v)
    o, lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 5, return_lse=True)
    with pytest.raises(ValueError, match=r"^out: overlaps prefix_output in memory"):
        module.merge_attn_states(o, lse, o.clone(), lse.clone(), out=o)
    with pytest.raises(ValueError, match=r"^out_lse: overlaps suffix_lse in memory"):
        suffix_lse = lse.clone()
        module.merge_attn_states(o, lse, o.clone(), suffix_lse, out_lse=suffix_lse)


def test_decode_outputs_that_overlap_are_refused_on_the_first_and_later_calls(module):
    dq, kv, table, lengths = decode_args(module, [9, 11])
    h, dc = module.NUM_HEADS, module.KV_LORA_RANK
    schedule = module.get_decode_schedule(2, 1, DEVICE)
    out = torch.empty(2, 1, h, dc, dtype=module.DTYPE, device=DEVICE)
    lse_over_out = out.view(torch.float32).reshape(-1)[: 2 * h].view(2, h, 1)
    with pytest.raises(ValueError, match=r"^out: overlaps lse in memory"):
        module.mla_decode(dq, kv, table, lengths, schedule=schedule, out=out, lse=lse_over_out)
    with pytest.raises(ValueError, match=r"^out: overlaps q in memory"):
        module.mla_decode(dq, kv, table, lengths, schedule=schedule, out=dq[..., :dc])
    # a first call with buffers of their own prepares the launches; a later one of the same layouts whose
    # buffers overlap takes the prepared path, which checks them too while validating
    lse = torch.empty(2, h, 1, dtype=torch.float32, device=DEVICE)
    module.mla_decode(dq, kv, table, lengths, schedule=schedule, out=out, lse=lse)
    module.mla_decode(dq, kv, table, lengths, schedule=schedule, out=out, lse=lse)
    twin = torch.empty(2 * h * dc * 2 + 2 * h * 4, dtype=torch.uint8, device=DEVICE)
    out2 = twin[: 2 * h * dc * 2].view(module.DTYPE).view(2, 1, h, dc)
    lse2 = twin[16 : 16 + 2 * h * 4].view(torch.float32).view(2, h, 1)
    with pytest.raises(ValueError, match=r"^out: overlaps lse in memory"):
        module.mla_decode(dq, kv, table, lengths, schedule=schedule, out=out2, lse=lse2)


def test_cache_write_into_its_own_input_is_refused(module):
    g = torch.Generator().manual_seed(8)
    cache = torch.randn(3, module.PAGE_SIZE, 1, 80, generator=g).to(module.DTYPE).to(DEVICE)
    c_kv = cache[0, :3, 0, :64]  # rows of the cache itself
    k_pe = torch.randn(3, 16, generator=g).to(module.DTYPE).to(DEVICE)
    with pytest.raises(ValueError, match=r"^kv_cache: overlaps c_kv in memory"):
        module.mla_cache_write(c_kv, k_pe, cache, torch.tensor([4, 5, 6], device=DEVICE))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((True, 1), {}, "batch_size: must be an int >= 1, got True"),
        ((2, True), {}, "seqlen_q: must be an int >= 1, got True"),
        ((2.0, 1), {}, "batch_size: must be an int >= 1, got 2.0"),
        ((2, 1), {"backend": "cuda"}, "backend: expected auto, gluon or triton, got 'cuda'"),
        ((2, 1), {"merge": "both"}, "merge: expected auto, fused or kernel, got 'both'"),
    ],
)
def test_schedule_arguments_name_themselves(module, args, kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        module.get_decode_schedule(*args, DEVICE, **kwargs)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MLAGEN_DECODE_BACKEND", "cuda", "MLAGEN_DECODE_BACKEND: expected auto, gluon or triton, got 'cuda'"),
        ("MLAGEN_DECODE_MERGE", "both", "MLAGEN_DECODE_MERGE: expected auto, fused or kernel, got 'both'"),
    ],
)
def test_schedule_environment_knobs_name_the_variable(module, name, value, message):
    """The variables are read into the options in one place (Options.from_env), which names a wrong value."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Options.from_env({name: value})
    with use_options(Options.from_env({name: ""})):  # blank: unset
        module.get_decode_schedule(2, 1, DEVICE)


@pytest.mark.parametrize("value", ["3", "one", "0", "auto,1"])
def test_the_gluon_prefill_warpgroups_variable_names_itself(module, value):
    """MLAGEN_PREFILL_GLUON_WARPGROUPS (the Gluon prefill's consumer warpgroups a program): auto, 1 or 2."""
    message = f"MLAGEN_PREFILL_GLUON_WARPGROUPS: expected auto, 1 or 2, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Options.from_env({"MLAGEN_PREFILL_GLUON_WARPGROUPS": value})
    with pytest.raises(
        ValueError, match=f"^prefill_gluon_warpgroups: expected auto, 1 or 2, got {re.escape(repr(value))}$"
    ):
        Options(prefill_gluon_warpgroups=value)
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    with use_options(Options.from_env({"MLAGEN_PREFILL_GLUON_WARPGROUPS": ""})):  # blank: unset (auto)
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5)


@pytest.mark.parametrize(
    ("flag", "value"), [("validate", "no"), ("validate", 1), ("return_lse", "yes"), ("return_lse", 0)]
)
def test_flags_take_a_bool_only(module, flag, value):
    """A string (truthy even when it says "no") or a number for an on/off argument is an error naming it."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    allowed = "None, True or False" if flag == "validate" else "True or False"
    message = f"^{flag}: expected {allowed}, got {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=message):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, **{flag: value})
    with pytest.raises(ValueError, match=message):
        module.mla_chunked_prefill(q, k_nope, k_pe, v, cu, 5, *chunked_extras(module, 2), **{flag: value})
    dq, kv, table, lengths = decode_args(module, [9, 11])
    with pytest.raises(ValueError, match=message):
        module.mla_decode(dq, kv, table, lengths, **{flag: value})


def test_an_output_whose_elements_share_memory_is_refused(module):
    """expand() gives a tensor whose rows are one row: every sequence's result would land on the same bytes."""
    q, k_nope, k_pe, v, cu = mha(module, [3, 5])
    h, dv, dc = module.NUM_HEADS, module.V_HEAD_DIM, module.KV_LORA_RANK
    message = r"^out: its elements overlap one another in memory \(a stride of 0, expand\(\)\): give it memory"
    with pytest.raises(ValueError, match=message):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 5, out=torch.empty(1, h, dv, dtype=module.DTYPE, device=DEVICE)
                           .expand(8, h, dv))  # fmt: skip
    dq, kv, table, lengths = decode_args(module, [9, 11])
    with pytest.raises(ValueError, match=message):
        module.mla_decode(dq, kv, table, lengths, out=torch.empty(1, 1, h, dc, dtype=module.DTYPE, device=DEVICE)
                          .expand(2, 1, h, dc))  # fmt: skip
    rows = torch.empty(8, h, 2 * dv, dtype=module.DTYPE, device=DEVICE)
    module.mla_prefill(q, k_nope, k_pe, v, cu, 5, out=rows[:, :, dv:])  # strided, not overlapping: fine
