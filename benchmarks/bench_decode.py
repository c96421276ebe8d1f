"""Decode benchmark: generated mla_decode vs PyTorch eager absorbed decode (and FlashMLA), on one GPU, in one process.

Measures the roofline first (device-to-device copy, bf16 8192^3 matmul), then for every case checks the
generated kernel against an fp32 reference on the same random inputs and times it and the eager baseline
with `triton.testing.do_bench` medians. Small-batch cases are also timed as serving engines run decode:
replaying a captured CUDA graph of the whole call (schedule planned once, outside the graph), and as eager
calls issued back to back, timed the same way (20 calls a sample) to set beside the replay.

Every case runs with the spec's bf16 cache and with an fp8 (e4m3) cache of the same geometry, B, H, S
(`--caches`), the fp8 one checked against the reference on its dequantised cache; the table gives the fp8
time over the bf16 time of the same backend and over the fastest bf16 backend. `--caches` fp8mma adds the fp8 cache
with cache_compute fp8 (e4m3 tensor-core products on the Gluon decode), checked against that option's own bound
(`mlagen_compiler.verify.compare_fp8_compute`); its config column says fp8mma where the launch took the fp8 kernel;
fp8mma1 the same with a one-term e4m3 query (an experiment beside the plan's two terms, same bound).

FlashMLA runs in the same process where a built one is importable (`--flash-mla`: a PATH holding the user's
built `flash_mla` package, `vllm` for vLLM's build through `vllm.v1.attention.ops.flashmla`; default `auto`):
on every case it can run (bf16 cache, Dc 512 / Dr 64, page 64, any head count) it is checked against the same
fp32 reference first (not timed when wrong), then timed the same way (do_bench median, graph replay and back to
back for the graph cases); its times and FlashMLA / mlagen (best of eager and graph replay each; above 1:
mlagen is faster) go in the table, decode.json and the results-log rows. Absent, the run says so once and goes on.

    python benchmarks/bench_decode.py [--out DIR] [--quick] [--sweep] [--compare-default] [--caches bf16,fp8]
        [--flash-mla PATH|vllm|auto|none] [--append benchmarks/results/results.jsonl]

--sweep times every configuration of the plan's autotune space on a few key cases (for tuning work);
--compare-default also times the untuned default configuration beside the selected (tuned) one.
Writes decode.json (after each row: a run stopped early keeps its rows, "complete": false) and decode.png into
DIR (default: $OUT, else ./out) and prints a table last; --append adds one line per result to a results log as
it is measured (harness.py: GPU, date, commit, case, figures).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import harness
import torch
import triton
import triton.testing
from harness import capture_graph, host_us_per_call

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402
from mlagen_compiler.cache_format import module_cache_format  # noqa: E402
from mlagen_compiler.options import use_options  # noqa: E402
from mlagen_compiler.reference import decode_paged_batched  # noqa: E402
from mlagen_compiler.registry import resolve_spec  # noqa: E402
from mlagen_compiler.tuning_db import tuned_for_spec  # noqa: E402
from mlagen_compiler.verify import compare_decode, paged_block_table  # noqa: E402

PAGE_SIZE = 64
#: latent caches a case runs with: the bundled spec's own (bf16) and fp8 e4m3 (cache_dtype) of the same geometry;
#: fp8mma: the fp8 cache with cache_compute fp8 (e4m3 tensor-core products on the Gluon decode); fp8mma1: the same
#: with the query as one e4m3 term instead of the plan's two (CACHE_OVERRIDES: half the Q K^T products, less exact)
CACHES = {"bf16": None, "fp8": "float8_e4m3fn", "fp8mma": "float8_e4m3fn", "fp8mma1": "float8_e4m3fn"}
#: the spec's cache_compute of a cache (exact where not named)
CACHE_COMPUTE = {"fp8mma": "fp8", "fp8mma1": "fp8"}
#: module constants a cache's module takes instead of its plan's, before its first launch (fp8mma1: one query term)
CACHE_OVERRIDES = {"fp8mma1": {"DECODE_GLUON_FP8_QUERY_TERMS": 1}}


@dataclass
class Case:
    name: str
    spec: str  # bundled spec name to derive the geometry from
    num_heads: int
    seqlens: list[int]
    seqlen_q: int = 1
    graph: bool = False  # judge by CUDA-graph replay (small batches)
    varlen: bool = False


@dataclass
class Result:
    case: str
    backend: str
    cache: str
    geometry: str
    batch: int
    seqlen_q: int
    num_heads: int
    total_tokens: int
    config: str
    us: float
    gbps: float
    tflops: float
    pct_copy: float
    pct_mma: float
    eager_us: float
    speedup: float
    graph_us: float | None = None
    #: eager calls issued back to back, 20 per timed sample as for graph_us (same L2 state, launch gaps amortised
    #: alike): the eager figure to set beside graph replay; `us` is one call after an L2 flush (do_bench)
    stream_us: float | None = None
    merge: str = "auto"
    host_us: float = float("nan")
    bare_host_us: float = float("nan")
    default_us: float | None = None
    max_err: float = 0.0
    rel_err: float = 0.0
    passed: bool = True
    extra: dict = field(default_factory=dict)
    #: FlashMLA in the same run (`flash_mla_figures`: us, graph_us, stream_us, max_err, rel_err, passed, detail,
    #: source), None where it did not run; vs_flash_mla: its best time over mlagen's (above 1: mlagen is faster)
    flash_mla: dict | None = None
    vs_flash_mla: float | None = None


def lengths(batch: int, seqlen: int, varlen: bool, gen: torch.Generator) -> list[int]:
    if not varlen:
        return [seqlen] * batch
    # uniform in [S/2, 3S/2): same mean as the fixed case, a realistic spread
    return torch.randint(seqlen // 2, seqlen * 3 // 2, (batch,), generator=gen).tolist()


def cases(quick: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    heads = (16, 128) if quick else (16, 32, 64, 128)
    seqs = (8192,) if quick else (4096, 8192)
    for h in heads:
        for s in seqs:
            for sq in (1, 2):
                for varlen in (False, True):
                    if quick and (varlen or sq == 2):
                        continue
                    tag = "var" if varlen else "fix"
                    out.append(
                        Case(
                            f"H{h} B128 S{s} Sq{sq} {tag}",
                            v3_spec(h),
                            h,
                            lengths(128, s, varlen, gen),
                            sq,
                            varlen=varlen,
                        )
                    )
    for b in (1, 8):
        for h in (16, 128):
            out.append(Case(f"H{h} B{b} S8192 graph", v3_spec(h), h, [8192] * b, graph=True))
    out.append(Case("H128 B32 S8192", "deepseek-v3-tp1", 128, [8192] * 32))
    out.append(Case("H16 B64 S32768", "deepseek-v3-tp8", 16, [32768] * 64))
    out.append(Case("H16 skewed4 Sq4 graph", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 4, graph=True))
    out.append(Case("H16 skewed4 Sq1 graph", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 1, graph=True))
    out.append(Case("Kimi-K2 H64 B128 S8192", "kimi-k2", 64, [8192] * 128))
    out.append(Case("Mistral-S4 H32 B128 S8192", "mistral-small-4", 32, [8192] * 128))
    # Dc 256 with two row blocks of query rows (4 tokens a sequence, e.g. multi-token prediction): long blocks
    out.append(Case("Mistral-S4 H32 B128 S8192 Sq4", "mistral-small-4", 32, [8192] * 128, 4))
    return out


def roofline() -> dict[str, float]:
    n = 1 << 30  # 1 GiB copy: bytes read + bytes written
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t_copy = harness.median_ms(lambda: dst.copy_(src), warmup=50, rep=300)
    copy_gbps = 2 * n / (t_copy * 1e-3) / 1e9
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_mm = harness.median_ms(lambda: a @ b, warmup=50, rep=300)
    mm_tflops = 2 * 8192**3 / (t_mm * 1e-3) / 1e12
    return {"copy_gbps": copy_gbps, "matmul_tflops": mm_tflops}


_MODULES: dict[tuple[str, int, str], object] = {}


def module_for(spec_name: str, num_heads: int, tmp: Path, cache: str = "bf16"):
    """The bundled spec (with its shipped tuned configurations), or one derived from it with num_heads and
    the cache dtype of `cache` (a key of CACHES)."""
    key = (spec_name, num_heads, cache)
    if key not in _MODULES:
        spec = resolve_spec(spec_name)
        if spec.num_heads != num_heads or CACHES[cache] is not None:
            fields = {**spec.to_flat_dict(), "name": f"{spec_name}-h{num_heads}-{cache}", "num_heads": num_heads}
            if cache in CACHE_COMPUTE:
                fields["cache_compute"] = CACHE_COMPUTE[cache]
            spec = spec_from_dict({**fields, "cache_dtype": CACHES[cache] or spec.dtype})
        module = import_module_from_path(compile_spec(spec, tmp / spec.name, tuned_for_spec(spec)))
        for name, value in CACHE_OVERRIDES.get(cache, {}).items():
            if hasattr(module, name):  # (a geometry the fp8 products do not take has none)
                setattr(module, name, value)
        _MODULES[key] = module
    return _MODULES[key]


def v3_spec(num_heads: int) -> str:
    """DeepSeek-V3 geometry at the tensor-parallel degree that leaves num_heads heads per rank."""
    return f"deepseek-v3-tp{128 // num_heads}"


def add_fixed_case_arguments(parser: argparse.ArgumentParser, spec: str = "deepseek-v3-tp8") -> None:
    """The options of one decode case of equal lengths (the probes'): --spec, --heads (the spec's by default),
    --batch, --seqlen, --seqlen-q, --cache; read back by fixed_case."""
    parser.add_argument("--spec", default=spec)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--cache", choices=sorted(CACHES), default="bf16")


def fixed_case(args: argparse.Namespace, tmp: Path):
    """(module, lens, (q, kv, table, lens, kv_scale)) of add_fixed_case_arguments' case: the module compiled under
    tmp, fresh random inputs (make_inputs) of args.batch sequences of args.seqlen."""
    module = module_for(args.spec, args.heads or resolve_spec(args.spec).num_heads, tmp, args.cache)
    lens = [args.seqlen] * args.batch
    return module, lens, make_inputs(module, lens, args.seqlen_q, torch.Generator().manual_seed(1))


def make_inputs(module, seqlens: list[int], seqlen_q: int, gen: torch.Generator, device="cuda"):
    """Random bf16 data (never zeros) and a shuffled page table with every page distinct: (q, kv, table,
    lens, kv_scale), on `device`. An fp8 cache holds bf16 latent rows quantised with kv_scale = max |value| / 448
    (a float32 tensor on the GPU, as serving engines keep per-layer scales); kv_scale is None for bf16."""
    width = module.KV_LORA_RANK + module.QK_ROPE_HEAD_DIM
    batch = len(seqlens)
    table, num_pages = paged_block_table(seqlens, PAGE_SIZE, gen)
    kv = torch.randn(num_pages, PAGE_SIZE, 1, width, dtype=torch.bfloat16, device=device)
    kv_scale = None
    fmt = module_cache_format(module)
    if fmt.scaled:
        kv_scale = (kv.abs().amax().float() / fmt.max_abs).reshape(1)
        kv = fmt.quantize(kv, kv_scale)
    q = torch.randn(batch, seqlen_q, module.NUM_HEADS, width, dtype=torch.bfloat16, device=device)
    return q, kv, table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device), kv_scale


def bytes_and_flops(module, seqlens, seqlen_q):
    dc, dr, h = module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM, module.NUM_HEADS
    tokens = sum(seqlens)
    b = len(seqlens)
    cache_bytes = getattr(module, "CACHE_DTYPE", module.DTYPE).itemsize
    nbytes = tokens * (dc + dr) * cache_bytes + b * seqlen_q * h * (dc + dr) * 2 + b * seqlen_q * h * dc * 2
    flops = 2 * seqlen_q * h * tokens * (2 * dc + dr)
    return nbytes, flops


def check(module, q, kv, table, lens, out, lse, max_len, kv_scale=None):
    """fp32 reference (over the dequantised cache for fp8): compare_decode's (max err, rel err, message): a module
    with cache_compute fp8 against the fp8 products' bound."""
    ref_out, ref_lse = decode_paged_batched(
        q.float(), kv, table, lens, module.KV_LORA_RANK, module.SOFTMAX_SCALE, max_seqlen=max_len, kv_scale=kv_scale
    )
    # (the fp8mma caches' rows are judged by the products' bound, also where a launch took the exact path)
    return compare_decode(out, lse, ref_out, ref_lse, "bfloat16", module.SPEC.get("cache_compute") == "fp8")


