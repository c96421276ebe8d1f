"""Property tests: generated mla_decode == reference absorbed decode over a paged cache.

Runs in Triton's interpreter without a GPU and unchanged on one. Outputs are poisoned (NaN) before each
call and workspaces are NaN-filled (MLAGEN_POISON_WORKSPACE, conftest), so unwritten elements fail.
The cache is drawn 16-bit (the spec dtype) or fp8 e4m3 with a per-layer kv_scale; the reference reads the
dequantised fp8 cache, so both are held to the same tolerances (see test_fp8.py for fp8 against the
unquantised latent).
"""

import dataclasses
from unittest.mock import patch

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEEPSEEK_V3_TP8_SPEC, SMALL_SPEC
from hypothesis import given, note, settings
from hypothesis import strategies as st

from mlagen_compiler import runtime
from mlagen_compiler.options import use_options
from mlagen_compiler.plan import lower_gluon_decode
from mlagen_compiler.testing import DecodeProblem, assert_decode_matches_reference, decode_inputs
from mlagen_compiler.verify import compare, decode_reference, make_decode_inputs

BACKENDS = ["triton", "gluon"]

GEOMETRIES = [  # (H, Dc, Dr): DeepSeek-like, Mistral-Small-4-like, MiniCPM3-like, odd widths
    (16, 512, 64),
    (1, 64, 16),
    (40, 256, 32),
    (128, 512, 64),
    (3, 96, 16),
    (5, 320, 48),
    (32, 256, 64),
]
#: the geometries the Gluon backend takes (the others always run the portable kernel)
GLUON_GEOMETRIES = [g for g in GEOMETRIES if lower_gluon_decode(g[1], g[2]).eligible]
PAGE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
#: cache dtypes: the spec dtype (None) or fp8 (the Gluon decode converts it to float16 in its stages)
CACHE_DTYPES = [None, "float8_e4m3fn"]


def gluon_skip_reason(build_module, device) -> str:
    """'' when the Gluon decode runs here, else why not (interpreter, GPU, Triton release)."""
    module = build_module(**{**DEEPSEEK_V3_TP8_SPEC, "name": "gluon-probe"})
    backend, reason = module.decode_backend(device, "auto")
    return "" if backend == "gluon" else reason


def require_backend(build_module, device, backend):
    if backend == "gluon" and (reason := gluon_skip_reason(build_module, device)):
        pytest.skip(f"Gluon decode cannot run here: {reason}")


def require_gluon_gpu(build_module, device):
    """Skip unless the Gluon decode runs here: on a GPU (never in the interpreter), as require_backend says."""
    if device.type != "cuda":
        pytest.skip("GPU only: the Gluon decode does not run in the interpreter")
    require_backend(build_module, device, "gluon")


@st.composite
def decode_geometries(draw, geometries=tuple(GEOMETRIES), cache_dtypes=tuple(CACHE_DTYPES)):
    """The spec fields of a module for module_for: geometry, page size, dtype and cache dtype."""
    heads, dc, dr = draw(st.sampled_from(geometries))
    return dict(
        heads=heads,
        dc=dc,
        dr=dr,
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        dtype=draw(st.sampled_from(["bfloat16", "float16"])),
        cache_dtype=draw(st.sampled_from(cache_dtypes)),
    )


def module_for(build_module, problem):
    """The module of a problem dict's geometry fields (see decode_geometries)."""
    return build_module(
        name="prop",
        num_heads=problem["heads"],
        kv_lora_rank=problem["dc"],
        qk_rope_head_dim=problem["dr"],
        qk_nope_head_dim=64,
        v_head_dim=64,
        page_size=problem["page_size"],
        dtype=problem["dtype"],
        cache_dtype=problem.get("cache_dtype"),
    )


#: the fields of a problem dict that are the call's (the others name its module, see module_for)
CALL_FIELDS = {field.name for field in dataclasses.fields(DecodeProblem)}


