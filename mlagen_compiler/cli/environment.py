"""`mlagen env` and `mlagen cache info|clear`: what this machine runs mlagen with (versions, GPU, cache, tuning
databases, spec directories, the MLAGEN_* variables), and the compile cache of generated modules."""

from __future__ import annotations

import platform
import sys

import typer

from .._version import __version__
from .common import SpecDirOption, add_commands, gpu_visible

__all__ = ["register"]


def _triton_line(version: str | None) -> str:
    from ..triton_support import TRITON_REQUIREMENT, TRITON_TESTED, triton_supported

    verdict = "inside" if triton_supported(version) else "OUTSIDE"
    tested = ", ".join(TRITON_TESTED)
    return f"{version or 'not installed'}  ({verdict} the supported range {TRITON_REQUIREMENT}; CI tests {tested})"


def env_command(spec_dir: SpecDirOption = None) -> None:
    """Versions, GPU, cache directory, tuning databases and spec directories in use."""
    import torch

    from ..cache import cache_dir, directory_size, list_entries
    from ..knobs import knob_states
    from ..registry import registered_specs, spec_dirs
    from ..triton_support import triton_version
    from ..tuning_db import read_db, shipped_db_paths, user_db_path

    _, gpu_text = gpu_visible()
    states = knob_states()
    root = cache_dir()
    try:
        entries = list_entries(root)
        size = sum(directory_size(e.directory) for e in entries)
        cache_text = f"{len(entries)} module(s), {size / 1024:.0f} KiB"
    except OSError as error:  # (a cache dir that is a file: the knob's line below says so too)
        cache_text = f"unusable: {error}"
    rows = [
        ("mlagen", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("triton", _triton_line(triton_version())),
        ("gpu", gpu_text),
        ("cache", f"{root}  ({cache_text}; MLAGEN_CACHE_DIR)"),
    ]
    for path in shipped_db_paths():
        rows.append(("tuning (shipped)", f"{path}  ({len(read_db(path))} entries)"))
    user = user_db_path()
    try:
        state = f"{len(read_db(user))} entries" if user.is_file() else "not created yet"
    except (OSError, ValueError) as error:
        state = f"unreadable: {' '.join(str(error).splitlines())}"
    rows.append(("tuning (user)", f"{user}  ({state}; MLAGEN_TUNING_DB; `mlagen tune` writes here)"))
    extra = list(spec_dir or [])
    for directory in spec_dirs(extra):
        rows.append(("spec dir", f"{directory}{'' if directory.is_dir() else '  (missing)'}"))
    rows.append(("specs", f"{len(registered_specs(extra))} registered (mlagen list)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        typer.echo(f"{key:<{width}}  {value}")
    typer.echo("environment variables (value as set, or the default; INVALID: what is wrong):")
    name_width = max(len(s.name) for s in states)
    for s in states:
        shown = s.value if s.value is not None else f"unset -> {s.effective}"
        verdict = f"INVALID: {s.problem}" if s.problem else "ok"
        typer.echo(f"  {s.name:<{name_width}}  {shown!s:<24} {verdict}" + (f"  ({s.meaning})" if s.meaning else ""))


def cache_info_command() -> None:
    """Where the cache is and what it holds (one line per cached module)."""
    from ..cache import cache_dir, directory_size, entry_is_intact, foreign_paths, list_entries

    root = cache_dir()
    entries = list_entries(root)
    total = sum(directory_size(e.directory) for e in entries)
    typer.echo(f"cache: {root}{'' if root.exists() else '  (not created yet)'}")
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
    for path in foreign_paths(root):
        typer.echo(f"not a cache entry (no manifest.json; left alone by `mlagen cache clear`): {path}")


def cache_clear_command() -> None:
    """Remove every cached module (the tuning database is kept)."""
    from ..cache import cache_dir, clear_cache, foreign_paths

    root = cache_dir()
    removed = clear_cache(root)
    typer.echo(f"removed {removed} cached module(s) from {root}")
    kept = foreign_paths(root)
    if kept:
        typer.echo(f"kept {len(kept)} path(s) that are not cache entries (no manifest.json), e.g. {kept[0]}")


def register(app: typer.Typer) -> None:
    """Add env and cache (info, clear) to `app`."""
    cache_help = "The compile cache of generated modules (mlagen_compiler.load)."
    add_commands(
        app, {"env": env_command}, {"cache": (cache_help, {"info": cache_info_command, "clear": cache_clear_command})}
    )
