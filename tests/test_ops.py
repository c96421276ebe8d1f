"""A generated module's kernels as torch.library custom ops (`module.ops`): the ops pass
torch.library.opcheck, return what the plain wrappers return, trace with torch.compile(fullgraph=True),
live in a namespace of their own per module source, and are registered once per process however often
the same file is imported."""

import math
import shutil

import pytest
import torch
from helpers import SMALL_SPEC

from mlagen_compiler import compile_spec, import_module_from_path, reference, runtime, spec_from_dict
from mlagen_compiler.options import use_options
from mlagen_compiler.verify import LSE_TOLERANCE, TOLERANCES

FIELDS = {
    **SMALL_SPEC, "name": "ops", "num_heads": 2, "qk_nope_head_dim": 16, "v_head_dim": 16, "page_size": 4,
    "kernels": ["decode", "prefill"],
}  # fmt: skip
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # as in conftest


@pytest.fixture
def module(build_module):
    return build_module(**FIELDS)


def inputs(module, seed=0):
    """Small random arguments of every op: two sequences, prefixes of 7 and 3 cached tokens."""
    g = torch.Generator().manual_seed(seed)
    h, dc, dr, dn, dv = (module.NUM_HEADS, module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM, module.QK_NOPE_HEAD_DIM,
                         module.V_HEAD_DIM)  # fmt: skip

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(module.DTYPE).to(DEVICE)

    def ints(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    kv = rand(6, module.PAGE_SIZE, 1, dc + dr)
    lengths = [7, 3]
    mha = (rand(5, h, dn + dr), rand(5, h, dn), rand(5, dr), rand(5, h, dv), ints([0, 3, 5]), 3)
    return {
        "decode": (rand(2, 2, h, dc + dr), kv, ints([[4, 1], [0, 5]]), ints(lengths)),
        "prefill": mha,
        "chunked_prefill": (*mha, kv, ints([[4, 1], [0, 5]]), ints(lengths), rand(h, dn, dc), rand(h, dv, dc), 10),
        "cache_write": (rand(3, dc), rand(3, dr), kv.clone(), ints([5, -1, 22], torch.int64)),
    }


@pytest.mark.parametrize("name", ["decode", "prefill", "chunked_prefill", "cache_write"])
def test_opcheck(module, name):
    torch.library.opcheck(getattr(module.ops, name), inputs(module)[name])


def test_ops_return_what_the_wrappers_return(module):
    args = inputs(module)
    for name, wrapper in [("decode", module.mla_decode), ("prefill", module.mla_prefill)]:
        out, lse = getattr(module.ops, name)(*args[name])
        want, want_lse = wrapper(*args[name], return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), name
    *mha, kv, table, prefix, w_uk, w_uv, total = args["chunked_prefill"]
    out, lse = module.ops.chunked_prefill(*args["chunked_prefill"], softmax_scale=0.25)
    want, want_lse = module.mla_chunked_prefill(*mha, kv, table, prefix, w_uk, w_uv, softmax_scale=0.25,
                                                return_lse=True, num_prefix_tokens=total)  # fmt: skip
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    c_kv, k_pe, cache, slots = args["cache_write"]
    expected = module.mla_cache_write(c_kv, k_pe, cache.clone(), slots)
    assert module.ops.cache_write(c_kv, k_pe, cache, slots) is None and torch.equal(cache, expected)


def test_fake_outputs_have_the_real_shapes_and_dtypes(module):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = inputs(module)
    for name in ("decode", "prefill", "chunked_prefill"):
        real = getattr(module.ops, name)(*args[name])
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = getattr(module.ops, name)(*args[name])
        assert [(t.shape, t.dtype, t.device) for t in fake] == [(t.shape, t.dtype, t.device) for t in real], name


def test_a_step_compiles_with_fullgraph(module):
    """Cache write, decode and prefill in one function under torch.compile(fullgraph=True): a graph break
    would raise; the compiled function gives the eager results."""
    args = inputs(module)
    c_kv, k_pe, _, slots = args["cache_write"]
    q, kv, table, lengths = args["decode"]

    def step(kv):
        module.ops.cache_write(c_kv, k_pe, kv, slots)
        out, lse = module.ops.decode(q, kv, table, lengths)
        pre, _ = module.ops.prefill(*args["prefill"], softmax_scale=0.5)
        return out.float().sum(-1) + lse.transpose(1, 2), pre * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_kv, compiled_kv = kv.clone(), kv.clone()
    want = step(eager_kv)
    got = compiled(compiled_kv)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(compiled_kv, eager_kv) and not torch.equal(compiled_kv, kv)  # the write happened


def test_namespace_is_an_identifier_per_module_source(module, build_module):
    namespace = module.ops.namespace
    assert namespace == module.OPS_NAMESPACE and namespace.isidentifier() and namespace.startswith("mlagen_ops_")
    other = build_module(**{**FIELDS, "page_size": 8})  # same name, other kernels
    assert other.ops.namespace != namespace and other.ops.decode is not module.ops.decode
    args = inputs(other)
    out, _ = other.ops.decode(*args["decode"])
    assert torch.equal(out, other.mla_decode(*args["decode"]))  # each module runs its own kernels


def test_importing_the_same_file_twice_keeps_the_first_registration(module, tmp_path, monkeypatch):
    """A second copy of the module (another path, as `load()` beside a vendored `generated/` file) imports
    without error and shares the ops, which keep running the first copy's functions: torch.library would
    otherwise have replaced the registration behind the first copy's back."""
    copy = tmp_path / "again" / f"{FIELDS['name']}.py"
    copy.parent.mkdir()
    shutil.copy(module.__file__, copy)
    again = import_module_from_path(copy)
    assert again is not module and again.ops.namespace == module.ops.namespace
    assert again.ops.cache_write is module.ops.cache_write and again.ops.decode is module.ops.decode
    calls = []
    monkeypatch.setattr(module, "mla_cache_write", lambda *args, **kwargs: calls.append("first"))
    monkeypatch.setattr(again, "mla_cache_write", lambda *args, **kwargs: calls.append("second"))
    again.ops.cache_write(*inputs(module)["cache_write"])
    assert calls == ["first"]


def test_a_spec_with_another_source_gets_another_namespace(tmp_path):
    """Two modules of one spec that differ in their rendered source (here: tuned configurations) never share
    ops, even loaded together."""
    spec = spec_from_dict({**FIELDS, "name": "ops-tuned"})
    plain = import_module_from_path(compile_spec(spec, tmp_path / "plain"))
    tuned = import_module_from_path(compile_spec(spec, tmp_path / "tuned", {"decode": {"sm90|*|m16": [32, 4, 3]}}))
    assert plain.SPEC_HASH == tuned.SPEC_HASH and plain.ops.namespace != tuned.ops.namespace


def test_decode_op_plans_once_per_batch_shape(module, monkeypatch):
    plans = []
    plan = module.get_decode_schedule
    monkeypatch.setattr(module, "get_decode_schedule", lambda *a, **k: plans.append(a[:2]) or plan(*a, **k))
    monkeypatch.setattr(module, "_DEFAULT_SCHEDULES", {})
    q, kv, table, lengths = inputs(module)["decode"]
    for _ in range(3):
        module.ops.decode(q, kv, table, lengths)
    module.ops.decode(q[:, :1], kv, table, lengths)
    assert plans == [(2, 2), (2, 1)]


def test_bad_arguments_are_the_wrappers_one_line_errors(module):
    q, kv, table, lengths = inputs(module)["decode"]
    with pytest.raises(ValueError, match=r"^q: expected 4 dimensions, got shape \(2, 2, 80\)$"):
        module.ops.decode(q[:, :, 0], kv, table, lengths)
    table[1, 0] = 99
    with pytest.raises(ValueError, match=r"^block_table\[1, 0\] = 99: a page used by its sequence"):
        module.ops.decode(q, kv, table, lengths)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_op_captures_in_a_cuda_graph(module):
    with use_options(validate=False):  # validation synchronises: not capturable
        q, kv, table, lengths = inputs(module)["decode"]
        want, want_lse = module.ops.decode(q, kv, table, lengths)  # compiles the kernels, plans the schedule
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = module.ops.decode(q, kv, table, lengths)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _ops_in_graph(fn, *args):
    """fn compiled with fullgraph=True (aot_eager) and called on args: its result, and the custom ops its graph
    calls (the ones of a module's namespace, by name)."""
    called = []

    def backend(graph, example_inputs):
        called.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(graph, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)(*args), called


def test_plain_entry_points_trace_through_the_ops(module):
    """A function calling the plain mla_cache_write, mla_decode, mla_prefill and mla_chunked_prefill compiles
    with fullgraph=True (their calls become the module's ops in the graph) and gives the eager results."""
    args = inputs(module)
    c_kv, k_pe, _, slots = args["cache_write"]
    q, kv, table, lengths = args["decode"]
    *mha, _, _, prefix, w_uk, w_uv, total = args["chunked_prefill"]

    def step(kv):
        module.mla_cache_write(c_kv, k_pe, kv, slots)
        out, lse = module.mla_decode(q, kv, table, lengths, return_lse=True, empty_lse=math.inf)
        alone = module.mla_decode(q, kv, table, lengths, causal=False, softmax_scale=0.3)
        pre = module.mla_prefill(*args["prefill"], softmax_scale=0.5)
        chunk, chunk_lse = module.mla_chunked_prefill(
            *mha, kv, table, prefix, w_uk, w_uv, return_lse=True, num_prefix_tokens=total
        )
        return out, lse, alone, pre, chunk, chunk_lse

    eager_kv, compiled_kv = kv.clone(), kv.clone()
    want = step(eager_kv)
    got, called = _ops_in_graph(step, compiled_kv)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(compiled_kv, eager_kv) and not torch.equal(compiled_kv, kv)  # the write happened
    namespace = module.ops.namespace
    assert sorted(name for name in called if namespace in name) == sorted(
        f"{namespace}.{op}" for op in ("cache_write", "decode", "decode", "prefill", "chunked_prefill")
    )
    # and the reference (against which the suite checks the eager calls), within verify's tolerances
    ref, ref_lse = reference.decode_paged(q, eager_kv, table, lengths, module.KV_LORA_RANK, module.SOFTMAX_SCALE)
    tolerance = TOLERANCES[str(module.DTYPE).removeprefix("torch.")]
    torch.testing.assert_close(got[0].double(), ref.double(), atol=tolerance["atol"], rtol=tolerance["rtol"])
    torch.testing.assert_close(got[1].double(), ref_lse.double(), **LSE_TOLERANCE)


@pytest.fixture
def checked_path_only():
    """Every decode call through the checked path (no prepared launches), for tests that watch that path."""
    with use_options(direct_launch=False):
        yield


def test_a_traced_call_keeps_its_schedule_and_buffers(module, monkeypatch, checked_path_only):
    """schedule=, out= and lse= under torch.compile: the op runs on the very schedule given (by its handle) and the
    results land in the given buffers; another schedule is another graph."""
    q, kv, table, lengths = inputs(module)["decode"]
    fused = module.get_decode_schedule(2, 2, DEVICE, merge="fused", num_parts=5, min_blocks_per_part=1)
    combine = module.get_decode_schedule(2, 2, DEVICE, merge="kernel", num_parts=3, min_blocks_per_part=1)
    used = []
    checked = runtime.mla_decode_checked
    monkeypatch.setattr(runtime, "mla_decode_checked", lambda m, *a: used.append(a[7]) or checked(m, *a))

    def call(schedule, out, lse):
        return module.mla_decode(q, kv, table, lengths, schedule=schedule, out=out, lse=lse, return_lse=True)

    out = torch.empty(2, 2, module.NUM_HEADS, module.KV_LORA_RANK, dtype=module.DTYPE, device=DEVICE)
    lse = torch.empty(2, module.NUM_HEADS, 2, device=DEVICE)
    want = [call(s, None, None) for s in (fused, combine)]
    used.clear()
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    for schedule, (want_out, want_lse) in zip((fused, combine), want, strict=True):
        got_out, got_lse = compiled(schedule, out, lse)
        assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert used == [fused, combine]


def test_traced_calls_say_what_cannot_be_traced(module):
    """What a graph cannot hold is a one-line error while tracing (fullgraph=True: dynamo reports the error it
    met, with its message), and a schedule the graph outlives is one when the graph runs."""
    q, kv, table, lengths = inputs(module)["decode"]
    *mha, _, _, prefix, w_uk, w_uv, _ = inputs(module)["chunked_prefill"]

    def compiled(fn):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager")

    # dynamo words the ValueError it met differently across torch releases (torch 2.11 on the GPU machine:
    # "ValueError([ConstantVariable(str: '...')])"): the match is on the message
    with pytest.raises(Exception, match=r"ValueError.{0,40}schedule: expected a DecodeSchedule from this module's"):
        compiled(lambda: module.mla_decode(q, kv, table, lengths, schedule="fused"))()
    with pytest.raises(Exception, match=r"ValueError.{0,40}num_prefix_tokens: required under torch.compile"):
        compiled(lambda: module.mla_chunked_prefill(*mha, kv, table, prefix, w_uk, w_uv))()
    schedule = module.get_decode_schedule(2, 2, DEVICE)
    handle = schedule._handle
    assert runtime.schedule_of_handle(handle) is schedule
    del schedule
    with pytest.raises(ValueError, match=r"^schedule: the DecodeSchedule this compiled graph was traced with no lon"):
        runtime.schedule_of_handle(handle)


def test_eager_calls_never_reach_the_ops(module, monkeypatch):
    """Outside tracing the plain entry points run as before: no op dispatch (the ops poisoned here), the same
    results as the ops give."""
    args = inputs(module)
    want = {name: getattr(module.ops, name)(*args[name]) for name in ("decode", "prefill")}
    monkeypatch.setattr(module, "ops", None)  # any op call would raise
    assert not torch.compiler.is_compiling()
    out, lse = module.mla_decode(*args["decode"], return_lse=True)
    assert torch.equal(out, want["decode"][0]) and torch.equal(lse, want["decode"][1])
    out, lse = module.mla_prefill(*args["prefill"], return_lse=True)
    assert torch.equal(out, want["prefill"][0]) and torch.equal(lse, want["prefill"][1])
    c_kv, k_pe, cache, slots = args["cache_write"]
    assert module.mla_cache_write(c_kv, k_pe, cache, slots) is cache


def test_an_fp8_modules_scale_traces_as_a_number_or_a_tensor(build_module):
    """An fp8 cache's kv_scale under torch.compile: a number becomes a tensor in the graph, a tensor goes in as it
    is; both give the eager results, and a bad number is the plain call's one-line error."""
    module = build_module(**{**FIELDS, "name": "ops-fp8", "kernels": ["decode"], "cache_dtype": "float8_e4m3fn"})
    args = inputs(module)
    c_kv, k_pe, _, slots = args["cache_write"]
    q, kv, table, lengths = args["decode"]
    kv = torch.zeros(kv.shape, dtype=module.CACHE_DTYPE, device=DEVICE)
    scale = torch.tensor([0.25], device=DEVICE)

    def step(kv, kv_scale):
        module.mla_cache_write(c_kv, k_pe, kv, slots, kv_scale=kv_scale)
        return module.mla_decode(q, kv, table, lengths, kv_scale=kv_scale, return_lse=True)

    for kv_scale in (0.25, scale):
        eager_kv, compiled_kv = kv.clone(), kv.clone()
        want = step(eager_kv, kv_scale)
        got, called = _ops_in_graph(step, compiled_kv, kv_scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert torch.equal(compiled_kv.view(torch.uint8), eager_kv.view(torch.uint8))
        assert sum(module.ops.namespace in name for name in called) == 2
    with pytest.raises(Exception, match=r"ValueError.{0,40}kv_scale: must be a finite number > 0"):
        _ops_in_graph(step, kv.clone(), -1.0)