def check_decode(module, device, problem, backend, **kwargs):
    """assert_decode_matches_reference on a problem dict that may also name its module's geometry."""
    call = DecodeProblem(**{name: value for name, value in problem.items() if name in CALL_FIELDS})
    assert_decode_matches_reference(module, call, backend=backend, device=device, **kwargs)


def gpu_problem(*, heads, dc, page_size, cache_dtype, seqlen_q, seqlens, seed, num_parts=None, min_blocks=None, **more):
    """A problem dict of the GPU tests' full-size geometries (for module_for and check_decode): Dr 64, bfloat16,
    TMA allowed, NaN in every unused slot; the launch policy's splits unless num_parts and min_blocks are given.
    more: other fields of the call (merge)."""
    return dict(
        heads=heads,
        dc=dc,
        dr=64,
        page_size=page_size,
        dtype="bfloat16",
        cache_dtype=cache_dtype,
        seqlen_q=seqlen_q,
        seqlens=seqlens,
        num_parts=num_parts,
        min_blocks=min_blocks,
        tma=True,
        nan_unused=True,
        seed=seed,
        **more,
    )


def split_test_module(build_module, device, backend, name, dtype="bfloat16"):
    """(module, block_n) of the split and merge tests, once require_backend lets the backend run: 4 heads, pages of
    4, the DeepSeek widths for the Gluon kernel (it takes Dc 512), the small spec's for the portable one;
    block_n: the cache block its default schedule streams, what the tests cut their sequences by."""
    require_backend(build_module, device, backend)
    base = DEEPSEEK_V3_TP8_SPEC if backend == "gluon" else SMALL_SPEC
    module = build_module(**{**base, "name": name, "num_heads": 4, "page_size": 4, "dtype": dtype})
    return module, module.get_decode_schedule(1, 1, device, backend=backend).config[0]


