"""FlashMLA's own dense-decoding suite through mlagen's drop-in, and the drop-in's host time (GPU machine).

    python benchmarks/flash_mla_dropin.py suite --flashmla CHECKOUT [--dtype bf16|fp16] [--shard K/N] [--json F]
    python benchmarks/flash_mla_dropin.py extra --flashmla CHECKOUT [--dtype bf16|fp16] [--shard K/N] [--json F]
    python benchmarks/flash_mla_dropin.py host [--calls 400] [--samples 9] [--json OUT.json]

suite: runs CHECKOUT/tests/test_flash_mla_dense_decoding.py unchanged, its own `main()` and case lists, with
`flash_mla` resolved to `mlagen_compiler.flash_mla` (FlashMLA's test code stays in its checkout; nothing of it
is copied here). Every case goes through the suite's own `test_flash_mla` (its data, its reference, its
tolerances); the script only counts: passed, failed (the suite's assertion), not applicable
(NotImplementedError: several KV heads are not MLA). The suite's performance cases run as correctness cases:
their timing looks the kernel up by FlashMLA's kernel name in a profile, which mlagen's kernels do not have.

extra: the same test function on cases FlashMLA cannot run: page sizes 1, 16 and 256, and a Dc 256 geometry
(d 320, dv 256), over a grid of the suite's batch, Sq, length, head, varlen and causal values.

--cases FILE: only these of the job's cases (a JSON list of their parameters, e.g. the failures of an earlier
run), each still run through the suite's own test function.

--shard K/N: the K-th of N contiguous slices of the cases (processes side by side; their counts add up). The
suite's `main()` runs first with the test function only collecting its cases, then this slice runs through it.

host: host time per call, B1 H16 S8192 page 64 bf16: `flash_mla_with_kvcache` with a filled FlashMLASchedMeta
against a direct `mla_decode` with its schedule, calls issued back to back (synchronised per sample of --calls
calls, the GPU work being shorter than the host's), interleaved sample by sample; both results are compared
with the float64 reference first.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlagen_compiler.flash_mla as drop_in  # noqa: E402

SUITE = "tests/test_flash_mla_dense_decoding.py"


def load_suite(checkout: Path):
    """FlashMLA's dense-decoding test module, importing `flash_mla` as the drop-in."""
    sys.path.insert(0, str(checkout / "tests"))  # its kernelkit package
    sys.modules["flash_mla"] = drop_in
    spec = importlib.util.spec_from_file_location("flashmla_dense_decoding_suite", checkout / SUITE)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


class Counts:
    """Outcome of each case by kind (MLA: one KV head; several KV heads), and the failures' parameters."""

    def __init__(self, test_function, json_path: Path | None = None):
        self.test_function = test_function
        self.json_path = json_path  # rewritten every 20 cases, so a run stopped by a time limit still counts
        self.counts = collections.Counter()
        self.failures = []
        self.started = time.perf_counter()

    def __call__(self, case) -> None:
        kind = "mla" if case.h_kv == 1 else "several_kv_heads"
        try:
            self.test_function(dataclasses.replace(case, test_performance=False))
        except NotImplementedError as error:
            outcome = "not_applicable"
            detail = str(error)
        except AssertionError:
            outcome, detail = "failed", traceback.format_exc(limit=2).splitlines()[-1]
        except Exception:  # noqa: BLE001 (an error is a failure, counted and shown)
            outcome, detail = "failed", traceback.format_exc(limit=3)
        else:
            outcome, detail = "passed", ""
        self.counts[f"{kind}_{outcome}"] += 1
        if outcome == "failed":
            self.failures.append({"case": dataclasses.asdict(case), "error": detail})
            print(f"FAILED {case}: {detail}", flush=True)
        if outcome == "not_applicable" and kind == "mla":
            print(f"NOT APPLICABLE (MLA case) {case}: {detail}", flush=True)
        total = sum(self.counts.values())
        if total % 100 == 0:
            print(f"[{time.perf_counter() - self.started:.0f} s] {total} cases: {dict(self.counts)}", flush=True)
        if self.json_path and total % 20 == 0:
            self.json_path.write_text(json.dumps({**self.summary(), **self.about}))

    about: dict = {}  # the run's description, added to every write

    def summary(self) -> dict:
        return {"counts": dict(self.counts), "failures": self.failures, "seconds": time.perf_counter() - self.started}


