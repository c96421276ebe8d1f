"""The tuning search behind `mlagen tune` ("the tuner"; GPU only): benchmark each kernel's autotune space, keep
the winners.

Buckets tuned, per spec:
- decode: every row-block bucket its batches reach with Sq = 1, 2, 4 query tokens per sequence, `m<block_m>`
  for serving-size batches and `m<block_m>-small` for the latency regime (at most DECODE_SMALL_BATCH
  sequences); each bucket is timed on the cases that reach it (with the smallest Sq that does), inputs
  realistic (varlen lengths around a mean, a shuffled page table, random data; never zeros), every
  configuration checked against the PyTorch reference on them first. Latency-regime buckets are timed
  by CUDA-graph replay, as serving engines run small batches (eager timing would measure the host).
  Where the Gluon backend runs (Hopper), also its bucket `gluon`: (block_n, registers of the second
  warpgroup, ring stages) timed on the serving-size cases with Sq = 1. Every decode candidate is checked,
  compiled and timed in the schedule a production call plans with it as the bucket's tuned entry
  (`decode_candidate_schedule`, get_decode_schedule's tuned=), not as a forced config=: on the Gluon bucket
  the launch policy's fp8 landing ring and long blocks (`launch_policy.gluon_blocks`) still replace the
  candidate's stages, or its block_n and stages, where production's would (its registers are kept), so the
  winner is chosen on the path production runs. Candidates that plan one schedule (they differ only in what the
  policy replaces) are one kernel: the first of them in the space is checked and timed, the others take its
  result, so the stages recorded are those that run, not the pick of a timing's noise. The portable kernel's
  schedule is the same either way.
- prefill: `causal` (`mla_prefill` over the case's new tokens) and `prefix` (the non-causal launch of
  chunked prefill: the new tokens against a prefix of the case's length, already in MHA form); each
  configuration is first checked against the float64 reference on `verify.prefill_cases` (tile-edge
  lengths, chunked prefill included), then timed. Where the Gluon prefill runs (Hopper, a geometry it
  takes), also its buckets `gluon-causal` and `gluon-prefix`: (block_n, ring stages) timed on the same cases
  and launches through `_launch_prefill_gluon`, each checked the same way with the Gluon backend forced
  (elsewhere they are left out, and `mlagen tune` says why).

A key (kernel, geometry, bucket) is tuned once per run even when several specs reach it (e.g. deepseek-v2
and deepseek-v3-tp1): the first spec measures it, and the entry records what it was measured with. A
configuration that fails to compile or launch (e.g. out of shared memory) is skipped and reported; one
that gives wrong results is reported and never chosen. The score over several cases is the geometric
mean of their median times. The untuned default is kept unless a configuration beats it by more than
`MARGIN`, so a recorded configuration is never slower than the default on the cases it was tuned on.

Compiling is most of the cost, so `warm_up` first compiles every (configuration, shape) in parallel
worker processes, each running the timed call once on tiny inputs of the same shapes (filling Triton's
on-disk cache); the timing then runs serially in this process on an otherwise idle GPU.

`tune_specs` is the whole of `mlagen tune` after argument checking (the CLI adds the progress bar and
prints the report); `tune_module`, `time_config` and `make_inputs` are importable on their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .launch_policy import DECODE_GLUON_BUCKET, PREFILL_GLUON_BUCKETS
from .tuning_db import MARGIN, kernel_geometry, tuned_for_spec, write_db

__all__ = [
    "CASES",
    "CASE_SETS",
    "MARGIN",
    "Bucket",
    "BucketResult",
    "ConfigResult",
    "TuneCase",
    "TuneReport",
    "decode_buckets",
    "decode_candidate_schedule",
    "entries_from_results",
    "gluon_prefill_unavailable",
    "make_inputs",
    "parse_buckets",
    "parse_cases",
    "prefill_buckets",
    "time_config",
    "tune_module",
    "tune_specs",
    "warm_up",
]

#: the query-token counts whose row blocks are tuned (plain decode, MTP / speculative decoding)
SEQLEN_QS = (1, 2, 4)
#: block_table width and page count are rounded up to this, so tiny warm-up inputs get the same Triton
#: specialization (divisibility of sizes and strides by 16) as the timed ones
_TABLE_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class TuneCase:
    """A batch to tune on: `batch` sequences, lengths uniform in [mean/2, 3*mean/2) (or all `mean_seqlen`).

    kernel "decode": cache lengths. kernel "prefill": new tokens per sequence, each also over a cached
    prefix of `prefix_len` tokens for the prefix bucket.
    """

    name: str
    batch: int
    mean_seqlen: int
    varlen: bool = True
    kernel: str = "decode"
    prefix_len: int = 0

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
        # the latency regime (at most 8 sequences): the m<block_m>-small buckets
        TuneCase("b1-s8k", 1, 8192, varlen=False),
        TuneCase("b4-s16k", 4, 16384),
        TuneCase("b8-s8k", 8, 8192),
        # prefill: new tokens per sequence, over a cached prefix for the prefix bucket
        TuneCase("pf-b1-s4k-p28k", 1, 4096, varlen=False, kernel="prefill", prefix_len=28672),
        TuneCase("pf-b4-s8k-p8k", 4, 8192, varlen=False, kernel="prefill", prefix_len=8192),
    )
}
CASE_SETS: dict[str, tuple[str, ...]] = {
    "quick": ("b64-s4k", "b1-s8k", "pf-b1-s4k-p28k"),
    "standard": ("b16-s16k", "b128-s8k", "b1-s8k", "b4-s16k", "pf-b1-s4k-p28k", "pf-b4-s8k-p8k"),
    "full": tuple(n for n in CASES if n != "b128-s4k"),
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


#: the prefill buckets by name: the portable kernel's, then the Gluon kernel's
PREFILL_BUCKET_NAMES = ("causal", "prefix", *PREFILL_GLUON_BUCKETS.values())


def parse_buckets(text: str) -> list[str]:
    """Comma-separated bucket names: m<rows>, m<rows>-small, gluon, causal, prefix, gluon-causal, gluon-prefix."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    fixed = (DECODE_GLUON_BUCKET, *PREFILL_BUCKET_NAMES)
    pattern = re.compile(r"^(m\d+(-small)?|" + "|".join(map(re.escape, fixed)) + ")$")
    for name in names:
        if not pattern.match(name):
            raise ValueError(f"--buckets: unknown bucket '{name}' (m<rows>, m<rows>-small, {', '.join(fixed)})")
    if not names:
        raise ValueError("--buckets: no bucket given")
    return names


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket of one kernel to tune: its configurations, its default and the cases that reach it."""

    kernel: str
    bucket: str
    configs: tuple[tuple[int, ...], ...]
    default: tuple[int, ...]
    cases: tuple[TuneCase, ...]
    seqlen_q: int | None = None  # decode: query tokens per sequence that reach the bucket
    block_m: int | None = None  # decode: rows per program


def decode_buckets(module: ModuleType, cases: Sequence[TuneCase], device) -> list[Bucket]:
    """The decode buckets the decode `cases` reach for Sq in SEQLEN_QS, each with the smallest Sq that
    reaches it and the cases that do so with that Sq."""
    found: dict[str, Bucket] = {}
    for seqlen_q in SEQLEN_QS:
        reached: dict[tuple[str, int, bool], list[TuneCase]] = {}
        for case in (c for c in cases if c.kernel == "decode"):
            block_m = module.get_decode_schedule(case.batch, seqlen_q, device, num_parts=1, backend="triton").block_m
            small = case.batch <= module.DECODE_SMALL_BATCH  # the condition get_decode_schedule applies
            reached.setdefault((module.decode_bucket(block_m, small), block_m, small), []).append(case)
        for (bucket, block_m, small), bucket_cases in reached.items():
            if bucket not in found:
                default = (module.DECODE_SMALL_DEFAULTS if small else module.DECODE_DEFAULTS)[block_m]
                configs = tuple(tuple(c) for c in module.DECODE_SPACE[block_m])
                found[bucket] = Bucket(
                    "decode", bucket, configs, tuple(default), tuple(bucket_cases), seqlen_q, block_m
                )
    gluon_cases = tuple(c for c in cases if c.kernel == "decode" and c.batch > module.DECODE_SMALL_BATCH)
    if gluon_cases and module.decode_backend(device, "auto")[0] == "gluon":
        # the Hopper backend's knobs: one bucket for the serving-size batches it takes, Sq = 1
        configs = tuple(tuple(c) for c in module.DECODE_GLUON_SPACE)
        found[DECODE_GLUON_BUCKET] = Bucket(
            "decode", DECODE_GLUON_BUCKET, configs, tuple(module.DECODE_GLUON_DEFAULT), gluon_cases, 1,
            module.DECODE_GLUON_BLOCK_M,
        )  # fmt: skip
    return list(found.values())


def _decode_backend(bucket: Bucket) -> str:
    return "gluon" if bucket.bucket == DECODE_GLUON_BUCKET else "triton"


def gluon_prefill_unavailable(module: ModuleType, device: Any) -> str:
    """'' where the module's Gluon prefill runs on `device` (None: nowhere), else why not: then its buckets are
    not tuned. The reason is the one forcing the Gluon backend there fails with (`prefill_backend`)."""
    if not hasattr(module, "mla_prefill"):
        return "the module has no prefill"
    if device is None:
        return "no device given"
    try:
        module.prefill_backend(device, "gluon")
    except ValueError as error:
        return str(error)
    return ""


def prefill_buckets(module: ModuleType, cases: Sequence[TuneCase], device: Any = None) -> list[Bucket]:
    """`causal` on every prefill case, `prefix` on those with a prefix (none when the module has no prefill);
    where the Gluon prefill runs on `device` (`gluon_prefill_unavailable`), `gluon-causal` and `gluon-prefix`
    on the same cases, over its (block_n, stages) space."""
    if not hasattr(module, "mla_prefill"):
        return []
    prefill_cases = [c for c in cases if c.kernel == "prefill"]
    reached = {"causal": tuple(prefill_cases), "prefix": tuple(c for c in prefill_cases if c.prefix_len > 0)}
    spaces = [("", module.PREFILL_SPACE, module.PREFILL_DEFAULT)]
    if not gluon_prefill_unavailable(module, device):
        spaces.append(("gluon", module.PREFILL_GLUON_SPACE, module.PREFILL_GLUON_DEFAULT))
    out = []
    for backend, space, default in spaces:
        configs = tuple(tuple(c) for c in space)
        for launch, bucket_cases in reached.items():
            bucket = PREFILL_GLUON_BUCKETS[launch] if backend else launch
            if bucket_cases:
                out.append(Bucket("prefill", bucket, configs, tuple(default), bucket_cases))
    return out


def _prefill_backend(bucket: Bucket) -> str:
    return "gluon" if bucket.bucket in PREFILL_GLUON_BUCKETS.values() else "triton"


def _prefill_causal(bucket: Bucket) -> bool:
    """Whether the bucket's launch is the causal one (new tokens among themselves), else the prefix launch."""
    return bucket.bucket in ("causal", PREFILL_GLUON_BUCKETS["causal"])


