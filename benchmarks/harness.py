"""What the benchmark jobs share: the run's environment (GPU, date, versions, commit), `do_bench` medians, the
host time of calls issued back to back, and the results log.

The results log (`benchmarks/results/results.jsonl`) is one JSON object a line, appended by a job run with
`--append PATH`: `{"bench", "gpu", "date", "commit", "torch", "triton", "case", "figures"}`, where `figures`
holds the job's own numbers for that case (times, bandwidth, errors, the configuration) as its JSON output
writes them. Lines are only ever appended; a run never rewrites earlier ones.

Imported by the jobs beside it (`python benchmarks/bench_decode.py` puts this folder on sys.path); needs torch
and triton, a GPU only for the timing helpers.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_LOG = ROOT / "benchmarks" / "results" / "results.jsonl"
#: a copy of the working tree without .git (a device machine's) names its commit here
COMMIT_VARIABLE = "MLAGEN_BENCH_COMMIT"


def git_commit(root: Path = ROOT) -> str | None:
    """MLAGEN_BENCH_COMMIT when set (a device machine's copy of the tree can hold an older .git beside newer
    files); else the checked-out commit (12 hex digits), with "-dirty" when tracked files differ from it; else
    None."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}-dirty" if dirty else head


def environment(*, timespec: str = "minutes", gpu: str | None = None) -> dict[str, Any]:
    """gpu (the CUDA device's name, else "cpu"), date (UTC, ISO 8601 to `timespec`), torch, triton, commit."""
    import torch
    import triton

    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
    }


def median_ms(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 200, repeat: int = 1) -> float:
    """`triton.testing.do_bench` median in ms (L2 flushed before each call), measured `repeat` times; the last
    is kept (the first run after allocating and checking a case was seen to read up to 25% slow)."""
    import triton.testing

    for _ in range(repeat - 1):
        triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_us_per_call(call: Callable[[], Any], calls: int = 100) -> float:
    """Wall time per call issued back to back (no synchronisation between calls): the host's cost of a call;
    when the GPU is slower than the host, the launch queue fills and this approaches the GPU time."""
    import torch

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def capture_graph(fn: Callable[[], Any], warmup: int = 3) -> tuple[Any, Any]:
    """(CUDA graph of `fn` after `warmup` calls on a side stream, as PyTorch asks, fn's result during capture)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def result_lines(bench: str, meta: dict[str, Any], rows: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    """One results-log line per (case, figures) of a run whose environment is `meta`."""
    head = {key: meta.get(key) for key in ("gpu", "date", "commit", "torch", "triton")}
    return [
        json.dumps({"bench": bench, **head, "case": case, "figures": figures}, default=str, allow_nan=True)
        for case, figures in rows
    ]


def append_results(
    path: Path | str, bench: str, meta: dict[str, Any], rows: Iterable[tuple[str, dict[str, Any]]]
) -> int:
    """Append a run's rows to the results log at `path` (created with its folder if missing); returns how many."""
    lines = result_lines(bench, meta, rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.writelines(line + "\n" for line in lines)
    return len(lines)


def read_results(path: Path | str = RESULTS_LOG) -> list[dict[str, Any]]:
    """Every row of a results log, oldest first."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
