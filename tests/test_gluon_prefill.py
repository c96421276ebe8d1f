"""The Gluon prefill backend on the CPU: its plan, its rendered source, the prefill_backend option and how a
module chooses a backend.

The kernel itself cannot run here (Triton's interpreter does not run Gluon); on a GPU the property tests in
test_prefill.py run both backends.
"""

from __future__ import annotations

import ast

import pytest
import torch
from helpers import import_source
from hypothesis import given
from hypothesis import strategies as st

from mlagen_compiler.launch_policy import PREFILL_AUTO_GLUON, select_prefill_backend
from mlagen_compiler.module_file import module_source
from mlagen_compiler.options import Options, use_options
from mlagen_compiler.plan import (
    GLUON_MAX_SMEM,
    GLUON_PREFILL_BLOCK_NS,
    GLUON_PREFILL_LIVE_REGS,
    GLUON_PREFILL_MAX_STAGES,
    _gluon_prefill_live_regs,
    _gluon_prefill_smem_bytes,
    lower,
    lower_gluon_prefill,
)
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.spec import spec_from_dict

PREFILL_SPECS = sorted(name for name in registered_specs() if "prefill" in resolve_spec(name).kernels)


@pytest.mark.parametrize("name", PREFILL_SPECS)
def test_bundled_specs_render_gluon_prefill_source(name):
    spec = resolve_spec(name)
    plan = lower(spec).prefill.gluon
    assert plan.eligible, plan.reason
    assert plan.smem_bytes <= GLUON_MAX_SMEM and plan.num_stages >= 2 and plan.block_m == 2 * plan.warpgroup_rows
    source = module_source(spec)
    assert "def _mla_prefill_gluon_kernel(" in source and "_launch_prefill_gluon = _bind(_M, " in source
    assert "def _mla_prefill_gluon_persistent_kernel(" in source  # (the prefill_persistent option's variant)
    assert f"PREFILL_GLUON_BLOCK_N = {plan.block_n}" in source and f"PREFILL_GLUON_STAGES = {plan.num_stages}" in source
    # the tuning space and its default (today's tile) beside them
    assert f"PREFILL_GLUON_SPACE = {plan.space}" in source and f"PREFILL_GLUON_DEFAULT = {plan.default}" in source
    compile(source, f"<{name}>", "exec")


def _fits(dn, dr, dv, block_n, stages):
    """Whether a (block_n, stages) tile of the Gluon prefill fits its registers and shared memory."""
    plan = lower_gluon_prefill(dn, dr, dv)
    smem = _gluon_prefill_smem_bytes(dn, dr, dv, plan.block_m, block_n, stages)
    return (
        smem <= GLUON_MAX_SMEM and _gluon_prefill_live_regs(dv, plan.warpgroup_rows, block_n) <= GLUON_PREFILL_LIVE_REGS
    )


@pytest.mark.parametrize("name", PREFILL_SPECS)
def test_gluon_prefill_space_is_every_tile_that_fits(name):
    """The space `mlagen tune` times: every (block_n, stages) of the offered blocks and ring depths that fits
    registers and shared memory, largest block first; its default is the plan's tile (the largest block that fits,
    with the most stages beside it)."""
    spec = resolve_spec(name)
    dims = (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim)
    plan = lower(spec).prefill.gluon
    offered = [(n, s) for n in GLUON_PREFILL_BLOCK_NS for s in range(2, GLUON_PREFILL_MAX_STAGES + 1)]
    assert plan.space == tuple(c for c in offered if _fits(*dims, *c)) and len(set(plan.space)) == len(plan.space)
    assert plan.default == (plan.block_n, plan.num_stages) and plan.default in plan.space
    largest = max(n for n, _ in plan.space)
    assert plan.default == (largest, max(s for n, s in plan.space if n == largest))
    assert plan.smem_bytes == _gluon_prefill_smem_bytes(*dims, plan.block_m, *plan.default)


