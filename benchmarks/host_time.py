"""Host time per decode call of several module files side by side (GPU machine), with a correctness check.

Each `--module LABEL=PATH[:VAR=VALUE,...]` is imported fresh with those environment variables set (modules of
earlier commits read MLAGEN_* at import), and this tree's modules run under the options they ask for
(mlagen_compiler.options, put in force before each module's calls), e.g. the committed module of an earlier
commit as `before`, this tree's as `after`, and `after` with MLAGEN_RAW_LAUNCH=0. Per case (backend, batch; B
sequences of --seqlen tokens, pages shuffled), every module's calls are timed interleaved, sample by sample:
back-to-back calls issued with `schedule=`, `out=`, `lse=` passed, and bare (none of them); a sample is
--calls calls, synchronised before and after, so the time is the host's as long as the launch queue does not
fill. Then the results: every module's output and LSE must equal the first module's bit for bit, with its
schedule and bare, on the timing inputs and on fresh ones (another query at another address, another layer's
cache on the same schedule), and B <= 8 cases are also compared with the float64 reference.

    python benchmarks/host_time.py --module before=old.py --module after=generated/deepseek_v3_tp8.py \
        [--batch 1 128] [--backend triton gluon] [--calls 200] [--samples 9] [--profile after] [--parts after]

--profile LABEL: cProfile of that module's calls with schedule= (top functions by own time).
--parts LABEL: that module's per-call pieces timed alone (signature, allocations, each launch).

--kind prefill: host time per mla_prefill call instead (B sequences of --seqlen tokens, H of the module; per
--backend, bare back-to-back calls with validate=False, median and min of --samples samples of --calls calls).
On the GPU the launch runs; with --stub-launch (any machine, e.g. a CPU under TRITON_INTERPRET=1) the final
launch is stubbed (runtime._launch, and the prepared path's _launch_prepared where the runtime has one), so the
time is the host path alone:

    TRITON_INTERPRET=1 python benchmarks/host_time.py --kind prefill --module after=generated/deepseek_v3_tp8.py \
        --batch 1 --seqlen 4096 --stub-launch [--calls 2000] [--profile after]

--vary N: each call takes the next of N batch shapes of one layout in turn (a serving engine's batches, whose token
counts change every step): shape k has sequences of --seqlen - k tokens (chunked: over --prefix - k cached ones),
its max_seqlen and (chunked) num_prefix_tokens; the default 1 repeats one shape exactly.

--kind chunked: the same for mla_chunked_prefill (B sequences of --seqlen new tokens over --prefix cached ones,
num_prefix_tokens given: the serving path). The prefix's expansion (a gather and two GEMMs through torch) is device
work, real work on a CPU too: --stub-expand replaces it by the first call's result (per prefix total), so the time is
the host path alone.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import harness
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler import runtime  # noqa: E402
from mlagen_compiler.module_file import import_module_from_path  # noqa: E402
from mlagen_compiler.options import Options, reload_options, set_options  # noqa: E402
from mlagen_compiler.verify import compare_with_lse, decode_reference  # noqa: E402


def load(label: str, path: str, env: dict[str, str]):
    """A fresh import of the module file with `env` set during the import (restored after)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        name = f"_host_time_{label.replace('-', '_')}"
        sys.modules.pop(name, None)  # fresh: imported under this env even where the label was loaded before
        return import_module_from_path(path, name)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parse_module(text: str) -> tuple[str, str, dict[str, str]]:
    label, _, rest = text.partition("=")
    path, _, env_text = rest.partition(":")
    env = dict(item.split("=", 1) for item in env_text.split(",") if item)
    return label, path, env


