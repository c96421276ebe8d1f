"""Decode launches prepared once per tensor layout and schedule (_PreparedLaunch, _decode_signature).

A call whose tensors have the layout of an earlier, fully checked call with the same schedule skips the
checks and only puts its tensors into the prepared launches: these tests pin what must send a call back
to the checks (another shape, strides, dtype, alignment, schedule) and that results stay right.
"""

import pytest
import torch
from helpers import SMALL_SPEC

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


class _RecordingKernel:
    """Stands in for a JIT function: records the arguments of each launch."""

    arg_names = ["A", "DESC", "WORK", "N", "X"]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.launches.append((grid, args, options))


def test_prepared_launch_puts_in_tensors_and_remakes_descriptors(build_module):
    module = build_module(**SPEC)
    kernel = _RecordingKernel()

    def call_tensors():
        return torch.randn(8, 16), torch.randn(32, 24)

    a, b = call_tensors()
    work = torch.zeros(4)
    descriptor = module.TensorDescriptor(b[:, 8:], [32, 16], [24, 1], [16, 16])
    launch = module._PreparedLaunch(kernel, (2,), (a, b), (work,), (a, descriptor, work, 7), {"X": 3}, num_warps=4)
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


def test_prepared_launch_is_not_reusable_with_a_per_call_copy(build_module):
    module = build_module(**SPEC)
    a, b = torch.randn(8, 16), torch.randn(32, 16)
    copied = module.TensorDescriptor(b.clone(), [32, 16], [16, 1], [16, 16])
    args = (a, copied, torch.zeros(4), 7)
    assert not module._PreparedLaunch(_RecordingKernel(), (1,), (a, b), (), args, {"X": 3}, num_warps=4).reusable
    unowned = (a, None, torch.zeros(4), 7)
    assert not module._PreparedLaunch(_RecordingKernel(), (1,), (a, b), (), unowned, {"X": 3}, num_warps=4).reusable
