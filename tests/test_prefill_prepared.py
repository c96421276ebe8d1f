"""mla_prefill's launches prepared once per signature (runtime.prefill_signature, mla_prefill_prepared).

A call whose tensors and scalars have the signature of an earlier, fully checked call (their layouts, not the batch
shape: token counts, sequences, max_seqlen and prefix totals change from call to call) skips the checks and only
puts its tensors and sizes into the prepared launch: these tests pin that it launches exactly what the checked path
would (kernel, grid, every argument and constexpr, descriptors made on this call's tensors), for both backends (the
Gluon kernel's launch is captured, not run: the interpreter does not run Gluon), that what depends on values is
still checked, and that anything new sends a call back to the checks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import import_source
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from mlagen_compiler import runtime
from mlagen_compiler.module_file import module_source
from mlagen_compiler.options import use_options
from mlagen_compiler.registry import resolve_spec

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # as in conftest


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    spec = resolve_spec("deepseek-v3-tp8")
    return import_source(module_source(spec), tmp_path_factory.mktemp("prefill_prepared"), "prefill_prepared")


def _tensors(module, lengths, *, k_pe_of_rows=False, misaligned_q=False, seed=0):
    """q, k_nope, k_pe, v, cu_seqlens of packed sequences of `lengths` (fresh memory each call). k_pe_of_rows: a
    column slice of latent rows (strided); misaligned_q: q one element into its buffer (not 16-byte aligned)."""
    g = torch.Generator().manual_seed(seed)
    tokens, heads = sum(lengths), module.NUM_HEADS
    dn, dr, dv, dc = module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK

    def drawn(*shape):  # on the device before any view is taken (a copy there would be contiguous and aligned)
        return torch.randn(*shape, generator=g).to(module.DTYPE).to(DEVICE)

    q_shape = (tokens, heads, dn + dr)
    q = drawn(tokens * heads * (dn + dr) + 1)[1:].view(q_shape) if misaligned_q else drawn(*q_shape)
    k_nope = drawn(tokens, heads, dn)
    k_pe = drawn(tokens, dc + dr)[:, dc:] if k_pe_of_rows else drawn(tokens, dr)
    v = drawn(tokens, heads, dv)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, k_nope, k_pe, v, cu


def _normal(value):
    """A launch argument as compared: a tensor by where and how it lies, a descriptor by its fields and base."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    if hasattr(value, "block_shape"):
        fields = {name: field for name, field in vars(value).items() if name != "base"}
        return ("descriptor", type(value), _normal(value.base), repr(sorted(fields.items())))
    return value


@pytest.fixture
def dispatched(monkeypatch):
    """Every launch that reaches Triton's dispatch (the interpreter's only way), as (kernel, grid, {argument name:
    normalised value, launch options included}); the kernels do not run."""
    launches = []

    def record(kernel, grid, args, options):
        named = dict(zip(kernel.arg_names, args, strict=False))
        named.update(options)
        launches.append((kernel, runtime._grid3(grid), {name: _normal(value) for name, value in named.items()}))

    monkeypatch.setattr(runtime, "_dispatch", record)
    if not runtime._INTERPRET:
        # (on a GPU a kernel compiled once is launched past the dispatch: by its launcher, or a prepared launch's
        # raw one; here every launch takes the dispatch again, as under the interpreter)
        monkeypatch.setattr(runtime, "_COMPILED", _NothingKept())
        monkeypatch.setattr(runtime, "_raw_launch", lambda: False)
        launch = runtime._PreparedLaunch.launch

        def dispatching(self, inputs, call=None):
            self.compiled = self.raw = None
            return launch(self, inputs, call)

        monkeypatch.setattr(runtime._PreparedLaunch, "launch", dispatching)
    return launches


class _NothingKept(dict):
    """runtime._COMPILED that keeps no compiled kernel, so _launch dispatches every launch."""

    def setdefault(self, key, default=None):
        return {}


def _counted(monkeypatch, name):
    """The calls of runtime's function `name` (patched to count them)."""
    calls = []
    function = getattr(runtime, name)

    def counting(*args):
        calls.append(args)
        return function(*args)

    monkeypatch.setattr(runtime, name, counting)
    return calls


@pytest.fixture
def checked_calls(monkeypatch):
    """How many prefill calls took the checked path."""
    return _counted(monkeypatch, "mla_prefill_checked")


@pytest.fixture(autouse=True)
def _portable_unless_gluon_asked(monkeypatch):
    """The portable kernel, as auto takes it off Hopper (on an H200 auto takes the Gluon one); a test of the Gluon
    kernel asks for it (_gluon)."""
    monkeypatch.setattr(runtime, "prefill_backend", lambda m, device=None, requested=None, **knobs: ("triton", ""))


