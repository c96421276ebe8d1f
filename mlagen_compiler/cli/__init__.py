"""The `mlagen` command line: the typer app and its console entry point, `main`.

Errors are one line on stderr with exit code 2, never a traceback. The commands live in one submodule per
group, each adding its commands to the app with `register(app)`:

- `modules.py`: compile, verify (write generated modules; run their kernels against the reference);
- `specs.py`: list, show, schema, spec-from-hf (the registered specs, a spec's plan, the schema, a spec from a
  Hugging Face config);
- `tuning.py`: tune, tuning migrate (the tuning search on a GPU; the tuning database's format);
- `environment.py`: env, cache info|clear (what this machine runs with; the compile cache);
- `common.py`: what they share (one-line errors, the spec arguments and options, spec resolution).
"""

from __future__ import annotations

from typing import Annotated

import typer

from .._version import __version__
from . import environment, modules, specs, tuning

__all__ = ["app", "main"]

app = typer.Typer(
    name="mlagen",
    help="Generate MLA attention kernels (Triton) from a YAML layer spec.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


modules.register(app)  # compile, verify
specs.register(app)  # list, show, schema, spec-from-hf
tuning.register(app)  # tune, tuning migrate
environment.register(app)  # env, cache info|clear


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
