"""`mlagen tune`, `mlagen env` and `mlagen cache info|clear`: the commands around the cache and tuning database.

Registered on the main typer app by `cli.py` (kept apart so the core commands stay short); errors are
one line with exit code 2 like every other command.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ._version import __version__

__all__ = ["register"]

# option types shared with cli.py (annotations must resolve in each module's globals, so cli.py imports them)
SpecArgs = Annotated[list[str] | None, typer.Argument(help="YAML spec files or registered spec names")]
AllOption = Annotated[bool, typer.Option("--all", help="every registered spec")]
SpecDirOption = Annotated[
    list[Path] | None,
    typer.Option("--spec-dir", help="directory of user specs to register (repeatable; also MLAGEN_SPEC_PATH)"),
]
#: seeds feed torch.Generator.manual_seed after an offset per case, so they stay well inside 64 bits
SeedOption = Annotated[int, typer.Option(min=0, max=2**32 - 1, help="seed of the random inputs (0..2**32-1)")]


def _gpu_visible() -> tuple[bool, str]:
    """(usable for native kernels, description)."""
    import torch

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "none used: TRITON_INTERPRET=1 (kernels run in Triton's CPU interpreter)"
    if not torch.cuda.is_available():
        return False, "none (torch.cuda.is_available() is False; kernels run in Triton's CPU interpreter)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return True, ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))


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


def _triton_line(version: str | None) -> str:
    from .triton_support import TRITON_REQUIREMENT, TRITON_TESTED, triton_supported

    verdict = "inside" if triton_supported(version) else "OUTSIDE"
    tested = ", ".join(TRITON_TESTED)
    return f"{version or 'not installed'}  ({verdict} the supported range {TRITON_REQUIREMENT}; CI tests {tested})"


def register(
    app: typer.Typer, one_line_errors: Callable, usage_error: type[Exception], resolve_specs: Callable
) -> None:
    """Add tune, env and cache to `app` (helpers passed in from cli.py to avoid an import cycle)."""

    @app.command("tune")
    @one_line_errors
    def tune_command(
        specs: SpecArgs = None,
        all_bundled: AllOption = False,
        spec_dir: SpecDirOption = None,
        cases: Annotated[
            str,
            typer.Option(
                "--cases",
                help="case set (quick, standard, full) or comma-separated cases "
                "(b16-s16k, b64-s4k, b128-s4k, b128-s8k, b32-s32k)",
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
    ) -> None:
        """Benchmark each spec's autotune space on this GPU and record the winners in a tuning database.

        Each configuration of each reachable decode bucket is checked against the reference, then timed
        (triton.testing.do_bench median); the fastest wins, the default unless one beats it by over 1%.
        """
        from .tuner import default_jobs, parse_cases
        from .tuning import user_db_path

        chosen = resolve_specs(specs or [], all_bundled, spec_dir)
        case_list = parse_cases(cases)
        on_gpu, gpu_text = _gpu_visible()
        if not on_gpu:
            raise usage_error(f"mlagen tune needs a CUDA GPU: {gpu_text}")
        import torch

        ok = run_tune(
            chosen,
            case_list,
            db_path=db if db is not None else user_db_path(),
            jobs=default_jobs() if jobs is None else jobs,
            warmup_ms=warmup_ms,
            rep_ms=rep_ms,
            seed=seed,
            device=torch.device("cuda", torch.cuda.current_device()),
        )
        if not ok:
            raise typer.Exit(1)

    @app.command("env")
    @one_line_errors
    def env_command(spec_dir: SpecDirOption = None) -> None:
        """Versions, GPU, cache directory, tuning databases and spec directories in use."""
        import torch

        from .cache import cache_dir, directory_size, list_entries
        from .registry import registered_specs, spec_dirs
        from .triton_support import triton_version
        from .tuning import read_db, shipped_db_paths, user_db_path

        _, gpu_text = _gpu_visible()
        root = cache_dir()
        entries = list_entries(root)
        size = sum(directory_size(e.directory) for e in entries)
        rows = [
            ("mlagen", __version__),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", torch.__version__),
            ("triton", _triton_line(triton_version())),
            ("gpu", gpu_text),
            ("cache", f"{root}  ({len(entries)} module(s), {size / 1024:.0f} KiB; MLAGEN_CACHE_DIR)"),
        ]
        for path in shipped_db_paths():
            rows.append(("tuning (shipped)", f"{path}  ({len(read_db(path))} entries)"))
        user = user_db_path()
        state = f"{len(read_db(user))} entries" if user.exists() else "not created yet"
        rows.append(("tuning (user)", f"{user}  ({state}; MLAGEN_TUNING_DB; `mlagen tune` writes here)"))
        extra = list(spec_dir or [])
        for directory in spec_dirs(extra):
            rows.append(("spec dir", f"{directory}{'' if directory.is_dir() else '  (missing)'}"))
        rows.append(("specs", f"{len(registered_specs(extra))} registered (mlagen list)"))
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            typer.echo(f"{key:<{width}}  {value}")

    cache_app = typer.Typer(help="The compile cache of generated modules (mlagen_compiler.load).", no_args_is_help=True)
    app.add_typer(cache_app, name="cache")

    @cache_app.command("info")
    @one_line_errors
    def cache_info_command() -> None:
        """Where the cache is and what it holds (one line per cached module)."""
        from .cache import cache_dir, directory_size, entry_is_intact, list_entries

        root = cache_dir()
        entries = list_entries(root)
        total = sum(directory_size(e.directory) for e in entries)
        typer.echo(f"cache: {root}")
        typer.echo(f"{len(entries)} module(s), {total / 1024:.0f} KiB")
        if entries:
            typer.echo(f"{'spec':<22} {'key':<14} {'mlagen':<8} {'triton':<8} {'created':<21} state")
        for e in entries:
            m = e.manifest
            state = "ok" if entry_is_intact(e) else "damaged (rebuilt on next load)"
            typer.echo(
                f"{m.get('spec_name', e.directory.name):<22} {e.key[:12]:<14} {m.get('mlagen', '?'):<8} "
                f"{m.get('triton', '?'):<8} {m.get('created', '?'):<21} {state}"
            )

    @cache_app.command("clear")
    @one_line_errors
    def cache_clear_command() -> None:
        """Remove every cached module (the tuning database is kept)."""
        from .cache import cache_dir, clear_cache

        root = cache_dir()
        removed = clear_cache(root)
        typer.echo(f"removed {removed} cached module(s) from {root}")


def run_tune(
    chosen: list,
    case_list: list,
    *,
    db_path: Path,
    jobs: int,
    warmup_ms: int,
    rep_ms: int,
    seed: int,
    device: Any,
) -> bool:
    """`mlagen tune` after argument checking: compile, warm up, time, write the database, check that the
    database reaches the generated modules, print the summary. False when anything needs attention."""
    from .compile import compile_spec, import_module_from_path
    from .tuner import WarmUpTask, decode_buckets, entries_from_results, tune_module, warm_up
    from .tuning import tuned_for_spec, write_db

    started = time.monotonic()
    decode_specs = [s for s in chosen if "decode" in s.kernels]
    for spec in chosen:
        if "decode" not in spec.kernels:
            typer.echo(f"{spec.name}: emits no decode kernel; nothing to tune yet", err=True)
    with tempfile.TemporaryDirectory(prefix="mlagen-tune-") as tmp:
        modules = [(s, compile_spec(s, Path(tmp) / s.module_name)) for s in decode_specs]
        loaded = [(s, path, import_module_from_path(path)) for s, path in modules]
        plans = [(s, path, m, decode_buckets(m, device)) for s, path, m in loaded]
        tasks = sorted(
            {
                WarmUpTask(str(path), case.batch, b.seqlen_q, cfg, str(device))
                for _, path, _, buckets in plans
                for b in buckets
                for case in case_list
                for cfg in b.configs
            },
            key=lambda t: (t.module_path, t.seqlen_q, t.batch, t.config),
        )
        runs = sum(len(b.configs) * len(case_list) for *_, buckets in plans for b in buckets)
        gpu = plans[0][2]._gpu_name(device) if plans else str(device)
        typer.echo(
            f"tuning {len(plans)} spec(s) on {gpu}: {sum(len(b) for *_, b in plans)} bucket(s), {runs} timed "
            f"runs over cases {', '.join(c.name for c in case_list)}; {len(tasks)} kernels to compile on "
            f"{jobs} process(es)",
            err=True,
        )
        results = []
        with _Progress() as progress:
            warm_failures = warm_up(tasks, jobs, progress.phase("compiling", len(tasks))) if jobs > 0 else {}
            typer.echo(f"compiled in {time.monotonic() - started:.0f} s", err=True)
            advance = progress.phase("timing", runs)
            for _, _, module, buckets in plans:
                results += tune_module(
                    module,
                    case_list,
                    device=device,
                    seed=seed,
                    warmup_ms=warmup_ms,
                    rep_ms=rep_ms,
                    buckets=buckets,
                    advance=advance,
                )
        if warm_failures:
            typer.echo(f"{len(warm_failures)} kernel(s) failed in the parallel compile (tried again):", err=True)
            for task, error in list(warm_failures.items())[:10]:
                typer.echo(f"  {Path(task.module_path).stem} B={task.batch} {task.config}: {error}", err=True)
        entries = entries_from_results(results)
        write_db(db_path, entries)

        # the database must reach the generated module: compile from it and ask the module what it picks
        mismatched = []
        for spec, _, _, _ in plans:
            check_dir = Path(tmp) / "check" / spec.module_name
            module = import_module_from_path(compile_spec(spec, check_dir, tuned_for_spec(spec, [db_path])))
            for r in (r for r in results if r.spec_name == spec.name and r.chosen is not None):
                if getattr(device, "type", "cuda") == "cuda":
                    picked = module.get_decode_schedule(case_list[0].batch, r.seqlen_q, device).config
                else:  # interpreter (tests): the schedule never uses tuned configurations there
                    picked = module.DECODE_TUNED.get((r.gpu, r.bucket))
                if tuple(picked or ()) != tuple(r.chosen):
                    mismatched.append(f"{spec.name} {r.bucket}: module picks {picked}, tuned {r.chosen}")

    _print_summary(results)
    typer.echo(f"wrote {len(entries)} entries to {db_path} in {time.monotonic() - started:.0f} s")
    problems = [
        f"{r.spec_name} {r.bucket} {x.config}: {x.detail}" for r in results for x in r.results if x.status == "wrong"
    ]
    for line in problems:
        typer.echo(f"WRONG RESULTS: {line}", err=True)
    for line in mismatched:
        typer.echo(f"NOT PICKED UP: {line}", err=True)
    for r in results:
        if r.chosen is None:
            typer.echo(f"NO WORKING CONFIGURATION: {r.spec_name} {r.bucket}", err=True)
    return not (problems or mismatched or any(r.chosen is None for r in results))


def _print_summary(results: list) -> None:
    header = (
        f"{'spec':<18} {'bucket':<6} {'Sq':>2} {'default':<11} {'def µs':>9} {'tuned':<11} {'tuned µs':>9} "
        f"{'speedup':>7} {'ok/wrong/failed':>15}"
    )
    typer.echo(header)
    typer.echo("-" * len(header))
    for r in results:
        default = r.result_of(r.default)
        chosen = r.result_of(r.chosen) if r.chosen is not None else None
        d_us = default.score_us if default is not None else None
        c_us = chosen.score_us if chosen is not None else None
        counts = [sum(x.status == s for x in r.results) for s in ("ok", "wrong", "failed")]

        def fmt(cfg: Any) -> str:
            return "-" if cfg is None else f"n{cfg[0]}w{cfg[1]}s{cfg[2]}"

        def us(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        speed = f"{d_us / c_us:.3f}x" if d_us and c_us else "-"
        typer.echo(
            f"{r.spec_name:<18} {r.bucket:<6} {r.seqlen_q:>2} {fmt(r.default):<11} {us(d_us):>9} "
            f"{fmt(r.chosen):<11} {us(c_us):>9} {speed:>7} {'/'.join(map(str, counts)):>15}"
        )