def checked_call(module, call, inputs, max_len, out, lse, replayed=False) -> str:
    """Fill `out` and `lse` (the tensors `call` writes) with NaN, run `call`, and check what it wrote against
    the fp32 reference: '' when right, else the message. Poisoning first matters: the caching allocator can
    hand a fresh output the memory of an earlier call's correct result, which would hide unwritten elements.
    replayed: `call` is a graph replay (it writes the captured out / lse)."""
    q, kv, table, lens, kv_scale = inputs
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    call()
    _sync(out)
    _, _, msg = check(module, q, kv, table, lens, out, lse, max_len, kv_scale)
    return f"{'graph replay: ' if replayed else ''}{msg}" if msg else ""


def median_ms(fn, rep: int = 200) -> float:
    """do_bench median, measured twice; the second is kept (the first run after allocating and checking
    a case was seen to read up to 25% slow on fresh buffers)."""
    return harness.median_ms(fn, warmup=25, rep=rep, repeat=2)


def time_graph(fn, graph=None) -> float:
    """Median ms of one replay of a graph of `fn` (or of `graph`, captured already)."""
    if graph is None:
        graph, _ = capture_graph(fn)

    # 20 replays per timed call so launch gaps between replays are amortised like a serving loop
    def replay():
        for _ in range(20):
            graph.replay()

    return median_ms(replay) / 20


