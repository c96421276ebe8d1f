"""Property testing of generated modules: Hypothesis strategies that draw problems for a module, and checks
that run the module's kernels on them against `mlagen_compiler.reference`.

Every strategy takes a generated module (`mlagen_compiler.load(...)`, or a module file imported with
`import_module_from_path`) and draws a problem for it: a frozen dataclass of shapes, knobs and the seed
its tensors are made from (`problem.inputs(module, device)`), so a failing example replays exactly and
shrinks to small shapes. Its repr is Python that rebuilds it. Each `assert_*_matches_reference` runs one
problem: outputs poisoned with NaN before the call (an element nobody wrote fails), unused cache slots
NaN where the problem says so, results against the float64 reference within the per-dtype tolerances of
`mlagen_compiler.verify`.

    from hypothesis import given
    from mlagen_compiler import load
    from mlagen_compiler.testing import assert_decode_matches_reference, decode_inputs, prepare_environment

    prepare_environment()  # before the module is imported: Triton's interpreter without a GPU, poisoning
    mla = load("my-spec.yaml")

    @given(decode_inputs(mla))
    def test_decode(problem):
        assert_decode_matches_reference(mla, problem)

The pytest plugin (`pytest --mlagen-spec SPEC`, see `mlagen_compiler.pytest_plugin`) runs these for every
kernel a module holds; mlagen's own tests draw through them too.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from .options import reload_options, use_options
from .reference import cache_write, chunked_prefill, dequantize_cache, prefill_varlen
from .verify import (
    compare_with_lse,
    cu_seqlens,
    decode_reference,
    make_decode_inputs,
    paged_block_table,
    poison_unused_cache,
    random_cache,
    random_mha,
    same_bits,
)

__all__ = [
    "CacheWriteProblem",
    "ChunkedPrefillProblem",
    "DecodeProblem",
    "MergeProblem",
    "PrefillProblem",
    "assert_cache_write_matches_reference",
    "assert_chunked_prefill_matches_reference",
    "assert_decode_matches_reference",
    "assert_merge_matches_reference",
    "assert_prefill_matches_reference",
    "cache_write_inputs",
    "chunked_prefill_inputs",
    "decode_backends",
    "decode_inputs",
    "default_device",
    "load_hypothesis_profile",
    "load_target",
    "merge_inputs",
    "prefill_inputs",
    "prepare_environment",
    "register_hypothesis_profiles",
    "reproduce",
    "reproducer",
]

#: the environment variable naming the Hypothesis profile (see HYPOTHESIS_PROFILES)
PROFILE_ENV = "MLAGEN_HYPOTHESIS_PROFILE"
_COMMON_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
#: `ci` is derandomized so CI is repeatable, `dev` (the default) is small and random, `fuzz` hunts long
HYPOTHESIS_PROFILES: dict[str, dict[str, Any]] = {
    "ci": {"max_examples": 50, "derandomize": True, "print_blob": True},
    "dev": {"max_examples": 12},
    "fuzz": {"max_examples": 2000},
}
DEFAULT_PROFILE = "dev"
#: (block_m, block_n) prefill tiles drawn besides the module's own choice, so both loop shapes are covered
PREFILL_EXTRA_TILES: tuple[tuple[int, int], ...] = ((32, 16), (16, 32))


def register_hypothesis_profiles() -> None:
    """Register HYPOTHESIS_PROFILES with Hypothesis as `mlagen-<name>` (no interpreter deadline)."""
    for name, values in HYPOTHESIS_PROFILES.items():
        settings.register_profile(f"mlagen-{name}", **_COMMON_SETTINGS, **values)


def load_hypothesis_profile(name: str | None = None) -> str:
    """Load profile `name` (default: $MLAGEN_HYPOTHESIS_PROFILE, else `dev`) and return its name."""
    name = name or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    if name not in HYPOTHESIS_PROFILES:
        raise ValueError(f"{PROFILE_ENV}: '{name}' is not a profile; allowed: {', '.join(HYPOTHESIS_PROFILES)}")
    register_hypothesis_profiles()
    settings.load_profile(f"mlagen-{name}")
    return name


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU (kernels in Triton's interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def prepare_environment() -> torch.device:
    """Set what the checks rely on, before any generated module is imported: Triton's interpreter when there
    is no GPU, NaN-filled workspaces (MLAGEN_POISON_WORKSPACE) and every index value validated
    (MLAGEN_VALIDATE, on the GPU too). Returns the device the kernels run on."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["MLAGEN_POISON_WORKSPACE"] = "1"  # (for child processes too)
    os.environ["MLAGEN_VALIDATE"] = "1"
    reload_options()
    return default_device()