def test_gluon_prefill_space_of_deepseek_and_of_an_ineligible_geometry():
    # DeepSeek-V3: 128-key blocks fit two stages beside the 128-row query tile, 64-key blocks up to four
    plan = lower_gluon_prefill(128, 64, 128)
    assert plan.space == ((128, 2), (64, 2), (64, 3), (64, 4)) and plan.default == (128, 2)
    # where the Gluon prefill does not run, nothing to tune
    assert lower_gluon_prefill(48, 64, 128).space == ()
    assert lower_gluon_prefill(256, 256, 256).space == ()


def test_bundled_prefill_specs_exist():
    assert {"deepseek-v3-tp8", "deepseek-v3-tp1"} <= set(PREFILL_SPECS)
    # DeepSeek-V3 (qk 192 = 128 + 64, v 128): 128-key blocks, two stages beside the 128-row query tile
    plan = lower_gluon_prefill(128, 64, 128)
    assert (plan.block_m, plan.block_n, plan.num_stages) == (128, 128, 2)


@st.composite
def prefill_specs(draw):
    return dict(
        name="gluon-prefill-drawn",
        num_heads=draw(st.integers(1, 128)),
        kv_lora_rank=draw(st.sampled_from([64, 128, 256, 512])),
        qk_rope_head_dim=draw(st.sampled_from([16, 32, 48, 64, 128])),
        qk_nope_head_dim=draw(st.sampled_from([16, 32, 48, 64, 128, 256])),
        v_head_dim=draw(st.sampled_from([16, 32, 64, 80, 128, 256])),
        dtype=draw(st.sampled_from(["bfloat16", "float16"])),
        kernels=["prefill"],
    )


@given(fields=prefill_specs())
def test_drawn_geometry_renders_gluon_prefill_source_that_compiles(fields):
    spec = spec_from_dict(fields)
    plan = lower(spec).prefill.gluon
    dims = (fields["qk_nope_head_dim"], fields["qk_rope_head_dim"], fields["v_head_dim"])
    assert plan == lower_gluon_prefill(*dims)
    source = module_source(spec)
    tree = ast.parse(source)
    compile(tree, "<drawn>", "exec")
    assert ("def _mla_prefill_gluon_kernel(" in source) == plan.eligible
    # (the module's constant as Python reads it: a long reason is rendered as a literal wrapped over lines)
    (reason,) = (
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [ast.unparse(t) for t in node.targets] == ["PREFILL_GLUON_INELIGIBLE_REASON"]
    )
    assert reason == plan.reason
    if plan.eligible:
        assert all(d in (16, 32, 64, 128, 256) for d in dims) and plan.smem_bytes <= GLUON_MAX_SMEM
    else:
        assert plan.reason


@pytest.mark.parametrize(
    ("dims", "reason"),
    [
        ((48, 64, 128), "Dn = 48 is not a power of two in 16..256"),
        ((128, 48, 128), "Dr = 48 is not a power of two in 16..256"),
        ((128, 64, 80), "Dv = 80 is not a power of two in 16..256"),
        ((128, 64, 512), "Dv = 512 is not a power of two in 16..256"),
        ((256, 256, 256), "shared memory"),
    ],
)
def test_ineligible_geometries_say_why(dims, reason):
    plan = lower_gluon_prefill(*dims)
    assert not plan.eligible and reason in plan.reason


def test_show_names_the_prefill_backend():
    shown = lower(resolve_spec("deepseek-v3-tp8")).summary()["prefill"]["backend"]
    assert shown.startswith("gluon on compute capability 9.x") and "(auto or MLAGEN_PREFILL_BACKEND=gluon)" in shown
    odd = spec_from_dict(dict(name="odd", num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=48,
                              v_head_dim=80, kernels=["prefill"]))  # fmt: skip
    assert lower(odd).summary()["prefill"]["backend"] == (
        "triton (not gluon: Dn = 48 is not a power of two in 16..256; Dv = 80 is not a power of two in 16..256)"
    )