def time_stream(fn) -> float:
    """Median ms of one eager call of `fn`, timed as time_graph times a replay: 20 calls back to back per
    sample (a model step's layers issue their decode calls so), the L2 flushed once per sample."""

    def calls():
        for _ in range(20):
            fn()

    return median_ms(calls) / 20


# ---- FlashMLA in the same run ----------------------------------------------------------------------------------
@dataclass
class FlashMLA:
    """A built FlashMLA's dense decode API: the user's build, loaded by `load_flash_mla` (mlagen holds none of its
    code). Both generations of the API take the calls made here, `get_mla_metadata(cache_seqlens,
    num_q_tokens_per_head_k, num_heads_k)` then `flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens,
    head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=, causal=)`: the 2025 one plans its tile
    scheduler metadata there; the current one ignores those arguments, returns an empty schedule (and None for
    num_splits) that its first decode call fills, as mlagen's schedule is planned once outside the timed calls."""

    source: str
    get_mla_metadata: Callable[..., Any]
    flash_mla_with_kvcache: Callable[..., Any]


#: where --flash-mla looks by default: an importable `flash_mla`, else vLLM's build of FlashMLA where vLLM imports
FLASH_MLA_CHOICES = "PATH (a folder holding a built flash_mla package), vllm, auto or none"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _import_flash_mla(path: Path | None) -> tuple[FlashMLA | None, str]:
    """The `flash_mla` package from `path` (a folder holding it, or the package folder itself), else the one
    Python finds; (None, why) when there is none or it does not import."""
    where = ""
    if path is not None:
        path = path.expanduser().resolve()
        if path.name == "flash_mla" and (path / "__init__.py").is_file():
            path = path.parent
        if not (path / "flash_mla" / "__init__.py").is_file():
            return None, f"{path} holds no flash_mla package (give the folder that holds the built flash_mla/)"
        for name in [n for n in sys.modules if n == "flash_mla" or n.startswith("flash_mla.")]:
            del sys.modules[name]  # this path's build, not one imported earlier from elsewhere
        sys.path.insert(0, str(path))  # also for its extension where it sits beside the package (older builds)
        where = f" from {path}"
    try:
        package = importlib.import_module("flash_mla")
    except Exception as error:  # noqa: BLE001 - an unbuilt checkout, a build for another torch or GPU
        return None, f"flash_mla{where} does not import ({_first_line(error)})"
    missing = [name for name in ("get_mla_metadata", "flash_mla_with_kvcache") if not hasattr(package, name)]
    if missing:
        return None, f"flash_mla{where} has no {', '.join(missing)}"
    source = f"flash_mla {getattr(package, '__version__', '?')} from {Path(package.__file__).parent}"
    return FlashMLA(source, package.get_mla_metadata, package.flash_mla_with_kvcache), ""


def _vllm_flash_mla() -> tuple[FlashMLA | None, str]:
    """vLLM's build of FlashMLA (`vllm._flashmla_C`) through its wrapper `vllm.v1.attention.ops.flashmla`."""
    try:
        import vllm

        ops = importlib.import_module("vllm.v1.attention.ops.flashmla")
    except Exception as error:  # noqa: BLE001
        return None, f"vLLM's FlashMLA does not import ({_first_line(error)})"
    version = getattr(vllm, "__version__", "?")
    supported, why = ops.is_flashmla_dense_supported()
    if not supported:
        return None, f"vLLM {version}'s FlashMLA cannot run here: {why}"
    source = f"vLLM {version}'s FlashMLA (vllm._flashmla_C through vllm.v1.attention.ops.flashmla)"
    return FlashMLA(source, ops.get_mla_metadata, ops.flash_mla_with_kvcache), ""