def load_target(target: str | Path) -> ModuleType:
    """A generated module: a `.py` file (generated or vendored) is imported as it is; anything else is a spec
    (YAML path or registered name) loaded through the compile cache (`mlagen_compiler.load`)."""
    from .cache import load
    from .module_file import import_module_from_path

    if str(target).endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"module: {target}: no such file; expected a generated module (.py)")
        return import_module_from_path(path)
    return load(target)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available()


def reproducer(target: str | Path, problem: Any, **kwargs: Any) -> str:
    """One shell line that runs `problem` against module `target` again (see `reproduce`)."""
    arguments = ", ".join([repr(str(target)), repr(problem)] + [f"{k}={v!r}" for k, v in kwargs.items()])
    code = f"from mlagen_compiler.testing import {type(problem).__name__}, reproduce; reproduce({arguments})"
    env = "TRITON_INTERPRET=1 " if _interpreting() else ""
    return f"{env}python -c {shlex.quote(code)}"


def reproduce(target: str | Path, problem: Any, **kwargs: Any) -> None:
    """Load `target` (see load_target) after `prepare_environment` and run the check of `problem`'s kind."""
    device = prepare_environment()
    module = load_target(target)
    CHECKS[type(problem)](module, problem, device=device, **kwargs)
    print(f"passed: {problem!r}")


def _spec_dtype(module: ModuleType) -> str:
    return module.SPEC["dtype"]


def _assert_close(got, got_lse, want, want_lse, module: ModuleType) -> None:
    __tracebackhide__ = True  # pytest reports the failing test's line and the message, not these tensors
    assert not got.isnan().any(), "unwritten or NaN output elements"
    _, _, message = compare_with_lse(got, got_lse, want, want_lse, _spec_dtype(module))
    assert not message, message


def _scales(module: ModuleType) -> st.SearchStrategy[float | None]:
    """The module's default softmax scale (None) or an explicit one around it."""
    factor = st.sampled_from([0.25, 0.5, 2.0]) | st.floats(0.1, 3.0)
    return st.none() | factor.map(lambda f: round(module.SOFTMAX_SCALE * f, 6))


def _shape_line(module: ModuleType) -> str:
    cache = str(module.CACHE_DTYPE).replace("torch.", "")
    return (
        f"{module.SPEC['name']}: H={module.NUM_HEADS} Dc={module.KV_LORA_RANK} Dr={module.QK_ROPE_HEAD_DIM} "
        f"Dn={module.QK_NOPE_HEAD_DIM} Dv={module.V_HEAD_DIM} page_size={module.PAGE_SIZE} "
        f"dtype={_spec_dtype(module)} cache={cache}"
    )