def test_prefill_backend_option():
    assert Options.from_env({}).prefill_backend == "auto"
    for value in ("auto", "gluon", "triton"):
        assert Options.from_env({"MLAGEN_PREFILL_BACKEND": value}).prefill_backend == value
    assert Options.from_env({"MLAGEN_PREFILL_BACKEND": " "}).prefill_backend == "auto"
    with pytest.raises(ValueError, match="^MLAGEN_PREFILL_BACKEND: expected auto, gluon or triton, got 'fast'$"):
        Options.from_env({"MLAGEN_PREFILL_BACKEND": "fast"})
    with pytest.raises(ValueError, match="^prefill_backend: expected auto, gluon or triton, got 'cuda'$"):
        Options(prefill_backend="cuda")
    assert Options(prefill_backend="gluon").environ()["MLAGEN_PREFILL_BACKEND"] == "gluon"


FACTS = dict(eligible=True, ineligible_reason="", gluon_error="", interpreting=False)


def test_prefill_persistent_option():
    """MLAGEN_PREFILL_PERSISTENT (0 / 1, default 0): the Gluon prefill's persistent variant, off unless asked."""
    assert Options.from_env({}).prefill_persistent is False and Options().prefill_persistent is False
    assert Options.from_env({"MLAGEN_PREFILL_PERSISTENT": "1"}).prefill_persistent is True
    assert Options.from_env({"MLAGEN_PREFILL_PERSISTENT": "0"}).prefill_persistent is False
    assert Options.from_env({"MLAGEN_PREFILL_PERSISTENT": " "}).prefill_persistent is False
    with pytest.raises(ValueError, match="^MLAGEN_PREFILL_PERSISTENT: expected 0 or 1, got 'yes'$"):
        Options.from_env({"MLAGEN_PREFILL_PERSISTENT": "yes"})
    with pytest.raises(ValueError, match="^prefill_persistent: expected True or False, got 1$"):
        Options(prefill_persistent=1)
    assert Options(prefill_persistent=True).environ()["MLAGEN_PREFILL_PERSISTENT"] == "1"
    assert hash(Options(prefill_persistent=True)) != hash(Options())  # (what prepared launches key on)


def test_prefill_tile_chunk_option():
    """MLAGEN_PREFILL_TILE_CHUNK (0-8, default 0): an int option, the persistent kernel's consecutive tiles a
    program (0: off)."""
    assert Options.from_env({}).prefill_tile_chunk == 0 and Options().prefill_tile_chunk == 0
    for text in ("1", "4", "8"):
        assert Options.from_env({"MLAGEN_PREFILL_TILE_CHUNK": text}).prefill_tile_chunk == int(text)
    assert Options.from_env({"MLAGEN_PREFILL_TILE_CHUNK": " 2 "}).prefill_tile_chunk == 2
    with pytest.raises(ValueError, match="^MLAGEN_PREFILL_TILE_CHUNK: expected 0, 1, 2, .* or 8, got '9'$"):
        Options.from_env({"MLAGEN_PREFILL_TILE_CHUNK": "9"})
    with pytest.raises(ValueError, match="^MLAGEN_PREFILL_TILE_CHUNK: expected 0, 1, 2, .* or 8, got '-1'$"):
        Options.from_env({"MLAGEN_PREFILL_TILE_CHUNK": "-1"})
    for wrong in ("2", True, 9, -1, 2.0):
        with pytest.raises(ValueError, match=f"^prefill_tile_chunk: expected an int in 0, 1, .* or 8, got {wrong!r}$"):
            Options(prefill_tile_chunk=wrong)
    assert Options(prefill_tile_chunk=3).environ()["MLAGEN_PREFILL_TILE_CHUNK"] == "3"
    assert hash(Options(prefill_tile_chunk=2)) != hash(Options())  # (what prepared launches key on)


