"""mlagen_compiler.runtime as a generated module uses it: its view of the module, the entry points bound to it,
the per-module DecodeSchedule, and the checks that moved out of the templates."""

import inspect

import pytest
import torch
from helpers import SMALL_SPEC

from mlagen_compiler import runtime

SPEC = {**SMALL_SPEC, "name": "runtime", "num_heads": 4, "page_size": 4, "kernels": ["decode", "prefill"]}


def test_module_view_reads_the_module_as_it_is_now():
    namespace = {"__name__": "some_module", "NUM_HEADS": 4}
    m = runtime.ModuleView(namespace)
    assert m.NUM_HEADS == 4
    namespace["NUM_HEADS"] = 8  # (what a test's monkeypatch of the module does)
    assert m.NUM_HEADS == 8
    with pytest.raises(AttributeError):
        m.PAGE_SIZE  # noqa: B018


def test_bind_gives_the_entry_point_its_name_docstring_and_signature_less_the_module():
    m = runtime.ModuleView({"__name__": "some_module", "NUM_HEADS": 4})

    def heads_times(m, factor, *, offset=0):
        """NUM_HEADS * factor + offset."""
        return m.NUM_HEADS * factor + offset

    bound = runtime.bind(m, heads_times)
    assert bound(2, offset=1) == 9
    assert bound.__name__ == "heads_times" and bound.__doc__ == "NUM_HEADS * factor + offset."
    assert bound.__module__ == "some_module"
    assert list(inspect.signature(bound).parameters) == ["factor", "offset"]


def test_generated_entry_points_are_the_runtimes_bound_to_the_module(build_module):
    module = build_module(**SPEC)
    for name in ("get_decode_schedule", "mla_prefill", "mla_chunked_prefill", "merge_attn_states", "mla_cache_write"):
        entry = getattr(module, name)
        assert entry.__module__ == module.__name__ and entry.__doc__ == getattr(runtime, name).__doc__
        assert "m" not in inspect.signature(entry).parameters
    assert list(inspect.signature(module.get_decode_schedule).parameters)[:3] == ["batch_size", "seqlen_q", "device"]
    assert module._M.NUM_HEADS == module.NUM_HEADS == 4


def test_each_module_has_its_own_schedule_type(build_module, device):
    module = build_module(**SPEC)
    other = build_module(**{**SPEC, "name": "runtime-other", "num_heads": 8})
    schedule = module.get_decode_schedule(2, 1, device)
    assert type(schedule) is module.DecodeSchedule and issubclass(module.DecodeSchedule, runtime.DecodeSchedule)
    assert module.DecodeSchedule is not other.DecodeSchedule
    assert schedule.spec_hash == module.SPEC_HASH and schedule.workspace(device)[0].shape[1] == 4
    with pytest.raises(AttributeError, match="DecodeSchedule is immutable"):
        schedule.num_parts = 3
    q = torch.zeros(2, 1, 8, other.KV_LORA_RANK + other.QK_ROPE_HEAD_DIM, dtype=other.DTYPE, device=device)
    kv = torch.zeros(4, other.PAGE_SIZE, 1, q.shape[-1], dtype=other.CACHE_DTYPE, device=device)
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="^schedule: planned by another module"):
        other.mla_decode(q, kv, table, lens, schedule=schedule)


def test_validate_pages_takes_the_page_size():
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    lengths = torch.tensor([8, 3], dtype=torch.int32)
    runtime._validate_pages(table, lengths, "cache_seqlens", 3, 4)  # pages of 4 tokens: rows hold 8
    with pytest.raises(ValueError, match=r"^cache_seqlens\[0\] = 8: a length \(block_table rows hold 4 tokens\)"):
        runtime._validate_pages(table, lengths, "cache_seqlens", 3, 2)
    with pytest.raises(ValueError, match=r"^block_table\[1, 0\] = 2: a page used by its sequence must be in \[0, 1\]"):
        runtime._validate_pages(table, lengths, "cache_seqlens", 2, 4)
