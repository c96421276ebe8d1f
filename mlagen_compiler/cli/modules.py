"""`mlagen compile` and `mlagen verify`: write each spec's generated module; run its kernels against the reference."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from ..module_file import compile_spec, import_module_from_path
from ..plan import emitted_kinds
from ..spec import MLASpec
from .common import AllOption, SeedOption, SpecArgs, SpecDirOption, UsageError, add_commands, resolve_specs

__all__ = ["register"]

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
    for spec in resolve_specs(specs or [], all_bundled, spec_dir):
        path = compile_spec(spec, out_dir, _tuned(spec, tuning))
        typer.echo(f"{spec.name}: wrote {path} (kernels: {', '.join(k.name for k in emitted_kinds(spec))})")


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

    chosen = resolve_specs(specs or [], all_bundled, spec_dir)
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


def register(app: typer.Typer) -> None:
    """Add compile and verify to `app`."""
    add_commands(app, {"compile": compile_command, "verify": verify_command})
