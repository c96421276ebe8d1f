"""The property tests `pytest --mlagen-spec SPEC` / `--mlagen-module PATH` collects (mlagen_compiler.pytest_plugin).

One test per kernel kind, parametrized by the modules under test (and the decode backends that run here);
a module without a kernel shows that test skipped. Each draws problems with mlagen_compiler.testing and
checks them against the reference; a failure reports Hypothesis's shrunk problem, its shapes and a
one-line reproducer. On a GPU the shapes reach further (long caches, bigger batches) than in Triton's
interpreter, where they stay small enough to run on a few cores within minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from mlagen_compiler import testing
from mlagen_compiler.pytest_plugin import Target, targets

#: shape bounds per strategy: (interpreter, GPU)
_BOUNDS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "decode": ({}, {"max_batch": 16, "max_length": 4096}),
    "prefill": ({}, {"max_batch": 8, "max_length": 1024}),
    "chunked": ({}, {"max_batch": 6, "max_length": 512, "max_prefix": 2048}),
    "merge": ({}, {"max_tokens": 300, "max_keys": 300}),
    "cache_write": ({}, {"max_tokens": 2048}),
}


def _bounds(kind: str) -> dict[str, int]:
    interpreter, gpu = _BOUNDS[kind]
    return gpu if testing.default_device().type == "cuda" else interpreter


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    entry = getattr(metafunc.function, "entry_point", None)
    if entry is None or "target" not in metafunc.fixturenames:
        return
    params = []
    for target in targets(metafunc.config):
        present = hasattr(target.module, entry)
        marks = () if present else pytest.mark.skip(reason=f"{target.name} has no {entry}")
        backends = testing.decode_backends(target.module) if present and "backend" in metafunc.fixturenames else []
        if "backend" in metafunc.fixturenames:
            for backend in backends or ["triton"]:
                params.append(pytest.param(target, backend, id=f"{target.name}-{backend}", marks=marks))
        else:
            params.append(pytest.param(target, id=target.name, marks=marks))
    names = ["target", "backend"] if "backend" in metafunc.fixturenames else ["target"]
    metafunc.parametrize(names if len(names) > 1 else names[0], params)


def entry_point(name: str):
    """Mark a test as checking the module's `name` (modules without it skip the test)."""

    def mark(function):
        function.entry_point = name
        return function

    return mark


def _explain(target: Target, problem: Any, **kwargs: Any) -> None:
    """What Hypothesis reports with a failing example: the shapes and a line that replays it."""
    note(problem.describe(target.module))
    note(f"reproduce: {testing.reproducer(target.arg, problem, **kwargs)}")


def _check(
    target: Target,
    data: st.DataObject,
    inputs: Callable[..., st.SearchStrategy],
    assert_matches: Callable[..., None],
    bounds: str,
    **kwargs: Any,
) -> None:
    """Draw a problem from `inputs` (shapes within _BOUNDS[bounds]), explain it and check it with
    `assert_matches` (kwargs go to it and to the reproducer)."""
    problem = data.draw(inputs(target.module, **_bounds(bounds)), label="problem")
    _explain(target, problem, **kwargs)
    assert_matches(target.module, problem, **kwargs)


@entry_point("mla_decode")
@given(data=st.data())
def test_decode(target: Target, backend: str, data: st.DataObject) -> None:
    """mla_decode == absorbed decode over the paged cache: batch, Sq, lengths at page edges and empty ones,
    shuffled page tables, default and explicit scales, splits and both merges, NaN in unused slots, an fp8
    cache's scale in each form."""
    _check(target, data, testing.decode_inputs, testing.assert_decode_matches_reference, "decode", backend=backend)


@entry_point("mla_prefill")
@given(data=st.data())
def test_prefill(target: Target, data: st.DataObject) -> None:
    """mla_prefill == causal MHA-form attention per packed sequence, lengths at the tile edges."""
    _check(target, data, testing.prefill_inputs, testing.assert_prefill_matches_reference, "prefill")


@entry_point("mla_chunked_prefill")
@given(data=st.data())
def test_chunked_prefill(target: Target, data: st.DataObject) -> None:
    """mla_chunked_prefill == full causal attention over the cached prefix (shuffled pages, empty prefixes)
    and the new tokens."""
    _check(target, data, testing.chunked_prefill_inputs, testing.assert_chunked_prefill_matches_reference, "chunked")


@entry_point("merge_attn_states")
@given(data=st.data())
def test_merge_attn_states(target: Target, data: st.DataObject) -> None:
    """merge_attn_states of attention over keys A and over keys B == attention over A + B."""
    _check(target, data, testing.merge_inputs, testing.assert_merge_matches_reference, "merge")


@entry_point("mla_cache_write")
@given(data=st.data())
def test_cache_write(target: Target, data: st.DataObject) -> None:
    """mla_cache_write == reference.cache_write bit for bit (padding skipped, other rows untouched)."""
    _check(target, data, testing.cache_write_inputs, testing.assert_cache_write_matches_reference, "cache_write")
