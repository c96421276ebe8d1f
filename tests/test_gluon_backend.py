"""The Gluon decode backend on the CPU: its plan, its rendered source, and how a module chooses a backend.

The kernels themselves cannot run here (Triton's interpreter does not run Gluon); on a GPU the property
tests in test_decode.py run them for every backend.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import triton
from helpers import import_source
from hypothesis import given
from hypothesis import strategies as st

from mlagen_compiler.module_file import module_source
from mlagen_compiler.options import Options, use_options
from mlagen_compiler.plan import GLUON_VERIFIED_TRITON, lower, lower_gluon_decode
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import spec_from_dict

GEOMETRY = dict(qk_nope_head_dim=64, v_head_dim=64)


@pytest.mark.parametrize("name", sorted(registered_specs()))
def test_bundled_specs_render_gluon_source(name):
    spec = resolve_spec(name)
    plan = lower(spec).decode.gluon
    assert plan.eligible, plan.reason
    assert plan.convert_cache == spec.cache_format.scaled  # an fp8 cache: converted by the producer into float16 stages
    source = module_source(spec)
    assert "def _mla_decode_gluon_kernel(" in source and "gl.warp_specialize(" in source
    # the fp8 converters and landing rings only where the cache is fp8 (a 16-bit cache's module never runs them)
    fp8 = ("def _gluon_producer_convert(", "def _gluon_land_issuer(", "def _fp8_e4m3_round(", "_GLUON_LAYOUT_LAND")
    for fragment in fp8:
        assert (fragment in source) == spec.cache_format.scaled, fragment
    compile(source, f"<{name}>", "exec")


@st.composite
def gluon_specs(draw):
    dc = draw(st.sampled_from([128, 256, 512]))
    dr = draw(st.sampled_from([16, 32, 64, 128]))
    return dict(
        name="gluon-drawn",
        num_heads=draw(st.integers(1, 256)),
        kv_lora_rank=dc,
        qk_rope_head_dim=dr,
        page_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])),
        dtype=draw(st.sampled_from(["bfloat16", "float16"])),
        cache_dtype=draw(st.sampled_from([None, "float8_e4m3fn"])),
        **GEOMETRY,
    )


@given(fields=gluon_specs())
def test_drawn_geometry_renders_gluon_source_that_compiles(fields):
    spec = spec_from_dict(fields)
    plan = lower(spec).decode.gluon
    source = module_source(spec)
    compile(source, "<drawn>", "exec")
    assert ("def _mla_decode_gluon_kernel(" in source) == plan.eligible
    if plan.eligible:
        assert plan.dc_half * 2 == fields["kv_lora_rank"] and plan.num_stages >= 2
        assert plan.convert_cache == (fields["cache_dtype"] is not None)
        assert plan == lower_gluon_decode(fields["kv_lora_rank"], fields["qk_rope_head_dim"], fields["cache_dtype"])
        assert f"DECODE_GLUON_STAGES = {plan.num_stages}" in source
    else:
        assert plan.reason and repr(plan.reason) in source


@pytest.mark.parametrize(
    ("dc", "dr", "reason"),
    [
        (320, 64, "Dc/2 = 160 is not a power of two"),
        (1024, 64, "Dc/2 = 512 is not a power of two"),
        (64, 16, "Dc/2 = 32 is not a power of two"),
        (256, 48, "Dr = 48 is not a power of two"),
        (512, 128, "shared memory"),
    ],
)
def test_ineligible_geometries_say_why(dc, dr, reason):
    plan = lower_gluon_decode(dc, dr)
    assert not plan.eligible and reason in plan.reason


def test_stages_fill_shared_memory():
    assert lower_gluon_decode(512, 64).num_stages == 2  # 72 KB query tile + 2 x 72 KB stages
    assert lower_gluon_decode(256, 64).num_stages == 4
    assert all(lower_gluon_decode(dc, 64).smem_bytes <= 232448 for dc in (128, 256, 512))


def test_the_narrow_form_is_wider_in_large_batches_with_a_16_bit_cache():
    for dc in (256, 512):
        plan = lower_gluon_decode(dc, 64)
        assert (plan.narrow_rows, plan.narrow_rows_large_batch, plan.narrow_large_batch) == (16, 32, 64)
        assert lower_gluon_decode(dc, 64, "float8_e4m3fn").narrow_rows_large_batch == 16


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    spec = spec_from_dict(dict(name="select-me", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, **GEOMETRY))
    return import_source(module_source(spec), tmp_path_factory.mktemp("select"), "select_me")


def test_environment_variable_forces_a_backend(module):
    import torch

    cpu = torch.device("cpu")
    with use_options(Options.from_env({"MLAGEN_DECODE_BACKEND": "triton"})):
        schedule = module.get_decode_schedule(2, 1, cpu)
    assert schedule.backend == "triton" and "MLAGEN_DECODE_BACKEND=triton" in schedule.backend_reason
    assert "backend='triton'" in repr(schedule)
    gluon = use_options(Options.from_env({"MLAGEN_DECODE_BACKEND": "gluon"}))
    with gluon, pytest.raises(ValueError, match="MLAGEN_DECODE_BACKEND: 'gluon' cannot run here"):
        module.get_decode_schedule(2, 1, cpu)
    with pytest.raises(ValueError, match="^MLAGEN_DECODE_BACKEND: expected auto, gluon or triton, got 'fast'$"):
        Options.from_env({"MLAGEN_DECODE_BACKEND": "fast"})
    with use_options(Options.from_env({})):
        assert module.get_decode_schedule(2, 1, cpu).backend == "triton"  # auto, on a CPU


def test_unverified_triton_release_imports_without_gluon_kernels(tmp_path):
    """Under a Triton release the Gluon code was not verified with, the module imports and falls back."""
    spec = spec_from_dict(dict(name="future", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, **GEOMETRY))
    source = module_source(spec)
    unverified = f"{max(GLUON_VERIFIED_TRITON)[0]}.{max(GLUON_VERIFIED_TRITON)[1] + 3}.0"
    with patch.object(triton, "__version__", unverified):
        module = import_source(source, tmp_path, "future")
    assert f"triton {unverified} is not a release the Gluon decode was verified with" in module._GLUON_IMPORT_ERROR
    assert not hasattr(module, "_mla_decode_gluon_kernel")
    backend, reason = module.select_decode_backend(
        "auto",
        eligible=True,
        ineligible_reason="",
        gluon_error=module._GLUON_IMPORT_ERROR,
        interpreting=False,
        capability=(9, 0),
    )
    assert backend == "triton" and unverified in reason


def test_gluon_api_missing_falls_back(monkeypatch, tmp_path):
    spec = spec_from_dict(dict(name="no-gluon", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, **GEOMETRY))
    source = module_source(spec)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # "import ... gluon" raises
    module = import_source(source, tmp_path, "no_gluon")
    if module.TRITON_VERSION in GLUON_VERIFIED_TRITON:
        assert "triton.experimental.gluon is unusable" in module._GLUON_IMPORT_ERROR
    assert module._GLUON_IMPORT_ERROR and not hasattr(module, "_mla_decode_gluon_kernel")


def test_a_wrong_merge_names_where_it_came_from(module):
    import torch

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="^merge: expected auto, fused or kernel, got 'both'$"):
        module.get_decode_schedule(2, 1, cpu, merge="both")
    with pytest.raises(ValueError, match="^MLAGEN_DECODE_MERGE: expected auto, fused or kernel, got 'fast'$"):
        Options.from_env({"MLAGEN_DECODE_MERGE": "fast"})
    with pytest.raises(ValueError, match="^decode_merge: expected auto, fused or kernel, got 'fast'$"):
        Options(decode_merge="fast")
    with use_options(Options.from_env({"MLAGEN_DECODE_MERGE": "fused"})):
        assert module.get_decode_schedule(2, 1, cpu).merge == "fused"


@pytest.mark.parametrize("name", ["deepseek-v3-tp8-fp8", "deepseek-v3-tp8"])
def test_gluon_producer_kind(tmp_path, name):
    """Which producer fills the Gluon stages: an fp8 cache lands by TMA in the query tile's lower half where
    Sq * H takes at most its upper half and every block lies in one page of a TMA-addressable cache, else it
    is converted row by row (byte by byte where rows are off 4-byte words); a 16-bit cache goes by TMA boxes or
    is gathered. Only shapes, strides and the address are read (CPU tensors do)."""
    import torch

    spec = resolve_spec(name)
    module = import_source(module_source(spec), tmp_path, name.replace("-", "_"))
    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")
    width, page = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM, module.PAGE_SIZE
    cache = torch.empty(4, page, 1, width, dtype=module.CACHE_DTYPE)
    rows_off = torch.empty(4, page, 1, width + 8, dtype=module.CACHE_DTYPE)[..., :width]  # a row stride != width
    half = module.DECODE_GLUON_LAND_ROWS
    assert half == module.DECODE_GLUON_BLOCK_M // 2  # the landing zone is the tile's lower half
    scaled = module.CACHE_FORMAT.scaled

    def producer_kind(cache, rows):  # the narrow form as the schedule plans it
        return module._gluon_producer_kind(cache, rows, module.gluon_narrow_rows(rows, module.DECODE_GLUON_NARROW_ROWS))

    assert producer_kind(cache, half)[0] == ("land" if scaled else "tma")
    assert producer_kind(cache, half + 1)[0] == ("convert" if scaled else "tma")
    assert producer_kind(rows_off, 16)[0] == ("convert" if scaled else "gather")
    # rows off 4-byte words: an fp8 cache is read byte by byte
    rows_off_words = torch.empty(4, page, 1, width + 1, dtype=module.CACHE_DTYPE)[..., :width]
    assert producer_kind(rows_off_words, 16)[0] == ("convert_bytes" if scaled else "gather")
    # a cache starting on a 4-byte word but not on 16 bytes reads bytes too: a prepared launch is reused across
    # caches whose layout and 16-byte alignment match, and one starting off a word has the same
    shift = 4 // torch.empty(0, dtype=module.CACHE_DTYPE).element_size()  # elements in 4 bytes
    strided = torch.empty(4 * page * (width + 8) + shift, dtype=module.CACHE_DTYPE)[shift:]
    word_start = strided.view(4, page, 1, width + 8)[..., :width]
    assert word_start.data_ptr() % 16 == 4
    assert producer_kind(word_start, 16)[0] == ("convert_bytes" if scaled else "gather")
    with patch.object(module, "PAGE_SIZE", module.DECODE_GLUON_BLOCK_N // 2):  # pages smaller than a block
        small = torch.empty(8, page // 2, 1, width, dtype=module.CACHE_DTYPE)
        assert producer_kind(small, 16)[0] == ("convert" if scaled else "gather")
    kind, warps, regs = producer_kind(cache, 16)
    if scaled:
        # the landing boxes: the query's 64-column chunks half a tile tall, the cache's one block tall
        q = torch.empty(16, width, dtype=module.DTYPE)
        descs = module._gluon_launch_descriptors(q, cache, kind)
        assert [list(d.block_shape) for d in descs] == [[half, 64], [half, 64], [64, 64], [64, 64]]
        assert descs[2].base.dtype == module.CACHE_DTYPE
        # 16 rows: the narrow form, with more converting warps; 17..32 rows keep the 64-row accumulator
        assert (warps, regs) == (module.DECODE_GLUON_NARROW_LAND_WARPS, module.DECODE_GLUON_LAND_REGS)
        assert producer_kind(cache, 17)[1] == module.DECODE_GLUON_LAND_WARPS


def test_fp8_module_selects_gluon_on_hopper(tmp_path):
    """An fp8-cache module holds the Gluon kernels (with the converting producer) and chooses them on a
    compute capability 9.x GPU; elsewhere, and when asked, the portable kernel."""
    spec = resolve_spec("deepseek-v3-tp8-fp8")
    module = import_source(module_source(spec), tmp_path, "fp8_select")
    assert module.CACHE_FORMAT.scaled and module.DECODE_GLUON_ELIGIBLE and module.DECODE_GLUON_INELIGIBLE_REASON == ""
    facts = dict(
        eligible=module.DECODE_GLUON_ELIGIBLE,
        ineligible_reason=module.DECODE_GLUON_INELIGIBLE_REASON,
        gluon_error=module._GLUON_IMPORT_ERROR,
        interpreting=False,
    )
    backend, reason = module.select_decode_backend("auto", capability=(9, 0), **facts)
    if module._GLUON_IMPORT_ERROR:  # a Triton release the Gluon code was not verified with
        assert backend == "triton" and reason
        return
    assert hasattr(module, "_gluon_producer_convert")
    assert backend == "gluon", reason
    assert module.select_decode_backend("auto", capability=(8, 0), **facts)[0] == "triton"
    assert module.select_decode_backend("triton", capability=(9, 0), **facts)[0] == "triton"


def test_a_geometry_the_gluon_plan_rejects_renders_no_gluon_code():
    spec = spec_from_dict(dict(name="no-gluon", num_heads=4, kv_lora_rank=96, qk_rope_head_dim=16, **GEOMETRY))
    assert not lower(spec).decode.gluon.eligible
    source = module_source(spec)
    assert "@gluon.jit" not in source and "triton.experimental" not in source and "_mla_decode_gluon" not in source
    compile(source, "<no-gluon>", "exec")


def test_both_backends_share_one_split_schedule_and_merge():
    """The split-KV schedule and the fused merge have one home: the @triton.jit functions of the portable kernels,
    which the Gluon kernel calls too (a @gluon.jit function may call a @triton.jit one whose tensors it gives
    layouts). No Gluon copy of them is rendered, so the backends cannot drift apart."""
    source = module_source(resolve_spec("deepseek-v3-tp8"))
    shared = ("_split_schedule", "_sequence_run_blocks", "_run_extent", "_run_piece", "_merge_group",
              "_arrive_and_merge", "_write_empty_sequences")  # fmt: skip
    for name in shared:
        assert source.count(f"\ndef {name}(") == 1, name
        assert f"@triton.jit\ndef {name}(" in source, name
    gluon = source[source.index(" def _gluon_merge_pieces(") : source.index(" _GLUON_DTYPE = ")]
    for call in ("_split_schedule(", "_run_extent(", "_run_piece(", "_arrive_and_merge(", "_write_empty_sequences("):
        assert call in gluon, call
    for twin in ("_gluon_split_schedule", "_gluon_sequence_run_blocks", "_gluon_piece(", "_gluon_merge_group"):
        assert twin not in source, twin


@pytest.mark.parametrize("flags", [[], ["--sequence-runs", "--empty-inf"], ["--combine-kernel"]])
def test_gluon_kernel_with_the_shared_functions_compiles_for_sm90(module, flags):
    """The Gluon kernel, calling the shared schedule and merge, compiles for sm_90a offline (Triton's front end,
    passes and ptxas; no GPU), in a process of its own (the offline driver replaces the active one)."""
    import subprocess

    if module._GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon kernels are not defined under this Triton: {module._GLUON_IMPORT_ERROR}")

    root = Path(__file__).resolve().parent.parent
    tool = root / "benchmarks" / "gluon_offline_compile.py"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    # (this tree first, then what the caller's path holds: a GPU machine's wheels live there)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    for name in ("deepseek_v3_tp8.py", "deepseek_v3_tp8_fp8.py"):
        done = subprocess.run(
            [sys.executable, str(tool), str(root / "generated" / name), *flags],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "'resources': 'REG:" in done.stdout, done.stdout
