"""Decode launches prepared once per tensor layout and schedule (_PreparedLaunch, decode_signature).

A call whose tensors have the layout of an earlier, fully checked call with the same schedule skips the
checks and only puts its tensors into the prepared launches: these tests pin what must send a call back
to the checks (another shape, strides, dtype, alignment, schedule) and that results stay right.
"""

import pytest
import torch
import triton
from helpers import SMALL_SPEC

from mlagen_compiler import runtime
from mlagen_compiler.options import use_options
from mlagen_compiler.verify import compare_with_lse, decode_reference, make_decode_inputs

SPEC = {**SMALL_SPEC, "name": "prepared", "num_heads": 4, "page_size": 4, "dtype": "bfloat16"}


def decode_and_check(module, inputs, schedule=None, **kwargs):
    got, got_lse = module.mla_decode(**inputs, return_lse=True, schedule=schedule, **kwargs)
    want, want_lse = decode_reference(module, inputs)
    _, _, message = compare_with_lse(got, got_lse, want, want_lse, "bfloat16")
    assert not message, message


def fresh_inputs(module, device, seed, seqlens=(5, 9)):
    return make_decode_inputs(module, list(seqlens), 1, torch.Generator().manual_seed(seed), device)


def test_a_later_call_reuses_the_launch_with_its_own_tensors(build_module, device):
    module = build_module(**SPEC)
    schedule = module.get_decode_schedule(2, 1, device, num_parts=3, min_blocks_per_part=1)
    for seed in range(3):  # new tensors (new addresses, new values) of one layout each time
        inputs = fresh_inputs(module, device, seed)
        decode_and_check(module, inputs, schedule)
    assert len(schedule._launches) == 1
    (launches,) = schedule._launches.values()
    workspace = schedule.workspace(inputs["q"].device)  # (keyed by the tensors' device: cuda:0, not cuda)
    for launch in launches:  # the template keeps no call's tensor alive
        call_tensors = [v for v in launch.values if isinstance(v, torch.Tensor)]
        assert all(any(v is w for w in workspace) for v in call_tensors)


def test_another_layout_is_checked_and_prepared_again(build_module, device):
    module = build_module(**SPEC)
    schedule = module.get_decode_schedule(2, 1, device, num_parts=3, min_blocks_per_part=1)
    inputs = fresh_inputs(module, device, 0)
    decode_and_check(module, inputs, schedule)
    # other strides: q inside a wider buffer
    q = inputs["q"]
    wide = torch.zeros(*q.shape[:-1], q.shape[-1] + 8, dtype=q.dtype, device=device)
    wide[..., : q.shape[-1]] = q
    decode_and_check(module, {**inputs, "q": wide[..., : q.shape[-1]]}, schedule)
    # not 16-byte aligned: q one element into a flat buffer
    flat = torch.zeros(q.numel() + 1, dtype=q.dtype, device=device)
    misaligned = flat[1:].view(q.shape)
    misaligned.copy_(q)
    assert misaligned.data_ptr() % 16
    decode_and_check(module, {**inputs, "q": misaligned}, schedule)
    # more pages in the cache
    pages = inputs["kv_cache"]
    decode_and_check(module, {**inputs, "kv_cache": torch.cat([pages, pages[:1]])}, schedule)
    assert len(schedule._launches) == 4


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(q=a["q"].float()), "q: expected dtype"),
        (lambda a: a.update(q=a["q"][:1]), "block_table: batch size 2"),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table: expected dtype"),
        (lambda a: a.update(cache_seqlens=a["cache_seqlens"] + 1000), "cache_seqlens\\[0\\] = 1005"),
    ],
)
def test_a_prepared_launch_does_not_skip_a_failing_check(build_module, device, mutate, match):
    module = build_module(**SPEC)
    for schedule in (module.get_decode_schedule(2, 1, device), None):  # given, and a bare call's
        inputs = fresh_inputs(module, device, 0)
        decode_and_check(module, inputs, schedule)
        mutate(inputs)
        with pytest.raises(ValueError, match=match):
            module.mla_decode(**inputs, schedule=schedule)


