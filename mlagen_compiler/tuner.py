"""The autotuner behind `mlagen tune` (GPU only): benchmark each kernel's autotune space, keep the winners.

For every spec and every decode bucket the spec can reach (block_m for Sq = 1, 2, 4 tokens per sequence),
it builds realistic inputs for each tuning case (varlen sequence lengths around a mean, a shuffled page
table, random data; never zeros), runs every configuration of `DECODE_SPACE[block_m]` once and checks it
against the PyTorch reference before timing it with `triton.testing.do_bench` (median). A configuration
that fails to compile or launch (e.g. out of shared memory) is skipped and reported; one that gives
wrong results is reported and never chosen. The score over several cases is the geometric mean of their
median times. The untuned default is kept unless a configuration beats it by more than `MARGIN`, so a
recorded configuration is never slower than the default on the cases it was tuned on (up to noise).

Compiling is most of the cost, so `warm_up` first compiles every (configuration, shape) in parallel
worker processes, each launching the kernel once on tiny inputs of the same shapes (filling Triton's
on-disk cache); the timing then runs serially in this process on an otherwise idle GPU.

Everything here is importable (benchmarks call `time_config` / `tune_module`); the CLI adds the progress
bar, the database write and the summary table.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "CASES",
    "CASE_SETS",
    "MARGIN",
    "BucketResult",
    "ConfigResult",
    "TuneCase",
    "decode_buckets",
    "entries_from_results",
    "make_inputs",
    "parse_cases",
    "time_config",
    "tune_module",
    "warm_up",
]

#: a configuration replaces the default only if it is faster by more than this fraction
MARGIN = 0.01
#: the query-token counts whose row blocks are tuned (plain decode, MTP / speculative decoding)
SEQLEN_QS = (1, 2, 4)
#: block_table width and page count are rounded up to this, so tiny warm-up inputs get the same Triton
#: specialization (divisibility of sizes and strides by 16) as the timed ones
_TABLE_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class TuneCase:
    """A batch shape to tune on: `batch` sequences, lengths uniform in [mean/2, 3*mean/2)."""

    name: str
    batch: int
    mean_seqlen: int
    varlen: bool = True

    def seqlens(self, generator) -> list[int]:
        import torch

        if not self.varlen:
            return [self.mean_seqlen] * self.batch
        lo, hi = self.mean_seqlen // 2, self.mean_seqlen * 3 // 2
        return torch.randint(lo, hi, (self.batch,), generator=generator).tolist()


CASES: dict[str, TuneCase] = {
    c.name: c
    for c in (
        TuneCase("b16-s16k", 16, 16384),  # few long sequences: split-KV decides
        TuneCase("b64-s4k", 64, 4096),
        TuneCase("b128-s4k", 128, 4096),
        TuneCase("b128-s8k", 128, 8192),  # a full serving batch
        TuneCase("b32-s32k", 32, 32768),
    )
}
CASE_SETS: dict[str, tuple[str, ...]] = {
    "quick": ("b64-s4k",),
    "standard": ("b16-s16k", "b128-s8k"),
    "full": ("b16-s16k", "b64-s4k", "b128-s8k", "b32-s32k"),
}


def parse_cases(text: str) -> list[TuneCase]:
    """A case-set name (quick, standard, full) or comma-separated case names."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in CASE_SETS:
            names += CASE_SETS[part]
        elif part in CASES:
            names.append(part)
        else:
            choices = ", ".join([*CASE_SETS, *CASES])
            raise ValueError(f"--cases: unknown case '{part}' (choose from {choices})")
    if not names:
        raise ValueError("--cases: no case given")
    return [CASES[n] for n in dict.fromkeys(names)]


@dataclasses.dataclass(frozen=True)
class DecodeBucket:
    bucket: str
    block_m: int
    seqlen_q: int
    configs: tuple[tuple[int, ...], ...]
    default: tuple[int, ...]


