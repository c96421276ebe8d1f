"""`mlagen tune` and `mlagen tuning migrate`: the tuning search on this GPU, and converting an old tuning database.

The work itself is library code (`tuning_search.tune_specs`, `tuning_db.migrate_db`); these commands parse
arguments, show progress and print the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..launch_policy import DECODE_GLUON_BUCKET, PREFILL_GLUON_BUCKETS
from .common import (
    AllOption,
    SeedOption,
    SpecArgs,
    SpecDirOption,
    UsageError,
    add_commands,
    check_spec_dirs,
    gpu_visible,
    resolve_specs,
)

__all__ = ["print_tune_report", "register"]


class _Progress:
    """A rich progress bar on stderr (plain lines when rich is missing or stderr is not a terminal)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._plain_total = 0
        self._plain_done = 0
        self._last_print = 0.0
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self._bar = Progress(
                    TextColumn("{task.description:<48}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=console,
                )
        except ImportError:
            self._bar = None

    def phase(self, description: str, total: int) -> Callable[[str], None]:
        if self._bar is not None:
            if self._task is not None:
                self._bar.update(self._task, visible=False)
            self._task = self._bar.add_task(description, total=total)

            def advance(detail: str) -> None:
                self._bar.update(self._task, advance=1, description=detail[:48])

            return advance
        self._plain_total, self._plain_done = total, 0
        typer.echo(f"{description}: {total} steps", err=True)

        def advance_plain(detail: str) -> None:
            self._plain_done += 1
            now = time.monotonic()
            if now - self._last_print > 5 or self._plain_done == self._plain_total:
                self._last_print = now
                typer.echo(f"  [{self._plain_done}/{self._plain_total}] {detail}", err=True)

        return advance_plain

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def tune_command(
    specs: SpecArgs = None,
    all_bundled: AllOption = False,
    spec_dir: SpecDirOption = None,
    cases: Annotated[
        str,
        typer.Option(
            "--cases",
            help="case set (quick, standard, full) or comma-separated cases: decode "
            "(b16-s16k, b64-s4k, b128-s4k, b128-s8k, b32-s32k; latency regime b1-s8k, b4-s16k, b8-s8k) and "
            "prefill (pf-b1-s4k-p28k, pf-b4-s8k-p8k)",
        ),
    ] = "standard",
    db: Annotated[
        Path | None,
        typer.Option("--db", help="tuning database to merge the winners into (default: the user database)"),
    ] = None,
    jobs: Annotated[
        int | None, typer.Option("--jobs", "-j", help="processes compiling in parallel first (0: none)")
    ] = None,
    warmup_ms: Annotated[int, typer.Option(help="do_bench warm-up per configuration and case (ms)")] = 25,
    rep_ms: Annotated[int, typer.Option(help="do_bench measuring time per configuration and case (ms)")] = 100,
    seed: SeedOption = 0,
    buckets: Annotated[
        str | None,
        typer.Option(
            "--buckets",
            help="only these buckets, comma-separated: decode m<rows>, m<rows>-small, gluon (the Hopper "
            "backend's registers and stages); prefill causal, prefix, gluon-causal, gluon-prefix (the Hopper "
            "backend's key blocks and stages)",
        ),
    ] = None,
) -> None:
    """Benchmark each spec's autotune spaces on this GPU and record the winners in a tuning database.

    Decode row-block buckets (serving batches and the latency regime) and prefill (causal, prefix), and on
    Hopper the Gluon backends' (decode gluon; prefill gluon-causal, gluon-prefix): each configuration is
    checked against the reference, then timed; the fastest wins, the default unless one beats it by over 1%.
    A kernel that several specs share is tuned once.
    """
    from ..tuning_db import user_db_path
    from ..tuning_search import default_jobs, parse_buckets, parse_cases, tune_specs

    chosen = resolve_specs(specs or [], all_bundled, spec_dir)
    case_list = parse_cases(cases)
    wanted = parse_buckets(buckets) if buckets is not None else None
    on_gpu, gpu_text = gpu_visible()
    if not on_gpu:
        raise UsageError(f"mlagen tune needs a CUDA GPU: {gpu_text}")
    import torch

    with _Progress() as progress:
        report = tune_specs(
            chosen,
            case_list,
            db_path=db if db is not None else user_db_path(),
            jobs=default_jobs() if jobs is None else jobs,
            warmup_ms=warmup_ms,
            rep_ms=rep_ms,
            seed=seed,
            device=torch.device("cuda", torch.cuda.current_device()),
            phase=progress.phase,
            log=lambda line: typer.echo(line, err=True),
            buckets_wanted=wanted,
        )
    print_tune_report(report)
    if not report.ok:
        raise typer.Exit(1)


def print_tune_report(report: Any) -> None:
    """The summary table, then what needs attention (on stderr)."""
    for line in report.shared:
        typer.echo(f"tuned once: {line}", err=True)
    if report.warm_failures:
        typer.echo(f"{len(report.warm_failures)} kernel(s) failed in the parallel compile (tried again):", err=True)
        for line in report.warm_failures[:10]:
            typer.echo(f"  {line}", err=True)
    _print_summary(report.results)
    typer.echo(f"wrote {len(report.entries)} entries to {report.db_path} in {report.seconds:.0f} s")
    for line in report.wrong:
        typer.echo(f"WRONG RESULTS: {line}", err=True)
    for line in report.not_picked:
        typer.echo(f"NOT PICKED UP: {line}", err=True)
    for line in report.unsolved:
        typer.echo(f"NO WORKING CONFIGURATION: {line}", err=True)


def migrate_command(
    path: Annotated[Path, typer.Argument(help="a schema-1 tuning database (entries keyed by spec hash)")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="where to write (default: in place)")] = None,
    gpu_arch: Annotated[
        list[str] | None,
        typer.Option("--gpu-arch", help="NAME=ARCH for a GPU the built-in table does not know (repeatable)"),
    ] = None,
    spec_dir: SpecDirOption = None,
) -> None:
    """Convert a schema-1 tuning database to schema 2 (keys derived from the specs its entries name).

    Nothing is re-measured: entries that land on one key (specs sharing a kernel) pool their measurements.
    """
    from ..registry import resolve_spec
    from ..tuning_db import migrate_db

    archs = {}
    for item in gpu_arch or []:
        name, sep, arch = item.rpartition("=")
        if not sep or not name or not arch:
            raise UsageError(f"--gpu-arch {item!r}: expected NAME=ARCH, e.g. 'NVIDIA H100 PCIe=sm90'")
        archs[name] = arch
    extra = check_spec_dirs(spec_dir)
    entries = migrate_db(path, out, resolve=lambda name: resolve_spec(name, extra), gpu_archs=archs)
    typer.echo(f"wrote {len(entries)} schema-2 entries to {out if out is not None else path}")