def _gluon(module, monkeypatch):
    if module._PREFILL_GLUON_IMPORT_ERROR:
        pytest.skip(f"the Gluon prefill is not defined under this Triton: {module._PREFILL_GLUON_IMPORT_ERROR}")
    monkeypatch.setattr(runtime, "prefill_backend", lambda m, device=None, requested=None, **knobs: ("gluon", ""))


def test_a_prepared_call_gives_the_checked_calls_results(module, checked_calls):
    module._PREFILL_LAUNCHES.clear()
    lengths = (37, 5)
    for seed in range(3):
        q, k_nope, k_pe, v, cu = _tensors(module, lengths, seed=seed, k_pe_of_rows=True)
        got, got_lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 37, return_lse=True)
        with use_options(direct_launch=False):
            want, want_lse = module.mla_prefill(q, k_nope, k_pe, v, cu, 37, return_lse=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
        assert got.is_contiguous() and got_lse.is_contiguous() and got.data_ptr() != want.data_ptr()
    assert len(checked_calls) == 5  # (all but the third call's: the prepared launch)


def _warm(module, tensors, max_seqlen, **kwargs):
    module._PREFILL_LAUNCHES.clear()
    for _ in range(2):
        module.mla_prefill(*tensors, max_seqlen, **kwargs)


def test_a_prepared_call_still_validates_index_values(module, dispatched):
    tensors = _tensors(module, (8, 8))
    _warm(module, tensors, 8, validate=True)
    bad = torch.tensor([0, 9, 16], dtype=torch.int32, device=DEVICE)
    dispatched.clear()
    with pytest.raises(ValueError, match=r"^max_seqlen: 8 is less than the longest sequence \(9 tokens\)$"):
        module.mla_prefill(*tensors[:4], bad, 8, validate=True)
    assert not dispatched


def test_a_given_output_is_checked_against_the_inputs_every_call(module, dispatched):
    q, k_nope, k_pe, v, cu = _tensors(module, (8,))
    out = torch.empty(8, module.NUM_HEADS, module.V_HEAD_DIM, dtype=module.DTYPE, device=DEVICE)
    _warm(module, (q, k_nope, k_pe, v, cu), 8, out=out)
    dispatched.clear()
    # the same layout, its memory now v's
    with pytest.raises(ValueError, match="^out: overlaps v in memory: give out memory of its own$"):
        module.mla_prefill(q, k_nope, k_pe, v, cu, 8, out=v)
    assert not dispatched


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(config=(16, 32, 4, True)), "^config: expected"),
        (dict(softmax_scale=float("nan")), "^softmax_scale: must be a finite number"),
        (dict(return_lse=1), "^return_lse: "),
        (dict(max_seqlen=9), r"^max_seqlen: 9 is more than the number of tokens \(8\)"),
        (dict(validate="yes"), "^validate: expected None, True or False"),
    ],
)
def test_a_scalar_the_checks_reject_is_rejected_after_warm_up(module, change, match):
    tensors = _tensors(module, (8,))
    _warm(module, tensors, 8, config=(16, 32, 4, 1))
    arguments = dict(config=(16, 32, 4, 1), max_seqlen=8) | change
    with pytest.raises(ValueError, match=match):
        module.mla_prefill(*tensors, **arguments)


def test_the_signature_keys_on_the_options_in_force(module, dispatched, checked_calls):
    tensors = _tensors(module, (40,))
    _warm(module, tensors, 40)
    with use_options(prefill_tma=False):
        checked_calls.clear()
        module.mla_prefill(*tensors, 40)
        assert checked_calls  # another signature: checked
    dispatched.clear()
    checked_calls.clear()
    module.mla_prefill(*tensors, 40)
    assert not checked_calls and dispatched[-1][2]["USE_TMA"] is True


@pytest.mark.parametrize("switch", [{"prefill_persistent": True}, {"prefill_tile_chunk": 2}])
@pytest.mark.parametrize("kind", ["prefill", "chunked"])
def test_the_signature_keys_on_the_prefill_persistent_option(module, kind, switch, dispatched, monkeypatch):
    """The Gluon prefill (pretend Hopper): a launch prepared under one prefill_persistent (or prefill_tile_chunk)
    setting is never reused under the other (the signature holds the options in force): switching it sends the
    call to the checks, which launch the other variant, and switching back takes the first variant's prepared
    launch again."""
    _gluon(module, monkeypatch)
    chunked = kind == "chunked"
    checked_calls = _counted(monkeypatch, "mla_chunked_prefill_checked" if chunked else "mla_prefill_checked")
    tiled, looping = module._mla_prefill_gluon_kernel, module._mla_prefill_gluon_persistent_kernel
    if chunked:
        tensors = _chunked_tensors(module, (40, 3), (70, 20))

        def call():
            module.mla_chunked_prefill(*tensors[:5], 40, *tensors[5:], num_prefix_tokens=90)
    else:
        tensors = _tensors(module, (300, 7))

        def call():
            module.mla_prefill(*tensors, 300)

    def gluon_kernels():
        return [kernel for kernel, _, _ in dispatched if kernel in (tiled, looping)]

    module._PREFILL_LAUNCHES.clear()
    off = {name: type(value)(0) for name, value in switch.items()}
    for persistent, checked in ((False, True), (False, True), (False, False), (True, True), (True, True)):
        # (off: seen, prepared, then reused; on: another signature, seen, then prepared)
        with use_options(**(switch if persistent else off)):
            dispatched.clear()
            checked_calls.clear()
            call()
            assert bool(checked_calls) == checked
            assert gluon_kernels() == [looping if persistent else tiled] * (2 if chunked else 1)
    for persistent in (True, False):  # both prepared now: each reused under its own setting
        with use_options(**(switch if persistent else off)):
            dispatched.clear()
            checked_calls.clear()
            call()
            assert not checked_calls
            assert gluon_kernels() == [looping if persistent else tiled] * (2 if chunked else 1)
            _assert_gluon_variant(module, dispatched, persistent, switch.get("prefill_tile_chunk", 0))