def test_a_schedule_of_another_module_is_refused_after_warm_up(build_module, device):
    module = build_module(**SPEC)
    other = build_module(**{**SPEC, "name": "prepared-other"})
    inputs = fresh_inputs(module, device, 0)
    schedule = other.get_decode_schedule(2, 1, device)
    other.mla_decode(**inputs, schedule=schedule)
    module.mla_decode(**inputs, schedule=module.get_decode_schedule(2, 1, device))
    with pytest.raises(ValueError, match="schedule: planned by another module"):
        module.mla_decode(**inputs, schedule=schedule)


def test_given_and_allocated_outputs_are_different_signatures(build_module, device):
    module = build_module(**SPEC)
    schedule = module.get_decode_schedule(2, 1, device)
    inputs = fresh_inputs(module, device, 1)
    first = module.mla_decode(**inputs, schedule=schedule)
    out = torch.full_like(first, float("nan"))
    again = module.mla_decode(**inputs, schedule=schedule, out=out)
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, first)
    assert module.mla_decode(**inputs, schedule=schedule).data_ptr() != first.data_ptr()  # a new output
    assert len(schedule._launches) == 2


def test_allocated_outputs_are_fresh_and_contiguous_lse_rows_shared_only_when_not_returned(build_module, device):
    module = build_module(**SPEC)
    inputs = fresh_inputs(module, device, 2)
    for schedule in (module.get_decode_schedule(2, 1, device), None):
        calls = [module.mla_decode(**inputs, schedule=schedule, return_lse=True) for _ in range(3)]  # 2 prepared
        for out, lse in calls:
            assert out.shape == (2, 1, module.NUM_HEADS, module.KV_LORA_RANK) and out.is_contiguous()
            assert lse.shape == (2, module.NUM_HEADS, 1) and lse.is_contiguous() and lse.dtype == torch.float32
            assert torch.equal(out, calls[0][0]) and torch.equal(lse, calls[0][1])
        assert len({t.data_ptr() for call in calls for t in call}) == 6  # every returned tensor its own
        outs = [module.mla_decode(**inputs, schedule=schedule) for _ in range(2)]
        assert outs[0].data_ptr() != outs[1].data_ptr() and torch.equal(outs[0], calls[0][0])


class _RecordingKernel:
    """Stands in for a JIT function: records the arguments of each launch."""

    arg_names = ["A", "DESC", "WORK", "N", "X"]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.launches.append((grid, args, options))


def test_prepared_launch_puts_in_tensors_and_remakes_descriptors():
    kernel = _RecordingKernel()

    def call_tensors():
        return torch.randn(8, 16), torch.randn(32, 24)

    a, b = call_tensors()
    work = torch.zeros(4)
    descriptor = runtime.TensorDescriptor(b[:, 8:], [32, 16], [24, 1], [16, 16])
    launch = runtime._PreparedLaunch(kernel, (2,), (a, b), (work,), (a, descriptor, work, 7), {"X": 3}, num_warps=4)
    assert launch.reusable
    assert not any(v is a or v is b for v in launch.values)
    a2, b2 = call_tensors()
    launch.launch((a2, b2))
    grid, args, options = kernel.launches[-1]
    assert grid == (2, 1, 1) and options == {"num_warps": 4}
    assert args[0] is a2 and args[2] is work and args[3:] == (7, 3)
    remade = args[1]
    assert remade.base.data_ptr() == b2.data_ptr() + 8 * b2.element_size()
    assert torch.equal(remade.base, b2[:, 8:])
    assert (remade.shape, remade.strides, remade.block_shape) == ([32, 16], [24, 1], [16, 16])