def test_select_prefill_backend():
    # auto takes the Gluon kernel where it runs (PREFILL_AUTO_GLUON); with auto_gluon off it keeps the portable one
    assert PREFILL_AUTO_GLUON
    assert select_prefill_backend("auto", capability=(9, 0), **FACTS) == ("gluon", "")
    backend, reason = select_prefill_backend("auto", capability=(9, 0), auto_gluon=False, **FACTS)
    assert backend == "triton" and "host cost" in reason
    assert select_prefill_backend("gluon", capability=(9, 0), **FACTS) == ("gluon", "")
    assert select_prefill_backend("triton", capability=(9, 0), **FACTS)[0] == "triton"
    # config given: the portable kernel's knobs
    assert select_prefill_backend("auto", capability=(9, 0), knobs_given=True, auto_gluon=True, **FACTS)[0] == "triton"
    # where it cannot run, auto says why and gluon is an error naming it
    for capability, why in (((8, 0), "compute capability 8.0"), ((10, 0), "compute capability 10.0"),
                            (None, "not a CUDA device")):  # fmt: skip
        backend, reason = select_prefill_backend("auto", capability=capability, auto_gluon=True, **FACTS)
        assert backend == "triton" and why in reason
        with pytest.raises(ValueError, match=f"^MLAGEN_PREFILL_BACKEND: 'gluon' cannot run here: {why}"):
            select_prefill_backend("gluon", capability=capability, **FACTS)
    interpreting = {**FACTS, "interpreting": True}
    assert "interpreter" in select_prefill_backend("auto", capability=(9, 0), auto_gluon=True, **interpreting)[1]
    ineligible = {**FACTS, "eligible": False, "ineligible_reason": "Dv = 80 is not a power of two"}
    with pytest.raises(ValueError, match="geometry not taken by the Gluon prefill: Dv = 80"):
        select_prefill_backend("gluon", capability=(9, 0), **ineligible)
    with pytest.raises(ValueError, match="^backend: expected auto, gluon or triton, got 'x'$"):
        select_prefill_backend("x", capability=None, name="backend", **FACTS)


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    spec = resolve_spec("deepseek-v3-tp8")
    return import_source(module_source(spec), tmp_path_factory.mktemp("prefill_select"), "prefill_select")


def test_module_chooses_the_portable_prefill_on_a_cpu(module):
    cpu = torch.device("cpu")
    assert module.PREFILL_GLUON_ELIGIBLE and module.PREFILL_GLUON_INELIGIBLE_REASON == ""
    with use_options(Options.from_env({})):
        assert module.prefill_backend(cpu)[0] == "triton"
    with use_options(Options.from_env({"MLAGEN_PREFILL_BACKEND": "triton"})):
        assert module.prefill_backend(cpu) == ("triton", "MLAGEN_PREFILL_BACKEND=triton")
    gluon = use_options(Options.from_env({"MLAGEN_PREFILL_BACKEND": "gluon"}))
    with gluon, pytest.raises(ValueError, match="^MLAGEN_PREFILL_BACKEND: 'gluon' cannot run here"):
        module.prefill_backend(cpu)
    with pytest.raises(ValueError, match="^backend: 'gluon' cannot run here"):
        module.prefill_backend(cpu, "gluon")


def test_module_defines_the_gluon_prefill_under_its_triton(module):
    """Under a Triton release the Gluon prefill was verified with, the module defines it and its launch helpers."""
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    assert hasattr(module, "_mla_prefill_gluon_kernel") and hasattr(module, "_launch_prefill_gluon")
    # the TMA layouts it takes: heads dense, 16-byte rows and start; a strided view is copied first
    q = torch.empty(8, module.NUM_HEADS, module.QK_NOPE_HEAD_DIM + module.QK_ROPE_HEAD_DIM, dtype=module.DTYPE)
    assert module._gluon_prefill_tma_ok(q, q.shape[-1])
    assert not module._gluon_prefill_tma_ok(q[:, :, : module.QK_NOPE_HEAD_DIM], module.QK_NOPE_HEAD_DIM)
    rows = torch.empty(8, module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM, dtype=module.DTYPE)
    assert module._gluon_prefill_tma_ok(rows[:, module.KV_LORA_RANK :], module.QK_ROPE_HEAD_DIM)  # k_pe of the cache
    # the descriptors' boxes: a warpgroup's query rows (nope, rope), one key block (k_nope, k_pe, v)
    k_nope = torch.empty(8, module.NUM_HEADS * module.QK_NOPE_HEAD_DIM, dtype=module.DTYPE)
    v = torch.empty(8, module.NUM_HEADS * module.V_HEAD_DIM, dtype=module.DTYPE)
    descs = module._gluon_prefill_descriptors(q.view(8, -1), k_nope, rows[:, module.KV_LORA_RANK :], v, 128)
    rows_wg = module.PREFILL_GLUON_WARPGROUP_ROWS
    assert [list(d.block_shape) for d in descs] == [
        [rows_wg, module.QK_NOPE_HEAD_DIM],
        [rows_wg, module.QK_ROPE_HEAD_DIM],
        [128, module.QK_NOPE_HEAD_DIM],
        [128, module.QK_ROPE_HEAD_DIM],
        [128, module.V_HEAD_DIM],
    ]


