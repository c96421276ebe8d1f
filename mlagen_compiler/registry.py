"""Finding specs by name: the bundled `specs/` directory, then user directories.

A spec argument is a path to a YAML file or the name of a registered spec. User directories come from
the `MLAGEN_SPEC_PATH` environment variable (os.pathsep-separated) and from `extra_dirs`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path

from .paths import bundled_spec_dir
from .plan import emitted_kinds
from .spec import MLASpec, SpecError, brief_repr, load_spec

__all__ = ["registered_specs", "resolve_kernel", "resolve_spec", "spec_dirs"]

SPEC_PATH_ENV = "MLAGEN_SPEC_PATH"


def spec_dirs(extra_dirs: Iterable[str | Path] | str | Path = ()) -> list[Path]:
    """Bundled specs, then MLAGEN_SPEC_PATH, then `extra_dirs` (one path, or several)."""
    if isinstance(extra_dirs, (str, os.PathLike)):
        extra_dirs = [extra_dirs]  # one directory, not a sequence of characters
    dirs = [bundled_spec_dir()]
    env = os.environ.get(SPEC_PATH_ENV, "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += [Path(p) for p in extra_dirs]
    return dirs


def registered_specs(extra_dirs: Iterable[str | Path] = ()) -> dict[str, Path]:
    """name -> YAML path; later directories override earlier ones (a user may shadow a bundled spec)."""
    found: dict[str, Path] = {}
    for directory in spec_dirs(extra_dirs):
        for path in sorted(directory.glob("*.yaml")) + sorted(directory.glob("*.yml")):
            found[path.stem] = path
    return found


def _split_name(arg: str) -> tuple[str, str | None]:
    """'deepseek-v3-tp8/decode' -> ('deepseek-v3-tp8', 'decode'); a plain name has no kernel part."""
    name, _, kernel = str(arg).partition("/")
    return name, (kernel or None)


def resolve_spec(arg: str | Path | MLASpec, extra_dirs: Iterable[str | Path] = ()) -> MLASpec:
    """A spec object, a YAML path, or a registered name (optionally `name/kernel`) -> validated MLASpec."""
    return resolve_kernel(arg, extra_dirs)[0]


def resolve_kernel(arg: str | Path | MLASpec, extra_dirs: Iterable[str | Path] = ()) -> tuple[MLASpec, str | None]:
    """Like `resolve_spec`, and the kernel a `name/kernel` argument names (None when it names none).

    Unknown names and kernels the spec does not emit are errors that list the close matches.
    """
    if isinstance(arg, MLASpec):
        return arg, None
    if not isinstance(arg, (str, os.PathLike)):
        raise TypeError(
            f"spec: expected a registered spec name, a YAML path or an MLASpec, got {type(arg).__name__} "
            f"{brief_repr(arg)}"
        )
    path = Path(arg)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return load_spec(path), None
    known = registered_specs(extra_dirs)
    name, kernel = _split_name(str(arg))
    if name in known:
        spec = load_spec(known[name])
        if spec.name != name:
            raise SpecError(f"{known[name]}: file is registered as '{name}' but its name field is '{spec.name}'")
        kinds = [k.name for k in emitted_kinds(spec)]
        if kernel is not None and kernel not in kinds:
            emitted = ", ".join(f"{name}/{k}" for k in kinds)
            raise SpecError(f"spec '{name}' does not emit a '{kernel}' kernel; it emits: {emitted}")
        return spec, kernel
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; registered: {', '.join(sorted(known))}"
    raise SpecError(f"spec '{arg}': no such file or registered spec{hint}")