def test_prepared_launch_is_not_reusable_with_a_per_call_copy():
    a, b = torch.randn(8, 16), torch.randn(32, 16)
    copied = runtime.TensorDescriptor(b.clone(), [32, 16], [16, 1], [16, 16])
    args = (a, copied, torch.zeros(4), 7)
    assert not runtime._PreparedLaunch(_RecordingKernel(), (1,), (a, b), (), args, {"X": 3}, num_warps=4).reusable
    unowned = (a, None, torch.zeros(4), 7)
    assert not runtime._PreparedLaunch(_RecordingKernel(), (1,), (a, b), (), unowned, {"X": 3}, num_warps=4).reusable


# ---- the raw launch (_RawLaunch): Triton's own launcher code, with the C launcher and the driver faked ----

_TRITON_36 = triton.__version__.startswith("3.6.")


class _RecordingCLaunch:
    """Stands in for the compiled C launcher (`mod.launch`): records each argument list."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _FakeUtils:
    def __init__(self):
        self.encoded = []

    def fill_tma_descriptor(self, address, swizzle, elem_size, elem_type, block, shape, strides, padding):
        self.encoded.append(address)
        return (
            "tensor map",
            address,
            swizzle,
            elem_size,
            elem_type,
            tuple(block),
            tuple(shape),
            tuple(strides),
            padding,
        )


class _FakeDriver:
    """triton.runtime.driver.active on a GPU machine, as far as the launches read it."""

    def __init__(self):
        self.utils = _FakeUtils()
        self.stream = 77

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return self.stream


class _FakeCompiled:
    """A CompiledKernel whose `run` is Triton's CudaLauncher over a recording C launcher."""

    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, 0xF00, (4, 1, 1024)
        self.hooked = []

    def __getitem__(self, grid):  # the launch with a launch hook installed
        return lambda *args: self.hooked.append((grid, args))


class _CompilingKernel:
    """Stands in for a JIT function whose dispatch returns `compiled` (as Triton's does)."""

    def __init__(self, arg_names, compiled):
        self.arg_names, self.compiled, self.dispatched = arg_names, compiled, 0

    def __getitem__(self, grid):
        def dispatch(*args, **options):
            self.dispatched += 1
            return self.compiled

        return dispatch


_SIGNATURE = {
    "A": "*bf16",
    "DESC": "tensordesc<bf16[16, 16]>",
    "WORK": "*fp32",
    "PDESC": "tensordesc<bf16[8, 16]>",
    "N": "i32",
    "S": "fp32",
    "NONE": "constexpr",
    "X": "constexpr",
}
_DESCRIPTOR_META = [
    {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [16, 16], "fp4_padded": False},
    None,
]  # the second lowered to a pointer


def _cuda_launcher(c_launch, signature=_SIGNATURE, meta=_DESCRIPTOR_META):
    """Triton's CudaLauncher as its __init__ leaves it, minus the compiled C module (c_launch stands in)."""
    from triton.backends.nvidia import driver

    launcher = object.__new__(driver.CudaLauncher)
    launcher.num_ctas = 1
    launcher.launch = driver.wrap_handle_tensordesc(c_launch, signature, meta)
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, False
    return launcher


def _raw_setup(module, monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    monkeypatch.setattr(runtime, "_INTERPRET", False)
    c_launch = _RecordingCLaunch()
    compiled = _FakeCompiled(_cuda_launcher(c_launch))
    kernel = _CompilingKernel(list(_SIGNATURE), compiled)

    def call_tensors():
        return torch.randn(8, 16), torch.randn(32, 24), torch.randn(40, 16)

    a, b, c = call_tensors()
    work = torch.zeros(4)
    args = (
        a,
        runtime.TensorDescriptor(b[:, 8:], [32, 16], [24, 1], [16, 16]),
        work,
        runtime.TensorDescriptor(c[8:], [32, 16], [16, 1], [8, 16]),
        7,
        0.5,
        None,
    )
    launch = runtime._PreparedLaunch(kernel, (2, 3), (a, b, c), (work,), args, {"X": 3}, num_warps=4)
    return fake, c_launch, compiled, kernel, launch, call_tensors


def _described(inputs):
    """The address of the first descriptor's base (b[:, 8:]) for a call's tensors (a, b, c)."""
    return inputs[1].data_ptr() + 8 * inputs[1].element_size()


def _as_addresses(arguments):
    """Triton's launcher passes tensors (the C launcher reads their data_ptr): the raw launch, their addresses."""
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in arguments)


