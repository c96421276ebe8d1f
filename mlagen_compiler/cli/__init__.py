"""The `mlagen` command line. Errors are one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from .._version import __version__
from ..module_file import compile_spec, import_module_from_path
from ..plan import emitted_kinds, lower
from ..registry import registered_specs, resolve_spec, spec_dirs
from ..spec import MLASpec, SpecError, json_schema
from . import tuning as _tuning_commands
from .common import AllOption, SeedOption, SpecArgs, SpecDirOption, UsageError, one_line_errors
from .common import check_spec_dirs as _spec_dirs
from .common import resolve_specs as _specs

app = typer.Typer(
    name="mlagen",
    help="Generate MLA attention kernels (Triton) from a YAML layer spec.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

TuningOption = Annotated[
    str,
    typer.Option(
        "--tuning",
        help="tuned configurations to render in: 'all' (shipped + user database), 'shipped' or 'none'",
    ),
]


def _tuned(spec: MLASpec, which: str) -> dict[str, Any] | None:
    from ..tuning_db import default_db_paths, tuned_for_spec

    if which not in ("all", "shipped", "none"):
        raise UsageError(f"--tuning {which!r}: choose all, shipped or none")
    if which == "none":
        return None
    return tuned_for_spec(spec, default_db_paths(include_user=which == "all"))


@app.command("compile")
@one_line_errors
def compile_command(
    specs: SpecArgs = None,
    out_dir: Annotated[Path, typer.Option("-o", "--out-dir", help="where to write modules")] = Path("generated"),
    all_bundled: AllOption = False,
    spec_dir: SpecDirOption = None,
    tuning: TuningOption = "all",
) -> None:
    """Validate, lower and render each spec into OUT_DIR/<name>.py (with its tuned configurations)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"-o {out_dir}: exists and is not a directory")
    from ..triton_support import triton_version, unsupported_message

    warning = unsupported_message(triton_version())
    if warning:
        typer.echo(f"mlagen: warning: {warning}", err=True)
    for spec in _specs(specs or [], all_bundled, spec_dir):
        path = compile_spec(spec, out_dir, _tuned(spec, tuning))
        typer.echo(f"{spec.name}: wrote {path} (kernels: {', '.join(k.name for k in emitted_kinds(spec))})")


@app.command("list")
@one_line_errors
def list_command(spec_dir: SpecDirOption = None) -> None:
    """Registered specs and the kernels each emits (name/kernel), then the spec directories searched."""
    extra = _spec_dirs(spec_dir)
    header = f"{'name':<22} {'H':>4} {'Dc':>5} {'Dr':>4} {'Dn':>4} {'Dv':>4} {'Lq':>5} {'page':>5} {'dtype':<9} kernels"
    typer.echo(header)
    for name in registered_specs(extra):
        try:
            s = resolve_spec(name, extra)
        except SpecError as error:
            typer.echo(f"{name:<22} INVALID: {str(error).splitlines()[0]}")
            continue
        kernels = ", ".join(f"{s.name}/{k.name}" for k in emitted_kinds(s))
        lq = "-" if s.q_lora_rank is None else str(s.q_lora_rank)
        typer.echo(
            f"{s.name:<22} {s.num_heads:>4} {s.kv_lora_rank:>5} {s.qk_rope_head_dim:>4} {s.qk_nope_head_dim:>4} "
            f"{s.v_head_dim:>4} {lq:>5} {s.page_size:>5} {s.dtype:<9} {kernels}"
        )
    typer.echo("spec directories (later ones shadow earlier ones):")
    for directory in spec_dirs(extra):
        typer.echo(f"  {directory}{'' if directory.is_dir() else '  (missing)'}")


@app.command("show")
@one_line_errors
def show_command(
    spec: Annotated[str, typer.Argument(help="YAML spec file or registered name")],
    spec_dir: SpecDirOption = None,
) -> None:
    """Print the derived plan (every constant the kernels are rendered with) as JSON."""
    typer.echo(json.dumps(lower(resolve_spec(spec, _spec_dirs(spec_dir))).summary(), indent=2, default=str))


@app.command("schema")
@one_line_errors
def schema_command() -> None:
    """Print the JSON schema of a spec (for editor validation of YAML)."""
    typer.echo(json.dumps(json_schema(), indent=2, sort_keys=True))


@app.command("verify")
@one_line_errors
def verify_command(
    specs: SpecArgs = None,
    all_bundled: AllOption = False,
    seed: SeedOption = 0,
    spec_dir: SpecDirOption = None,
) -> None:
    """Run each spec's generated kernels against the PyTorch reference on random inputs.

    On the GPU if there is one, else in Triton's interpreter. Exit code 1 if any case fails.
    """
    from dataclasses import replace

    from ..options import options, set_options
    from ..verify import use_interpreter_if_no_gpu, verify_module

    set_options(replace(options(), validate=True))  # index values checked on the GPU too

    chosen = _specs(specs or [], all_bundled, spec_dir)
    on_gpu = use_interpreter_if_no_gpu()
    where = "GPU" if on_gpu else "Triton interpreter (CPU)"
    if on_gpu:
        import torch

        where += f": {torch.cuda.get_device_name()}"
    typer.echo(f"verifying {len(chosen)} spec(s) on {where}", err=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mlagen-verify-") as tmp:
        for spec in chosen:
            module = import_module_from_path(compile_spec(spec, tmp, _tuned(spec, "all")))  # what users get

            def progress(message: str) -> None:
                typer.echo(f"  ... {message}", err=True)

            results += verify_module(module, seed, on_gpu, progress)
    widths = (22, 13, 18, 11, 11, 5)
    typer.echo(
        f"{'spec':<{widths[0]}} {'kernel':<{widths[1]}} {'case':<{widths[2]}} "
        f"{'max abs err':>{widths[3]}} {'rel err':>{widths[4]}} {'result':<{widths[5]}}"
    )
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        typer.echo(
            f"{r.spec:<{widths[0]}} {r.kernel:<{widths[1]}} {r.case:<{widths[2]}} "
            f"{r.max_abs_error:>{widths[3]}.3e} {r.rel_norm_error:>{widths[4]}.3e} {verdict:<{widths[5]}}"
            + (f"  {r.detail}" if r.detail else "")
        )
    failed = sum(not r.passed for r in results)
    typer.echo(f"{len(results) - failed} passed, {failed} failed")
    if failed:
        raise typer.Exit(1)


_tuning_commands.register(app)  # tune, tuning, env, cache

from .spec_from_hf import register as _register_hf  # noqa: E402  (spec-from-hf)

_register_hf(app, one_line_errors, UsageError)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="print the version and exit")] = False,
) -> None:
    if version:
        typer.echo(f"mlagen {__version__}")
        raise typer.Exit(0)


def main(argv: list[str] | None = None) -> int:
    """The console entry point: like the typer app, but usage errors are one line too (exit code 2)."""
    try:
        result = app(args=argv, prog_name="mlagen", standalone_mode=False)
    except typer.Abort:
        typer.echo("mlagen: aborted", err=True)
        return 130
    except Exception as error:
        # click's UsageError (unknown option, missing or bad value); click is vendored inside newer typer
        # releases, so it is recognised by name rather than imported
        if not any(cls.__name__ == "UsageError" for cls in type(error).__mro__):
            raise
        ctx = getattr(error, "ctx", None)
        where = ctx.command_path if ctx is not None else "mlagen"
        typer.echo(f"mlagen: error: {error.format_message()} (see '{where} --help')", err=True)
        return 2
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