def split_problem(*, seqlens, seqlen_q, num_parts, merge, seed, dtype="bfloat16"):
    """A problem dict of the split and merge tests (split_test_module's module): num_parts runs of at least one
    block, TMA allowed, NaN in every unused slot."""
    return dict(
        seqlens=seqlens,
        seqlen_q=seqlen_q,
        num_parts=num_parts,
        min_blocks=1,
        merge=merge,
        tma=True,
        seed=seed,
        dtype=dtype,
        nan_unused=True,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_decode_matches_reference(build_module, device, backend, data):
    require_backend(build_module, device, backend)
    gluon = backend == "gluon"
    geometry = data.draw(decode_geometries(tuple(GLUON_GEOMETRIES if gluon else GEOMETRIES)), label="geometry")
    module = module_for(build_module, geometry)
    problem = data.draw(decode_inputs(module), label="problem")
    note(problem.describe(module))
    assert_decode_matches_reference(module, problem, backend=backend, device=device)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_every_page_size(build_module, device, backend, page_size, cache_dtype):
    """Every page size with Sq 1..4, page edges, an empty sequence and NaN in every unused slot, 16-bit and
    fp8 caches; GPU only (under the interpreter the property test above covers these, a few at a time)."""
    if device.type != "cuda":
        pytest.skip("GPU only: the interpreter runs the property test's draws instead")
    require_backend(build_module, device, backend)
    p = page_size
    for seqlen_q in (1, 2, 3, 4):
        problem = gpu_problem(
            heads=16,
            dc=512,
            page_size=p,
            cache_dtype=cache_dtype,
            seqlen_q=seqlen_q,
            seqlens=[1, max(1, p - 1), p + 1, 0, 3 * p + 5, 700, 64, 129],
            num_parts=None if seqlen_q % 2 else 7,
            min_blocks=None if seqlen_q % 2 else 1,
            seed=1000 * p + seqlen_q,
        )
        check_decode(module_for(build_module, problem), device, problem, backend)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_gluon_narrow_and_wide_forms_both_match_the_reference(build_module, device, cache_dtype):
    """16 query rows run the Gluon decode's narrow form (the MMAs 16 rows wide); the same inputs with the form
    turned off run rows padded to 64. Both against the reference: page edges, an empty sequence, splits, NaN in
    every unused slot. GPU only."""
    require_gluon_gpu(build_module, device)
    problem = gpu_problem(
        heads=16,
        dc=512,
        page_size=64,
        cache_dtype=cache_dtype,
        seqlen_q=1,
        seqlens=[1, 63, 65, 0, 197, 700, 64, 129],
        num_parts=7,
        min_blocks=1,
        seed=4242,
    )
    module = module_for(build_module, problem)
    assert module.gluon_narrow_rows(16, module.DECODE_GLUON_NARROW_ROWS) == 16
    check_decode(module, device, problem, "gluon")
    with patch.object(module, "DECODE_GLUON_NARROW_ROWS", 0):
        assert module.gluon_narrow_rows(16, module.DECODE_GLUON_NARROW_ROWS) == 0
        check_decode(module, device, problem, "gluon")


@pytest.mark.parametrize("page_size", [64, 16])
def test_gluon_narrow_form_32_rows_wide_in_large_batches(build_module, device, page_size):
    """From DECODE_GLUON_NARROW_LARGE_BATCH sequences on, 17-32 query rows take the narrow form 32 rows wide with a
    16-bit cache (H32 Sq 1 at Dc 256, H16 Sq 2 at Dc 512), not with an fp8 one (rows as the MMAs' M); with the wider
    limit turned off the same inputs run rows padded to 64. Each against the reference: page edges, empty sequences,
    splits, NaN in every unused slot. GPU only."""
    require_gluon_gpu(build_module, device)
    for heads, dc, seqlen_q, cache_dtype, narrow in (
        (32, 256, 1, None, 32),
        (16, 512, 2, None, 32),
        (16, 512, 2, "float8_e4m3fn", 0),
        (32, 256, 1, "float8_e4m3fn", 0),
    ):
        problem = gpu_problem(
            heads=heads,
            dc=dc,
            page_size=page_size,
            cache_dtype=cache_dtype,
            seqlen_q=seqlen_q,
            seqlens=[1, 63, 65, 0, 197, 700, 64, 129, 2000, 5] * 7,
            seed=77 * heads + seqlen_q,
        )
        module = module_for(build_module, problem)
        batch = len(problem["seqlens"])
        assert batch >= module.DECODE_GLUON_NARROW_LARGE_BATCH
        assert module.get_decode_schedule(batch, seqlen_q, device).narrow == narrow
        check_decode(module, device, problem, "gluon")
        if narrow:
            with patch.object(module, "DECODE_GLUON_NARROW_ROWS_LARGE_BATCH", module.DECODE_GLUON_NARROW_ROWS):
                assert module.get_decode_schedule(batch, seqlen_q, device).narrow == 0
                check_decode(module, device, problem, "gluon")


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize(("heads", "seqlen_q", "dc"), [(128, 1, 256), (32, 4, 256), (128, 1, 128)])
@pytest.mark.parametrize("page_size", [64, 128])
def test_gluon_long_and_tuned_blocks_both_match_the_reference(
    build_module, device, page_size, heads, seqlen_q, dc, merge
):
    """Two row blocks of query rows at Dc 256 or 128 with a 16-bit cache, beyond the small batches, stream 128-position
    cache blocks (gluon_long_blocks: one TMA box a block with pages of 128, two with pages of 64; the gathering
    producer for a cache TMA cannot address); the same inputs with the tuned configuration given stream
    64-position blocks. All against the reference, both merges: page edges, an empty sequence, lengths off the
    blocks, causal masks over the last blocks (Sq 4), the runs the launch policy plans, NaN in every unused slot.
    GPU only."""
    require_gluon_gpu(build_module, device)
    problem = gpu_problem(
        heads=heads,
        dc=dc,
        page_size=page_size,
        cache_dtype=None,
        seqlen_q=seqlen_q,
        seqlens=[1, 63, 65, 0, 127, 129, 3 * page_size + 5, 700, 64, 1029],
        merge=merge,
        seed=7400 + page_size + heads + seqlen_q + dc,
    )
    module = module_for(build_module, problem)
    batch = len(problem["seqlens"])
    assert batch > module.DECODE_SMALL_BATCH
    long = module.get_decode_schedule(batch, seqlen_q, device, backend="gluon", merge=merge)
    assert long.config[0] == module.DECODE_GLUON_LONG_BLOCK_N == 128, long
    assert long.config[2] == module.DECODE_GLUON_LONG_BLOCK_STAGES and long.row_blocks == 2
    kv = torch.empty(2, page_size, 1, dc + 64, dtype=torch.bfloat16, device=device)
    assert module._gluon_producer_kind(kv, heads * seqlen_q, 0, 128)[0] == "tma"
    check_decode(module, device, problem, "gluon")
    check_decode(module, device, problem, "gluon", cache_view=rows_off_word_boundaries)  # the gathering producer
    tuned = module.get_decode_schedule(batch, seqlen_q, device, backend="gluon", config=module.DECODE_GLUON_DEFAULT)
    assert tuned.config == module.DECODE_GLUON_DEFAULT and tuned.config[0] == 64
    check_decode(module, device, {**problem, "config": tuned.config}, "gluon")


def tall_rows_small_batch(page_size: int, merge: str, cache_dtype: str | None, seed: int) -> dict:
    """8 sequences of DeepSeek H16 at Sq 4 (64 query rows: one row block, rows as the MMAs' M): page edges, an
    empty sequence, splits by the launch policy, NaN in every unused slot."""
    return gpu_problem(
        heads=16,
        dc=512,
        page_size=page_size,
        cache_dtype=cache_dtype,
        seqlen_q=4,
        seqlens=[1, 31, 33, 0, 197, 700, 64, 129],
        merge=merge,
        seed=seed,
    )


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_gluon_short_and_tuned_blocks_both_match_the_reference(build_module, device, page_size, merge):
    """A small batch with rows as the MMAs' M (a 16-bit cache; an fp8 one: the next test) whose sequences average
    16 runs or more streams 32-position cache blocks in a ring of 3 (gluon_short_blocks); the same inputs with
    the tuned configuration given stream 64-position blocks (TMA boxes where a page holds them, else the
    gathering producer). Both against the reference, both merges: page edges, an empty sequence, splits, NaN
    in every unused slot. GPU only."""
    require_gluon_gpu(build_module, device)
    problem = tall_rows_small_batch(page_size, merge, None, seed=4343 + page_size)
    module = module_for(build_module, problem)
    # the schedule check_decode plans (the launch policy's runs)
    short = module.get_decode_schedule(8, 4, device, backend="gluon", merge=merge)
    assert short.config[0] == module.DECODE_GLUON_SMALL_BATCH_BLOCK_N == 32, short
    assert short.config[2] == module.DECODE_GLUON_SMALL_BATCH_STAGES
    check_decode(module, device, problem, "gluon")
    tuned = module.get_decode_schedule(9, 4, device, backend="gluon").config  # beyond the small batches
    assert tuned[0] == module.DECODE_GLUON_BLOCK_N == 64
    check_decode(module, device, {**problem, "config": tuned}, "gluon")


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_gluon_fp8_query_filling_the_tile_loads_rows_and_matches_the_reference(build_module, device, page_size, merge):
    """An fp8 cache at Dc 512 with 64 query rows (H16 Sq4: the query fills the tile, one row block; no landing ring
    fits) has its blocks' rows loaded by the converting warps: 64-position blocks beyond the small batches, the
    short blocks (32 positions, a ring of 3) for the short runs of a small batch. Against the reference, both
    merges: page edges, an empty sequence, splits, NaN in every unused slot. GPU only."""
    require_gluon_gpu(build_module, device)
    small_batch = tall_rows_small_batch(page_size, merge, "float8_e4m3fn", seed=4545 + page_size)
    larger = {**small_batch, "seqlens": small_batch["seqlens"] + [95, 2 * page_size + 3]}  # 10 sequences
    module = module_for(build_module, larger)
    assert len(larger["seqlens"]) > module.DECODE_SMALL_BATCH >= len(small_batch["seqlens"])
    assert module.DECODE_GLUON_LAND_RING_SLOTS == 1
    kv = torch.empty(2, page_size, 1, 576, dtype=torch.float8_e4m3fn, device=device)
    for problem, block_n in ((larger, 64), (small_batch, module.DECODE_GLUON_SMALL_BATCH_BLOCK_N)):
        schedule = module.get_decode_schedule(len(problem["seqlens"]), 4, device, backend="gluon", merge=merge)
        assert schedule.config[0] == block_n and schedule.land_slots == 1, schedule
        assert module._gluon_producer_kind(kv, 64, 0, schedule.config[0], schedule.land_slots)[0] == "convert"
        check_decode(module, device, problem, "gluon")


@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize(("heads", "dc"), [(16, 256), (32, 256), (64, 256), (32, 128)])
@pytest.mark.parametrize("page_size", [64, 128])
def test_gluon_fp8_landing_ring_and_one_landing_block_both_match_the_reference(
    build_module, device, page_size, heads, dc, merge
):
    """An fp8 cache with Dc 256 (Mistral-Small-4) or 128 and one row block of query rows (H16: the narrow form;
    H32: the tile's upper half; H64: the whole tile) lands two blocks at a time in a ring of its own
    (gluon_land_ring); the same inputs with the tuned configuration given land one block at a time in the query
    tile's lower half (H16, H32) or load rows into registers (H64). Both against the reference, both merges: page
    edges, an empty sequence, splits, NaN in every unused slot. GPU only."""
    require_gluon_gpu(build_module, device)
    problem = gpu_problem(
        heads=heads,
        dc=dc,
        page_size=page_size,
        cache_dtype="float8_e4m3fn",
        seqlen_q=1,
        seqlens=[1, 63, 65, 0, 3 * page_size + 5, 700, 64, 1029],
        merge=merge,
        seed=7300 + page_size + heads + dc,
    )
    module = module_for(build_module, problem)
    ring = module.get_decode_schedule(8, 1, device, backend="gluon", merge=merge)
    assert ring.land_slots == module.DECODE_GLUON_LAND_RING_SLOTS > 1, ring
    assert ring.config[0] == 64 and ring.config[2] == module.DECODE_GLUON_LAND_RING_STAGES
    kv = torch.empty(2, page_size, 1, dc + 64, dtype=torch.float8_e4m3fn, device=device)
    assert module._gluon_producer_kind(kv, heads, ring.narrow, ring.config[0], ring.land_slots)[0] == "land"
    check_decode(module, device, problem, "gluon")
    tuned = module.get_decode_schedule(8, 1, device, backend="gluon", merge=merge, config=module.DECODE_GLUON_DEFAULT)
    assert tuned.land_slots == 1 and tuned.config == module.DECODE_GLUON_DEFAULT
    check_decode(module, device, {**problem, "config": tuned.config}, "gluon")


@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("page_size", [64, 128])
def test_gluon_fp8_two_row_blocks_match_the_reference(build_module, device, page_size, seqlen_q):
    """An fp8 cache with two row blocks of query rows (DeepSeek H128: the query fills the tile) is read row by row
    as 4-byte words a block ahead of its conversion (the converting producer): against the reference with page
    edges, an empty sequence, splits, NaN in every unused slot, Sq 1 and 2. GPU only."""
    require_gluon_gpu(build_module, device)
    problem = gpu_problem(
        heads=128,
        dc=512,
        page_size=page_size,
        cache_dtype="float8_e4m3fn",
        seqlen_q=seqlen_q,
        seqlens=[1, 63, 65, 0, 3 * page_size + 5, 700, 64, 1029],
        num_parts=None if seqlen_q == 1 else 13,
        min_blocks=None if seqlen_q == 1 else 1,
        seed=7100 + page_size + seqlen_q,
    )
    module = module_for(build_module, problem)
    kv = torch.empty(2, page_size, 1, 576, dtype=torch.float8_e4m3fn, device=device)
    assert module._gluon_producer_kind(kv, 128 * seqlen_q, 0)[0] == "convert"
    check_decode(module, device, problem, "gluon")


def rows_off_word_boundaries(cache: torch.Tensor) -> torch.Tensor:
    """The cache copied into a view whose rows are one element longer than they are wide and whose first
    element is one element past its storage's start (the gaps hold NaN): neither rows nor pages start on a
    4-byte word."""
    pages, page_size, one, width = cache.shape
    storage = torch.empty(1 + pages * page_size * (width + 1), dtype=cache.dtype, device=cache.device)
    if cache.element_size() == 1:
        storage.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    else:
        storage.fill_(float("nan"))
    view = storage[1:].view(pages, page_size, one, width + 1)[..., :width]
    view.copy_(cache)
    return view


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_cache_rows_off_word_boundaries(build_module, device, backend, cache_dtype):
    """A cache view whose rows and pages start off 4-byte words, with NaN in the gaps (no TMA boxes: the
    Gluon kernel gathers or converts rows at any alignment): the same results. GPU only: it is about the
    Gluon producers' paths, and under the interpreter (the portable kernel only) this geometry takes minutes."""
    if device.type != "cuda":
        pytest.skip("GPU only: the Gluon producers' paths; the interpreter runs the portable kernel only")
    require_backend(build_module, device, backend)
    problem = gpu_problem(
        heads=16,
        dc=512,
        page_size=64,
        cache_dtype=cache_dtype,
        seqlen_q=2,
        seqlens=[1, 63, 200, 0, 700],
        seed=41,
    )
    check_decode(module_for(build_module, problem), device, problem, backend, cache_view=rows_off_word_boundaries)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fanin", [2, 3, 8])
def test_fused_merge_trees(build_module, device, backend, fanin):
    """Sequences cut into up to 19 runs, merged by their runs up trees of 2, 3 or 8 results per step: deep
    trees, lone tail members and several sequences' trees in one launch; every call leaves the arrival
    counters at 0, so a second call with the same schedule (and workspace) is right too."""
    module, block_n = split_test_module(build_module, device, backend, "trees")
    seqlens = [19 * block_n - 3, 0, 5, 2 * block_n + 1]
    problem = split_problem(seqlens=seqlens, seqlen_q=2, num_parts=19, merge="fused", seed=fanin)
    with patch.object(module, "DECODE_MERGE_FANIN", fanin):
        check_decode(module, device, problem, backend, calls=2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6)
@given(
    runs=st.integers(2, 23),
    runs_per_step=st.sampled_from([2, 4, 64]),
    seqlen_q=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_combine_merges_many_runs_in_steps(build_module, device, backend, runs, runs_per_step, seqlen_q, seed):
    """The combine launch merges a sequence's runs runs_per_step at a time in one pass, rescaling its sums
    when a later step holds a larger LSE: one long sequence cut into up to 23 runs beside short and empty
    ones (a skewed small batch), against the reference; a second call on the same workspace too."""
    module, block_n = split_test_module(build_module, device, backend, "steps")
    problem = split_problem(
        seqlens=[3, runs * block_n - 1, 0, block_n + 2],
        seqlen_q=seqlen_q,
        num_parts=runs + 2,
        merge="kernel",
        seed=seed,
    )
    note(f"problem: {problem}")
    with patch.object(module, "DECODE_COMBINE_TILES", {(2, 16): runs_per_step}):
        check_decode(module, device, problem, backend, calls=2)


@triton.jit
def _schedule_of(
    SEQLENS,
    OUT,
    batch,
    num_parts,
    min_blocks,
    SPLIT_SCHEDULE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """A generated module's _split_schedule with SEQUENCE_RUNS: the padded block counts, then per_part."""
    offs_b = tl.arange(0, BLOCK_B)
    n_blocks, _, _, per_part = SPLIT_SCHEDULE(SEQLENS, offs_b, batch, num_parts, min_blocks, BLOCK_N, True)
    tl.store(OUT + offs_b, n_blocks)
    tl.store(OUT + BLOCK_B, per_part)


@settings(max_examples=25)
@given(
    blocks=st.lists(st.one_of(st.just(0), st.integers(1, 40), st.integers(41, 3000)), min_size=2, max_size=8),
    spare_runs=st.integers(0, 300),
    min_blocks=st.integers(1, 6),
)
def test_runs_of_one_sequence_each_fit_the_runs(build_module, device, blocks, spare_runs, min_blocks):
    """_split_schedule with SEQUENCE_RUNS: each sequence padded to whole runs, the runs fitting num_parts;
    per_part is the equal runs' length (at least min_blocks) where that fits, else the smaller of
    cdiv(blocks, num_parts - batch) and the longest sequence."""
    module = build_module(**{**SMALL_SPEC, "name": "schedule"})
    block_n = 16
    num_parts = len(blocks) + spare_runs
    # lengths in tokens: a sequence's last block is partial or full
    lens = torch.tensor([n * block_n - (n % 3 if n else 0) for n in blocks], dtype=torch.int32, device=device)
    out = torch.full((17,), -1, dtype=torch.int32, device=device)
    _schedule_of[(1,)](
        lens,
        out,
        len(blocks),
        num_parts,
        min_blocks,
        SPLIT_SCHEDULE=module._split_schedule,
        BLOCK_N=block_n,
        BLOCK_B=16,
    )
    per_part = int(out[16])
    padded = out[: len(blocks)].tolist()

    def runs(length):
        return sum(-(-n // length) for n in blocks)

    assert padded == [-(-n // per_part) * per_part for n in blocks]
    assert runs(per_part) <= num_parts
    shortest = max(-(-sum(blocks) // num_parts), min_blocks)
    fallback = min(-(-sum(blocks) // spare_runs), max(blocks)) if spare_runs else max(blocks)
    assert per_part == (shortest if runs(shortest) <= num_parts else max(fallback, shortest))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize("sequence_runs", [True, False])
def test_skewed_small_batch_with_and_without_runs_of_one_sequence(build_module, device, backend, merge, sequence_runs):
    """A skewed small batch (one long sequence beside short and empty ones), its runs of one sequence each
    or equal runs across sequences, both merges, against the reference; a second call on the same workspace
    too. The policy takes runs of one sequence each for the Gluon kernel's tall rows only; it is overruled
    here so that both kernels (and the shared combine) run both schedules, the portable ones on the CPU."""
    module, block_n = split_test_module(build_module, device, backend, "skewed")
    problem = split_problem(
        seqlens=[3 * block_n + 1, 11 * block_n - 2, 0, block_n + 2, 2], seqlen_q=2, num_parts=7, merge=merge, seed=11
    )
    with patch.object(runtime, "decode_sequence_runs", lambda *args, **kwargs: sequence_runs):
        schedule = module.get_decode_schedule(5, 2, device, num_parts=7, min_blocks_per_part=1, backend=backend)
        assert schedule.sequence_runs is sequence_runs
        check_decode(module, device, problem, backend, calls=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("merge", ["fused", "kernel"])
@pytest.mark.parametrize(("in_dtype", "keep"), [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_partial_rows_in_either_dtype_with_or_without_l2_hints(
    build_module, device, backend, merge, in_dtype, keep, dtype
):
    """Split sequences' partial rows stored in float32 or in the output's dtype (decode_partials_in_dtype), with
    or without the L2 hints on their stores and loads (decode_keep_partials), both merges, against the
    reference within the dtype's tolerance; the policies are overruled so that every backend runs each form (the
    partial rows' dtype through MLAGEN_DECODE_PARTIALS's option)."""
    module, block_n = split_test_module(build_module, device, backend, f"partials-{dtype}", dtype)
    problem = split_problem(
        seqlens=[9 * block_n - 3, 2 * block_n + 1, 0], seqlen_q=1, num_parts=6, merge=merge, seed=5, dtype=dtype
    )
    with (
        use_options(decode_partials="dtype" if in_dtype else "float32"),
        patch.object(runtime, "decode_keep_partials", lambda: keep),
    ):
        schedule = module.get_decode_schedule(3, 1, device, num_parts=6, min_blocks_per_part=1, backend=backend)
        assert schedule.keep_partials is keep
        assert schedule.workspace(device)[0].dtype == (module.DTYPE if in_dtype else torch.float32)
        check_decode(module, device, problem, backend, calls=2)


def test_default_call_and_softmax_scale(build_module, device):
    module = build_module(**{**DEEPSEEK_V3_TP8_SPEC, "name": "plain"})
    g = torch.Generator().manual_seed(7)
    inputs = make_decode_inputs(module, [130, 5], 1, g, device)
    out = module.mla_decode(**inputs)
    assert out.shape == (2, 1, 16, 512) and out.dtype == torch.bfloat16
    for scale in (None, 0.3):
        got = module.mla_decode(**inputs, softmax_scale=scale)
        want, _ = decode_reference(module, inputs, scale)
        assert not compare(got, want, "bfloat16")[2]
    # an explicit scale really changes the result (so the check above is not vacuous)
    assert compare(module.mla_decode(**inputs, softmax_scale=0.3), module.mla_decode(**inputs), "bfloat16")[2]


@pytest.mark.parametrize(
    ("argument", "mutate", "match"),
    [
        ("q", lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
        ("q", lambda a: a.update(q=a["q"][..., :-1]), "q: expected last dimension"),
        ("q", lambda a: a.update(q=a["q"][0]), "q: expected 4 dimensions"),
        ("q", lambda a: a.update(q=a["q"][:, :, :3]), "q: expected 4 heads"),
        ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache: expected dtype"),
        ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][:, :2]), "kv_cache: expected \\[num_pages, 4"),
        (
            "block_table",
            lambda a: a.update(block_table=a["block_table"].long()),
            "block_table: expected dtype",
        ),
        ("block_table", lambda a: a.update(block_table=a["block_table"][:1]), "block_table: batch size 1"),
        (
            "cache_seqlens",
            lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]),
            "cache_seqlens: batch size",
        ),
        (
            "cache_seqlens",
            lambda a: a.update(cache_seqlens=a["cache_seqlens"][None]),
            "cache_seqlens: expected 1",
        ),
        ("q", lambda a: a.update(q=a["q"].to("meta")), "q: a meta tensor holds no data"),
    ],
)
def test_bad_arguments_name_the_argument(build_module, device, argument, mutate, match):
    module = build_module(
        **{
            **SMALL_SPEC,
            "name": "args",
            "num_heads": 4,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "page_size": 4,
            "dtype": "bfloat16",
        }  # fmt: skip
    )
    inputs = make_decode_inputs(module, [5, 9], 1, torch.Generator().manual_seed(0), device)
    mutate(inputs)
    with pytest.raises(ValueError, match=match):
        module.mla_decode(**inputs)