@pytest.mark.skipif(not _TRITON_36, reason="the raw launch is written against Triton 3.6's launcher")
def test_raw_launch_passes_what_tritons_launcher_passes(build_module, monkeypatch):
    module = build_module(**SPEC)
    fake, c_launch, compiled, kernel, launch, call_tensors = _raw_setup(module, monkeypatch)
    launch.launch(call_tensors())  # the first launch: Triton's dispatch, then the raw launch is prepared
    assert kernel.dispatched == 1 and launch.raw is not None and not c_launch.calls
    for stream in (77, 78):  # the stream is read at every launch
        fake.stream = stream
        inputs = call_tensors()
        launch.launch(inputs)
        raw = c_launch.calls.pop()
        runtime._launch_compiled(compiled, launch.grid, launch.arguments(inputs), 0)  # CudaLauncher, its `inner`
        want = _as_addresses(c_launch.calls.pop())
        assert raw == want
        assert raw[:13] == (2, 3, 1, stream, 0xF00, False, False, None, None, (4, 1, 1024), None, None, None)
        a, b, c = inputs
        assert raw[13] == a.data_ptr()
        assert raw[14][:2] == ("tensor map", b.data_ptr() + 8 * b.element_size())  # encoded at b[:, 8:]
        assert raw[15:19] == (32, 16, 24, 1)
        assert raw[20] == c.data_ptr() + 8 * 16 * c.element_size()  # the pointer-lowered descriptor's base
    assert kernel.dispatched == 1


@pytest.mark.skipif(not _TRITON_36, reason="the raw launch is written against Triton 3.6's launcher")
def test_raw_launch_encodes_a_descriptor_once_per_address(build_module, monkeypatch):
    module = build_module(**SPEC)
    fake, c_launch, compiled, kernel, launch, call_tensors = _raw_setup(module, monkeypatch)
    inputs = call_tensors()
    launch.launch(inputs)
    assert len(fake.utils.encoded) == 1  # the first launch's expansion
    for _ in range(3):  # the same tensors again: no encoding
        launch.launch(inputs)
    assert len(fake.utils.encoded) == 1
    moved = call_tensors()  # another address: encoded once, then kept
    launch.launch(moved)
    launch.launch(moved)
    assert fake.utils.encoded[1:] == [_described(moved)]
    launch.launch(inputs)  # the first address is still kept
    assert len(fake.utils.encoded) == 2
    monkeypatch.setattr(runtime, "_RAW_DESCRIPTORS_MAX", 2)  # full: the oldest goes
    third = call_tensors()
    launch.launch(third)
    launch.launch(inputs)
    assert len(fake.utils.encoded) == 4
    assert fake.utils.encoded[2:] == [_described(third), _described(inputs)]  # (the first went when third came)
    assert [call[14][1] for call in c_launch.calls[-3:]] == [_described(t) for t in (inputs, third, inputs)]


@pytest.mark.skipif(not _TRITON_36, reason="the raw launch is written against Triton 3.6's launcher")
def test_raw_launch_gives_way_to_launch_hooks(build_module, monkeypatch):
    module = build_module(**SPEC)
    _, c_launch, compiled, _, launch, call_tensors = _raw_setup(module, monkeypatch)
    launch.launch(call_tensors())
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata):
        pass

    hooks.add(hook)
    try:
        inputs = call_tensors()
        launch.launch(inputs)
    finally:
        hooks.remove(hook)
    assert not c_launch.calls and len(compiled.hooked) == 1  # through CompiledKernel[grid], which calls hooks
    assert compiled.hooked[0][1][0] is inputs[0]
    launch.launch(inputs)
    assert len(c_launch.calls) == 1