def load_flash_mla(where: str) -> tuple[FlashMLA | None, str]:
    """(FlashMLA's API, '') or (None, why it is absent) for --flash-mla `where`: a PATH (a folder holding a built
    `flash_mla` package, e.g. a FlashMLA checkout built in place), "vllm" (vLLM's build), "auto" (an importable
    `flash_mla`, else vLLM's where vLLM imports) or "none"."""
    if where == "none":
        return None, "not asked for (--flash-mla none)"
    if where == "vllm":
        return _vllm_flash_mla()
    if where == "auto":
        if importlib.util.find_spec("flash_mla") is not None:
            return _import_flash_mla(None)
        if importlib.util.find_spec("vllm") is not None:
            return _vllm_flash_mla()
        return None, f"no flash_mla package and no vLLM importable (--flash-mla {FLASH_MLA_CHOICES})"
    return _import_flash_mla(Path(where))


def flash_mla_unsupported(module, cache: str) -> str:
    """Why FlashMLA's dense decode cannot run this module's geometry with this cache ('' where it can): it runs
    Dc 512 / Dr 64 (head_dim 576, head_dim_v 512), pages of 64, a bf16 or fp16 query and a cache of the same dtype,
    any number of query heads over its one latent head."""
    why = []
    if (module.KV_LORA_RANK, module.QK_ROPE_HEAD_DIM) != (512, 64):
        why.append(f"Dc {module.KV_LORA_RANK} / Dr {module.QK_ROPE_HEAD_DIM} (it runs 512 / 64)")
    if module.PAGE_SIZE != 64:
        why.append(f"page {module.PAGE_SIZE} (it runs 64)")
    if module.DTYPE not in (torch.bfloat16, torch.float16):
        why.append(f"dtype {module.DTYPE}")
    if CACHES.get(cache) is not None:
        why.append(f"a {cache} cache (FlashMLA's fp8 cache is its own layout, 656 bytes a token)")
    return "; ".join(why)


def flash_mla_call(api: FlashMLA, module, q, kv, table, lens) -> Callable[[], Any]:
    """FlashMLA's decode of these inputs as mlagen's call computes it (the module's softmax scale; causal, as
    mla_decode's default: query token j of Sq sees the cache up to cache_seqlens - Sq + j), its metadata
    planned here, once, outside the timed call. The call returns (out [B, Sq, H, Dc], lse [B, H, Sq])."""
    metadata, num_splits = api.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
    return functools.partial(
        api.flash_mla_with_kvcache, q, kv, table, lens, module.KV_LORA_RANK, metadata, num_splits,
        softmax_scale=module.SOFTMAX_SCALE, causal=True,
    )  # fmt: skip


