"""Kernel time of several builds of the committed modules, case by case in one run (GPU machine): did a change
meant to keep the kernels as they were keep their speed?

Each `--build LABEL=DIR` is a folder of module files named as in `generated/` (e.g. an earlier commit's
modules, written with `git show COMMIT:generated/NAME.py`, beside this tree's `generated/`). The first build is
the baseline. Cases: every case of bench_decode.py on both decode backends (16-bit modules; the fp8 modules
for the cases whose geometry has one), bench_prefill.py's shapes at 16 and 128 heads, and chunked prefill
(8192 cached tokens + 1024 new). Per case and build:

* correctness first: outputs NaN-poisoned, then the baseline's output and LSE checked against the float32
  reference (verify.compare_with_lse / compare with bf16 tolerances) and every other build's compared with
  the baseline's bit for bit (a change that keeps the kernels keeps their results);
* then time, interleaved: --rounds rounds, each timing every build once (do_bench median, L2 flushed; graph
  replay too for bench_decode's graph cases), and per build the median over rounds.

Verdict per row: time / baseline's time; a row is SLOWER when that exceeds 1 + --tolerance (default 0.02).

    mkdir -p .ab/before && for m in deepseek_v3_tp1 deepseek_v3_tp8 deepseek_v3_tp8_fp8; do
        git show e8e1617:generated/$m.py > .ab/before/$m.py; done
    python benchmarks/before_after.py --build before=.ab/before --build after=generated [--only H16,prefill]

Writes before_after.json into --out (default $OUT, else ./out); --append adds one line per row to a results log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_decode
import bench_prefill
import harness
import torch

from mlagen_compiler.module_file import import_module_from_path
from mlagen_compiler.verify import compare

DECODE_BACKENDS = ("gluon", "triton")
#: the committed fp8 modules, by the 16-bit module whose geometry they share
FP8_MODULES = {"deepseek_v3_tp8": "deepseek_v3_tp8_fp8", "mistral_small_4": "mistral_small_4_fp8"}
PREFILL_MODULES = {16: "deepseek_v3_tp8", 128: "deepseek_v3_tp1"}


def load_module(path: Path, label: str):
    return import_module_from_path(path, f"_before_after_{label}_{path.stem}")


class Builds:
    """The builds' module files, imported once each on first use."""

    def __init__(self, builds: list[tuple[str, Path]]):
        self.builds = builds
        self._modules: dict[tuple[str, str], Any] = {}

    @property
    def labels(self) -> list[str]:
        return [label for label, _ in self.builds]

    def modules(self, name: str) -> list[Any] | None:
        """Every build's module `name` (a file stem), or None when a build lacks it."""
        found = []
        for label, folder in self.builds:
            path = folder / f"{name}.py"
            if not path.is_file():
                return None
            if (label, name) not in self._modules:
                self._modules[(label, name)] = load_module(path, label)
            found.append(self._modules[(label, name)])
        return found


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def parse_builds(parser: argparse.ArgumentParser, values: list[str]) -> list[tuple[str, Path]]:
    """--build LABEL=DIR values as (label, folder); a value without a label or naming no folder, or a label
    given twice, is the parser's one-line error."""
    builds = []
    for value in values:
        label, _, folder = value.partition("=")
        if not label or not folder or not Path(folder).is_dir():
            parser.error(f"--build {value!r}: expected LABEL=DIR with DIR a folder of module files")
        if label in (known for known, _ in builds):
            parser.error(f"--build {value!r}: label {label!r} given twice")
        builds.append((label, Path(folder)))
    return builds


def interleaved_ms(fns: list[Callable[[], Any]], rounds: int, timer: Callable[[Callable], float]) -> list[float]:
    """Per function, the median over `rounds` rounds of `timer(fn)`, the functions timed in turn each round."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(timer(fn))
    return [statistics.median(s) for s in samples]


def row(kind: str, case: str, labels: list[str], ms: list[float], checked: str, extra: dict | None = None) -> dict:
    ratios = [t / ms[0] for t in ms]
    return {
        "kind": kind,
        "case": case,
        "ms": dict(zip(labels, ms, strict=True)),
        "ratio": dict(zip(labels, ratios, strict=True)),
        "check": checked,
        **(extra or {}),
    }


def run_row(rows: list[dict], args, kind: str, label: str, measure: Callable[..., dict], *measure_args) -> None:
    """Append `measure(*measure_args)`'s row, or a NOT RUN row past the time budget, or the error `measure`
    raised as the row's outcome (the run goes on); print it."""
    if time.monotonic() - args.start > args.budget:
        rows.append({"kind": kind, "case": label, "error": "NOT RUN: time budget"})
    else:
        try:
            rows.append(measure(*measure_args))
        except Exception as error:  # noqa: BLE001 - reported as the row's outcome
            rows.append({"kind": kind, "case": label, "error": f"{type(error).__name__}: {error}"})
    print(json.dumps(rows[-1]), flush=True)