@pytest.mark.parametrize("sections", [0, -1, 3, 1.5, True])
def test_a_wrong_section_count_is_a_one_line_error(module, sections):
    """sections (a probe's override of the tile order) outside 1..pairs is refused before anything launches."""
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    q, k_nope = torch.randn(8, heads, dn + dr).to(module.DTYPE), torch.randn(8, heads, dn).to(module.DTYPE)
    k_pe, v = torch.randn(8, dr).to(module.DTYPE), torch.randn(8, heads, dv).to(module.DTYPE)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out = torch.full_like(v, float("nan"))
    bad = sections if sections != 3 else heads + 1  # one more than the (sequence, head) pairs
    with pytest.raises(ValueError, match=rf"^sections: must be an int in 1\.\.{heads} "):
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, 8, out, None, 0.1, True, sections=bad)
    assert out.isnan().all()


def test_gluon_prefill_layouts_are_made_once(module):
    """The descriptors' shared layouts are cached per box: the same object each call, equal to a fresh one."""
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    rows, dn = module.PREFILL_GLUON_WARPGROUP_ROWS, module.QK_NOPE_HEAD_DIM
    layout = module._gluon_prefill_layout(rows, dn)
    assert module._gluon_prefill_layout(rows, dn) is layout
    assert layout == module.gl.NVMMASharedLayout.get_default_for([rows, dn], module._GLUON_PREFILL_DTYPE)