def _sync(tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize()


def _poisoned_call(call, q, dc: int):
    """call() (FlashMLA's: it allocates its outputs, out [B, Sq, H, dc] in q's dtype and lse [B, H, Sq] float32)
    right after NaN-filled blocks of those sizes went back to the caching allocator, which hands them to the next
    allocations of those sizes: a block holding an earlier call's right result would otherwise hide elements the
    call did not write (mlagen's rows are poisoned in their own output tensors, see checked_call)."""
    batch, seqlen_q, heads, _ = q.shape
    poison = [
        torch.full((batch, seqlen_q, heads, dc), float("nan"), dtype=q.dtype, device=q.device),
        torch.full((batch, heads, seqlen_q), float("nan"), dtype=torch.float32, device=q.device),
    ]
    del poison
    return call()


#: how flash_mla_figures times (the CPU test gives its own clock): the same functions as mlagen's rows
TIMERS = SimpleNamespace(
    median_ms=median_ms, capture_graph=capture_graph, time_graph=time_graph, time_stream=time_stream
)


def flash_mla_figures(api: FlashMLA, module, inputs, max_len: int, graph: bool, timers=None) -> dict[str, Any]:
    """FlashMLA on a case's inputs, run as mlagen's call is: checked against the same fp32 reference first and
    not timed when wrong; then the do_bench median (L2 flushed), the check once more on poisoned outputs, and
    where `graph` (the case's graph replay) the replay of a captured CUDA graph and eager calls back to back,
    the replay checked too. Figures: us, graph_us, stream_us (None where not timed), max_err, rel_err, passed,
    detail (what was wrong), source."""
    timers = timers or TIMERS
    q, kv, table, lens, _ = inputs
    figures: dict[str, Any] = {"source": api.source, "us": None, "graph_us": None, "stream_us": None}
    figures.update(max_err=float("nan"), rel_err=float("nan"), passed=False, detail="")
    try:
        call = flash_mla_call(api, module, q, kv, table, lens)
        out, lse = _poisoned_call(call, q, module.KV_LORA_RANK)
        _sync(out)
        figures["max_err"], figures["rel_err"], message = check(module, q, kv, table, lens, out, lse, max_len)
        if message:
            figures["detail"] = message
            return figures
        us = timers.median_ms(call) * 1e3
        out, lse = _poisoned_call(call, q, module.KV_LORA_RANK)
        _sync(out)
        message = check(module, q, kv, table, lens, out, lse, max_len)[2]
        if not message and graph:
            captured, (out, lse) = timers.capture_graph(call)
            graph_us = timers.time_graph(call, captured) * 1e3
            stream_us = timers.time_stream(call) * 1e3
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            captured.replay()
            _sync(out)
            replayed = check(module, q, kv, table, lens, out, lse, max_len)[2]
            message = f"graph replay: {replayed}" if replayed else ""
            figures.update(graph_us=graph_us, stream_us=stream_us)
    except Exception as error:  # noqa: BLE001 - FlashMLA refusing a case is reported in its row, not fatal
        figures.update(us=None, graph_us=None, stream_us=None, detail=_first_line(error))
        return figures
    if message:
        figures.update(graph_us=None, stream_us=None, detail=message)
    else:
        figures.update(us=us, passed=True)
    return figures


#: FlashMLA's figures per case (the same for every backend and merge of a case: run once), None where it cannot run
_FLASH_MLA: dict[str, dict[str, Any] | None] = {}


def flash_mla_for_case(api: FlashMLA | None, case: Case, module, cache: str, inputs, graph: bool, timers=None):
    """FlashMLA's figures for this case and cache, measured on its first row (None where FlashMLA is absent or
    cannot run the case, said once a case)."""
    if api is None:
        return None
    key = f"{case.name} | {cache}"
    if key not in _FLASH_MLA:
        why = flash_mla_unsupported(module, cache)
        if why:
            print(f"[flash-mla] {case.name} {cache}: not run ({why})", flush=True)
            _FLASH_MLA[key] = None
        else:
            _FLASH_MLA[key] = flash_mla_figures(api, module, inputs, max(case.seqlens), graph, timers)
    return _FLASH_MLA[key]


def flash_best_us(figures: dict[str, Any] | None) -> float | None:
    """FlashMLA's figure for a case: the better of its eager median and its graph replay (None: not timed)."""
    if not figures or figures.get("us") is None:
        return None
    return min(t for t in (figures["us"], figures.get("graph_us")) if t is not None)


def attach_flash_mla(result: Result, figures: dict[str, Any] | None) -> Result:
    """Put FlashMLA's figures beside mlagen's result, with vs_flash_mla = FlashMLA's best time over mlagen's
    (above 1: mlagen is faster), each the better of eager and graph replay."""
    result.flash_mla = figures
    flash = flash_best_us(figures)
    result.vs_flash_mla = flash / best_us(result) if flash is not None else None
    return result


_EAGER_US: dict[tuple[str, str], float] = {}


def run_case(
    case: Case,
    roof,
    tmp: Path,
    compare_default: bool,
    gen: torch.Generator,
    backend: str = "auto",
    graph_all: bool = False,
    merge: str = "auto",
    cache: str = "bf16",
    flash_mla: FlashMLA | None = None,
) -> Result | None:
    """None when `backend` cannot run this case here (e.g. gluon off Hopper, an ineligible geometry, or a
    Triton release the Gluon code was not verified with). flash_mla: FlashMLA's API, run on the case's inputs
    beside mlagen where it can (once a case, on its first row: flash_mla_for_case)."""
    module = module_for(case.spec, case.num_heads, tmp, cache)
    chosen, why = module.decode_backend(torch.device("cuda"), "auto" if backend == "gluon" else backend)
    if backend == "gluon" and chosen != "gluon":
        print(f"[skip] {case.name} {cache} gluon: {why}", flush=True)
        return None
    q, kv, table, lens, kv_scale = make_inputs(module, case.seqlens, case.seqlen_q, gen)
    scaled = {} if kv_scale is None else {"kv_scale": kv_scale}
    batch = len(case.seqlens)
    max_len = max(case.seqlens)
    schedule = module.get_decode_schedule(batch, case.seqlen_q, q.device, backend=backend, merge=merge)
    out = torch.empty(
        (batch, case.seqlen_q, module.NUM_HEADS, module.KV_LORA_RANK), dtype=torch.bfloat16, device="cuda"
    )
    lse = torch.empty((batch, module.NUM_HEADS, case.seqlen_q), device="cuda")
    call = lambda: module.mla_decode(
        q, kv, table, lens, schedule=schedule, out=out, lse=lse, return_lse=True, **scaled
    )  # fmt: skip
    inputs = (q, kv, table, lens, kv_scale)
    # checked on NaN-poisoned outputs: unwritten elements show
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    call()
    max_err, rel, msg = check(module, q, kv, table, lens, out, lse, max_len, kv_scale)
    us = median_ms(call) * 1e3
    # the timed call once more after timing, on poisoned outputs
    msg = msg or checked_call(module, call, inputs, max_len, out, lse)
    graph_us = stream_us = None
    if case.graph or graph_all:
        graph, _ = capture_graph(call)
        graph_us = time_graph(call, graph) * 1e3
        stream_us = time_stream(call) * 1e3
        msg = msg or checked_call(module, graph.replay, inputs, max_len, out, lse, replayed=True)
    flash = flash_mla_for_case(flash_mla, case, module, cache, inputs, case.graph or graph_all)
    host_us = host_us_per_call(call)
    # a bare call plans its schedule and allocates its outputs (same backend and merge, from the options)
    with use_options(decode_backend=schedule.backend, decode_merge=merge):
        bare_host_us = host_us_per_call(lambda: module.mla_decode(q, kv, table, lens, **scaled))
    eager = lambda: decode_paged_batched(
        q, kv, table, lens, module.KV_LORA_RANK, module.SOFTMAX_SCALE, max_seqlen=max_len, kv_scale=kv_scale
    )
    if (case.name, cache) not in _EAGER_US:  # the same for every backend and merge of a case: timed once
        try:
            eager_us = harness.median_ms(eager, warmup=5, rep=100) * 1e3
        except torch.OutOfMemoryError:
            eager_us = float("nan")
        _EAGER_US[(case.name, cache)] = eager_us
    eager_us = _EAGER_US[(case.name, cache)]
    default_us = None
    if compare_default and schedule.backend == "triton":
        small = batch <= module.DECODE_SMALL_BATCH
        default_cfg = (module.DECODE_SMALL_DEFAULTS if small else module.DECODE_DEFAULTS)[schedule.block_m]
        sched_d = module.get_decode_schedule(batch, case.seqlen_q, q.device, config=default_cfg, backend="triton")
        call_d = lambda: module.mla_decode(q, kv, table, lens, schedule=sched_d, out=out, lse=lse, **scaled)
        default_us = (time_graph(call_d) if case.graph else median_ms(call_d)) * 1e3
    best = min(us, graph_us) if graph_us is not None else us
    nbytes, flops = bytes_and_flops(module, case.seqlens, case.seqlen_q)
    gbps = nbytes / (best * 1e-6) / 1e9
    tflops = flops / (best * 1e-6) / 1e12
    result = Result(
        case=case.name,
        backend=schedule.backend,
        cache=cache,
        geometry=f"Dc{module.KV_LORA_RANK}/Dr{module.QK_ROPE_HEAD_DIM}",
        batch=batch,
        seqlen_q=case.seqlen_q,
        num_heads=module.NUM_HEADS,
        total_tokens=sum(case.seqlens),
        # Gluon: r = registers of the second warpgroup; portable: w = warps
        # (" fp8mma": the launch's kernel multiplies e4m3 operands, the schedule's fp8_compute)
        config=f"m{schedule.block_m} n{schedule.config[0]} {'r' if schedule.backend == 'gluon' else 'w'}"
        f"{schedule.config[1]} s{schedule.config[2]} p{schedule.num_parts}"
        f"{' fp8mma' if getattr(schedule, 'fp8_compute', False) else ''}",
        us=us,
        gbps=gbps,
        tflops=tflops,
        pct_copy=100 * gbps / roof["copy_gbps"],
        pct_mma=100 * tflops / roof["matmul_tflops"],
        eager_us=eager_us,
        speedup=eager_us / us,
        graph_us=graph_us,
        stream_us=stream_us,
        merge=schedule.merge,
        host_us=host_us,
        bare_host_us=bare_host_us,
        default_us=default_us,
        max_err=max_err,
        rel_err=rel,
        passed=not msg,
        extra={"detail": msg} if msg else {},
    )
    return attach_flash_mla(result, flash)


def _time_schedule(module, inputs, sched, max_len, graph=False):
    q, kv, table, lens, kv_scale = inputs
    scaled = {} if kv_scale is None else {"kv_scale": kv_scale}
    out = torch.empty((q.shape[0], q.shape[1], module.NUM_HEADS, module.KV_LORA_RANK), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], module.NUM_HEADS, q.shape[1]), dtype=torch.float32, device=q.device)
    call = functools.partial(
        module.mla_decode, q, kv, table, lens, schedule=sched, out=out, lse=lse, return_lse=True, **scaled
    )
    try:
        msg = checked_call(module, call, inputs, max_len, out, lse)
        us = (time_graph(call) if graph else harness.median_ms(call, warmup=10, rep=60)) * 1e3
    except Exception as error:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
        msg, us = f"{type(error).__name__}: {str(error)[:80]}", float("nan")
    return us, msg