def decode_rows(builds: Builds, args) -> list[dict]:
    rows, labels, rounds = [], builds.labels, args.rounds
    for case in bench_decode.cases(quick=False):
        base = case.spec.replace("-", "_")
        for cache, name in (("bf16", base), ("fp8", FP8_MODULES.get(base))):
            # (--only matches the row's whole name: case, cache and backend)
            chosen = [
                (backend, f"{case.name} {cache} {backend}")
                for backend in DECODE_BACKENDS
                if not args.only or any(word in f"decode {case.name} {cache} {backend}" for word in args.only)
            ]
            modules = builds.modules(name) if name and chosen else None
            if modules is None:
                continue
            for backend, label in chosen:
                run_row(rows, args, "decode", label, decode_case, modules, labels, case, label, backend, rounds)
    return rows


def decode_case(modules, labels, case, label, backend, rounds) -> dict:
    first = modules[0]
    gen = torch.Generator().manual_seed(7)
    inputs = bench_decode.make_inputs(first, case.seqlens, case.seqlen_q, gen)
    q, kv, table, lens, kv_scale = inputs
    max_len = max(case.seqlens)
    schedules = [m.get_decode_schedule(len(case.seqlens), case.seqlen_q, q.device, backend=backend) for m in modules]
    outs = [torch.empty(q.shape[:-1] + (first.KV_LORA_RANK,), dtype=q.dtype, device=q.device) for _ in modules]
    lses = [torch.empty(q.shape[0], first.NUM_HEADS, case.seqlen_q, dtype=torch.float32, device=q.device)]
    lses += [torch.empty_like(lses[0]) for _ in modules[1:]]

    def call(i):
        return lambda: modules[i].mla_decode(
            q, kv, table, lens, kv_scale=kv_scale, schedule=schedules[i], out=outs[i], lse=lses[i], return_lse=True
        )

    calls = [call(i) for i in range(len(modules))]
    msg = bench_decode.checked_call(first, calls[0], inputs, max_len, outs[0], lses[0])
    for i in range(1, len(modules)):
        outs[i].fill_(float("nan"))
        lses[i].fill_(float("nan"))
        calls[i]()
        torch.cuda.synchronize()
        if not (bit_equal(outs[i], outs[0]) and bit_equal(lses[i], lses[0])):
            msg += f" {labels[i]} differs from {labels[0]} bit for bit;"
    ms = interleaved_ms(calls, rounds, bench_decode.median_ms)
    extra = {"backend": backend, "schedule": str(schedules[-1])[:200]}
    if case.graph:
        graphs = [bench_decode.capture_graph(fn)[0] for fn in calls]
        graph_ms = interleaved_ms(graphs, rounds, lambda graph: bench_decode.time_graph(None, graph=graph))
        extra["graph_ms"] = dict(zip(labels, graph_ms, strict=True))
        extra["graph_ratio"] = dict(zip(labels, [t / graph_ms[0] for t in graph_ms], strict=True))
    return row("decode", label, labels, ms, msg or "ok", extra)


def prefill_rows(builds: Builds, args) -> list[dict]:
    rows, labels, rounds = [], builds.labels, args.rounds
    device = torch.device("cuda")
    for heads, name in PREFILL_MODULES.items():
        modules = builds.modules(name)
        if modules is None:
            continue
        shapes = [(b, s) for b, s in bench_prefill.SHAPES]
        for batch, seqlen in shapes:
            label = f"prefill H{heads} B{batch} S{seqlen}"
            if args.only and not any(word in label for word in args.only):
                continue
            run_row(rows, args, "prefill", label, prefill_case, modules, labels, label, batch, seqlen, device, rounds)
        label = f"chunked prefill H{heads} prefix 8192 + 1024"
        if args.only and not any(word in label for word in args.only):
            continue
        run_row(rows, args, "chunked", label, chunked_case, modules, labels, label, device, rounds)
    return rows