# ---- chunked prefill: the prefix attention, the new tokens' attention and the merge, prepared together ----------


def _chunked_tensors(
    module, lengths, prefix_lens, *, k_pe_of_rows=False, misaligned_q=False, seed=0, num_pages=None, table_width=None
):
    """_tensors' new tokens plus a paged latent cache holding `prefix_lens` (pages shuffled; num_pages of them, by
    default one more than the prefixes take), its block table (table_width pages a row, by default the longest
    prefix's) and prefix_lens, and the up-projections w_uk, w_uv: every tensor fresh memory each call."""
    q, k_nope, k_pe, v, cu = _tensors(module, lengths, k_pe_of_rows=k_pe_of_rows, misaligned_q=misaligned_q, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    heads, dn, dv, dc = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK
    pages = [-(-length // module.PAGE_SIZE) for length in prefix_lens]
    width = table_width or max(1, max(pages))
    num_pages = num_pages or sum(pages) + 1
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.zeros(len(prefix_lens), width, dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    cache = torch.randn(num_pages, module.PAGE_SIZE, 1, dc + module.QK_ROPE_HEAD_DIM, generator=g)
    w_uk = (torch.randn(heads, dn, dc, generator=g) / dc**0.5).to(module.DTYPE)
    w_uv = (torch.randn(heads, dv, dc, generator=g) / dc**0.5).to(module.DTYPE)
    plen = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
    tensors = (cache.to(module.CACHE_DTYPE), table, plen, w_uk, w_uv)
    return q, k_nope, k_pe, v, cu, *(t.to(DEVICE) for t in tensors)


def _canonical(launches, given):
    """Launches (dispatched's) with each tensor not among the call's `given` ones (its temporaries: another call's
    are elsewhere) named by order of first appearance instead of its address."""
    names = {tensor.data_ptr(): ("given", i) for i, tensor in enumerate(given) if tensor is not None}
    temporaries = {}

    def name(value):
        if isinstance(value, tuple) and value[:1] == ("tensor",):
            where = names.get(value[1]) or temporaries.setdefault(value[1], ("temporary", len(temporaries)))
            return ("tensor", where, *value[2:])
        if isinstance(value, tuple) and value[:1] == ("descriptor",):
            return (*value[:2], name(value[2]), *value[3:])
        return value

    return [(kernel, grid, {key: name(value) for key, value in named.items()}) for kernel, grid, named in launches]


@pytest.fixture
def chunked_checked_calls(monkeypatch):
    """How many chunked prefill calls took the checked path."""
    return _counted(monkeypatch, "mla_chunked_prefill_checked")


@pytest.mark.parametrize("kind", ["prefill", "chunked"])
@pytest.mark.parametrize("backend", ["triton", "gluon"])
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # (the test clears what they record)
@given(data=st.data())
def test_a_prepared_call_launches_what_the_checked_path_launches(module, kind, backend, data, dispatched, monkeypatch):
    """mla_prefill's launch, or mla_chunked_prefill's (prefix attention, new-token attention, merge; its temporaries
    compared by layout and order of appearance, each call having its own)."""
    if backend == "gluon":
        _gluon(module, monkeypatch)
    chunked = kind == "chunked"
    entry = module.mla_chunked_prefill if chunked else module.mla_prefill
    checked_calls = _counted(monkeypatch, "mla_chunked_prefill_checked" if chunked else "mla_prefill_checked")
    lengths = data.draw(st.lists(st.integers(0, 80 if chunked else 300), min_size=1, max_size=3), label="lengths")
    prefix = st.lists(st.integers(0, 140), min_size=len(lengths), max_size=len(lengths))
    prefix_lens = data.draw(prefix, label="prefix_lens") if chunked else None
    layout = data.draw(
        st.fixed_dictionaries({"k_pe_of_rows": st.booleans(), "misaligned_q": st.booleans()}), label="layout"
    )
    return_lse = data.draw(st.booleans(), label="return_lse")
    give_out, give_lse = data.draw(st.booleans(), label="out given"), data.draw(st.booleans(), label="lse given")
    scale = data.draw(st.sampled_from([None, 0.0625]), label="softmax_scale")
    tma = data.draw(st.booleans(), label="prefill_tma")
    persistent = backend == "gluon" and data.draw(st.booleans(), label="prefill_persistent")
    chunk = data.draw(st.sampled_from([0, 3]), label="prefill_tile_chunk") if backend == "gluon" else 0
    config = None if backend == "gluon" else data.draw(st.sampled_from([None, (16, 32, 4, 1)]), label="config")
    max_seqlen = max(lengths)
    tokens, heads = sum(lengths), module.NUM_HEADS
    extra = dict(num_prefix_tokens=sum(prefix_lens)) if chunked else {}

    def call(seed):
        if chunked:
            tensors = _chunked_tensors(module, lengths, prefix_lens, seed=seed, **layout)
            arguments = (*tensors[:5], max_seqlen, *tensors[5:])
        else:
            tensors = _tensors(module, lengths, seed=seed, **layout)
            arguments = (*tensors, max_seqlen)
        out = torch.empty(tokens, heads, module.V_HEAD_DIM, dtype=module.DTYPE, device=DEVICE) if give_out else None
        lse = torch.empty(heads, tokens, dtype=torch.float32, device=DEVICE) if give_lse else None
        result = entry(
            *arguments, softmax_scale=scale, return_lse=return_lse, out=out, lse=lse, config=config, validate=False,
            **extra,
        )  # fmt: skip
        return arguments, out, lse, result

    module._PREFILL_LAUNCHES.clear()
    with use_options(prefill_tma=tma, prefill_persistent=persistent, prefill_tile_chunk=chunk):
        call(0)  # (seen)
        call(1)  # (prepared)
        dispatched.clear()
        checked_calls.clear()
        arguments, out, lse, result = call(2)
        fast, took_checks = list(dispatched), bool(checked_calls)
        note(f"checked: {took_checks}, launches: {len(fast)}")
        # the checked path's launches with the same tensors (and outputs, as the fast path allocated them)
        out = out if give_out else result[0] if return_lse else result
        lse = lse if give_lse else result[1] if return_lse else None
        dispatched.clear()
        with use_options(direct_launch=False):
            entry(
                *arguments, softmax_scale=scale, return_lse=return_lse, out=out, lse=lse, config=config, validate=False,
                **extra,
            )  # fmt: skip
    # taken for every layout but a per-call copy (the Gluon kernel's misaligned q: both calls checked, each
    # launching a descriptor of its own copy)
    copied = backend == "gluon" and layout["misaligned_q"] and max_seqlen > 0
    assert took_checks == copied
    given_tensors = (*arguments[:5], out, lse)
    fast, checked = _canonical(fast, given_tensors), _canonical(dispatched, given_tensors)
    assert [launch[:2] for launch in fast] == [launch[:2] for launch in checked]
    # (chunked: the prefix's gather where it has rows, the two attentions where there are new tokens, the merge)
    gathers = chunked and sum(prefix_lens) > 0
    assert len(fast) == gathers + (2 if chunked else 1) * (max_seqlen > 0) + (chunked and tokens > 0)
    for (_, _, got), (_, _, want) in zip(fast, checked, strict=True):
        assert {name: value for name, value in got.items() if value != want[name]} == {} or copied
    _assert_gluon_variant(module, fast, persistent or chunk > 0, chunk)


def _assert_gluon_variant(module, launches, persistent, chunk=0):
    """The Gluon prefill's launches among `launches` (dispatched's) are of the variant the prefill_persistent and
    prefill_tile_chunk options ask for (the persistent kernel on at most runtime._sm_count programs, or with
    chunk > 0 on a program per `chunk` tiles)."""
    tiled, looping = module._mla_prefill_gluon_kernel, module._mla_prefill_gluon_persistent_kernel
    for kernel, grid, named in launches:
        assert kernel is not (tiled if persistent else looping)
        if kernel is looping:
            tiles = named["pairs"] * named["m_blocks"]
            assert named["chunk"] == chunk
            assert grid == (-(-tiles // chunk) if chunk else min(tiles, runtime._sm_count(DEVICE)), 1, 1)


@pytest.mark.parametrize("give_outputs", [False, True])
def test_a_prepared_chunked_call_gives_the_checked_calls_results(module, chunked_checked_calls, give_outputs):
    """Bit for bit, in the interpreter: fresh tensors at new addresses every call, given outputs poisoned (NaN)."""
    module._PREFILL_LAUNCHES.clear()
    lengths, prefix_lens = (21, 5), (70, 0)
    heads, tokens = module.NUM_HEADS, sum(lengths)

    def outputs():
        if not give_outputs:
            return {}
        out = torch.full((tokens, heads, module.V_HEAD_DIM), float("nan"), dtype=module.DTYPE, device=DEVICE)
        return dict(out=out, lse=torch.full((heads, tokens), float("nan"), device=DEVICE))

    for seed in range(3):
        tensors = _chunked_tensors(module, lengths, prefix_lens, seed=seed, k_pe_of_rows=True)
        arguments = (*tensors[:5], 21, *tensors[5:])
        given = outputs()
        got, got_lse = module.mla_chunked_prefill(*arguments, return_lse=True, num_prefix_tokens=70, **given)
        with use_options(direct_launch=False):
            want, want_lse = module.mla_chunked_prefill(*arguments, return_lse=True, num_prefix_tokens=70, **outputs())
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
        assert not got.isnan().any() and not got_lse.isnan().any()
        assert got.data_ptr() != want.data_ptr()
        if give_outputs:
            assert got.data_ptr() == given["out"].data_ptr() and got_lse.data_ptr() == given["lse"].data_ptr()
    assert len(chunked_checked_calls) == 5  # (all but the third call's: the prepared launches)


def _warm_chunked(module, tensors, **kwargs):
    module._PREFILL_LAUNCHES.clear()
    for _ in range(2):
        module.mla_chunked_prefill(*tensors[:5], 8, *tensors[5:], **kwargs)


def test_a_prepared_chunked_call_still_validates_index_values(module, dispatched, chunked_checked_calls):
    tensors = _chunked_tensors(module, (8, 8), (30, 40))
    _warm_chunked(module, tensors, validate=True, num_prefix_tokens=70)
    chunked_checked_calls.clear()
    dispatched.clear()
    with pytest.raises(ValueError, match=r"^num_prefix_tokens: 70 is not the sum of prefix_lens \(71\)$"):
        wrong_total = torch.tensor([31, 40], dtype=torch.int32, device=DEVICE)
        module.mla_chunked_prefill(
            *tensors[:5], 8, *tensors[5:7], wrong_total, *tensors[8:], validate=True, num_prefix_tokens=70
        )  # fmt: skip
    bad = torch.tensor([0, 9, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^max_seqlen: 8 is less than the longest sequence \(9 tokens\)$"):
        module.mla_chunked_prefill(*tensors[:4], bad, 8, *tensors[5:], validate=True, num_prefix_tokens=70)
    assert not dispatched and not chunked_checked_calls  # (the prepared path's own checks)


def test_a_given_chunked_output_is_checked_against_the_inputs_every_call(module, dispatched):
    tensors = _chunked_tensors(module, (8,), (30,))
    out = torch.empty(8, module.NUM_HEADS, module.V_HEAD_DIM, dtype=module.DTYPE, device=DEVICE)
    _warm_chunked(module, tensors, out=out, num_prefix_tokens=30)
    dispatched.clear()
    # the same layout, its memory now v's
    with pytest.raises(ValueError, match="^out: overlaps v in memory: give out memory of its own$"):
        module.mla_chunked_prefill(*tensors[:5], 8, *tensors[5:], out=tensors[3], num_prefix_tokens=30)
    assert not dispatched


def test_a_chunked_call_without_the_prefix_total_is_always_checked(module, chunked_checked_calls):
    """Without num_prefix_tokens the call reads prefix_lens (a synchronisation) and is never prepared."""
    tensors = _chunked_tensors(module, (8,), (30,))
    _warm_chunked(module, tensors)
    module.mla_chunked_prefill(*tensors[:5], 8, *tensors[5:])
    assert len(chunked_checked_calls) == 3


def test_a_call_passing_one_tensor_twice_prepares_nothing(module, checked_calls):
    """A prepared launch finds the call's tensors by identity: k_nope passed as v too would leave a later call's
    v unread."""
    q, k_nope, k_pe, v, cu = _tensors(module, (8,))
    if k_nope.shape != v.shape:
        pytest.skip("k_nope and v differ in shape in this spec")
    _warm(module, (q, k_nope, k_pe, k_nope, cu), 8)
    got = module.mla_prefill(q, k_nope, k_pe, v, cu, 8)
    assert len(checked_calls) == 3  # (the third call prepares: the first of its signature to pass each once)
    with use_options(direct_launch=False):
        want = module.mla_prefill(q, k_nope, k_pe, v, cu, 8)
    assert torch.equal(got, want)


# ---- calls of any batch shape: the prepared launches take each call's token counts, sequences and sizes ----------


def _size_key(chunked, lengths, prefix_lens):
    """What of a call's batch shape its signature holds (runtime._size_classes of the token count and, chunked, of
    the prefix total; whether max_seqlen is 0): calls alike in these share prepared launches."""
    key = (*runtime._size_classes(sum(lengths)), max(lengths) == 0)
    return key + (runtime._size_classes(sum(prefix_lens)) if chunked else ())


_batch = st.lists(st.integers(0, 40), min_size=1, max_size=3)
#: a cache and block table of one size for batches of up to 3 prefixes of up to 70 tokens
_CACHE = dict(num_pages=16, table_width=4)


@pytest.mark.parametrize("kind", ["prefill", "chunked"])
@pytest.mark.parametrize("backend", ["triton", "gluon"])
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=25)
@given(data=st.data())
def test_calls_of_changing_batch_shapes_launch_what_the_checked_path_launches(
    module, kind, backend, data, dispatched, monkeypatch
):
    """A run of calls of one layout and changing batch shapes (token counts, sequences, max_seqlen, prefix totals):
    from the second call of a signature on (its layout, scalars and size classes, _size_key) each call takes the
    prepared launches, which launch exactly what the checked path launches for that call (grid, every argument and
    constexpr; descriptors on this call's rows)."""
    if backend == "gluon":
        _gluon(module, monkeypatch)
        # (the Gluon kernel's sections between 1 and 2 from one batch to the next, as the H200's L2 makes them for
        # a serving engine's batches: an int Triton does not specialise, which must not send calls to the checks)
        monkeypatch.setattr(module, "prefill_sections", lambda pairs, keys, bytes_per_key, l2_bytes: 1 + (keys >= 10))
    chunked = kind == "chunked"
    entry = module.mla_chunked_prefill if chunked else module.mla_prefill
    checked_calls = _counted(monkeypatch, "mla_chunked_prefill_checked" if chunked else "mla_prefill_checked")
    layout = data.draw(
        st.fixed_dictionaries({"k_pe_of_rows": st.booleans(), "misaligned_q": st.booleans()}), label="layout"
    )
    return_lse = data.draw(st.booleans(), label="return_lse")
    give_out, give_lse = data.draw(st.booleans(), label="out given"), data.draw(st.booleans(), label="lse given")
    scale = data.draw(st.sampled_from([None, 0.0625]), label="softmax_scale")
    tma = data.draw(st.booleans(), label="prefill_tma")
    persistent = backend == "gluon" and data.draw(st.booleans(), label="prefill_persistent")
    chunk = data.draw(st.sampled_from([0, 3]), label="prefill_tile_chunk") if backend == "gluon" else 0
    config = None if backend == "gluon" else data.draw(st.sampled_from([None, (16, 32, 4, 1)]), label="config")
    shapes = []
    for _ in range(data.draw(st.integers(3, 6), label="calls")):
        lengths = data.draw(_batch, label="lengths")
        prefix = st.lists(st.integers(0, 70), min_size=len(lengths), max_size=len(lengths))
        shapes.append((lengths, data.draw(prefix, label="prefix_lens") if chunked else None))
    heads = module.NUM_HEADS

    def call(seed, lengths, prefix_lens):
        tokens, max_seqlen = sum(lengths), max(lengths)
        if chunked:  # (a serving engine's cache and block table: one size for every batch)
            tensors = _chunked_tensors(module, lengths, prefix_lens, seed=seed, **layout, **_CACHE)
            arguments = (*tensors[:5], max_seqlen, *tensors[5:])
            extra = dict(num_prefix_tokens=sum(prefix_lens))
        else:
            arguments, extra = (*_tensors(module, lengths, seed=seed, **layout), max_seqlen), {}
        out = torch.empty(tokens, heads, module.V_HEAD_DIM, dtype=module.DTYPE, device=DEVICE) if give_out else None
        lse = torch.empty(heads, tokens, dtype=torch.float32, device=DEVICE) if give_lse else None
        result = entry(
            *arguments, softmax_scale=scale, return_lse=return_lse, out=out, lse=lse, config=config, validate=False,
            **extra,
        )  # fmt: skip
        out = out if give_out else result[0] if return_lse else result
        lse = lse if give_lse else result[1] if return_lse else None
        return arguments, extra, out, lse

    module._PREFILL_LAUNCHES.clear()
    seen = {}
    with use_options(prefill_tma=tma, prefill_persistent=persistent, prefill_tile_chunk=chunk):
        for seed, (lengths, prefix_lens) in enumerate(shapes):
            key = _size_key(chunked, lengths, prefix_lens)
            seen[key] = seen.get(key, 0) + 1
            dispatched.clear()
            checked_calls.clear()
            arguments, extra, out, lse = call(seed, lengths, prefix_lens)
            fast, took_checks = list(dispatched), bool(checked_calls)
            dispatched.clear()
            with use_options(direct_launch=False):  # the checked path's launches with the same tensors and outputs
                entry(
                    *arguments, softmax_scale=scale, return_lse=return_lse, out=out, lse=lse, config=config,
                    validate=False, **extra,
                )  # fmt: skip
            # (the Gluon kernel's misaligned q: a copy each call, never prepared)
            copied = backend == "gluon" and layout["misaligned_q"] and max(lengths) > 0
            note(f"call {seed}: {lengths} {prefix_lens}, checked: {took_checks}, launches: {len(fast)}")
            assert took_checks == (seen[key] <= 2 or copied)
            given_tensors = (*arguments[:5], out, lse)
            fast, checked = _canonical(fast, given_tensors), _canonical(dispatched, given_tensors)
            assert [launch[:2] for launch in fast] == [launch[:2] for launch in checked]
            for (_, _, got), (_, _, want) in zip(fast, checked, strict=True):
                assert {name: value for name, value in got.items() if value != want[name]} == {} or copied
            _assert_gluon_variant(module, fast, persistent or chunk > 0, chunk)


def _poisoned_outputs(module, tokens):
    """out and lse for `tokens` tokens, NaN: an element a launch leaves unwritten shows."""
    out = torch.full((tokens, module.NUM_HEADS, module.V_HEAD_DIM), float("nan"), dtype=module.DTYPE, device=DEVICE)
    return dict(out=out, lse=torch.full((module.NUM_HEADS, tokens), float("nan"), device=DEVICE))


#: batch shapes of one size class (token counts and prefix totals neither 0, 1 nor multiples of 16)
_SHAPES = [((7, 5), (20, 0)), ((9, 3, 2), (3, 17, 9)), ((13,), (30,)), ((5, 6), (12, 1)), ((2, 1, 8), (0, 5, 40))]


@pytest.mark.parametrize("give_outputs", [False, True])
@pytest.mark.parametrize("kind", ["prefill", "chunked"])
def test_calls_of_changing_batch_shapes_give_the_checked_calls_results(module, kind, give_outputs, monkeypatch):
    """Bit for bit, in the interpreter: every call a new batch shape of one layout, fresh tensors, given outputs
    poisoned (NaN); all but the first two calls take the prepared launches."""
    chunked = kind == "chunked"
    entry = module.mla_chunked_prefill if chunked else module.mla_prefill
    checked_calls = _counted(monkeypatch, "mla_chunked_prefill_checked" if chunked else "mla_prefill_checked")
    module._PREFILL_LAUNCHES.clear()
    for seed, (lengths, prefix_lens) in enumerate(_SHAPES):
        tokens, max_seqlen = sum(lengths), max(lengths)
        if chunked:
            tensors = _chunked_tensors(module, lengths, prefix_lens, seed=seed, k_pe_of_rows=True, **_CACHE)
            arguments = (*tensors[:5], max_seqlen, *tensors[5:])
            extra = dict(num_prefix_tokens=sum(prefix_lens), return_lse=True)
        else:
            arguments = (*_tensors(module, lengths, seed=seed, k_pe_of_rows=True), max_seqlen)
            extra = dict(return_lse=True)
        given = _poisoned_outputs(module, tokens) if give_outputs else {}
        before = len(checked_calls)
        got, got_lse = entry(*arguments, **extra, **given)
        assert len(checked_calls) - before == (seed < 2)
        with use_options(direct_launch=False):
            want, want_lse = entry(*arguments, **extra, **_poisoned_outputs(module, tokens))
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
        assert not got.isnan().any() and not got_lse.isnan().any()
        assert got.shape == (tokens, module.NUM_HEADS, module.V_HEAD_DIM) and got_lse.shape == (
            module.NUM_HEADS,
            tokens,
        )
        if give_outputs:
            assert got.data_ptr() == given["out"].data_ptr() and got_lse.data_ptr() == given["lse"].data_ptr()


def _warm_shapes(module, make, calls=2):
    """Two calls of _SHAPES' first two batch shapes (the signature seen, then prepared)."""
    module._PREFILL_LAUNCHES.clear()
    for lengths, prefix_lens in _SHAPES[:calls]:
        make(lengths, prefix_lens)


@pytest.mark.parametrize(
    "change",
    ["k_pe dense", "return_lse", "a multiple of 16 tokens", "one token", "max_seqlen 0", "tma off", "lse given"],
)
def test_a_call_that_changes_a_keyed_property_does_not_reuse_a_prepared_launch(
    module, change, dispatched, checked_calls
):
    """After a layout is prepared, a call differing in what the launch is specialised on (a stride pattern, the LSE,
    a size class, the options) takes the checked path, and launches what the checked path launches."""

    def call(lengths, prefix_lens=None, *, k_pe_of_rows=True, return_lse=False, lse=None, max_seqlen=None):
        q, k_nope, k_pe, v, cu = _tensors(module, lengths, k_pe_of_rows=k_pe_of_rows)
        max_seqlen = max(lengths) if max_seqlen is None else max_seqlen
        module.mla_prefill(q, k_nope, k_pe, v, cu, max_seqlen, return_lse=return_lse, lse=lse)
        return q, k_nope, k_pe, v, cu, max_seqlen, lse

    _warm_shapes(module, call)
    lengths = (5, 6)
    arguments = {}
    if change == "k_pe dense":
        arguments = dict(k_pe_of_rows=False)
    elif change == "return_lse":
        arguments = dict(return_lse=True)
    elif change == "a multiple of 16 tokens":
        lengths = (9, 7)
    elif change == "one token":
        lengths = (1,)
    elif change == "max_seqlen 0":
        lengths = (0, 0)
    elif change == "lse given":
        arguments = dict(lse=torch.empty(module.NUM_HEADS, 11, device=DEVICE))
    dispatched.clear()
    checked_calls.clear()
    with use_options(prefill_tma=change != "tma off"):
        q, k_nope, k_pe, v, cu, max_seqlen, lse = call(lengths, **arguments)
        assert len(checked_calls) == 1
        fast = list(dispatched)
        dispatched.clear()
        with use_options(direct_launch=False):
            module.mla_prefill(
                q, k_nope, k_pe, v, cu, max_seqlen, return_lse=arguments.get("return_lse", False), lse=lse
            )
    assert [launch[:2] for launch in fast] == [launch[:2] for launch in dispatched]
    given = (q, k_nope, k_pe, v, cu, None, lse)
    assert _canonical(fast, given) == _canonical(dispatched, given)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("k_nope of other tokens", r"^k_nope: expected shape \[12,"),
        ("out of other tokens", r"^out: expected shape \(12,"),
        ("lse of other tokens", r"^lse: expected float32 \["),
        ("max_seqlen past the tokens", r"^max_seqlen: 13 is more than the number of tokens \(12\)"),
        ("q of another dtype", r"^q: expected dtype"),
        ("q of other heads", r"^q: expected \d+ heads"),
        ("no sequence", r"^cu_seqlens: expected \[B\+1\] with B >= 1"),
    ],
)
def test_sizes_that_disagree_are_rejected_after_warm_up(module, change, match, dispatched):
    """A prepared layout takes any batch shape, but its sizes must agree with one another as the checks require:
    a call whose do not goes to the checks (and launches nothing)."""
    _warm_shapes(module, lambda lengths, _: module.mla_prefill(*_tensors(module, lengths), max(lengths)))
    q, k_nope, k_pe, v, cu = _tensors(module, (5, 7))
    heads, dv = module.NUM_HEADS, module.V_HEAD_DIM
    kwargs, max_seqlen = {}, 7
    if change == "k_nope of other tokens":
        k_nope = _tensors(module, (5, 8))[1]
    elif change == "out of other tokens":
        kwargs = dict(out=torch.empty(13, heads, dv, dtype=module.DTYPE, device=DEVICE))
    elif change == "lse of other tokens":
        kwargs = dict(lse=torch.empty(heads, 13, device=DEVICE))
    elif change == "max_seqlen past the tokens":
        max_seqlen = 13
    elif change == "q of another dtype":
        q = q.to({torch.float16: torch.bfloat16}.get(module.DTYPE, torch.float16))
    elif change == "q of other heads":
        q = q[:, :-1]
    elif change == "no sequence":
        cu = cu[:1]
    dispatched.clear()
    with pytest.raises(ValueError, match=match):
        module.mla_prefill(q, k_nope, k_pe, v, cu, max_seqlen, validate=False, **kwargs)
    assert not dispatched


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("block_table of another batch", r"^block_table: batch size 3 disagrees with 2"),
        ("prefix_lens of another batch", r"^prefix_lens: batch size 3 disagrees with 2"),
        ("a negative prefix total", r"^num_prefix_tokens: must be an int >= 0, got -1"),
    ],
)
def test_chunked_sizes_that_disagree_are_rejected_after_warm_up(module, change, match, dispatched):
    def call(lengths, prefix_lens):
        tensors = _chunked_tensors(module, lengths, prefix_lens, **_CACHE)
        module.mla_chunked_prefill(*tensors[:5], max(lengths), *tensors[5:], num_prefix_tokens=sum(prefix_lens))

    _warm_shapes(module, call)
    tensors = list(_chunked_tensors(module, (5, 7), (12, 9), **_CACHE))
    total = 21
    other = _chunked_tensors(module, (5, 7, 1), (12, 9, 3), **_CACHE)
    if change == "block_table of another batch":
        tensors[6] = other[6]
    elif change == "prefix_lens of another batch":
        tensors[7] = other[7]
    else:
        total = -1
    dispatched.clear()
    with pytest.raises(ValueError, match=match):
        module.mla_chunked_prefill(*tensors[:5], 7, *tensors[5:], validate=False, num_prefix_tokens=total)
    assert not dispatched


def test_a_list_config_is_checked_every_call(module, checked_calls):
    """The prefill op passes its config as a list, which the checks accept and a signature cannot hold (it is not
    hashable): such calls are checked every time, never prepared."""
    module._PREFILL_LAUNCHES.clear()
    tensors = _tensors(module, (8,))
    for _ in range(3):
        module.mla_prefill(*tensors, 8, config=[16, 32, 4, 1])
    assert len(checked_calls) == 3 and not module._PREFILL_LAUNCHES