def test_raw_launch_is_declined_for_a_launcher_of_another_structure():
    c_launch = _RecordingCLaunch()

    def other_wrapper(*args):  # not Triton 3.6's `inner`
        return c_launch(*args)

    launcher = _cuda_launcher(c_launch)
    parts = runtime._cuda_launcher_parts(_FakeCompiled(launcher))
    assert (parts is not None) == _TRITON_36  # Triton 3.9's CudaLauncher wraps another structure
    launcher.launch = other_wrapper
    assert runtime._cuda_launcher_parts(_FakeCompiled(launcher)) is None
    launcher.launch = c_launch  # no descriptor argument: the C function itself (3.6), an argument list apart (3.9)
    assert (runtime._cuda_launcher_parts(_FakeCompiled(launcher)) is not None) == _TRITON_36
    launcher.global_scratch_size = 64  # scratch allocated per launch: Triton's launcher does it
    assert runtime._cuda_launcher_parts(_FakeCompiled(launcher)) is None
    assert runtime._cuda_launcher_parts(_FakeCompiled(object())) is None  # not a CudaLauncher
    # only the releases whose launcher source was read take it
    assert (runtime.TRITON_VERSION in runtime._RAW_LAUNCH_RELEASES) == runtime._raw_launch()
    with use_options(raw_launch=False):
        assert not runtime._raw_launch()
    with use_options(direct_launch=False):
        assert not runtime._raw_launch()
    assert runtime._RAW_LAUNCH_RELEASES == ((3, 6),)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the raw launch runs compiled kernels (GPU)")
@pytest.mark.parametrize("page_size", [4, 64])  # 64: the cache (and wide query blocks) through TMA descriptors
def test_raw_launch_gives_the_results_of_tritons_launcher(build_module, device, page_size):
    module = build_module(**{**SPEC, "name": f"prepared-raw-{page_size}", "page_size": page_size})
    schedule = module.get_decode_schedule(2, 1, device, num_parts=5, min_blocks_per_part=1)
    seqlens = (300, 700)
    decode_and_check(module, fresh_inputs(module, device, 0, seqlens), schedule)
    (launches,) = schedule._launches.values()
    assert all((launch.raw is not None) == runtime._raw_launch() for launch in launches)
    if runtime._raw_launch() and page_size == 64:
        assert any(launch.raw.map_slots for launch in launches)
    for seed in (1, 2):  # new tensors at new addresses: tensor maps encoded for them
        inputs = fresh_inputs(module, device, seed, seqlens)
        raw = module.mla_decode(**inputs, schedule=schedule, return_lse=True)
        kept = [launch.raw for launch in launches]
        for launch in launches:
            launch.raw = None  # Triton's launcher (_launch_compiled)
        try:
            plain = module.mla_decode(**inputs, schedule=schedule, return_lse=True)
        finally:
            for launch, saved in zip(launches, kept, strict=True):
                launch.raw = saved
        assert torch.equal(raw[0], plain[0]) and torch.equal(raw[1], plain[1])
        decode_and_check(module, inputs, schedule)


class _HookRecordingKernel:
    """Stands in for a JIT kernel: records the compile hooks installed when it is dispatched."""

    def __init__(self, gluon: bool):
        self.gluon = gluon
        self.seen = []

    def is_gluon(self):
        return self.gluon

    def __getitem__(self, grid):
        def dispatch(*args, **options):
            runtime = triton.knobs.runtime
            self.seen.append((runtime.jit_cache_hook, runtime.jit_post_compile_hook, grid, args, options))
            return f"compiled {grid}"

        return dispatch


