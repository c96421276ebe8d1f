"""What the `mlagen` command groups share: one-line errors, spec arguments and their option types, spec
resolution, the GPU check. Every group's module imports from here, so none has to import another.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ..registry import registered_specs, resolve_spec
from ..spec import MLASpec, SpecError

__all__ = [
    "AllOption",
    "SeedOption",
    "SpecArgs",
    "SpecDirOption",
    "UsageError",
    "add_commands",
    "check_spec_dirs",
    "fail",
    "gpu_visible",
    "one_line_errors",
    "resolve_specs",
]

F = TypeVar("F", bound=Callable[..., Any])

SpecArgs = Annotated[list[str] | None, typer.Argument(help="YAML spec files or registered spec names")]
AllOption = Annotated[bool, typer.Option("--all", help="every registered spec")]
SpecDirOption = Annotated[
    list[Path] | None,
    typer.Option("--spec-dir", help="directory of user specs to register (repeatable; also MLAGEN_SPEC_PATH)"),
]
#: seeds feed torch.Generator.manual_seed after an offset per case, so they stay well inside 64 bits
SeedOption = Annotated[int, typer.Option(min=0, max=2**32 - 1, help="seed of the random inputs (0..2**32-1)")]


class UsageError(Exception):
    """A problem with what the user asked for; reported as one line."""


def fail(message: str) -> None:
    typer.echo(f"mlagen: error: {message}", err=True)
    raise typer.Exit(2)


def one_line_errors(func: F) -> F:
    """Report SpecError, UsageError, ValueError and OSError as one line on stderr with exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (SpecError, UsageError, ValueError, OSError) as error:
            fail(" | ".join(str(error).splitlines()) or type(error).__name__)

    return wrapper  # type: ignore[return-value]


def add_commands(
    app: typer.Typer,
    commands: dict[str, Callable[..., Any]],
    groups: dict[str, tuple[str, dict[str, Callable[..., Any]]]] | None = None,
) -> None:
    """Add each command (name -> function) to `app`, its errors one line (one_line_errors), then each group
    (name -> (help, {name: function})) as a command of sub-commands."""
    for name, function in commands.items():
        app.command(name)(one_line_errors(function))
    for name, (help_text, members) in (groups or {}).items():
        group = typer.Typer(help=help_text, no_args_is_help=True)
        app.add_typer(group, name=name)
        add_commands(group, members)


def gpu_visible() -> tuple[bool, str]:
    """(usable for native kernels, description)."""
    import torch

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "none used: TRITON_INTERPRET=1 (kernels run in Triton's CPU interpreter)"
    if not torch.cuda.is_available():
        return False, "none (torch.cuda.is_available() is False; kernels run in Triton's CPU interpreter)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return True, ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))


def check_spec_dirs(dirs: list[Path] | None) -> list[Path]:
    for directory in dirs or []:
        if not directory.is_dir():
            raise UsageError(f"--spec-dir {directory}: not a directory")
    return list(dirs or [])


def resolve_specs(args: list[str], all_bundled: bool, dirs: list[Path] | None = None) -> list[MLASpec]:
    """The specs named on the command line (paths or registered names; --all adds every registered one),
    each once."""
    extra = check_spec_dirs(dirs)
    if all_bundled:
        args = [*args, *registered_specs(extra)]
    if not args:
        raise UsageError("no spec given: name YAML files or registered specs, or pass --all")
    seen: dict[str, tuple[str, MLASpec]] = {}
    for arg in args:
        spec = resolve_spec(arg, extra)
        if spec.name in seen and seen[spec.name][1] != spec:
            # both would be written to the same module file; the second would silently win or be dropped
            raise UsageError(
                f"{seen[spec.name][0]} and {arg} are different specs with the same name '{spec.name}': "
                "give each its own name"
            )
        seen.setdefault(spec.name, (str(arg), spec))
    return [spec for _, spec in seen.values()]