# ---- decode ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """One `mla_decode` call: cache lengths per sequence (0: an empty sequence), Sq new tokens each.

    num_parts / min_blocks: split-KV knobs of get_decode_schedule (None: the launch policy's); merge: split
    sequences merged by their own runs ("fused") or by the combine kernel; tma: cache blocks through TMA
    descriptors where the kernel can; nan_unused: NaN in every cache slot no sequence owns; config: a
    forced tile configuration; seed: the tensors' (q, the shuffled page table, the cache, an fp8 scale);
    causal: the Sq new tokens causal among themselves, or each seeing the whole sequence (mla_decode's causal).
    """

    seqlens: tuple[int, ...]
    seqlen_q: int = 1
    softmax_scale: float | None = None
    causal: bool = True
    num_parts: int | None = None
    min_blocks: int | None = None
    merge: str = "fused"
    tma: bool = True
    nan_unused: bool = True
    config: tuple[int, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seqlens", tuple(self.seqlens))

    def inputs(self, module: ModuleType, device: torch.device) -> dict[str, Any]:
        """mla_decode's tensor arguments (with kv_scale for an fp8 cache), drawn from the seed."""
        inputs = make_decode_inputs(
            module, self.seqlens, self.seqlen_q, torch.Generator().manual_seed(self.seed), device
        )
        if self.nan_unused:
            poison_unused_cache(inputs)
        return inputs

    def describe(self, module: ModuleType) -> str:
        scale = "default" if self.softmax_scale is None else self.softmax_scale
        return (
            f"decode {_shape_line(module)} | batch={len(self.seqlens)} Sq={self.seqlen_q} "
            f"lengths={list(self.seqlens)} softmax_scale={scale}{'' if self.causal else ' causal=False'}"
        )


def decode_backends(module: ModuleType, device: torch.device | None = None) -> list[str]:
    """The decode backends that run here: the portable kernel, and the Gluon one where this GPU, this
    Triton and the module's geometry take it."""
    backend, _ = module.decode_backend(device or default_device(), "auto")
    return ["triton", "gluon"] if backend == "gluon" else ["triton"]


@st.composite
def decode_inputs(
    draw: Callable, module: ModuleType, *, max_batch: int = 4, max_seqlen_q: int = 4, max_length: int = 70
) -> DecodeProblem:
    """DecodeProblems for `module`: lengths at its page edges, anywhere up to max_length, or 0; batch 1..max_batch;
    Sq 1..max_seqlen_q; default or explicit softmax scale; causal or not (where the module's mla_decode takes
    causal=); default or forced splits; both merges, both cache load paths; unused cache slots NaN or stale data."""
    p = module.PAGE_SIZE
    takes_causal = "causal" in inspect.signature(module.mla_decode).parameters
    length = st.one_of(
        st.sampled_from(sorted({1, max(1, p - 1), p, p + 1, 2 * p - 1, 2 * p + 1, 3 * p})),
        st.integers(1, max_length),
        st.just(0),  # an empty-but-valid sequence: output 0, lse -inf
    )
    return DecodeProblem(
        seqlens=tuple(draw(st.lists(length, min_size=1, max_size=max_batch), label="seqlens")),
        seqlen_q=draw(st.integers(1, max_seqlen_q), label="seqlen_q"),
        softmax_scale=draw(_scales(module), label="softmax_scale"),
        causal=draw(st.booleans(), label="causal") if takes_causal else True,
        num_parts=draw(st.one_of(st.none(), st.integers(1, 9)), label="num_parts"),
        # default (plan's cost rule) or forced small runs, so that splits and the merges are exercised
        min_blocks=draw(st.sampled_from([None, 1, 2]), label="min_blocks"),
        merge=draw(st.sampled_from(["fused", "kernel"]), label="merge"),
        tma=draw(st.booleans(), label="tma"),
        # unused cache slots (page tails, unused pages) hold NaN, as uninitialised memory may
        nan_unused=draw(st.booleans(), label="nan_unused"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


def assert_decode_matches_reference(
    module: ModuleType,
    problem: DecodeProblem,
    *,
    backend: str = "triton",
    device: torch.device | None = None,
    calls: int = 1,
    cache_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """mla_decode on `problem` == reference.decode_paged over the dequantised cache, outputs and LSEs.

    calls: later calls reuse the schedule's workspace (whose merge counters must be back at 0);
    cache_view: a function of the cache returning the cache the call reads (the same values).
    """
    __tracebackhide__ = True
    device = device or default_device()
    inputs = problem.inputs(module, device)
    if cache_view is not None:
        inputs["kv_cache"] = cache_view(inputs["kv_cache"])
    batch, seqlen_q = len(problem.seqlens), problem.seqlen_q
    schedule = module.get_decode_schedule(
        batch,
        seqlen_q,
        device,
        num_parts=problem.num_parts,
        min_blocks_per_part=problem.min_blocks,
        backend=backend,
        merge=problem.merge,
        config=problem.config,
    )
    assert schedule.backend == backend, schedule.backend_reason
    want, want_lse = decode_reference(module, inputs, problem.softmax_scale, causal=problem.causal)
    causal = {} if problem.causal else {"causal": False}  # (modules generated before causal= take the default)
    for _ in range(calls):
        out = torch.full(
            (batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), float("nan"), dtype=module.DTYPE, device=device
        )
        lse = torch.full((batch, module.NUM_HEADS, seqlen_q), float("nan"), device=device)
        with use_options(decode_tma=problem.tma):
            got, got_lse = module.mla_decode(
                **inputs,
                softmax_scale=problem.softmax_scale,
                return_lse=True,
                schedule=schedule,
                out=out,
                lse=lse,
                **causal,
            )
        assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
        _assert_close(got, got_lse, want, want_lse, module)
        # the fused merge's arrival counters are back at 0 for the next call
        assert not schedule.workspace(device)[2].any(), "merge counters not reset after the call"


# ---- prefill, chunked prefill, merge ---------------------------------------------------------------------
def _tiles_config(module: ModuleType, tiles: tuple[int, int] | None, device: torch.device) -> tuple[int, ...]:
    config = module.prefill_config(device)
    return config if tiles is None else (*tiles, *config[2:])


def _call_config(module: ModuleType, tiles: tuple[int, int] | None, device: torch.device, options: dict):
    """The config a check passes under `options`: the portable kernel's (tiles forced or the module's), or None
    where the Gluon kernel runs (its tuned or default (block_n, stages); a portable config would be refused)."""
    with use_options(**options):
        gluon = hasattr(module, "prefill_backend") and module.prefill_backend(device)[0] == "gluon"
    return None if gluon else _tiles_config(module, tiles, device)


def _tile_lengths(block_m: int, block_n: int, max_length: int) -> st.SearchStrategy[int]:
    """Lengths at the tiles' edges (+-1) or anywhere up to max_length."""
    edges = {1, 2, block_n - 1, block_n, block_n + 1, block_m - 1, block_m + 1, 2 * block_m + 1}
    return st.one_of(st.sampled_from(sorted(e for e in edges if e >= 1)), st.integers(1, max_length))


def _poisoned(module: ModuleType, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((num_tokens, module.NUM_HEADS, module.V_HEAD_DIM), float("nan"), dtype=module.DTYPE, device=device)
    return out, torch.full((module.NUM_HEADS, num_tokens), float("nan"), device=device)


@dataclasses.dataclass(frozen=True)
class PrefillProblem:
    """One `mla_prefill` call over packed sequences of `lengths` new tokens. tiles: (block_m, block_n) forced
    (None: the module's choice); tma: key / value tiles through TMA descriptors where the kernel can."""

    lengths: tuple[int, ...]
    tiles: tuple[int, int] | None = None
    tma: bool = True
    softmax_scale: float | None = None
    seed: int = 0

    def describe(self, module: ModuleType) -> str:
        return f"prefill {_shape_line(module)} | lengths={list(self.lengths)} tiles={self.tiles}"


@st.composite
def prefill_inputs(
    draw: Callable, module: ModuleType, *, max_batch: int = 4, max_length: int = 40, device: torch.device | None = None
) -> PrefillProblem:
    """PrefillProblems for `module`: the module's tiles on `device` or PREFILL_EXTRA_TILES, lengths at the
    tiles' edges or up to max_length, batch 1..max_batch, both load paths, default or explicit scale."""
    tiles = draw(st.sampled_from([None, *PREFILL_EXTRA_TILES]), label="tiles")
    config = _tiles_config(module, tiles, device or default_device())
    lengths = st.lists(_tile_lengths(config[0], config[1], max_length), min_size=1, max_size=max_batch)
    return PrefillProblem(
        lengths=tuple(draw(lengths, label="lengths")),
        tiles=tiles,
        tma=draw(st.booleans(), label="tma"),
        softmax_scale=draw(_scales(module), label="softmax_scale"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


#: what a prefill check's backend asks for: (the prefill_backend option, the prefill_persistent option)
PREFILL_CHECK_BACKENDS = {"triton": ("triton", False), "gluon": ("gluon", False), "gluon-persistent": ("gluon", True)}


def _prefill_backend_options(module: ModuleType, backend: str | None, device: torch.device, tma: bool) -> dict:
    """The options a prefill check runs under: the TMA switch and (backend given: one of PREFILL_CHECK_BACKENDS)
    the prefill backend, checked to be the one a call then takes, and the Gluon kernel's variant ("gluon-persistent":
    the persistent one) (a module from before the prefill backends takes only None)."""
    if backend is None:
        return {"prefill_tma": tma}
    option, persistent = PREFILL_CHECK_BACKENDS[backend]
    with use_options(prefill_backend=option):
        chosen, reason = module.prefill_backend(device)
    assert chosen == option, reason
    return {"prefill_tma": tma, "prefill_backend": option, "prefill_persistent": persistent}


def assert_prefill_matches_reference(
    module: ModuleType, problem: PrefillProblem, *, device: torch.device | None = None, backend: str | None = None
) -> None:
    """mla_prefill == reference.prefill_varlen (causal MHA form), outputs and LSEs. backend: "triton", "gluon" or
    "gluon-persistent" (run under that prefill_backend option, and the Gluon kernel's variant: PREFILL_CHECK_BACKENDS),
    None: the options in force."""
    __tracebackhide__ = True
    device = device or default_device()
    chosen = _prefill_backend_options(module, backend, device, problem.tma)
    lengths = problem.lengths
    g = torch.Generator().manual_seed(problem.seed)
    cu = cu_seqlens(lengths, device)
    q, k_nope, k_pe, v = random_mha(module, sum(lengths), g, device)
    out, lse = _poisoned(module, sum(lengths), device)
    with use_options(**chosen):
        got, got_lse = module.mla_prefill(
            q, k_nope, k_pe, v, cu, max(lengths), softmax_scale=problem.softmax_scale, return_lse=True, out=out,
            lse=lse, config=_call_config(module, problem.tiles, device, chosen),
        )  # fmt: skip
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    scale = module.SOFTMAX_SCALE if problem.softmax_scale is None else problem.softmax_scale
    want, want_lse = prefill_varlen(q.double(), k_nope.double(), k_pe.double(), v.double(), cu, scale)
    _assert_close(got, got_lse, want, want_lse, module)


@dataclasses.dataclass(frozen=True)
class ChunkedPrefillProblem:
    """One `mla_chunked_prefill` call: sequence b has prefix_lens[b] tokens in the paged cache (shuffled
    pages, unused slots NaN) and lengths[b] new ones. host_prefix_total: the prefix total given as a host
    int (graph-capturable) or read from prefix_lens."""

    lengths: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    tiles: tuple[int, int] | None = None
    tma: bool = True
    host_prefix_total: bool = False
    softmax_scale: float | None = None
    seed: int = 0

    def describe(self, module: ModuleType) -> str:
        return (
            f"chunked prefill {_shape_line(module)} | new={list(self.lengths)} prefix={list(self.prefix_lens)} "
            f"tiles={self.tiles}"
        )


@st.composite
def chunked_prefill_inputs(
    draw: Callable,
    module: ModuleType,
    *,
    max_batch: int = 3,
    max_length: int = 40,
    max_prefix: int = 50,
    device: torch.device | None = None,
) -> ChunkedPrefillProblem:
    """ChunkedPrefillProblems for `module`: new lengths as prefill_inputs draws them, prefixes empty, at the
    tiles' and pages' edges or up to max_prefix."""
    tiles = draw(st.sampled_from([None, *PREFILL_EXTRA_TILES]), label="tiles")
    config = _tiles_config(module, tiles, device or default_device())
    batch = draw(st.integers(1, max_batch), label="batch")
    new = st.lists(_tile_lengths(config[0], config[1], max_length), min_size=batch, max_size=batch)
    prefix = st.one_of(st.just(0), _tile_lengths(config[1], module.PAGE_SIZE, max_prefix), st.integers(0, max_prefix))
    return ChunkedPrefillProblem(
        lengths=tuple(draw(new, label="lengths")),
        prefix_lens=tuple(draw(st.lists(prefix, min_size=batch, max_size=batch), label="prefix_lens")),
        tiles=tiles,
        tma=draw(st.booleans(), label="tma"),
        host_prefix_total=draw(st.booleans(), label="host_prefix_total"),
        softmax_scale=draw(_scales(module), label="softmax_scale"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


def assert_chunked_prefill_matches_reference(
    module: ModuleType,
    problem: ChunkedPrefillProblem,
    *,
    device: torch.device | None = None,
    backend: str | None = None,
) -> None:
    """mla_chunked_prefill == reference.chunked_prefill (full causal attention over the dequantised prefix,
    expanded in the spec dtype, and the new tokens), outputs and LSEs. backend: as for
    assert_prefill_matches_reference."""
    __tracebackhide__ = True
    device = device or default_device()
    chosen = _prefill_backend_options(module, backend, device, problem.tma)
    lengths, prefix_lens = problem.lengths, problem.prefix_lens
    g = torch.Generator().manual_seed(problem.seed)
    cu = cu_seqlens(lengths, device)
    q, k_nope, k_pe, v = random_mha(module, sum(lengths), g, device)
    table, num_pages = paged_block_table(prefix_lens, module.PAGE_SIZE, g, spare_pages=2)
    cache, kv_scale = random_cache(module, num_pages, g, device)
    table = table.to(device)
    plen = torch.tensor(prefix_lens, dtype=torch.int32, device=device)
    poison_unused_cache({"kv_cache": cache, "block_table": table, "cache_seqlens": plen})
    heads, dn, dv, dc = module.NUM_HEADS, module.QK_NOPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK
    w_uk = (torch.randn(heads, dn, dc, generator=g) / dc**0.5).to(module.DTYPE).to(device)
    w_uv = (torch.randn(heads, dv, dc, generator=g) / dc**0.5).to(module.DTYPE).to(device)
    out, lse = _poisoned(module, sum(lengths), device)
    total = sum(prefix_lens) if problem.host_prefix_total else None
    with use_options(**chosen):
        got, got_lse = module.mla_chunked_prefill(
            q, k_nope, k_pe, v, cu, max(lengths), cache, table, plen, w_uk, w_uv, kv_scale=kv_scale,
            softmax_scale=problem.softmax_scale, return_lse=True, out=out, lse=lse,
            config=_call_config(module, problem.tiles, device, chosen), num_prefix_tokens=total,
        )  # fmt: skip
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    scale = module.SOFTMAX_SCALE if problem.softmax_scale is None else problem.softmax_scale
    want, want_lse = chunked_prefill(
        q.double(), k_nope.double(), k_pe.double(), v.double(), cu, dequantize_cache(cache, kv_scale), table, plen,
        w_uk.double(), w_uv.double(), scale, expanded_dtype=module.DTYPE,
    )  # fmt: skip
    _assert_close(got, got_lse, want, want_lse, module)


@dataclasses.dataclass(frozen=True)
class MergeProblem:
    """One `merge_attn_states` call: attention of num_tokens queries over keys_a keys and over keys_b keys
    (either may be 0) under a random visibility pattern; partials in float32 or the spec dtype; blind_rows:
    some queries see no key at all (lse -inf, zero output)."""

    num_tokens: int
    keys_a: int
    keys_b: int
    partials_fp32: bool = False
    blind_rows: bool = False
    seed: int = 0

    def describe(self, module: ModuleType) -> str:
        return f"merge_attn_states {_shape_line(module)} | tokens={self.num_tokens} keys={self.keys_a}+{self.keys_b}"


@st.composite
def merge_inputs(draw: Callable, module: ModuleType, *, max_tokens: int = 20, max_keys: int = 24) -> MergeProblem:
    keys_a = draw(st.integers(0, max_keys), label="keys_a")
    return MergeProblem(
        num_tokens=draw(st.integers(1, max_tokens), label="num_tokens"),
        keys_a=keys_a,
        keys_b=draw(st.integers(0 if keys_a else 1, max_keys), label="keys_b"),
        partials_fp32=draw(st.booleans(), label="partials_fp32"),
        blind_rows=draw(st.booleans(), label="blind_rows"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


def assert_merge_matches_reference(
    module: ModuleType, problem: MergeProblem, *, device: torch.device | None = None
) -> None:
    """Attention over keys A and over keys B, merged by merge_attn_states, == attention over A + B."""
    __tracebackhide__ = True
    from .reference import attention

    device = device or default_device()
    g = torch.Generator().manual_seed(problem.seed)
    tokens, keys_a, keys = problem.num_tokens, problem.keys_a, problem.keys_a + problem.keys_b
    heads, dv = module.NUM_HEADS, module.V_HEAD_DIM
    q = torch.randn(tokens, heads, 32, generator=g, dtype=torch.float64)
    k = torch.randn(keys, heads, 32, generator=g, dtype=torch.float64)
    v = torch.randn(keys, heads, dv, generator=g, dtype=torch.float64)
    # each query sees a key of the union, except the blind rows
    visible = torch.rand(tokens, keys, generator=g) < 0.7
    visible[torch.arange(tokens), torch.randint(0, keys, (tokens,), generator=g)] = True
    if problem.blind_rows:
        visible[torch.rand(tokens, generator=g) < 0.3] = False
    o_a, l_a = attention(q, k[:keys_a], v[:keys_a], 0.2, visible[:, :keys_a])
    o_b, l_b = attention(q, k[keys_a:], v[keys_a:], 0.2, visible[:, keys_a:])
    want, want_lse = attention(q, k, v, 0.2, visible)
    part_dtype = torch.float32 if problem.partials_fp32 else module.DTYPE
    out, lse = _poisoned(module, tokens, device)
    got, got_lse = module.merge_attn_states(
        o_a.to(part_dtype).to(device), l_a.float().to(device), o_b.to(part_dtype).to(device), l_b.float().to(device),
        out=out, out_lse=lse, return_lse=True,
    )  # fmt: skip
    _assert_close(got, got_lse, want, want_lse, module)


# ---- cache write -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheWriteProblem:
    """One `mla_cache_write` call: num_tokens rows into distinct slots over shuffled pages, a `padding`
    fraction of them padding (slot -1). An fp8 cache's kv_scale is the calibrated one (largest value -> 448)
    times scale_factor (below 1 the largest saturate), given as scale_form."""

    num_tokens: int
    padding: float = 0.0
    slot_dtype: str = "int32"
    scale_factor: float = 1.0
    scale_form: str = "number"
    seed: int = 0

    def describe(self, module: ModuleType) -> str:
        return f"cache_write {_shape_line(module)} | tokens={self.num_tokens} padding={self.padding}"


@st.composite
def cache_write_inputs(draw: Callable, module: ModuleType, *, max_tokens: int = 40) -> CacheWriteProblem:
    p = module.PAGE_SIZE
    edges = sorted({1, p - 1, p, p + 1, 2 * p + 1} & set(range(1, max(max_tokens, 2 * p + 1) + 1)))
    return CacheWriteProblem(
        num_tokens=draw(st.one_of(st.integers(0, max_tokens), st.sampled_from(edges)), label="num_tokens"),
        padding=draw(st.floats(0.0, 0.5), label="padding"),
        slot_dtype=draw(st.sampled_from(["int32", "int64"]), label="slot_dtype"),
        scale_factor=draw(st.floats(0.25, 2.0), label="scale_factor"),
        scale_form=draw(st.sampled_from(["number", "0-d tensor", "1-element tensor"]), label="scale_form"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


def assert_cache_write_matches_reference(
    module: ModuleType, problem: CacheWriteProblem, *, device: torch.device | None = None
) -> None:
    """mla_cache_write == reference.cache_write bit for bit: rows at their slots, padding skipped, every other
    row unchanged; an fp8 cache holds torch's conversion of the float32 quotient, saturated at +-448."""
    __tracebackhide__ = True
    device = device or default_device()
    dc, dr, page_size, num_tokens = module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM, module.PAGE_SIZE, problem.num_tokens
    g = torch.Generator().manual_seed(problem.seed)
    num_pages = -(-(num_tokens + 3) // page_size) + 2
    cache = torch.randn(num_pages, page_size, 1, dc + dr, generator=g).to(module.CACHE_DTYPE)
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < problem.padding] = -1
    c_kv = torch.randn(num_tokens, dc, generator=g).to(module.DTYPE)
    k_pe = torch.randn(num_tokens, dr, generator=g).to(module.DTYPE)
    kv_scale = None
    if module.CACHE_FORMAT.scaled:
        amax = max(float(c_kv.abs().max()), float(k_pe.abs().max())) if num_tokens else 1.0
        kv_scale = torch.tensor([amax / module.CACHE_FORMAT.max_abs * problem.scale_factor], dtype=torch.float32)
    want = cache_write(cache, c_kv, k_pe, slots, kv_scale)
    if kv_scale is not None:
        forms = {"number": float(kv_scale), "0-d tensor": kv_scale[0], "1-element tensor": kv_scale}
        kv_scale = forms[problem.scale_form]
        kv_scale = kv_scale.to(device) if isinstance(kv_scale, torch.Tensor) else kv_scale
    got = cache.to(device)
    slot_dtype = getattr(torch, problem.slot_dtype)
    returned = module.mla_cache_write(
        c_kv.to(device), k_pe.to(device), got, slots.to(slot_dtype).to(device), kv_scale=kv_scale
    )
    assert returned.data_ptr() == got.data_ptr()
    assert same_bits(got, want), "cache differs from reference.cache_write"


#: each problem kind's check (reproduce dispatches on it)
CHECKS: dict[type, Callable[..., None]] = {
    DecodeProblem: assert_decode_matches_reference,
    PrefillProblem: assert_prefill_matches_reference,
    ChunkedPrefillProblem: assert_chunked_prefill_matches_reference,
    MergeProblem: assert_merge_matches_reference,
    CacheWriteProblem: assert_cache_write_matches_reference,
}
