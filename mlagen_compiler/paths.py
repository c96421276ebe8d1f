"""Where mlagen's files live: the data shipped with it, and the user's cache directory.

Shipped data (`templates/`, `specs/`, `tuning/`) sits at the repository root in a checkout and under
`mlagen_compiler/_data/` in the wheel (pyproject's force-include). The cache directory holds the compile
cache and the user's tuning database. Everything else reads these paths through this module.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = [
    "CACHE_DIR_ENV",
    "atomic_write_text",
    "bundled_spec_dir",
    "cache_dir",
    "data_dir",
    "shipped_tuning_dir",
    "template_dir",
]

CACHE_DIR_ENV = "MLAGEN_CACHE_DIR"


def data_dir(name: str) -> Path:
    """The shipped data directory `name` (templates, specs, tuning): inside the wheel, else the checkout's."""
    packaged = Path(__file__).parent / "_data" / name
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / name


def template_dir() -> Path:
    return data_dir("templates")


def bundled_spec_dir() -> Path:
    return data_dir("specs")


def shipped_tuning_dir() -> Path:
    return data_dir("tuning")


def cache_dir() -> Path:
    """`MLAGEN_CACHE_DIR`, else the platform's user cache directory (`~/.cache/mlagen` on Linux)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("mlagen", appauthor=False))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename: a reader sees the
    old file or the new one, never half of one."""
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