def register(app: typer.Typer) -> None:
    """Add tune and tuning (migrate) to `app`."""
    tuning_help = "The tuning database (mlagen tune writes it)."
    add_commands(app, {"tune": tune_command}, {"tuning": (tuning_help, {"migrate": migrate_command})})


def _print_summary(results: list) -> None:
    header = (
        f"{'spec':<18} {'kernel':<7} {'bucket':<12} {'Sq':>2} {'default':<15} {'def µs':>9} {'tuned':<15} "
        f"{'tuned µs':>9} {'speedup':>7} {'ok/wrong/failed':>15}"
    )
    typer.echo(header)
    typer.echo("-" * len(header))
    for r in results:
        default = r.result_of(r.default)
        chosen = r.result_of(r.chosen)
        d_us = default.score_us if default is not None else None
        c_us = chosen.score_us if chosen is not None else None
        counts = [sum(x.status == s for x in r.results) for s in ("ok", "wrong", "failed")]
        speed = f"{d_us / c_us:.3f}x" if d_us and c_us else "-"
        typer.echo(
            f"{r.spec_name:<18} {r.kernel:<7} {r.bucket:<12} {r.seqlen_q or '-':>2} "
            f"{_config_text(r.kernel, r.default, r.bucket):<15} {_us_text(d_us):>9} "
            f"{_config_text(r.kernel, r.chosen, r.bucket):<15} "
            f"{_us_text(c_us):>9} {speed:>7} {'/'.join(map(str, counts)):>15}"
        )


def _config_text(kernel: str, config: Any, bucket: str = "") -> str:
    """decode (block_n, warps, stages) -> n32w4s3, its Gluon bucket (block_n, registers, stages) -> n64r168s2;
    prefill (block_m, block_n, warps, stages) -> m128n64w8s3, its Gluon buckets (block_n, stages) -> n128s2."""
    if config is None:
        return "-"
    if kernel == "decode":
        names = "nrs" if bucket == DECODE_GLUON_BUCKET else "nws"
    else:
        names = "ns" if bucket in PREFILL_GLUON_BUCKETS.values() else "mnws"
    return "".join(f"{k}{v}" for k, v in zip(names, config, strict=True))


def _us_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
