"""Stage 4 of the pipeline: turn a spec into a module file on disk and import it.

`compile_spec` lowers, renders and writes `<out_dir>/<module_name>.py` atomically (temporary file in the
same directory, then rename), so a reader never sees half a module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from .plan import lower
from .render import render_module
from .spec import MLASpec

__all__ = ["atomic_write_text", "compile_spec", "import_module_from_path", "module_source"]


def module_source(spec: MLASpec, tuned: dict[str, Any] | None = None) -> str:
    return render_module(lower(spec), tuned)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile_spec(spec: MLASpec, out_dir: str | Path, tuned: dict[str, Any] | None = None) -> Path:
    """Write the generated module for `spec` into `out_dir`; returns its path."""
    path = Path(out_dir) / f"{spec.module_name}.py"
    source = module_source(spec, tuned)
    if not (path.exists() and path.read_text() == source):
        atomic_write_text(path, source)
    return path


def import_module_from_path(path: str | Path, module_name: str | None = None) -> ModuleType:
    """Import a generated module file under a unique name (so two specs never shadow each other)."""
    path = Path(path).resolve()
    name = module_name or f"mlagen_generated.{path.stem}_{abs(hash(str(path))) & 0xFFFFFFFF:08x}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