def decode_buckets(module: ModuleType, device) -> list[DecodeBucket]:
    """The decode buckets a spec reaches (for Sq in SEQLEN_QS), each with the smallest Sq that reaches it."""
    found: dict[str, DecodeBucket] = {}
    for seqlen_q in SEQLEN_QS:
        # a serving-size batch: the latency regime (few sequences) has its own "-small" buckets
        large_batch = max(128, getattr(module, "DECODE_SMALL_BATCH", 0) + 1)
        block_m = module.get_decode_schedule(large_batch, seqlen_q, device, num_parts=1, backend="triton").block_m
        bucket = module.decode_bucket(block_m)
        if bucket not in found:
            configs = tuple(tuple(c) for c in module.DECODE_SPACE[block_m])
            found[bucket] = DecodeBucket(bucket, block_m, seqlen_q, configs, tuple(module.DECODE_DEFAULTS[block_m]))
    return list(found.values())


def make_inputs(module: ModuleType, seqlens: Sequence[int], seqlen_q: int, generator, device) -> dict[str, Any]:
    """Random q and paged latent cache for `seqlens`: pages shuffled over a pool with spare pages, data
    N(0, 1) in the spec's dtype (never zeros), block_table width rounded up to a multiple of 16."""
    import torch

    page_size = module.PAGE_SIZE
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch = len(seqlens)
    pages_per_seq = [max(1, -(-int(s) // page_size)) for s in seqlens]
    table_width = -(-max(pages_per_seq) // _TABLE_ALIGN) * _TABLE_ALIGN
    num_pages = sum(pages_per_seq) + max(8, sum(pages_per_seq) // 16)
    num_pages = -(-num_pages // _TABLE_ALIGN) * _TABLE_ALIGN  # same divisibility in warm-up and timing
    perm = torch.randperm(num_pages, generator=generator).to(torch.int32)
    block_table = torch.zeros((batch, table_width), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = perm[used : used + n]
        used += n
    # unused table slots point at real (random) pages, as a serving engine's stale entries would
    tail = torch.randint(0, num_pages, (batch, table_width), generator=generator, dtype=torch.int32)
    mask = torch.arange(table_width)[None, :] >= torch.tensor(pages_per_seq)[:, None]
    block_table = torch.where(mask, tail, block_table)
    # the bulk is drawn on the device (a serving batch's cache is gigabytes), seeded from `generator`
    device = torch.device(device)
    data_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    kv = torch.randn(num_pages, page_size, 1, width, generator=data_gen, device=device, dtype=module.DTYPE)
    q = torch.randn(batch, seqlen_q, module.NUM_HEADS, width, generator=data_gen, device=device, dtype=module.DTYPE)
    return {
        "q": q,
        "kv_cache": kv,
        "block_table": block_table.to(device),
        "cache_seqlens": torch.tensor(list(seqlens), dtype=torch.int32, device=device),
    }


# ---- parallel compilation ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WarmUpTask:
    module_path: str
    batch: int
    seqlen_q: int
    config: tuple[int, ...]
    device: str = "cuda"


def _warm_up_one(task: WarmUpTask) -> tuple[WarmUpTask, str]:
    """Compile (and launch once on tiny inputs of the same shapes) one configuration; '' or the error."""
    try:
        import torch

        from .compile import import_module_from_path

        module = import_module_from_path(task.module_path)
        device = torch.device(task.device)
        generator = torch.Generator().manual_seed(0)
        inputs = make_inputs(module, [1] * task.batch, task.seqlen_q, generator, device)
        schedule = module.get_decode_schedule(task.batch, task.seqlen_q, device, config=task.config, backend="triton")
        module.mla_decode(**inputs, schedule=schedule)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return task, ""
    except Exception as error:  # noqa: BLE001 - reported, and the timing phase tries again
        return task, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def warm_up(tasks: Sequence[WarmUpTask], jobs: int, advance: Callable[[str], None] = lambda _: None) -> dict:
    """Compile every task in `jobs` spawned processes; returns {task: error} for the ones that failed."""
    import concurrent.futures
    import concurrent.futures.process
    import multiprocessing

    failed: dict[WarmUpTask, str] = {}
    if jobs <= 0 or not tasks:
        return failed
    context = multiprocessing.get_context("spawn")
    done: set[WarmUpTask] = set()
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            for task, error in pool.map(_warm_up_one, tasks, chunksize=1):
                done.add(task)
                if error:
                    failed[task] = error
                advance(f"compiled {Path(task.module_path).stem} {'/'.join(map(str, task.config))}")
    except concurrent.futures.process.BrokenProcessPool as error:
        # a worker died (a crashing compiler, say): the timing phase compiles what is left in-process
        for task in tasks:
            if task not in done:
                failed[task] = f"not compiled in parallel: worker pool broke ({error})"
    return failed


# ---- timing ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ConfigResult:
    config: tuple[int, ...]
    status: str  # "ok", "wrong" (failed the reference check) or "failed" (did not compile / launch)
    times_us: dict[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""

    @property
    def score_us(self) -> float | None:
        if self.status != "ok" or not self.times_us:
            return None
        return math.exp(sum(math.log(t) for t in self.times_us.values()) / len(self.times_us))


@dataclasses.dataclass
class BucketResult:
    spec_name: str
    spec_hash: str
    kernel: str
    bucket: str
    block_m: int
    seqlen_q: int
    gpu: str
    triton: str
    cases: list[TuneCase]
    default: tuple[int, ...]
    results: list[ConfigResult]
    chosen: tuple[int, ...] | None = None

    def result_of(self, config: tuple[int, ...]) -> ConfigResult | None:
        return next((r for r in self.results if r.config == config), None)

    def choose(self, margin: float = MARGIN) -> tuple[int, ...] | None:
        ok = [r for r in self.results if r.score_us is not None]
        if not ok:
            self.chosen = None
            return None
        best = min(ok, key=lambda r: r.score_us)
        default = self.result_of(self.default)
        if default is not None and default.score_us is not None and best.score_us > default.score_us * (1 - margin):
            best = default  # not clearly faster: keep the default
        self.chosen = best.config
        return self.chosen


def time_config(module: ModuleType, inputs: dict[str, Any], config, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time in µs of one mla_decode call with `config` (schedule planned outside the timed call,
    outputs preallocated)."""
    import torch
    import triton.testing

    q = inputs["q"]
    batch, seqlen_q = q.shape[0], q.shape[1]
    schedule = module.get_decode_schedule(batch, seqlen_q, q.device, config=tuple(config), backend="triton")
    out = torch.empty((batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), dtype=module.DTYPE, device=q.device)
    lse = torch.empty((batch, module.NUM_HEADS, seqlen_q), dtype=torch.float32, device=q.device)
    ms = triton.testing.do_bench(
        lambda: module.mla_decode(**inputs, schedule=schedule, out=out, lse=lse, return_lse=True),
        warmup=warmup_ms,
        rep=rep_ms,
        return_mode="median",
    )
    return float(ms) * 1e3


def _check_config(module: ModuleType, inputs: dict[str, Any], config, reference) -> str:
    """'' when the configuration's output and lse match the reference, else what is wrong."""
    import torch

    from .verify import LSE_TOLERANCE, compare

    q = inputs["q"]
    batch, seqlen_q = q.shape[0], q.shape[1]
    schedule = module.get_decode_schedule(batch, seqlen_q, q.device, config=tuple(config), backend="triton")
    # poisoned outputs: an element the kernel does not write fails the check
    nan = float("nan")
    out = torch.full((batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), nan, dtype=module.DTYPE, device=q.device)
    lse = torch.full((batch, module.NUM_HEADS, seqlen_q), nan, dtype=torch.float32, device=q.device)
    module.mla_decode(**inputs, schedule=schedule, out=out, lse=lse, return_lse=True)
    _, _, message = compare(out, reference[0], module.SPEC["dtype"])
    if message:
        return message
    try:
        torch.testing.assert_close(lse.double(), reference[1], **LSE_TOLERANCE)
    except AssertionError as error:
        return "lse: " + str(error).splitlines()[0]
    return ""


def _reference(module: ModuleType, inputs: dict[str, Any]):
    from .verify import decode_reference

    return decode_reference(module, inputs)


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def tune_module(
    module: ModuleType,
    cases: Sequence[TuneCase],
    *,
    device=None,
    seed: int = 0,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    buckets: Sequence[DecodeBucket] | None = None,
    advance: Callable[[str], None] = lambda _: None,
) -> list[BucketResult]:
    """Benchmark every decode configuration of every reachable bucket on `cases`; choose the winners."""
    import torch

    from .triton_support import triton_version

    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    gpu = module._gpu_name(device) if hasattr(module, "_gpu_name") else torch.cuda.get_device_name(device)
    name = module.SPEC["name"]
    out: list[BucketResult] = []
    for bucket in buckets if buckets is not None else decode_buckets(module, device):
        results = {cfg: ConfigResult(cfg, "ok") for cfg in bucket.configs}
        for case_index, case in enumerate(cases):
            generator = torch.Generator().manual_seed(seed * 7919 + case_index)
            inputs = make_inputs(module, case.seqlens(generator), bucket.seqlen_q, generator, device)
            reference = _reference(module, inputs)
            for cfg in bucket.configs:
                result = results[cfg]
                advance(f"{name} {bucket.bucket} {case.name} n{cfg[0]} w{cfg[1]} s{cfg[2]}")
                if result.status != "ok":
                    continue
                try:
                    problem = _check_config(module, inputs, cfg, reference)
                    if problem:
                        result.status, result.detail = "wrong", f"{case.name}: {problem}"
                        continue
                    result.times_us[case.name] = time_config(module, inputs, cfg, warmup_ms=warmup_ms, rep_ms=rep_ms)
                except Exception as error:  # noqa: BLE001 - a config that does not compile/launch is skipped
                    result.status, result.detail = "failed", f"{case.name}: {_error_line(error)}"
            del inputs, reference
            torch.cuda.empty_cache()
        bucket_result = BucketResult(
            spec_name=name,
            spec_hash=module.SPEC_HASH,
            kernel="decode",
            bucket=bucket.bucket,
            block_m=bucket.block_m,
            seqlen_q=bucket.seqlen_q,
            gpu=gpu,
            triton=triton_version(),
            cases=list(cases),
            default=bucket.default,
            results=list(results.values()),
        )
        bucket_result.choose()
        out.append(bucket_result)
    return out


def entries_from_results(results: Sequence[BucketResult]) -> list[dict[str, Any]]:
    """Tuning-database entries (see tuning.py) for the buckets that have a winner."""
    import torch

    from ._version import __version__

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = []
    for r in results:
        if r.chosen is None:
            continue
        chosen = r.result_of(r.chosen)
        default = r.result_of(r.default)
        ranked = sorted((x for x in r.results if x.score_us is not None), key=lambda x: x.score_us)
        entries.append(
            {
                "kernel": r.kernel,
                "spec": r.spec_name,
                "spec_hash": r.spec_hash,
                "gpu": r.gpu,
                "triton": r.triton,
                "bucket": r.bucket,
                "config": list(r.chosen),
                "time_us": round(chosen.score_us, 2),
                "default_config": list(r.default),
                "default_time_us": round(default.score_us, 2) if default and default.score_us else None,
                "seqlen_q": r.seqlen_q,
                "cases": [dataclasses.asdict(c) for c in r.cases],
                "candidates": [[list(x.config), round(x.score_us, 2)] for x in ranked],
                "skipped": [[list(x.config), x.status, x.detail] for x in r.results if x.status != "ok"],
                "mlagen": __version__,
                "torch": torch.__version__.split("+")[0],
                "tuned_at": now,
            }
        )
    return entries


def default_jobs() -> int:
    return max(1, min(12, (os.cpu_count() or 2) - 2))