# ---- inputs ------------------------------------------------------------------------------------------------
def _device_generator(generator, device):
    """A generator on `device` seeded from `generator`: the bulk of the data is drawn where it lives."""
    import torch

    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def make_inputs(module: ModuleType, seqlens: Sequence[int], seqlen_q: int, generator, device) -> dict[str, Any]:
    """Random q and paged latent cache for `seqlens` (`verify.paged_block_table`: shuffled pages, spare pages,
    stale entries in unused slots, width and pool rounded up to multiples of 16), data N(0, 1) in the
    spec's dtype (never zeros), drawn on the device (a serving batch's cache is gigabytes). An fp8 cache
    holds the quantised rows and the inputs carry its kv_scale (`verify.random_cache`)."""
    import torch

    from .verify import paged_block_table, random_cache

    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    spare = max(8, sum(-(-int(s) // module.PAGE_SIZE) for s in seqlens) // 16)
    block_table, num_pages = paged_block_table(
        seqlens, module.PAGE_SIZE, generator, spare_pages=spare, align=_TABLE_ALIGN
    )
    device = torch.device(device)
    data_gen = _device_generator(generator, device)
    shape_q = (len(seqlens), seqlen_q, module.NUM_HEADS, width)
    inputs = {"q": torch.randn(shape_q, generator=data_gen, device=device, dtype=module.DTYPE)}
    if module.CACHE_FORMAT.scaled:
        inputs["kv_cache"], inputs["kv_scale"] = random_cache(module, num_pages, data_gen, device)
    else:
        inputs["kv_cache"] = torch.randn(
            num_pages, module.PAGE_SIZE, 1, width, generator=data_gen, device=device, dtype=module.DTYPE
        )
    inputs["block_table"] = block_table.to(device)
    inputs["cache_seqlens"] = torch.tensor(list(seqlens), dtype=torch.int32, device=device)
    return inputs


def make_prefill_inputs(module: ModuleType, seqlens: Sequence[int], prefix_len: int, generator, device) -> dict:
    """Random packed MHA-form inputs for `seqlens` new tokens per sequence, and (prefix_len > 0) a prefix of
    prefix_len tokens per sequence already in MHA form, as chunked prefill attends to it."""
    import torch

    from .verify import cu_seqlens, random_mha

    device = torch.device(device)
    data_gen = _device_generator(generator, device)
    q, k_nope, k_pe, v = random_mha(module, sum(int(s) for s in seqlens), data_gen, device)
    inputs = {
        "q": q,
        "k_nope": k_nope,
        "k_pe": k_pe,
        "v": v,
        "cu_seqlens": cu_seqlens(seqlens, device),
        "max_seqlen": max(int(s) for s in seqlens),
    }
    if prefix_len > 0:
        prefix = [prefix_len] * len(seqlens)
        _, pre_k_nope, pre_k_pe, pre_v = random_mha(module, sum(prefix), data_gen, device)  # its q is not used
        inputs["prefix"] = {"k_nope": pre_k_nope, "k_pe": pre_k_pe, "v": pre_v, "cu_prefix": cu_seqlens(prefix, device)}
    return inputs


def _bucket_inputs(module: ModuleType, bucket: Bucket, seqlens: Sequence[int], prefix_len: int, generator, device):
    if bucket.kernel == "decode":
        return make_inputs(module, seqlens, bucket.seqlen_q, generator, device)
    return make_prefill_inputs(module, seqlens, 0 if _prefill_causal(bucket) else prefix_len, generator, device)


# ---- one call, as timed ---------------------------------------------------------------------------------
def decode_candidate_schedule(module: ModuleType, bucket: Bucket, q, config):
    """The schedule a decode bucket's candidate `config` is checked, compiled (warm_up) and timed with, for the
    batch and Sq of `q`: the one a production call (no config given) plans with `config` as the bucket's tuned
    entry, on the bucket's backend (get_decode_schedule's tuned=). On the Gluon backend the fp8 landing ring, the
    short and the long blocks are then chosen as in production (a forced config= would turn them off); the
    portable kernel's schedule is the same either way."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    return module.get_decode_schedule(batch, seqlen_q, q.device, tuned=tuple(config), backend=_decode_backend(bucket))


def _timed_call(module: ModuleType, bucket: Bucket, inputs: dict[str, Any], config) -> Callable[[], Any]:
    """The call that is timed for `config` (planning and output allocation done here, outside it)."""
    import torch

    config = tuple(config)
    if bucket.kernel == "decode":
        q = inputs["q"]
        batch, seqlen_q = q.shape[0], q.shape[1]
        schedule = decode_candidate_schedule(module, bucket, q, config)
        out_shape = (batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK)
        out = torch.empty(out_shape, dtype=module.DTYPE, device=q.device)
        lse = torch.empty((batch, module.NUM_HEADS, seqlen_q), dtype=torch.float32, device=q.device)
        return lambda: module.mla_decode(**inputs, schedule=schedule, out=out, lse=lse, return_lse=True)
    q = inputs["q"]
    lse = torch.empty((module.NUM_HEADS, q.shape[0]), dtype=torch.float32, device=q.device)
    out_shape = (q.shape[0], module.NUM_HEADS, module.V_HEAD_DIM)
    causal, gluon = _prefill_causal(bucket), _prefill_backend(bucket) == "gluon"
    if causal and not gluon:
        new = {k: inputs[k] for k in ("q", "k_nope", "k_pe", "v", "cu_seqlens", "max_seqlen")}
        out = torch.empty(out_shape, dtype=module.DTYPE, device=q.device)
        return lambda: module.mla_prefill(**new, out=out, lse=lse, return_lse=True, config=config)
    if causal:
        keys, cu_k = inputs, inputs["cu_seqlens"]
        out = torch.empty(out_shape, dtype=module.DTYPE, device=q.device)
    else:
        # the prefix launch of mla_chunked_prefill alone (the expansion GEMMs and the causal launch are
        # not what this bucket's configuration decides)
        keys, cu_k = inputs["prefix"], inputs["prefix"]["cu_prefix"]
        out = torch.empty(out_shape, dtype=torch.float32, device=q.device)  # fp32 partials, as chunked prefill
    args = (q, keys["k_nope"], keys["k_pe"], keys["v"], inputs["cu_seqlens"], cu_k, inputs["max_seqlen"], out, lse,
            module.SOFTMAX_SCALE, causal)  # fmt: skip
    if gluon:
        # the Gluon kernel's launch alone (mla_prefill's argument checks are host time its tile does not decide);
        # the two-warpgroup kernel, whose (block_n, stages) the buckets hold, whatever prefill_gluon_warpgroups says
        # (a module generated before the one-warpgroup form takes no warpgroups=)
        if hasattr(module, "PREFILL_GLUON_ONE_WG_SPACE"):
            return lambda: module._launch_prefill_gluon(*args, config=config, warpgroups=2)
        return lambda: module._launch_prefill_gluon(*args, config=config)
    return lambda: module._launch_prefill(*args, config)


def time_config(
    module: ModuleType, bucket: Bucket, inputs: dict[str, Any], config, *, warmup_ms: int = 25, rep_ms: int = 100
) -> float:
    """Median time in µs of one call with `config`: `triton.testing.do_bench`, or CUDA-graph replay
    (`do_bench_cudagraph`) for the latency-regime buckets, whose eager calls are bound by the host."""
    import triton.testing

    call = _timed_call(module, bucket, inputs, config)
    if bucket.bucket.endswith("-small"):
        call()  # compile outside the capture
        ms = triton.testing.do_bench_cudagraph(call, rep=rep_ms, return_mode="median")
    else:
        ms = triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3


def _check_config(module: ModuleType, bucket: Bucket, inputs: dict[str, Any], config, reference) -> str:
    """'' when `config` gives the reference's results, else what is wrong.

    decode: on the timed inputs, outputs poisoned so an element the kernel does not write fails.
    prefill: on `verify.prefill_cases` (tile-edge lengths, prefill and chunked prefill), on the bucket's backend.
    """
    import torch

    from .options import use_options
    from .verify import compare_with_lse, prefill_cases, run_prefill_case

    if bucket.kernel == "prefill":
        device = inputs["q"].device
        # the bucket's backend forced: a config is that backend's kind (mla_prefill's config)
        with use_options(prefill_backend=_prefill_backend(bucket)):
            for i, case in enumerate(prefill_cases(device.type == "cuda")):
                generator = torch.Generator().manual_seed(i)
                for result in run_prefill_case(module, case, generator, device, config=tuple(config)):
                    if not result.passed and result.kernel != "cache_write":
                        return f"{result.kernel} {case.name}: {result.detail}"
        return ""
    q = inputs["q"]
    batch, seqlen_q = q.shape[0], q.shape[1]
    schedule = decode_candidate_schedule(module, bucket, q, config)
    nan = float("nan")
    out = torch.full((batch, seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), nan, dtype=module.DTYPE, device=q.device)
    lse = torch.full((batch, module.NUM_HEADS, seqlen_q), nan, dtype=torch.float32, device=q.device)
    module.mla_decode(**inputs, schedule=schedule, out=out, lse=lse, return_lse=True)
    return compare_with_lse(out, lse, *reference, module.SPEC["dtype"])[2]


def _reference(module: ModuleType, bucket: Bucket, inputs: dict[str, Any]):
    from .verify import decode_reference

    return decode_reference(module, inputs) if bucket.kernel == "decode" else None


# ---- parallel compilation ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WarmUpTask:
    module_path: str
    bucket: Bucket
    batch: int
    config: tuple[int, ...]
    device: str = "cuda"


def _warm_up_one(task: WarmUpTask) -> tuple[WarmUpTask, str]:
    """Compile (and run once on tiny inputs of the same shapes) one configuration; '' or the error."""
    try:
        import torch

        from .module_file import import_module_from_path

        module = import_module_from_path(task.module_path)
        device = torch.device(task.device)
        generator = torch.Generator().manual_seed(0)
        # decode: one token per sequence; prefill: 16-token sequences and prefixes (same divisibility)
        length = 1 if task.bucket.kernel == "decode" else 16
        inputs = _bucket_inputs(module, task.bucket, [length] * task.batch, length, generator, device)
        _timed_call(module, task.bucket, inputs, task.config)()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return task, ""
    except Exception as error:  # noqa: BLE001 - reported, and the timing phase tries again
        return task, _error_line(error)


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
    num_heads: int
    kernel: str
    geometry: str
    bucket: str
    seqlen_q: int | None
    arch: str
    gpu: str
    triton: str
    cases: list[TuneCase]
    default: tuple[int, ...]
    results: list[ConfigResult]
    chosen: tuple[int, ...] | None = None

    def result_of(self, config: tuple[int, ...] | None) -> ConfigResult | None:
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


def _as_timed(first: ConfigResult, twin: ConfigResult, case: str) -> None:
    """A candidate that launches what `first` launched on `case`: `first`'s check and time there."""
    if first.status != "ok":
        twin.status, twin.detail = first.status, first.detail
    elif case in first.times_us:
        twin.times_us[case] = first.times_us[case]


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def tune_module(
    module: ModuleType,
    buckets: Sequence[Bucket],
    *,
    device=None,
    seed: int = 0,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    advance: Callable[[str], None] = lambda _: None,
) -> list[BucketResult]:
    """Check and time every configuration of every bucket on the bucket's cases; choose the winners."""
    import torch

    from .spec import spec_from_dict
    from .triton_support import triton_version

    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    arch, gpu = module._gpu_key(device)
    spec = spec_from_dict(module.SPEC)
    out: list[BucketResult] = []
    for bucket in buckets:
        results = {cfg: ConfigResult(cfg, "ok") for cfg in bucket.configs}
        for case_index, case in enumerate(bucket.cases):
            generator = torch.Generator().manual_seed(seed * 7919 + case_index)
            inputs = _bucket_inputs(module, bucket, case.seqlens(generator), case.prefix_len, generator, device)
            reference = _reference(module, bucket, inputs)
            timed_as: dict[str, tuple[int, ...]] = {}  # a decode schedule (its repr) -> the candidate timed in it
            for cfg in bucket.configs:
                result = results[cfg]
                advance(f"{spec.name} {bucket.kernel} {bucket.bucket} {case.name} {'/'.join(map(str, cfg))}")
                if result.status != "ok":
                    continue
                try:
                    if bucket.kernel == "decode":
                        # candidates the launch policy turns into one launch (the fp8 landing ring's stages replace
                        # theirs) are one kernel: it is checked and timed once, so noise never ranks its twins
                        schedule = repr(decode_candidate_schedule(module, bucket, inputs["q"], cfg))
                        first = timed_as.setdefault(schedule, cfg)
                        if first != cfg:
                            _as_timed(results[first], result, case.name)
                            continue
                    # prefill is checked once on its own cases; decode on every case's inputs
                    if bucket.kernel == "decode" or case_index == 0:
                        problem = _check_config(module, bucket, inputs, cfg, reference)
                        if problem:
                            result.status, result.detail = "wrong", f"{case.name}: {problem}"
                            continue
                    result.times_us[case.name] = time_config(
                        module, bucket, inputs, cfg, warmup_ms=warmup_ms, rep_ms=rep_ms
                    )
                except Exception as error:  # noqa: BLE001 - a config that does not compile/launch is skipped
                    result.status, result.detail = "failed", f"{case.name}: {_error_line(error)}"
            del inputs, reference
            if device.type == "cuda":
                torch.cuda.empty_cache()
        bucket_result = BucketResult(
            spec_name=spec.name,
            num_heads=spec.num_heads,
            kernel=bucket.kernel,
            geometry=kernel_geometry(bucket.kernel, spec),
            bucket=bucket.bucket,
            seqlen_q=bucket.seqlen_q,
            arch=arch,
            gpu=gpu,
            triton=triton_version() or "",
            cases=list(bucket.cases),
            default=bucket.default,
            results=list(results.values()),
        )
        bucket_result.choose()
        out.append(bucket_result)
    return out


def entries_from_results(results: Sequence[BucketResult]) -> list[dict[str, Any]]:
    """Tuning-database entries (see tuning_db.py) for the buckets that have a winner."""
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
                "geometry": r.geometry,
                "bucket": r.bucket,
                "arch": r.arch,
                "gpu": r.gpu,
                "triton": r.triton,
                "config": list(r.chosen),
                "time_us": round(chosen.score_us, 2),
                "default_config": list(r.default),
                "default_time_us": round(default.score_us, 2) if default and default.score_us else None,
                "measured_with": [{"spec": r.spec_name, "num_heads": r.num_heads, "seqlen_q": r.seqlen_q}],
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


# ---- mlagen tune -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TuneReport:
    """What `tune_specs` did; `ok` is False when anything needs attention."""

    results: list[BucketResult]
    entries: list[dict[str, Any]]
    db_path: Path
    seconds: float
    #: "<spec> <kernel> <bucket>: same kernel as <spec>" for keys another spec of this run measured
    shared: list[str]
    #: configurations that failed in the parallel compile (tried again in-process)
    warm_failures: list[str]
    #: winners the generated module does not pick up from the database written
    not_picked: list[str]

    @property
    def wrong(self) -> list[str]:
        return [
            f"{r.spec_name} {r.kernel} {r.bucket} {x.config}: {x.detail}"
            for r in self.results
            for x in r.results
            if x.status == "wrong"
        ]

    @property
    def unsolved(self) -> list[str]:
        return [f"{r.spec_name} {r.kernel} {r.bucket}" for r in self.results if r.chosen is None]

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.not_picked or self.unsolved)


def tune_specs(
    specs: Sequence[Any],
    cases: Sequence[TuneCase],
    *,
    db_path: str | Path,
    jobs: int,
    device: Any,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    seed: int = 0,
    phase: Callable[[str, int], Callable[[str], None]] = lambda _name, _total: lambda _: None,
    log: Callable[[str], None] = lambda _: None,
    buckets_wanted: Sequence[str] | None = None,
) -> TuneReport:
    """`mlagen tune` after argument checking: compile each spec, find its buckets (each key once; only those
    named in buckets_wanted when given), warm up, check and time, merge the winners into `db_path`, and
    check that a module compiled from that database picks them. phase(name, steps) returns the progress
    callback of a phase; log prints a line."""
    from .module_file import compile_spec, import_module_from_path

    started = time.monotonic()
    shared: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mlagen-tune-") as tmp:
        plans: list[tuple[Any, Path, ModuleType, list[Bucket]]] = []
        measured_by: dict[tuple[str, str, str], str] = {}
        for spec in specs:
            path = compile_spec(spec, Path(tmp) / spec.module_name)
            module = import_module_from_path(path)
            buckets = []
            found = decode_buckets(module, cases, device) if "decode" in spec.kernels else []
            found += prefill_buckets(module, cases, device)
            gluon_wanted = buckets_wanted is None or set(buckets_wanted) & set(PREFILL_GLUON_BUCKETS.values())
            if "prefill" in spec.kernels and gluon_wanted and any(c.kernel == "prefill" for c in cases):
                why = gluon_prefill_unavailable(module, device)
                if why:
                    log(f"{spec.name}: Gluon prefill buckets not tuned: {why}")
            for bucket in found:
                if buckets_wanted is not None and bucket.bucket not in buckets_wanted:
                    continue
                key = (bucket.kernel, kernel_geometry(bucket.kernel, spec), bucket.bucket)
                if key in measured_by:
                    shared.append(f"{spec.name} {bucket.kernel} {bucket.bucket}: same kernel as {measured_by[key]}")
                    continue
                measured_by[key] = spec.name
                buckets.append(bucket)
            if buckets:
                plans.append((spec, path, module, buckets))
            else:
                log(f"{spec.name}: nothing to tune with these cases")
        tasks = sorted(
            {
                WarmUpTask(str(path), b, case.batch, cfg, str(device))
                for _, path, _, buckets in plans
                for b in buckets
                for case in b.cases
                for cfg in b.configs
            },
            key=lambda t: (t.module_path, t.bucket.kernel, t.bucket.bucket, t.batch, t.config),
        )
        runs = sum(len(b.configs) * len(b.cases) for *_, buckets in plans for b in buckets)
        gpu = plans[0][2]._gpu_key(device)[1] if plans else str(device)
        log(
            f"tuning {len(plans)} spec(s) on {gpu}: {sum(len(b) for *_, b in plans)} bucket(s), {runs} timed runs; "
            f"{len(tasks)} kernels to compile on {jobs} process(es)"
        )
        warm_failures = warm_up(tasks, jobs, phase("compiling", len(tasks))) if jobs > 0 else {}
        log(f"compiled in {time.monotonic() - started:.0f} s")
        advance = phase("timing", runs)
        results: list[BucketResult] = []
        for _, _, module, buckets in plans:
            results += tune_module(
                module, buckets, device=device, seed=seed, warmup_ms=warmup_ms, rep_ms=rep_ms, advance=advance
            )
        entries = entries_from_results(results)
        write_db(db_path, entries)

        # the database must reach the generated module: compile from it and ask the module what it picks
        not_picked = []
        for spec, _, _, _ in plans:
            check_dir = Path(tmp) / "check" / spec.module_name
            module = import_module_from_path(compile_spec(spec, check_dir, tuned_for_spec(spec, [db_path])))
            for r in (r for r in results if r.spec_name == spec.name and r.chosen is not None):
                table = module.DECODE_TUNED if r.kernel == "decode" else module.PREFILL_TUNED
                picked = module.tuned_config(table, (r.arch, r.gpu), r.bucket, None)
                if tuple(picked or ()) != tuple(r.chosen):
                    not_picked.append(f"{spec.name} {r.kernel} {r.bucket}: module picks {picked}, tuned {r.chosen}")
    return TuneReport(
        results=results,
        entries=entries,
        db_path=Path(db_path),
        seconds=time.monotonic() - started,
        shared=shared,
        warm_failures=[
            f"{Path(t.module_path).stem} {t.bucket.kernel} {t.bucket.bucket} B={t.batch} {t.config}: {e}"
            for t, e in warm_failures.items()
        ],
        not_picked=not_picked,
    )