@pytest.mark.parametrize("gluon", [True, False])
def test_dispatch_sets_compile_hooks_aside_for_gluon_kernels_only(monkeypatch, gluon):
    # Triton hands compile hooks the constexprs as JSON, which a Gluon layout is not (vLLM installs such a hook)

    def cache_hook(**kwargs):
        return None

    def post_compile_hook(**kwargs):
        return None

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", cache_hook)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", post_compile_hook)
    kernel = _HookRecordingKernel(gluon)
    assert runtime._dispatch(kernel, (3, 1, 1), (1, 2), {"num_warps": 4}) == "compiled (3, 1, 1)"
    hooks_seen = kernel.seen[0][:2]
    assert hooks_seen == ((None, None) if gluon else (cache_hook, post_compile_hook))
    assert kernel.seen[0][2:] == ((3, 1, 1), (1, 2), {"num_warps": 4})
    # restored afterwards, also when the dispatch raises
    assert (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook) == (
        cache_hook,
        post_compile_hook,
    )

    class Failing(_HookRecordingKernel):
        def __getitem__(self, grid):
            def dispatch(*args, **options):
                raise RuntimeError("compile failed")

            return dispatch

    with pytest.raises(RuntimeError, match="compile failed"):
        runtime._dispatch(Failing(gluon), (1, 1, 1), (), {})
    assert triton.knobs.runtime.jit_post_compile_hook is post_compile_hook


@pytest.mark.skipif(not _TRITON_36, reason="the raw launch is written against Triton 3.6's launcher")
def test_a_raw_launch_of_changing_sizes_passes_what_tritons_launcher_passes(build_module, monkeypatch):
    """A launch prepared with per_call (a prefill's: grid and ints from the call's tensors, descriptors over their
    sources' leading rows) passes each call's grid, ints and descriptors at its rows, as Triton's launcher would;
    an int of another class (another compiled kernel) is declined."""
    build_module(**SPEC)
    fake = _FakeDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    monkeypatch.setattr(runtime, "_INTERPRET", False)
    c_launch = _RecordingCLaunch()
    compiled = _FakeCompiled(_cuda_launcher(c_launch))
    kernel = _CompilingKernel(list(_SIGNATURE), compiled)

    def per_call(a, c, max_seqlen):
        return (a.shape[0] * 2, max_seqlen, 1), (c.shape[0] + 5,)

    def call_tensors(rows_a, rows_b, rows_c):
        return torch.randn(rows_a, 16), torch.randn(rows_b, 24), torch.randn(rows_c, 16)

    a, b, c = call_tensors(8, 32, 40)
    work = torch.zeros(4)
    args = (
        a,
        runtime.TensorDescriptor(b[:, 8:], [32, 16], [24, 1], [16, 16]),
        work,
        runtime.TensorDescriptor(c, [40, 16], [16, 1], [8, 16]),
        45,
        0.5,
        None,
    )
    launch = runtime._PreparedLaunch(
        kernel, (16, 3, 1), (a, b, c), (work,), args, {"X": 3}, num_warps=4, per_call=(per_call, ("N",), (a, c), 3)
    )
    assert launch.reusable and launch.per_call
    inputs = call_tensors(4, 48, 50)
    launch.launch(inputs, launch.call_values(inputs, 7))  # the first launch: Triton's dispatch
    assert kernel.dispatched == 1 and launch.raw is not None and not c_launch.calls
    for rows, max_seqlen in (((8, 32, 40), 3), ((5, 24, 60), 9), ((12, 40, 50), 1)):
        inputs = call_tensors(*rows)
        call = launch.call_values(inputs, max_seqlen)
        launch.launch(inputs, call)
        raw = c_launch.calls.pop()
        runtime._launch_compiled(compiled, call[0], launch.arguments(inputs, call), 0)  # CudaLauncher, its `inner`
        assert raw == _as_addresses(c_launch.calls.pop())
        assert raw[:3] == (rows[0] * 2, max_seqlen, 1)
        assert raw[14][:2] == ("tensor map", inputs[1].data_ptr() + 8 * inputs[1].element_size())
        assert raw[15:19] == (rows[1], 16, 24, 1)  # the descriptor at the call's rows
        assert raw[20:22] == (inputs[2].data_ptr(), rows[2])  # the pointer-lowered descriptor: base, rows
        assert rows[2] + 5 in raw[21:]
    assert launch.call_values(call_tensors(8, 32, 11), 3) is None  # N = 16: another class
    assert kernel.dispatched == 1