def make_inputs(module, batch: int, seqlen: int, seed: int):
    """q, kv_cache, block_table, cache_seqlens: `batch` sequences of `seqlen` tokens, pages shuffled."""
    gen = torch.Generator().manual_seed(seed)
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    pages_per_seq = -(-seqlen // module.PAGE_SIZE)
    table = torch.randperm(batch * pages_per_seq, generator=gen).to(torch.int32).view(batch, pages_per_seq)
    kv = torch.randn(batch * pages_per_seq, module.PAGE_SIZE, 1, width, generator=gen).to(module.CACHE_DTYPE)
    q = torch.randn(batch, 1, module.NUM_HEADS, width, generator=gen).to(module.DTYPE)
    lens = torch.full((batch,), seqlen, dtype=torch.int32)
    return [t.cuda() for t in (q, kv, table, lens)]


def parts(module, q, kv, table, lens, schedule, out, lse, calls: int) -> None:
    """Per-call pieces of the module's prepared path, each timed alone (median of 9 samples, us)."""

    def median(call):
        for _ in range(20):
            call()
        return statistics.median(harness.host_us_per_call(call, calls) for _ in range(9))

    scale = module.SOFTMAX_SCALE
    # (the runtime's since the per-call path moved there; older modules: their own)
    signature = getattr(module, "_decode_signature", getattr(runtime, "decode_signature", None))
    addresses = getattr(module, "_decode_addresses", getattr(runtime, "decode_addresses", None))
    if signature is not None and addresses is not None:
        pointers = addresses(q, kv, table, lens, out, lse, None)
        args = (q, kv, table, lens, out, lse, None, None, scale, pointers)
        print(
            f"    decode_addresses + decode_signature (out, lse given): "
            f"{median(lambda: signature(*args[:-1], addresses(*args[:6], None))):6.2f} us"
        )
    shape, dtype, device = tuple(out.shape), out.dtype, out.device
    strides = out.stride()
    for text, allocate in (
        ("torch.empty", lambda: torch.empty(shape, dtype=dtype, device=device)),
        ("torch.empty_strided", lambda: torch.empty_strided(shape, strides, dtype=dtype, device=device)),
        ("q.new_empty", lambda: q.new_empty(shape)),
    ):
        print(f"    {text} of out: {median(allocate):6.2f} us")
    launches = next(iter(schedule._launches.values()), None) if hasattr(schedule, "_launches") else None
    if not launches:
        return
    inputs = (q, kv, table, lens, out, lse, None)
    if hasattr(runtime, "_launch_prepared") and addresses is not None:
        pointers = addresses(*inputs)
        prepared = median(lambda: runtime._launch_prepared(launches, inputs, pointers))
        print(f"    _launch_prepared (all launches): {prepared:6.2f} us")
    for k, launch in enumerate(launches):
        name = getattr(launch.kernel, "__name__", None) or getattr(getattr(launch.kernel, "fn", None), "__name__", "?")
        print(
            f"    launch {k} ({name}): prepared launch {median(lambda launch=launch: launch.launch(inputs)):6.2f} us",
            end="",
        )
        raw = getattr(launch, "raw", None)
        if raw is not None:
            addresses = [None if tensor is None else tensor.data_ptr() for tensor in inputs]
            stream = raw.get_stream(raw.device)
            raw_alone = median(lambda raw=raw, addresses=addresses, stream=stream: raw.launch_at(addresses, stream))
            print(f", raw alone {raw_alone:6.2f} us", end="")
            arguments = list(raw.arguments)
            arguments[3] = stream
            for position, index, offset in raw.pointer_slots:
                arguments[position] = addresses[index] + offset
            for position, index, offset, maps in raw.map_slots:
                arguments[position] = maps[addresses[index] + offset]
            alone = median(lambda raw=raw, arguments=arguments: raw.c_launch(*arguments))
            print(f", C launcher alone {alone:6.2f} us ({len(arguments)} arguments)", end="")
        if launch.compiled is not None and hasattr(launch, "arguments"):
            values = launch.arguments(inputs)
            # (modules generated before mlagen_compiler.runtime carry their own launcher)
            launch_compiled = getattr(module, "_launch_compiled", None) or runtime._launch_compiled
            triton_launcher = median(
                lambda launch=launch, values=values, run=launch_compiled: run(launch.compiled, launch.grid, values)
            )
            print(f", Triton's launcher {triton_launcher:6.2f} us", end="")
        print(flush=True)


def prefill_host_time(args, modules: dict, chosen: dict) -> None:
    """--kind prefill / chunked: host us per bare mla_prefill / mla_chunked_prefill call of each module, per backend
    and batch (see the docstring)."""
    on_gpu = torch.cuda.is_available() and not args.stub_launch
    device = torch.device("cuda" if on_gpu else "cpu")
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    if args.stub_launch:
        runtime._launch = lambda *_, **__: None
        if hasattr(runtime, "_launch_prepared"):
            runtime._launch_prepared = lambda *_: None

    def per_call(call):
        synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        elapsed = time.perf_counter() - start
        synchronize()
        return elapsed / args.calls * 1e6

    for backend in args.backend:
        for batch in args.batch:
            calls = {}
            for label, module in modules.items():
                set_options(replace(chosen[label], prefill_backend=backend))
                gen = torch.Generator().manual_seed(0)
                turn = itertools.cycle(shape_calls(args, module, batch, gen, device))

                def call(turn=turn):
                    next(turn)()

                for _ in range(20 * args.vary):
                    call()
                calls[label] = call
            times = {label: [] for label in modules}
            for _ in range(args.samples):  # interleaved: drift hits every module alike
                for label, call in calls.items():
                    set_options(replace(chosen[label], prefill_backend=backend))
                    times[label].append(per_call(call))
            case = f"{args.kind} {backend} B{batch} S{args.seqlen}" + (
                f" P{args.prefix}" if args.kind == "chunked" else ""
            )
            case += f" ({args.vary} shapes in turn)" if args.vary > 1 else ""
            stubbed = " (launch stubbed)" if args.stub_launch else ""
            stubbed += " (expansion stubbed)" if args.kind == "chunked" and args.stub_expand else ""
            for label, samples in times.items():
                print(
                    f"{case} {label}: {statistics.median(samples):.1f} us/call (min {min(samples):.1f}){stubbed}",
                    flush=True,
                )
            for label in args.profile:
                set_options(replace(chosen[label], prefill_backend=backend))
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    calls[label]()
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(16)
    reload_options()


def shape_calls(args, module, batch: int, gen, device) -> list:
    """--vary bare calls (--kind prefill: mla_prefill; chunked: mla_chunked_prefill) of the module, one per batch
    shape: shape k has `batch` sequences of --seqlen - k new tokens (max_seqlen the same), chunked over --prefix - k
    cached ones each (num_prefix_tokens given). The shapes' tensors are the leading rows of buffers made once for the
    largest (every layout alike, no memory per shape); the cache, its block table's width and the up-projections
    are shared, as a serving engine's are."""
    most, heads = batch * args.seqlen, module.NUM_HEADS
    dn, dr, dv, dc = module.QK_NOPE_HEAD_DIM, module.QK_ROPE_HEAD_DIM, module.V_HEAD_DIM, module.KV_LORA_RANK
    buffers = [
        torch.randn(shape, generator=gen).to(module.DTYPE).to(device)
        for shape in ((most, heads, dn + dr), (most, heads, dn), (most, dr), (most, heads, dv))
    ]
    if args.kind == "chunked":
        pages = max(1, -(-args.prefix // module.PAGE_SIZE))
        width = dc + module.QK_ROPE_HEAD_DIM
        cache = torch.randn(batch * pages, module.PAGE_SIZE, 1, width, generator=gen).to(module.CACHE_DTYPE)
        cache = cache.to(device)
        table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        w_uk, w_uv = (
            (torch.randn(heads, d, dc, generator=gen) / dc**0.5).to(module.DTYPE).to(device) for d in (dn, dv)
        )
        kv_scale = 1.0 if module.CACHE_FORMAT.scaled else None
        stub_expansion(args)
    calls = []
    for k in range(args.vary):
        seqlen = args.seqlen - k
        tokens = batch * seqlen
        tensors = tuple(buffer[:tokens] for buffer in buffers)
        cu = torch.arange(0, tokens + 1, seqlen, dtype=torch.int32, device=device)
        if args.kind == "chunked":
            prefix = args.prefix - k
            prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)

            def call(m=module, tensors=tensors, cu=cu, seqlen=seqlen, prefix_lens=prefix_lens, total=batch * prefix):
                m.mla_chunked_prefill(
                    *tensors, cu, seqlen, cache, table, prefix_lens, w_uk, w_uv, kv_scale=kv_scale, validate=False,
                    num_prefix_tokens=total,
                )  # fmt: skip

        else:

            def call(m=module, tensors=tensors, cu=cu, seqlen=seqlen):
                m.mla_prefill(*tensors, cu, seqlen, validate=False)

        calls.append(call)
    return calls


def stub_expansion(args) -> None:
    """--stub-expand: the chunked prefill's prefix expansion returns its first result per module, cache and prefix
    total (torch's gather and GEMMs are device work, real work on a CPU too)."""
    if not args.stub_expand or hasattr(runtime._expand_latent_prefix, "results"):
        return
    expand = runtime._expand_latent_prefix

    def expanded(m, kv_cache, block_table, cu_prefix, num_prefix_tokens, *arguments):
        key = (m, id(kv_cache), num_prefix_tokens)
        kept = expanded.results.get(key)
        if kept is None or kept[0] is not kv_cache:
            result = expand(m, kv_cache, block_table, cu_prefix, num_prefix_tokens, *arguments)
            kept = expanded.results[key] = (kv_cache, result)
        return kept[1]

    expanded.results = {}
    runtime._expand_latent_prefix = expanded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["decode", "prefill", "chunked"], default="decode")
    parser.add_argument("--stub-launch", action="store_true", help="prefill: stub the final launch (host path only)")
    parser.add_argument("--prefix", type=int, default=64, help="chunked: cached tokens per sequence")
    parser.add_argument("--stub-expand", action="store_true", help="chunked: the prefix's expansion done once")
    parser.add_argument("--vary", type=int, default=1, help="prefill, chunked: batch shapes taken in turn")
    parser.add_argument("--module", action="append", required=True, help="LABEL=PATH[:VAR=VALUE,...]")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--backend", nargs="+", default=["triton"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--profile", action="append", default=[])
    parser.add_argument("--parts", action="append", default=[])
    args = parser.parse_args()
    modules, chosen = {}, {}
    for text in args.module:
        label, path, env = parse_module(text)
        modules[label] = load(label, path, env)
        chosen[label] = Options.from_env({**os.environ, **env})
    if args.kind in ("prefill", "chunked"):
        prefill_host_time(args, modules, chosen)
        return
    first = next(iter(modules.values()))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, modules: {', '.join(args.module)}", flush=True)
    rows, failures = [], 0
    for backend in args.backend:
        for batch in args.batch:
            q, kv, table, lens = make_inputs(first, batch, args.seqlen, 0)
            q2, kv2, _, _ = make_inputs(first, batch, args.seqlen, 1)
            state = {}
            for label, module in modules.items():
                set_options(replace(chosen[label], decode_backend=backend))  # (what bare calls plan with)
                schedule = module.get_decode_schedule(batch, 1, q.device, backend=backend)
                out, lse = module.mla_decode(q, kv, table, lens, schedule=schedule, return_lse=True)
                module.mla_decode(q, kv, table, lens)  # the bare call's schedule and launches

                def with_schedule(m=module, s=schedule, o=out, e=lse, t=(q, kv, table, lens)):
                    m.mla_decode(*t, schedule=s, out=o, lse=e)

                def bare(m=module, t=(q, kv, table, lens)):
                    m.mla_decode(*t)

                for call in (with_schedule, bare):
                    for _ in range(20):
                        call()
                state[label] = (module, schedule, out, lse, with_schedule, bare)
            times = {label: ([], []) for label in modules}
            for _ in range(args.samples):  # interleaved: drift hits every module alike
                for label, (_, _, _, _, with_schedule, bare) in state.items():
                    set_options(replace(chosen[label], decode_backend=backend))
                    times[label][0].append(harness.host_us_per_call(with_schedule, args.calls))
                    times[label][1].append(harness.host_us_per_call(bare, args.calls))
            # results: bit for bit against the first module, given and bare, timing inputs and fresh ones
            results = {}
            for label, (module, schedule, _, _, _, _) in state.items():
                set_options(replace(chosen[label], decode_backend=backend))
                got = []
                for qq, cache in ((q, kv), (q2, kv), (q, kv2), (q2, kv2)):
                    got.append(module.mla_decode(qq, cache, table, lens, schedule=schedule, return_lse=True))
                    got.append(module.mla_decode(qq, cache, table, lens, return_lse=True))
                    out = torch.full_like(got[-1][0], float("nan"))
                    lse = torch.full_like(got[-1][1], float("nan"))
                    module.mla_decode(qq, cache, table, lens, schedule=schedule, out=out, lse=lse)
                    got.append((out, lse))
                torch.cuda.synchronize()
                results[label] = got
            base = results[next(iter(results))]
            reference_note = ""
            if batch <= 8:
                for k, (qq, cache) in enumerate(((q, kv), (q2, kv2))):
                    want = decode_reference(
                        first, {"q": qq, "kv_cache": cache, "block_table": table, "cache_seqlens": lens}
                    )
                    _, _, message = compare_with_lse(*base[0 if k == 0 else 9], *want, "bfloat16")
                    reference_note += " ref ok" if not message else f" REFERENCE FAILED: {message}"
                    failures += bool(message)
            for label in modules:
                same = all(
                    torch.equal(a, b)
                    for pair, other in zip(results[label], base, strict=True)
                    for a, b in zip(pair, other, strict=True)
                )
                failures += not same
                given, bare_times = times[label]
                schedule = state[label][1]
                rows.append(
                    (
                        f"{backend}/{schedule.backend} merge={schedule.merge} B{batch}",
                        label,
                        statistics.median(given),
                        min(given),
                        statistics.median(bare_times),
                        min(bare_times),
                        "equal" if same else "DIFFERENT",
                    )
                )
                print(
                    f"{rows[-1][0]} {label}: schedule= {rows[-1][2]:.1f} us (min {rows[-1][3]:.1f}), bare "
                    f"{rows[-1][4]:.1f} us (min {rows[-1][5]:.1f}), results {rows[-1][6]} to "
                    f"{next(iter(modules))}{reference_note}",
                    flush=True,
                )
            for label in args.parts:
                module, schedule, out, lse, _, _ = state[label]
                set_options(replace(chosen[label], decode_backend=backend))
                print(f"  parts of {label} ({backend} B{batch}):", flush=True)
                parts(module, q, kv, table, lens, schedule, out, lse, args.calls)
            for label in args.profile:
                with_schedule = state[label][4]
                set_options(replace(chosen[label], decode_backend=backend))
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    with_schedule()
                profiler.disable()
                torch.cuda.synchronize()
                print(f"  cProfile of {label} ({backend} B{batch}, schedule=, {args.calls} calls):")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(16)
    reload_options()
    print("\n| case | module | host us/call, schedule= (median, min) | bare (median, min) | results |")
    print("| --- | --- | --- | --- | --- |")
    for case, label, given, given_min, bare, bare_min, same in rows:
        print(f"| {case} | {label} | {given:.1f} ({given_min:.1f}) | {bare:.1f} ({bare_min:.1f}) | {same} |")
    print(f"\n{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