def test_gluon_prefill_goes_through_the_runtimes_launch_with_a_stable_key(module, monkeypatch):
    """_launch_prefill_gluon launches through runtime._launch (Triton's dispatch once per argument key, the
    compiled kernel's launcher after that); its arguments' key is hashable, the same for two calls of one shape,
    and the same for another token count (the descriptors' sizes, the LSE's stride and the do_not_specialize
    ints are keyed by what Triton reads of an int), so a prefill of a new length reuses the compiled kernel."""
    from mlagen_compiler import runtime

    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    launches = []

    def capture(kernel, grid, *args, num_warps, num_stages=None, **constexprs):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    monkeypatch.setattr(runtime, "_launch", capture)
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM

    def key(tokens, store_lse=True):
        q = torch.empty(tokens, heads, dn + dr, dtype=module.DTYPE)
        k_nope = torch.empty(tokens, heads, dn, dtype=module.DTYPE)
        k_pe = torch.empty(tokens, dr, dtype=module.DTYPE)
        v = torch.empty(tokens, heads, dv, dtype=module.DTYPE)
        cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
        out = torch.empty(tokens, heads, dv, dtype=module.DTYPE)
        lse = torch.empty(heads, tokens, dtype=torch.float32) if store_lse else None
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, tokens - tokens // 2, out, lse, 0.125, True)
        kernel, grid, args, constexprs, num_warps, num_stages = launches.pop()
        assert kernel is module._mla_prefill_gluon_kernel and num_warps == 4 and num_stages is None
        assert runtime._grid3(grid) == (2 * heads * -(-(tokens - tokens // 2) // module.PREFILL_GLUON_BLOCK_M), 1, 1)
        values = runtime._ordered_values(kernel, args, constexprs)
        assert len(values) == len(kernel.params)
        result = runtime._launch_key(kernel, values, tuple(runtime._launch_options(num_warps, None).items()))
        hash(result)
        return result

    assert key(300) == key(300)
    assert key(300) == key(302) == key(4098)  # (token counts of one class: not 1, not a multiple of 16, 32-bit)
    assert key(320) == key(4096)
    assert key(300) != key(300, store_lse=False)


def test_the_persistent_kernel_takes_the_same_arguments(module):
    """_mla_prefill_gluon_persistent_kernel: the tile-per-program kernel's arguments and constexprs, and one more
    int after sections, chunk; the same ints left unspecialised, chunk too (every chunk is one compile: a launch
    of either differs only in kernel, grid and chunk)."""
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    tiled, persistent = module._mla_prefill_gluon_kernel, module._mla_prefill_gluon_persistent_kernel
    at = tiled.arg_names.index("sections") + 1
    assert persistent.arg_names == [*tiled.arg_names[:at], "chunk", *tiled.arg_names[at:]]
    chunk = persistent.params[at]
    assert chunk.do_not_specialize and not chunk.is_constexpr
    others = persistent.params[:at] + persistent.params[at + 1 :]
    assert [p.do_not_specialize for p in others] == [p.do_not_specialize for p in tiled.params]
    assert [p.is_constexpr for p in others] == [p.is_constexpr for p in tiled.params]


def _normal(value):
    """A launch argument as compared (each launch has tensors of its own): a tensor by how it lies, a descriptor by
    its box and what it covers."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if hasattr(value, "block_shape"):
        return ("descriptor", list(value.shape), list(value.block_shape))
    return value


def _gluon_launch(module, monkeypatch, lengths, **kwargs):
    """The (kernel, grid, named arguments) _launch_prefill_gluon issues for packed causal sequences of `lengths`
    (captured at runtime._launch: nothing runs)."""
    from mlagen_compiler import runtime

    launches = []

    def capture(kernel, grid, *args, num_warps, num_stages=None, per_call=None, **constexprs):
        launches.append((kernel, runtime._grid3(grid), dict(zip(kernel.arg_names, args, strict=False)), constexprs))

    monkeypatch.setattr(runtime, "_launch", capture)
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    tokens = sum(lengths)
    q = torch.empty(tokens, heads, dn + dr, dtype=module.DTYPE)
    k_nope, k_pe = torch.empty(tokens, heads, dn, dtype=module.DTYPE), torch.empty(tokens, dr, dtype=module.DTYPE)
    v, out = torch.empty(tokens, heads, dv, dtype=module.DTYPE), torch.empty(tokens, heads, dv, dtype=module.DTYPE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, max(lengths), out, None, 0.125, True, **kwargs)
    (launch,) = launches
    return launch


@pytest.mark.parametrize("lengths", [(300,), (1000, 17, 129), (1,)])
def test_the_option_launches_the_persistent_kernel(module, monkeypatch, lengths):
    """With prefill_persistent on, _launch_prefill_gluon launches the persistent kernel on at most a program per SM
    (runtime._sm_count: INTERPRETER_SM_COUNT off a GPU), its arguments those of the tile-per-program launch; off
    (the default), the tile-per-program kernel on one program a tile."""
    from mlagen_compiler import runtime

    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    tiles = len(lengths) * module.NUM_HEADS * -(-max(lengths) // module.PREFILL_GLUON_BLOCK_M)
    with use_options(prefill_persistent=False):
        kernel, grid, args, constexprs = _gluon_launch(module, monkeypatch, lengths)
    assert kernel is module._mla_prefill_gluon_kernel and grid == (tiles, 1, 1)
    with use_options(prefill_persistent=True):
        p_kernel, p_grid, p_args, p_constexprs = _gluon_launch(module, monkeypatch, lengths)
    assert p_kernel is module._mla_prefill_gluon_persistent_kernel
    assert p_grid == (min(tiles, runtime._sm_count(torch.device("cpu"))), 1, 1)
    assert p_constexprs == constexprs
    assert p_args.pop("chunk") == 0  # (the stride)
    assert {name: _normal(value) for name, value in p_args.items()} == {
        name: _normal(value) for name, value in args.items()
    }
    # the argument wins over the option; programs (a test's or probe's) bounds the grid
    with use_options(prefill_persistent=False):
        assert _gluon_launch(module, monkeypatch, lengths, persistent=True)[0] is p_kernel
        assert _gluon_launch(module, monkeypatch, lengths, persistent=True, programs=1)[1] == (1, 1, 1)
    with use_options(prefill_persistent=True):
        assert _gluon_launch(module, monkeypatch, lengths, persistent=False)[0] is kernel
        assert _gluon_launch(module, monkeypatch, lengths, programs=10**6)[1] == (tiles, 1, 1)


@pytest.mark.parametrize("programs", [0, -1, 1.5, True])
def test_a_wrong_program_count_is_a_one_line_error(module, programs):
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    q, k_nope = torch.randn(8, heads, dn + dr).to(module.DTYPE), torch.randn(8, heads, dn).to(module.DTYPE)
    k_pe, v = torch.randn(8, dr).to(module.DTYPE), torch.randn(8, heads, dv).to(module.DTYPE)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out = torch.full_like(v, float("nan"))
    with pytest.raises(ValueError, match="^programs: must be an int >= 1, and only with the persistent kernel"):
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, 8, out, None, 0.1, True, persistent=True,
                                     programs=programs)  # fmt: skip
    with pytest.raises(ValueError, match="^programs: must be an int >= 1, and only with the persistent kernel"):
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, 8, out, None, 0.1, True, persistent=False,
                                     programs=2)  # fmt: skip
    assert out.isnan().all()


@pytest.mark.parametrize("lengths", [(300,), (1000, 17, 129), (1,)])
@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_the_chunk_option_launches_the_persistent_kernel_a_program_per_chunk(module, monkeypatch, lengths, chunk):
    """With prefill_tile_chunk = N > 0, _launch_prefill_gluon launches the persistent kernel (whatever
    prefill_persistent says) with chunk N on ceil(tiles / N) programs, its other arguments those of the
    tile-per-program launch; chunk= wins over the option, and persistent=False keeps the tile-per-program kernel."""
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    tiles = len(lengths) * module.NUM_HEADS * -(-max(lengths) // module.PREFILL_GLUON_BLOCK_M)
    kernel, grid, args, constexprs = _gluon_launch(module, monkeypatch, lengths, persistent=False)
    for persistent in (False, True):
        with use_options(prefill_persistent=persistent, prefill_tile_chunk=chunk):
            c_kernel, c_grid, c_args, c_constexprs = _gluon_launch(module, monkeypatch, lengths)
        assert c_kernel is module._mla_prefill_gluon_persistent_kernel
        assert c_grid == (-(-tiles // chunk), 1, 1) and c_constexprs == constexprs
        assert c_args.pop("chunk") == chunk
        assert {name: _normal(value) for name, value in c_args.items()} == {
            name: _normal(value) for name, value in args.items()
        }
    with use_options(prefill_tile_chunk=chunk):
        assert _gluon_launch(module, monkeypatch, lengths, persistent=False)[:2] == (kernel, grid)
        # (chunk=0 turns the option's chunks off: the tile-per-program kernel, as prefill_persistent is off)
        assert _gluon_launch(module, monkeypatch, lengths, chunk=0)[:2] == (kernel, grid)
    with use_options(prefill_tile_chunk=0):
        _, c_grid, c_args, _ = _gluon_launch(module, monkeypatch, lengths, chunk=chunk)
        assert c_grid == (-(-tiles // chunk), 1, 1) and c_args["chunk"] == chunk


@pytest.mark.parametrize(
    "kwargs",
    [dict(chunk=-1), dict(chunk=1.5), dict(chunk=True), dict(chunk=2, persistent=False), dict(chunk=2, programs=4)],
)
def test_a_wrong_chunk_is_a_one_line_error(module, kwargs):
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    heads, dn, dr, dv = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM
    q, k_nope = torch.randn(8, heads, dn + dr).to(module.DTYPE), torch.randn(8, heads, dn).to(module.DTYPE)
    k_pe, v = torch.randn(8, dr).to(module.DTYPE), torch.randn(8, heads, dv).to(module.DTYPE)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out = torch.full_like(v, float("nan"))
    message = (
        "^programs: must be an int >= 1, and only with the persistent kernel's stride \\(chunk 0\\), got 4$"
        if "programs" in kwargs
        else f"^chunk: must be an int >= 0, and > 0 only with the persistent kernel, got {kwargs['chunk']!r}$"
    )
    with pytest.raises(ValueError, match=message):
        module._launch_prefill_gluon(q, k_nope, k_pe, v, cu, cu, 8, out, None, 0.1, True, **kwargs)
    assert out.isnan().all()


@given(pairs=st.integers(1, 40), m_blocks=st.integers(1, 12), chunk=st.integers(1, 9))
def test_chunked_programs_take_consecutive_tiles_each_once(pairs, m_blocks, chunk):
    """The persistent kernel's chunked schedule (chunk > 0), its bounds written out as _gluon_prefill_tiles computes
    them: on ceil(tiles / chunk) programs, program p walks tiles first = p * chunk up to end = min(first + chunk,
    tiles) with step 1, so every tile is one program's exactly once, in the tile-per-program order, and no program
    is empty."""
    tiles = pairs * m_blocks
    grid = -(-tiles // chunk)
    walked = []
    for pid in range(grid):
        first = pid * chunk
        end = min(first + chunk, tiles)
        mine = list(range(first, end, 1))
        assert mine and len(mine) <= chunk
        walked += mine
    assert walked == list(range(tiles))


@given(pairs=st.integers(1, 40), m_blocks=st.integers(1, 12), sections=st.integers(1, 40), programs=st.integers(1, 20))
def test_persistent_programs_take_every_tile_once_heaviest_first(pairs, m_blocks, sections, programs):
    """The persistent kernel's schedule, in Python: program p takes tiles p, p + programs, ... of the
    tile-per-program kernel's order (_gluon_prefill_tile's, written out here as the kernel computes it), so every
    (pair, row block) is one program's exactly once, and each program's tiles come heaviest (last row block)
    first within a section."""
    sections = min(sections, pairs)
    small = pairs // sections
    large_pairs = (pairs % sections) * (small + 1)

    def tile_of(tile):
        in_large = tile < large_pairs * m_blocks
        if in_large:
            first_pair = tile // ((small + 1) * m_blocks) * (small + 1)
        else:
            first_pair = large_pairs + (tile - large_pairs * m_blocks) // (small * m_blocks) * small
        in_section = small + 1 if in_large else small
        rank = tile - first_pair * m_blocks
        return first_pair + rank % in_section, m_blocks - 1 - rank // in_section

    tiles = pairs * m_blocks
    grid = min(tiles, programs)
    taken = [tile_of(tile) for p in range(grid) for tile in range(p, tiles, grid)]
    assert sorted(taken) == [(pair, m) for pair in range(pairs) for m in range(m_blocks)]
    for p in range(grid):
        mine = [tile_of(tile) for tile in range(p, tiles, grid)]
        for (pair, m), (next_pair, next_m) in zip(mine, mine[1:], strict=False):
            # (a section's pairs are in [first_pair, first_pair + in_section): a later tile of the same section
            # never has a heavier row block)
            if (pair < large_pairs) == (next_pair < large_pairs) and (
                pair // (small + 1) == next_pair // (small + 1)
                if pair < large_pairs
                else (pair - large_pairs) // small == (next_pair - large_pairs) // small
            ):
                assert next_m <= m


def test_a_geometry_the_gluon_prefill_rejects_renders_no_gluon_prefill():
    spec = spec_from_dict(dict(name="no-gluon-prefill", num_heads=4, kv_lora_rank=96, qk_rope_head_dim=16,
                               qk_nope_head_dim=48, v_head_dim=80, kernels=["prefill"]))  # fmt: skip
    assert not lower(spec).prefill.gluon.eligible
    source = module_source(spec)
    assert "_mla_prefill_gluon_kernel" not in source and "PREFILL_GLUON_ELIGIBLE = False" in source
    assert "PREFILL_GLUON_SPACE = ()" in source
    compile(source, "<no-gluon-prefill>", "exec")