def compiled_resources(kernel, dump_dir: Path | None = None) -> list[str]:
    """Registers, spills and shared memory of every compiled variant of a Triton kernel (and its TTGIR)."""
    lines = []
    for caches in getattr(kernel, "device_caches", {}).values():
        for i, compiled in enumerate(caches[0].values()):
            if dump_dir is not None and i < 2:
                (dump_dir / f"{kernel.__name__}_{i}_w{compiled.metadata.num_warps}.ttgir").write_text(
                    compiled.asm.get("ttgir", "")
                )
            consts = {k: v for k, v in getattr(compiled, "constants", {}).items() if isinstance(v, int)}
            lines.append(
                f"regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
                f"smem={getattr(compiled.metadata, 'shared', '?')} warps={compiled.metadata.num_warps} "
                f"stages={compiled.metadata.num_stages} {consts}"
            )
    return lines


def sweep(
    tmp: Path, gen: torch.Generator, only: str = "", dump_dir: Path | None = None, caches: tuple[str, ...] = ("bf16",)
) -> list[dict]:
    """Every config of the space (and a few split policies) on the cases that decide the targets, per cache."""
    rows = []
    key_cases = [
        Case("H16 B128 S8192", "deepseek-v3-tp8", 16, [8192] * 128),
        Case("H128 B128 S8192", "deepseek-v3-tp1", 128, [8192] * 128),
        Case("H16 B1 S8192 graph", "deepseek-v3-tp8", 16, [8192], graph=True),
        Case("H16 skewed Sq4 graph", "deepseek-v3-tp8", 16, [4641, 45118, 1730, 1696], 4, graph=True),
        Case("Mistral H32 B128", "mistral-small-4", 32, [8192] * 128),
    ]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case, cache in [(case, cache) for case in key_cases for cache in caches]:
        if only and not any(part in case.name for part in only.split(",")):
            continue
        module = module_for(case.spec, case.num_heads, tmp, cache)
        inputs = make_inputs(module, case.seqlens, case.seqlen_q, gen)
        batch, max_len = len(case.seqlens), max(case.seqlens)
        base = module.get_decode_schedule(batch, case.seqlen_q, inputs[0].device)
        nbytes, flops = bytes_and_flops(module, case.seqlens, case.seqlen_q)
        case_rows = []

        def record(
            block_m,
            cfg,
            parts,
            min_blocks,
            case=case,
            cache=cache,
            module=module,
            inputs=inputs,
            batch=batch,
            max_len=max_len,
            nbytes=nbytes,
            flops=flops,
            case_rows=case_rows,
        ):
            sched = module.get_decode_schedule(
                batch,
                case.seqlen_q,
                inputs[0].device,
                num_parts=parts,
                config=cfg,
                min_blocks_per_part=min_blocks,
                block_m=block_m,
            )
            us, msg = _time_schedule(module, inputs, sched, max_len, graph=case.graph)
            row = {
                "case": case.name,
                "cache": cache,
                "block_m": block_m,
                "config": cfg,
                "parts": sched.num_parts,
                "min_blocks": sched.min_blocks_per_part,
                "us": us,
                "gbps": nbytes / (us * 1e-6) / 1e9,
                "tflops": flops / (us * 1e-6) / 1e12,
                "ok": not msg,
                "detail": msg,
            }
            case_rows.append(row)
            return row

        rows_q = case.seqlen_q * module.NUM_HEADS
        block_ms = [m for m in module.DECODE_SPACE if m <= max(16, triton.next_power_of_2(rows_q))]
        if rows_q > max(block_ms):  # many rows: only the widest row blocks are worth timing
            block_ms = [max(block_ms)]
        for block_m in block_ms:
            for cfg in module.DECODE_SPACE[block_m]:
                record(block_m, cfg, None, None)
        best = min((r for r in case_rows if r["ok"]), key=lambda r: r["us"])
        row_blocks = triton.cdiv(rows_q, best["block_m"])
        for parts in sorted({max(1, sms * k // row_blocks) for k in (1, 3, 4)}):
            record(best["block_m"], best["config"], parts, None)
        for factor in (0.25, 0.5, 2, 4, 8):
            record(best["block_m"], best["config"], best["parts"], max(1, int(best["min_blocks"] * factor)))
        ranked = sorted((r for r in case_rows if r["ok"]), key=lambda r: r["us"])
        default = next(
            r
            for r in case_rows
            if r["block_m"] == base.block_m and r["config"] == base.config and r["parts"] == base.num_parts
        )
        print(
            f"[sweep] {case.name} {cache}: default m{base.block_m} {default['config']}: {default['us']:.1f} us; "
            f"failures: {sum(not r['ok'] for r in case_rows)}",
            flush=True,
        )
        for r in ranked[:6]:
            print(
                f"    m{r['block_m']} {r['config']} p{r['parts']} mb{r['min_blocks']}: {r['us']:.1f} us "
                f"({r['gbps']:.0f} GB/s, {r['tflops']:.0f} TFLOP/s)",
                flush=True,
            )
        rows += case_rows
    for name in ("_mla_decode_split_kernel",):
        for module in _MODULES.values():
            dump = dump_dir if dump_dir is not None and module.NUM_HEADS == 128 else None
            for line in compiled_resources(getattr(module, name), dump):
                print(f"[resources] {module.SPEC['name']} {name}: {line}")
    return rows


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(12, 5))
    names = [r.case for r in results]
    xs = range(len(results))
    ours = [(r.graph_us or r.us) for r in results]
    flash = [flash_best_us(r.flash_mla) for r in results]
    width = 0.27 if any(t is not None for t in flash) else 0.4
    ax.bar([x - width / 2 for x in xs], [r.eager_us for r in results], width=width, label="PyTorch eager")
    ax.bar([x + width / 2 for x in xs], ours, width=width, label="mlagen (graph-replayed where marked)")
    if width < 0.4:  # FlashMLA's best of eager and graph replay, where it ran
        ax.bar([x + 1.5 * width for x in xs], [t or float("nan") for t in flash], width=width, label="FlashMLA")
    ax.set_yscale("log")
    ax.set_ylabel("µs (median, log)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=75, fontsize=7)
    ax.legend()
    ax.set_title(f"MLA decode, {torch.cuda.get_device_name()}, {datetime.date.today()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best_us(r: Result) -> float:
    """The case's figure: the better of the eager median and the CUDA-graph replay median."""
    return min(r.us, r.graph_us) if r.graph_us is not None else r.us


def fp8_ratios(r: Result, results: list[Result]) -> tuple[str, str]:
    """For an fp8 row: its time over the bf16 time of the same case and backend, and over the fastest bf16
    backend of the case ('-' where there is none, and for bf16 rows)."""
    if r.cache == "bf16":
        return "-", "-"
    bf16 = [o for o in results if o.case == r.case and o.cache == "bf16"]
    same = [o for o in bf16 if o.backend == r.backend]
    return (
        f"{best_us(r) / best_us(same[0]):.2f}x" if same else "-",
        f"{best_us(r) / min(best_us(o) for o in bf16):.2f}x" if bf16 else "-",
    )


def flash_mla_cells(r: Result) -> tuple[str, str, str]:
    """The table's FlashMLA columns for a row: its µs (eager median), its graph replay µs and FlashMLA / mlagen
    ('-' where it did not run; WRONG and what, where its check failed, and then no time)."""
    figures = r.flash_mla
    if figures is None:
        return "-", "-", "-"
    if not figures["passed"]:
        return f"WRONG: {figures['detail'][:80].replace('|', '/')}", "-", "-"
    graph = f"{figures['graph_us']:.1f}" if figures.get("graph_us") is not None else "-"
    return f"{figures['us']:.1f}", graph, f"{r.vs_flash_mla:.2f}x"


def done_line(r: Result) -> str:
    """The progress line printed as each row is measured."""
    line = (
        f"[done] {r.case} | {r.cache} {r.backend} {r.merge} {r.config} | {r.us:.1f} us, graph "
        f"{r.graph_us or float('nan'):.1f} us, back to back {r.stream_us or float('nan'):.1f} us, "
        f"host {r.host_us:.1f} us, bare host {r.bare_host_us:.1f} us | {r.gbps:.0f} GB/s {r.tflops:.0f} TFLOP/s | "
        f"eager {r.eager_us:.0f} us | {'ok' if r.passed else 'FAIL ' + str(r.extra)}"
    )
    if r.flash_mla is not None:
        us, graph, ratio = flash_mla_cells(r)
        line += f" | FlashMLA {us} us, graph {graph} us, FlashMLA / mlagen {ratio}"
    return line


def run_json(meta: dict, roof: dict, flash_note: str, results: list[Result], complete: bool = True) -> dict:
    """decode.json: the run's environment, roofline, where FlashMLA came from (or why it is absent), the rows;
    complete is False while the run goes on (the file is rewritten after each row)."""
    rows = [asdict(r) for r in results]
    return {**meta, "roofline": roof, "flash_mla": flash_note, "complete": complete, "results": rows}


def log_rows(results: list[Result], roof: dict) -> list[tuple[str, dict]]:
    """(case, figures) for the results log: each row's figures, FlashMLA's beside them, and the roofline."""
    return [(r.case, {**{k: v for k, v in asdict(r).items() if k != "case"}, "roofline": roof}) for r in results]


def summary_lines(results: list[Result], meta: dict, roof: dict, caches, flash_note: str) -> list[str]:
    """The table printed last (markdown)."""
    lines = [
        f"\n## Decode, {meta['gpu']}, {meta['date'][:10]}, bf16 q/out, caches {'/'.join(caches)}, page {PAGE_SIZE}; "
        f"copy {roof['copy_gbps']:.0f} GB/s, matmul {roof['matmul_tflops']:.0f} TFLOP/s; FlashMLA: {flash_note}",
        "| case | cache | backend | merge | config | µs | graph µs | back-to-back µs | host µs | bare host µs | GB/s "
        "| %copy | TFLOP/s | %mma | eager µs | speed-up | default µs | vs bf16 same backend | vs best bf16 "
        "| FlashMLA µs | FlashMLA graph µs | FlashMLA / mlagen | ok |",
        "|" + "---|" * 23,
    ]
    for r in results:
        g = f"{r.graph_us:.1f}" if r.graph_us is not None else "-"
        b2b = f"{r.stream_us:.1f}" if r.stream_us is not None else "-"
        d = f"{r.default_us:.1f}" if r.default_us is not None else "-"
        same, best = fp8_ratios(r, results)
        flash_us, flash_graph, vs_flash = flash_mla_cells(r)
        lines.append(
            f"| {r.case} | {r.cache} | {r.backend} | {r.merge} | {r.config} | {r.us:.1f} | {g} | {b2b} | "
            f"{r.host_us:.1f} | {r.bare_host_us:.1f} | {r.gbps:.0f} | {r.pct_copy:.0f}% | {r.tflops:.0f} | "
            f"{r.pct_mma:.0f}% | {r.eager_us:.0f} | {r.speedup:.1f}x | {d} | {same} | {best} | "
            f"{flash_us} | {flash_graph} | {vs_flash} | {'yes' if r.passed else 'NO ' + r.extra.get('detail', '')} |"
        )
    wrong = sorted({r.case for r in results if r.flash_mla is not None and not r.flash_mla["passed"]})
    if wrong:
        lines.append(f"FlashMLA failed its check (not timed): {wrong}")
    return lines


def only_matches(part: str, name: str) -> bool:
    """Whether --only's `part` selects the case `name`: a substring of it, or (written =NAME) exactly it."""
    return name == part[1:] if part.startswith("=") else part in name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--quick", action="store_true", help="fewer B=128 cases")
    parser.add_argument("--sweep", action="store_true", help="time the whole autotune space on key cases")
    parser.add_argument("--compare-default", action="store_true", help="also time the untuned default config")
    parser.add_argument(
        "--only", default="", help="run only cases whose name contains one of these (a,b,...; =NAME: exactly NAME)"
    )
    parser.add_argument("--dump-ir", action="store_true", help="write TTGIR of two H=128 split kernels")
    parser.add_argument("--no-suite", action="store_true", help="only the sweep, not the benchmark cases")
    parser.add_argument(
        "--backends",
        default="gluon,triton",
        help="decode backends to time side by side (gluon: the Hopper kernel, where it runs; triton: portable; "
        "auto: the launch policy's choice)",
    )
    parser.add_argument("--graph-all", action="store_true", help="time CUDA-graph replay for every case too")
    parser.add_argument(
        "--merges",
        default="auto",
        help="merges of split sequences to time side by side (fused: in the split launch; kernel: a second "
        "launch; auto: the launch policy's choice)",
    )
    parser.add_argument(
        "--caches",
        default="bf16,fp8",
        help="latent caches to time side by side: bf16 (the spec's), fp8 (e4m3, same geometry and batch) and "
        "fp8mma (the fp8 cache with cache_compute fp8: e4m3 tensor-core products, checked against their own bound), "
        "fp8mma1 (the same, the query one e4m3 term)",
    )
    parser.add_argument("--append", type=Path, help="also append each result to this results log (JSON lines)")
    parser.add_argument(
        "--flash-mla",
        default="auto",
        metavar="WHERE",
        help=f"FlashMLA in the same run, beside mlagen where it can run (bf16, Dc 512 / Dr 64, page 64): "
        f"{FLASH_MLA_CHOICES} (auto: an importable flash_mla, else vLLM's build where vLLM imports)",
    )
    args = parser.parse_args()
    caches = tuple(args.caches.split(","))
    unknown = [c for c in caches if c not in CACHES]
    if unknown:
        parser.error(f"--caches: unknown {unknown} (choose from {', '.join(CACHES)})")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    meta = harness.environment(timespec="minutes")
    gpu = meta["gpu"]
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, {meta['date']}", flush=True)
    roof = roofline()
    print(f"# roofline: copy {roof['copy_gbps']:.0f} GB/s, bf16 matmul {roof['matmul_tflops']:.0f} TFLOP/s", flush=True)
    flash_mla, why = load_flash_mla(args.flash_mla)
    flash_note = flash_mla.source if flash_mla is not None else f"absent: {why}"
    print(f"# FlashMLA: {flash_note}{'' if flash_mla else '; its columns stay empty'}", flush=True)
    decode_json = args.out / "decode.json"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.sweep:
            rows = sweep(tmp, gen, args.only, args.out if args.dump_ir else None, caches)
            (args.out / "decode_sweep.json").write_text(
                json.dumps({**meta, "roofline": roof, "rows": rows}, indent=1, default=str)
            )
        results = []
        for case in [] if args.no_suite else cases(args.quick):
            if args.only and not any(only_matches(part, case.name) for part in args.only.split(",")):
                continue
            for cache in caches:
                for backend in args.backends.split(","):
                    for merge in args.merges.split(","):
                        r = run_case(case, roof, tmp, args.compare_default, gen, backend, args.graph_all, merge,
                                     cache, flash_mla)  # fmt: skip
                        if r is None:
                            break
                        results.append(r)
                        print(done_line(r), flush=True)
                        # written as each row is measured: a run stopped by a time limit keeps the rows it has
                        decode_json.write_text(json.dumps(run_json(meta, roof, flash_note, results, False), indent=1))
                        if args.append:
                            harness.append_results(args.append, "decode", meta, log_rows([r], roof))
                        torch.cuda.empty_cache()
    decode_json.write_text(json.dumps(run_json(meta, roof, flash_note, results), indent=1))
    plot(results, args.out / "decode.png")
    if args.append:
        print(f"# appended {len(results)} rows to {args.append}")
    print("\n".join(summary_lines(results, meta, roof, caches, flash_note)))
    failed = [f"{r.case} ({r.backend})" for r in results if not r.passed]
    if failed:
        print(f"FAILED correctness: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
