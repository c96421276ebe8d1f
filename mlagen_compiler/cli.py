"""The `mlagen` command line. Errors are one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ._version import __version__
from .compile import compile_spec, import_module_from_path
from .plan import lower
from .registry import registered_specs, resolve_spec
from .spec import MLASpec, SpecError, json_schema

app = typer.Typer(
    name="mlagen",
    help="Generate MLA attention kernels (Triton) from a YAML layer spec.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

F = TypeVar("F", bound=Callable[..., Any])


class UsageError(Exception):
    """A problem with what the user asked for; reported as one line."""


def fail(message: str) -> None:
    typer.echo(f"mlagen: error: {message}", err=True)
    raise typer.Exit(2)


def one_line_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (SpecError, UsageError, ValueError, OSError) as error:
            fail(" | ".join(str(error).splitlines()) or type(error).__name__)

    return wrapper  # type: ignore[return-value]


def _specs(args: list[str], all_bundled: bool) -> list[MLASpec]:
    if all_bundled:
        args = [*args, *registered_specs()]
    if not args:
        raise UsageError("no spec given: name YAML files or registered specs, or pass --all")
    specs = [resolve_spec(a) for a in args]
    seen: dict[str, MLASpec] = {}
    for spec in specs:
        seen.setdefault(spec.name, spec)
    return list(seen.values())


SpecArgs = Annotated[list[str] | None, typer.Argument(help="YAML spec files or registered spec names")]
AllOption = Annotated[bool, typer.Option("--all", help="every registered spec")]


@app.command("compile")
@one_line_errors
def compile_command(
    specs: SpecArgs = None,
    out_dir: Annotated[Path, typer.Option("-o", "--out-dir", help="where to write modules")] = Path("generated"),
    all_bundled: AllOption = False,
) -> None:
    """Validate, lower and render each spec into OUT_DIR/<name>.py."""
    for spec in _specs(specs or [], all_bundled):
        path = compile_spec(spec, out_dir)
        typer.echo(f"{spec.name}: wrote {path} (kernels: {', '.join(spec.kernels)})")


@app.command("list")
@one_line_errors
def list_command() -> None:
    """Registered specs and the kernels each emits."""
    header = f"{'name':<22} {'H':>4} {'Dc':>5} {'Dr':>4} {'Dn':>4} {'Dv':>4} {'Lq':>5} {'page':>5} {'dtype':<9} kernels"
    typer.echo(header)
    for name, path in registered_specs().items():
        try:
            s = resolve_spec(path)
        except SpecError as error:
            typer.echo(f"{name:<22} INVALID: {str(error).splitlines()[0]}")
            continue
        kernels = ", ".join(f"{s.name}/{k}" for k in s.kernels)
        lq = "-" if s.q_lora_rank is None else str(s.q_lora_rank)
        typer.echo(
            f"{s.name:<22} {s.num_heads:>4} {s.kv_lora_rank:>5} {s.qk_rope_head_dim:>4} {s.qk_nope_head_dim:>4} "
            f"{s.v_head_dim:>4} {lq:>5} {s.page_size:>5} {s.dtype:<9} {kernels}"
        )


@app.command("show")
@one_line_errors
def show_command(spec: Annotated[str, typer.Argument(help="YAML spec file or registered name")]) -> None:
    """Print the derived plan (every constant the kernels are rendered with) as JSON."""
    typer.echo(json.dumps(lower(resolve_spec(spec)).summary(), indent=2, default=str))


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
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
) -> None:
    """Run each spec's generated kernels against the PyTorch reference on random inputs.

    On the GPU if there is one, else in Triton's interpreter. Exit code 1 if any case fails.
    """
    from .verify import use_interpreter_if_no_gpu, verify_module

    chosen = _specs(specs or [], all_bundled)
    on_gpu = use_interpreter_if_no_gpu()
    where = "GPU" if on_gpu else "Triton interpreter (CPU)"
    if on_gpu:
        import torch

        where += f": {torch.cuda.get_device_name()}"
    typer.echo(f"verifying {len(chosen)} spec(s) on {where}", err=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mlagen-verify-") as tmp:
        for spec in chosen:
            module = import_module_from_path(compile_spec(spec, tmp))

            def progress(message: str) -> None:
                typer.echo(f"  ... {message}", err=True)

            results += verify_module(module, seed, on_gpu, progress)
    widths = (22, 7, 18, 11, 11, 5)
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


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="print the version and exit")] = False,
) -> None:
    if version:
        typer.echo(f"mlagen {__version__}")
        raise typer.Exit(0)


def main() -> None:
    app(prog_name="mlagen")


if __name__ == "__main__":
    sys.exit(main())
