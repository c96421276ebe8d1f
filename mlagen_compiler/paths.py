"""Where mlagen's files live: the data shipped with it, and the user's cache directory.

Shipped data (`templates/`, `specs/`, `tuning/`) sits at the repository root in a checkout and under
`mlagen_compiler/_data/` in the wheel (pyproject's force-include). The cache directory holds the compile
cache and the user's tuning database. Everything else reads these paths through this module.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "bundled_spec_dir", "cache_dir", "data_dir", "shipped_tuning_dir", "template_dir"]

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
