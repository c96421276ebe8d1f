"""The options object (mlagen_compiler.options): the one reader of the generated modules' MLAGEN_* switches,
frozen, swapped for a block with use_options, and what the runtime's wrappers read."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from mlagen_compiler import runtime
from mlagen_compiler.launch_policy import ENV_KNOBS, env_knob
from mlagen_compiler.options import KNOBS, Options, options, reload_options, set_options, use_options


def test_unset_variables_are_the_defaults_and_each_variable_sets_its_field():
    defaults = Options.from_env({})
    assert defaults == Options()
    assert (defaults.decode_backend, defaults.decode_merge) == ("auto", "auto")
    assert defaults.decode_pdl and defaults.decode_tma and defaults.prefill_tma
    assert defaults.direct_launch and defaults.raw_launch
    assert not defaults.validate and not defaults.poison_workspace
    for name, (field, knob) in KNOBS.items():
        for text in knob.allowed:
            chosen = Options.from_env({name: text})
            assert getattr(chosen, field) == ((text == "1") if knob.switch else int(text) if knob.integer else text)
            assert chosen.environ()[name] == text  # the variables that ask for these options
        assert Options.from_env({name: "  "}) == defaults  # blank: unset


@pytest.mark.parametrize("name", list(KNOBS))
def test_a_wrong_value_is_one_line_naming_the_variable(name):
    knob = KNOBS[name][1]
    expected = " or ".join([", ".join(knob.allowed[:-1]), knob.allowed[-1]])
    with pytest.raises(ValueError, match=f"^{name}: expected {expected}, got 'bogus'$"):
        Options.from_env({name: "bogus"})
    with pytest.raises(ValueError, match=f"^{name}: expected {expected}, got 'bogus'$"):
        env_knob(name, "bogus")


def test_the_launch_policys_table_is_the_options_table():
    assert list(ENV_KNOBS) == list(KNOBS)
    for name, (allowed, default, meaning) in ENV_KNOBS.items():
        knob = KNOBS[name][1]
        assert (allowed, default, meaning) == (knob.allowed, knob.default, knob.meaning)


def test_options_are_frozen_and_checked():
    chosen = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.validate = True
    with pytest.raises(ValueError, match="^decode_backend: expected auto, gluon or triton, got 'cuda'$"):
        Options(decode_backend="cuda")
    with pytest.raises(ValueError, match="^decode_tma: expected True or False, got 'on'$"):
        Options(decode_tma="on")
    assert hash(Options(validate=True)) == hash(Options(validate=True)) and Options(validate=True) != chosen
    other = Options(decode_backend="triton", decode_tma=False)
    assert pickle.loads(pickle.dumps(other)) == other and copy.deepcopy(other) == other


def test_use_options_swaps_for_a_block_and_restores():
    before = options()
    with use_options(decode_merge="kernel", validate=False) as inside:
        assert options() is inside and inside.decode_merge == "kernel" and not inside.validate
        assert dataclasses.replace(inside, decode_merge=before.decode_merge, validate=before.validate) == before
        with use_options(Options(), prefill_tma=False):
            assert options() == Options(prefill_tma=False)
        assert options() is inside
    assert options() is before
    with pytest.raises(RuntimeError), use_options(decode_pdl=False):
        raise RuntimeError  # restored on an exception too
    assert options() is before


def test_set_and_reload(monkeypatch):
    before = options()
    try:
        previous = set_options(Options(validate=True))
        assert previous is before and options() == Options(validate=True)
        monkeypatch.setenv("MLAGEN_DECODE_MERGE", "fused")
        assert options().decode_merge == "auto"  # the environment is read once, not per call
        assert reload_options().decode_merge == "fused" and options().decode_merge == "fused"
        with pytest.raises(TypeError, match="expected an Options"):
            set_options({"validate": True})
    finally:
        set_options(before)


def test_the_runtime_reads_the_options_in_force():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with use_options(validate=False):
        assert runtime._validating(None, cpu) and not runtime._validating(None, cuda)
    with use_options(validate=True):
        assert runtime._validating(None, cuda)
    for raw, direct in ((False, True), (True, False)):
        with use_options(raw_launch=raw, direct_launch=direct):
            assert not runtime._raw_launch()


def test_a_bare_decode_call_plans_under_the_options_in_force(build_module, device):
    """The default schedules are kept per options: a swapped merge plans its own schedule."""
    module = build_module(
        name="options-merge", num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, page_size=16,
    )  # fmt: skip
    with use_options(decode_merge="kernel"):
        kernel = module._default_schedule(3, 1, device)
        assert kernel.merge == "kernel" and module._default_schedule(3, 1, device) is kernel
    with use_options(decode_merge="fused"):
        fused = module._default_schedule(3, 1, device)
    assert fused is not kernel and fused.merge == "fused"