def prefill_case(modules, labels, label, batch, seqlen, device, rounds) -> dict:
    first = modules[0]
    gen = torch.Generator(device=device).manual_seed(11)
    q, kn, kp, v, cu = bench_prefill.make_inputs(first, batch, seqlen, gen, device)
    outs = [torch.full_like(v, float("nan")) for _ in modules]
    lses = [torch.full((first.NUM_HEADS, q.shape[0]), float("nan"), device=device) for _ in modules]

    def call(i):
        return lambda: modules[i].mla_prefill(q, kn, kp, v, cu, seqlen, out=outs[i], lse=lses[i], return_lse=True)

    calls = [call(i) for i in range(len(modules))]
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    ref = bench_prefill.causal_reference(first, q, kn, kp, v, batch, seqlen)
    _, _, msg = compare(outs[0], ref, "bfloat16")
    del ref
    for i in range(1, len(modules)):
        if not (bit_equal(outs[i], outs[0]) and bit_equal(lses[i], lses[0])):
            msg += f" {labels[i]} differs from {labels[0]} bit for bit;"
    ms = interleaved_ms(calls, rounds, bench_prefill.bench)
    flops = batch * first.NUM_HEADS * seqlen**2 * (q.shape[-1] + v.shape[-1])
    tflops = dict(zip(labels, [flops / t / 1e9 for t in ms], strict=True))
    return row("prefill", label, labels, ms, msg or "ok", {"tflops": tflops})


def chunked_case(modules, labels, label, device, rounds, prefix: int = 8192, chunk: int = 1024) -> dict:
    first = modules[0]
    gen = torch.Generator(device=device).manual_seed(13)
    problem = bench_prefill.chunked_problem(first, device, gen, chunk, prefix)
    outs = []
    calls = [(lambda m=m: m.mla_chunked_prefill(*problem.args)) for m in modules]
    for fn in calls:
        outs.append(fn())
    torch.cuda.synchronize()
    ref = bench_prefill.chunked_reference(first, problem)
    _, _, msg = compare(outs[0], ref, "bfloat16")
    del ref
    for i in range(1, len(modules)):
        if not bit_equal(outs[i], outs[0]):
            msg += f" {labels[i]} differs from {labels[0]} bit for bit;"
    ms = interleaved_ms(calls, rounds, bench_prefill.bench)
    return row("chunked", label, labels, ms, msg or "ok")


def verdict(r: dict, tolerance: float) -> str:
    if "error" in r:
        return "NOT RUN" if r["error"].startswith("NOT RUN") else "ERROR"
    if r["check"] != "ok":
        return "WRONG"
    ratios = list(r["ratio"].values()) + list(r.get("graph_ratio", {}).values())
    return "SLOWER" if max(ratios) > 1 + tolerance else "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True, help="LABEL=DIR (the first is the baseline)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    parser.add_argument("--only", default="", help="only rows whose name holds one of these (a,b,...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds; rows not started by then: NOT RUN")
    parser.add_argument("--skip", default="", help="kinds to leave out: decode, prefill (a,b)")
    parser.add_argument("--append", type=Path, help="also append each row to this results log (JSON lines)")
    args = parser.parse_args()
    args.start = time.monotonic()
    args.only = [w for w in args.only.split(",") if w]
    builds = Builds(parse_builds(parser, args.build))
    meta = harness.environment()
    print(f"# {json.dumps(meta)}; builds: {args.build}", flush=True)
    skip = set(args.skip.split(","))
    rows = ([] if "decode" in skip else decode_rows(builds, args)) + (
        [] if "prefill" in skip else prefill_rows(builds, args)
    )
    for r in rows:
        r["verdict"] = verdict(r, args.tolerance)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "builds": args.build, "rows": rows}
    (args.out / "before_after.json").write_text(json.dumps(report, indent=1))
    if args.append:
        harness.append_results(args.append, "before_after", meta, [(r["case"], r) for r in rows])
    labels = builds.labels
    print("\n| case | " + " | ".join(f"{x} µs" for x in labels) + " | ratio | check | verdict |")
    print("| --- " * (len(labels) + 4) + "|")
    for r in rows:
        if "error" in r:
            dashes = " | ".join("-" for _ in labels)
            print(f"| {r['case']} | {dashes} | - | {r['error'][:80]} | {r['verdict']} |")
            continue
        times = " | ".join(f"{r['ms'][x] * 1e3:.1f}" for x in labels)
        ratio = "/".join(f"{r['ratio'][x]:.3f}" for x in labels[1:])
        if "graph_ms" in r:
            times += " (graph " + "/".join(f"{r['graph_ms'][x] * 1e3:.1f}" for x in labels) + ")"
            ratio += " (graph " + "/".join(f"{r['graph_ratio'][x]:.3f}" for x in labels[1:]) + ")"
        print(f"| {r['case']} | {times} | {ratio} | {r['check'][:60]} | {r['verdict']} |")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("ok", "SLOWER", "WRONG", "ERROR", "NOT RUN")}
    worst = max((max(r["ratio"].values()) for r in rows if "ratio" in r), default=math.nan)
    print(f"\n# rows: {counts}; worst ratio {worst:.3f} (tolerance {args.tolerance})")


if __name__ == "__main__":
    main()