def select(cases: list, args) -> list:
    """The cases this process runs: those named by --cases (if given), then its --shard slice."""
    if args.cases:
        wanted = {json.dumps(case, sort_keys=True) for case in json.loads(args.cases.read_text())}
        cases = [case for case in cases if json.dumps(dataclasses.asdict(case), sort_keys=True) in wanted]
    index, count = (int(part) for part in args.shard.split("/"))
    return cases[len(cases) * index // count : len(cases) * (index + 1) // count]


def run_suite(args) -> dict:
    suite = load_suite(args.flashmla)
    counts = Counts(suite.test_flash_mla, args.json)
    counts.about = dict(job="suite", dtype=args.dtype, shard=args.shard, partial=True)
    cases = []
    suite.test_flash_mla = cases.append  # main() looks the test function up in its module at each case
    suite.main(torch.bfloat16 if args.dtype == "bf16" else torch.float16)  # (its device and dtype defaults too)
    for case in select(cases, args):
        counts(case)
    return {**counts.summary(), "suite_cases": len(cases), "shard": args.shard, "selected": str(args.cases or "")}


def run_extra(args) -> dict:
    suite = load_suite(args.flashmla)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    device = torch.device("cuda:0")
    torch.set_default_dtype(dtype)
    torch.set_default_device(device)
    torch.cuda.set_device(device)
    counts = Counts(suite.test_flash_mla, args.json)
    counts.about = dict(job="extra", dtype=args.dtype, shard=args.shard, partial=True)
    geometries = [dict(block_size=page, d=576, dv=512) for page in (1, 16, 256)] + [dict(block_size=64, d=320, dv=256)]
    grid = list(itertools.product([1, 6, 64], [1, 2, 4], [20, 140, 4096], [1, 16, 128], [False, True], [False, True]))
    cases = []
    for geometry in geometries:
        for b, s_q, s_k, h_q, is_varlen, is_causal in grid:
            cases.append(suite.TestParam(b, s_q, s_k, is_varlen, is_causal, test_performance=False, h_q=h_q,
                                         **geometry))  # fmt: skip
        # empty sequences among long ones, as the suite's corner cases
        for h_q, is_causal in itertools.product([1, 16, 128], [False, True]):
            cases.append(suite.TestParam(32, 2, 4096, is_varlen=True, is_causal=is_causal, test_performance=False,
                                         have_zero_seqlen_k=True, h_q=h_q, **geometry))  # fmt: skip
    for case in select(cases, args):
        counts(case)
    return {**counts.summary(), "suite_cases": len(cases), "shard": args.shard, "selected": str(args.cases or "")}


def run_host(args) -> dict:
    from mlagen_compiler.verify import compare_with_lse, decode_reference

    device = torch.device("cuda")
    batch, seqlen, heads, dc, dr, page = 1, 8192, 16, 512, 64, 64
    g = torch.Generator(device=device).manual_seed(0)
    pages = batch * seqlen // page
    q = torch.randn(batch, 1, heads, dc + dr, generator=g, device=device).to(torch.bfloat16)
    cache = torch.randn(pages, page, 1, dc + dr, generator=g, device=device).to(torch.bfloat16)
    table = torch.randperm(pages, generator=g, device=device).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    scale = (dc + dr) ** -0.5
    meta, _ = drop_in.get_mla_metadata()
    out_drop, lse_drop = drop_in.flash_mla_with_kvcache(q, cache, table, lens, dc, meta, causal=True)
    module, schedule = meta.module, meta.schedule
    out_direct, lse_direct = module.mla_decode(q, cache, table, lens, softmax_scale=scale, return_lse=True,
                                               schedule=schedule)  # fmt: skip
    inputs = dict(q=q, kv_cache=cache, block_table=table, cache_seqlens=lens)
    want, want_lse = decode_reference(module, inputs, softmax_scale=scale)
    checks = {}
    for label, (out, lse) in {"drop-in": (out_drop, lse_drop), "direct": (out_direct, lse_direct)}.items():
        checks[label] = compare_with_lse(out, lse, want, want_lse, "bfloat16")[2] or "ok"
    calls = {
        "drop-in": lambda: drop_in.flash_mla_with_kvcache(q, cache, table, lens, dc, meta, causal=True),
        "direct": lambda: module.mla_decode(
            q, cache, table, lens, softmax_scale=scale, return_lse=True, schedule=schedule
        ),  # fmt: skip
    }
    samples = {label: [] for label in calls}
    for _ in range(args.samples):
        for label, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            samples[label].append((time.perf_counter() - start) / args.calls * 1e6)
    result = {label: {"median_us": statistics.median(s), "min_us": min(s), "check": checks[label]}
              for label, s in samples.items()}  # fmt: skip
    result["difference_us"] = result["drop-in"]["median_us"] - result["direct"]["median_us"]
    result["gpu"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=["suite", "extra", "host"])
    parser.add_argument("--flashmla", type=Path, help="a FlashMLA checkout (its tests/ folder is what is read)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--shard", default="0/1", help="K/N: the K-th of N contiguous slices of the cases")
    parser.add_argument("--cases", type=Path, help="a JSON list of case parameters: only those cases")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.job in ("suite", "extra") and not (args.flashmla and (args.flashmla / SUITE).is_file()):
        parser.error(f"--flashmla: give a FlashMLA checkout holding {SUITE}")
    result = {"suite": run_suite, "extra": run_extra, "host": run_host}[args.job](args)
    result.update(job=args.job, dtype=args.dtype, torch=torch.__version__, gpu=torch.cuda.get_device_name())
    text = json.dumps(result, indent=1)
    print(text if args.job == "host" else json.dumps({k: v for k, v in result.items() if k != "failures"}))
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
