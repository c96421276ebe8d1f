"""Finding specs by name: the bundled `specs/` directory, then user directories.

A spec argument is a path to a YAML file or the name of a registered spec. User directories come from
the `MLAGEN_SPEC_PATH` environment variable (os.pathsep-separated) and from `extra_dirs`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path

from .render import bundled_spec_dir
from .spec import MLASpec, SpecError, load_spec

__all__ = ["registered_specs", "resolve_spec", "spec_dirs"]

SPEC_PATH_ENV = "MLAGEN_SPEC_PATH"


def spec_dirs(extra_dirs: Iterable[str | Path] = ()) -> list[Path]:
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


def resolve_spec(arg: str | Path | MLASpec, extra_dirs: Iterable[str | Path] = ()) -> MLASpec:
    """A spec object, a YAML path, or a registered name -> validated MLASpec."""
    if isinstance(arg, MLASpec):
        return arg
    path = Path(arg)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_spec(path)
    known = registered_specs(extra_dirs)
    name = str(arg).split("/", 1)[0]
    if name in known:
        spec = load_spec(known[name])
        if spec.name != name:
            raise SpecError(f"{known[name]}: file is registered as '{name}' but its name field is '{spec.name}'")
        return spec
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; registered: {', '.join(sorted(known))}"
    raise SpecError(f"spec '{arg}': no such file or registered spec{hint}")
