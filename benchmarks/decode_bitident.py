"""Do two builds of a module's decode give bit-identical results on the GPU? (dev tool: a change meant to keep
kernel behaviour, e.g. the split schedule and fused merge the Gluon kernel shares with the portable one since
branch split-schedule, checked against the modules before it). Also: torch.compile (inductor, fullgraph) of the
plain entry points of the newer module, against its eager calls.

    mkdir -p old && for m in deepseek_v3_tp8 deepseek_v3_tp8_fp8; do
        git show 95d9294:generated/$m.py > old/$m.py; done
    python benchmarks/decode_bitident.py old generated [--cases 25]

Both builds run under this checkout's runtime (a module imports mlagen_compiler.runtime; the package's
__init__, and so pydantic, is not needed). For each module named in both folders, each backend (gluon,
triton) and the launch policy's choice of runs of one sequence (as planned, forced on where a schedule has a run per
sequence, forced off): drawn
batches (1 to 128 sequences, empty to 16k tokens, Sq 1 to 4, both merges, forced splits, causal or not,
empty_lse -inf or +inf), each called twice on one schedule; outputs and LSEs compared bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _runtime():
    """mlagen_compiler.runtime without the package's __init__ (which imports the spec's pydantic)."""
    if "mlagen_compiler" not in sys.modules:
        package = types.ModuleType("mlagen_compiler")
        package.__path__ = [str(ROOT / "mlagen_compiler")]
        sys.modules["mlagen_compiler"] = package
    from mlagen_compiler import runtime

    return runtime


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _case(old, new, rng: random.Random, backend: str, device: torch.device, runs: bool | None):
    """One drawn batch through both modules: (bit-identical, what was drawn). runs: the schedules' sequence_runs
    forced on or off (None: as planned)."""
    heads, width = new.NUM_HEADS, new.KV_LORA_RANK + new.QK_ROPE_HEAD_DIM
    batch = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 128])
    seqlen_q = rng.choice([1, 1, 2, 4])
    lengths = [
        rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300), rng.randint(1, 5000), rng.randint(4000, 9000)])
        for _ in range(batch)
    ]
    if rng.random() < 0.5:
        lengths[rng.randrange(batch)] = rng.randint(10000, 16000)
    pages_per = max(1, -(-max(lengths) // new.PAGE_SIZE))
    num_pages = batch * pages_per + 3
    g = torch.Generator(device=device).manual_seed(rng.randint(0, 2**31))
    q = torch.randn(batch, seqlen_q, heads, width, device=device, generator=g).to(new.DTYPE)
    kv = (torch.randn(num_pages, new.PAGE_SIZE, 1, width, device=device, generator=g) * 0.5).to(new.CACHE_DTYPE)
    table = torch.randperm(num_pages, device=device, generator=g)[: batch * pages_per].view(batch, pages_per).int()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    call = dict(causal=rng.random() < 0.7, empty_lse=rng.choice([-math.inf, math.inf]), return_lse=True)
    if new.CACHE_FORMAT.scaled:
        call["kv_scale"] = 0.37
    plan = dict(
        backend=backend,
        merge=rng.choice(["fused", "kernel"]),
        num_parts=rng.choice([None, None, rng.randint(1, 300)]),
        min_blocks_per_part=rng.choice([None, 1, 2, 3]),
    )
    results = []
    for module in (old, new):
        schedule = module.get_decode_schedule(batch, seqlen_q, device, **plan)
        if runs is not None and (not runs or schedule.num_parts >= batch):
            # (forced on only where the kernels' contract allows sequence runs: a run per sequence at least.
            # Schedules are immutable to their users; this dev tool overrides one field before the schedule's first
            # call, which prepares its launches from it)
            object.__setattr__(schedule, "sequence_runs", runs)
        first = module.mla_decode(q, kv, table, seqlens, schedule=schedule, **call)
        again = module.mla_decode(q, kv, table, seqlens, schedule=schedule, **call)  # the workspace reused
        drawn = (schedule.backend, schedule.sequence_runs, schedule.merge, schedule.num_parts)
        results.append(([*first, *again], drawn))
    (old_tensors, old_drawn), (new_tensors, new_drawn) = results
    same = old_drawn == new_drawn and all(
        torch.equal(_bits(a), _bits(b)) for a, b in zip(old_tensors, new_tensors, strict=True)
    )
    return same, (batch, seqlen_q, new_drawn, call["causal"], call["empty_lse"])


def compare(old_dir: Path, new_dir: Path, cases: int) -> int:
    _runtime()
    device = torch.device("cuda")
    failures = 0
    names = sorted(p.stem for p in old_dir.glob("*.py") if p.stem != "__init__" and (new_dir / p.name).exists())
    for name in names:
        old = _load(old_dir / f"{name}.py", f"old_{name}")
        new = _load(new_dir / f"{name}.py", f"new_{name}")
        for backend in ("gluon", "triton"):
            for runs in (None, True, False):
                rng = random.Random(f"{name}-{backend}-{runs}")
                count = cases if backend == "gluon" else max(1, cases // 3)
                bad = 0
                for _ in range(count):
                    same, drawn = _case(old, new, rng, backend, device, runs)
                    if not same:
                        bad += 1
                        print("MISMATCH", name, backend, runs, drawn, flush=True)
                print(f"{name} {backend} sequence_runs={runs}: {count - bad}/{count} bit-identical", flush=True)
                failures += bad
    return failures


def compiled_entry_points(new_dir: Path) -> bool:
    """torch.compile(fullgraph=True), inductor: cache write and decode through the plain entry points, with and
    without a schedule, equal to the eager calls."""
    module = _load(new_dir / "deepseek_v3_tp8.py", "compiled_deepseek_v3_tp8")
    device = torch.device("cuda")
    heads, dc, dr = module.NUM_HEADS, module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM
    q = torch.randn(4, 1, heads, dc + dr, device=device).to(module.DTYPE)
    kv = torch.randn(64, module.PAGE_SIZE, 1, dc + dr, device=device).to(module.DTYPE)
    table = torch.arange(64, device=device, dtype=torch.int32).view(4, 16)
    lengths = torch.tensor([100, 0, 700, 1000], device=device, dtype=torch.int32)
    c_kv = torch.randn(5, dc, device=device).to(module.DTYPE)
    k_pe = torch.randn(5, dr, device=device).to(module.DTYPE)
    slots = torch.tensor([3, 70, -1, 900, 1023], device=device)
    schedule = module.get_decode_schedule(4, 1, device)

    def step(kv, schedule):
        module.mla_cache_write(c_kv, k_pe, kv, slots)
        out, lse = module.mla_decode(q, kv, table, lengths, return_lse=True, schedule=schedule)
        return (out.float() * 2).sum(-1), lse

    want = step(kv.clone(), schedule)
    ok = True
    for given in (schedule, None):
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True)(kv.clone(), given)
        equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        print(f"inductor, fullgraph, schedule {'given' if given else 'none'}: equal to eager: {equal}", flush=True)
        ok &= equal
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="folder of the earlier build's modules")
    parser.add_argument("new", type=Path, help="folder of the later build's modules (e.g. generated)")
    parser.add_argument("--cases", type=int, default=25, help="drawn batches per Gluon sweep (a third for triton)")
    args = parser.parse_args(argv)
    failures = compare(args.old, args.new, args.cases)
    compiled = compiled_entry_points(args.new)
    return 1 if failures or not compiled else 0


if __name__ == "__main__":
    sys.exit(main())
